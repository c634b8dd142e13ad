"""``python -m cakeops.bench.tune [--ops OPS] [--out DIR]``: sweep the launch shapes of the mHC kernels
(prepare, backward_prepare, backward_finish, head_backward) on a GPU, check every variant against the default's
outputs, and print the fastest (with each kernel's GPU time).

One command so that a short lease on a GPU measures every candidate at once; the winners become the launchers'
defaults (with the numbers in docs/perf.md). Shape: T=16384, C=4096 unless --T / --C; bf16, sinkhorn_iters=20.
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from ..testing import rel_err
from .core import gbps, median_ms

HP = (1e-5, 1e-6, 20)


def _inputs(device, T: int, C: int):
    g = torch.Generator(device=device).manual_seed(0)
    X = torch.randn(T, 4, C, device=device, generator=g).bfloat16()
    fn = torch.randn(24, 4 * C, device=device, generator=g) / (4 * C) ** 0.5
    scale = torch.tensor([1.0, 1.0, 3.0], device=device)
    base = torch.randn(24, device=device, generator=g)
    dY = torch.randn(T, 4, C, device=device, generator=g).bfloat16()
    B = torch.randn(T, C, device=device, generator=g).bfloat16()
    dU = torch.randn(T, C, device=device, generator=g).bfloat16()
    return X, fn, scale, base, dY, B, dU


def _variants(config_class):
    """The default (None: the launcher's own choice), then the config class's candidates."""
    yield None, "default"
    for cfg in config_class.candidates():
        yield cfg, None


def _config_classes():
    from .._triton.mhc_backward_finish import FinishConfig
    from .._triton.mhc_backward_prepare import BackwardPrepareConfig
    from .._triton.mhc_prepare import PrepareConfig
    from .._triton.mhc_streams import StreamConfig

    return {"prepare": PrepareConfig, "backward_prepare": BackwardPrepareConfig, "backward_finish": FinishConfig,
            "head_backward": StreamConfig}


def kernel_regs(call) -> str:
    """Registers (and spills) per thread of each Triton kernel `call` launches, e.g. "_dx_kernel 168r"."""
    from triton.runtime.jit import JITFunction

    seen, run = {}, JITFunction.run

    def recording_run(self, *args, **kwargs):
        kernel = run(self, *args, **kwargs)
        regs, spills = getattr(kernel, "n_regs", None), getattr(kernel, "n_spills", None)
        if regs is not None:
            seen[getattr(self, "__name__", "?")] = f"{regs}r" + (f"+{spills}spill" if spills else "")
        return kernel

    JITFunction.run = recording_run
    try:
        call()
        torch.cuda.synchronize()
    except Exception as exc:  # a diagnostic: never the reason a variant fails
        return f"? ({type(exc).__name__})"
    finally:
        JITFunction.run = run
    return " | ".join(f"{name} {regs}" for name, regs in seen.items())


def kernel_us(call, reps: int = 5) -> str:
    """GPU time per call of each kernel `call` launches (torch.profiler), e.g. "_dpre_kernel 171 | ..."."""
    from .profile import kernel_times_us

    return " | ".join(f"{name[:28]} {us:.0f}" for name, us in kernel_times_us(call, reps).items() if us > 0.5)


def _label(cfg):
    if cfg is None:
        return "(the default config)"
    return " ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                    if getattr(cfg, f.name) != f.default) or "(the default config)"


def selected(variants, match: str = ""):
    """The default and the variants whose label contains ``match`` (all when empty): a short lease on a GPU
    measures the candidates it came for."""
    for cfg, name in variants:
        if not match or name == "default" or match in _label(cfg):
            yield cfg, name


def sweep(op, device, inputs, match: str = ""):
    from .._triton import mhc_backward, mhc_prepare

    X, fn, scale, base, dY, B, dU = inputs
    T, _, C = X.shape
    stats = torch.empty(T, 64, device=device)
    U = torch.empty(T, C, device=device, dtype=X.dtype)
    mhc_prepare.prepare(X, fn, scale, base, *HP, stats, U)
    gs = torch.empty(T, 32, device=device)
    dB = torch.empty_like(B)
    mhc_backward.backward_prepare(dY, B, X, stats, dB, gs)
    variants = _variants(_config_classes()[op])
    if op == "prepare":
        nbytes = X.nbytes + fn.nbytes + U.nbytes + stats.nbytes

        def run(cfg):
            u, st = torch.empty_like(U), torch.empty_like(stats)
            call = lambda: mhc_prepare.prepare(X, fn, scale, base, *HP, st, u, config=cfg)  # noqa: E731
            call()
            return call, (u, st)
    elif op == "backward_prepare":
        nbytes = dY.nbytes + 2 * B.nbytes + X.nbytes + stats.nbytes + gs.nbytes

        def run(cfg):
            db, g = torch.empty_like(dB), torch.empty_like(gs)
            call = lambda: mhc_backward.backward_prepare(dY, B, X, stats, db, g, config=cfg)  # noqa: E731
            call()
            return call, (db, g)
    elif op == "head_backward":
        from .._triton import mhc_streams
        nbytes = dU.nbytes + X.nbytes

        def run(cfg):
            dx = torch.empty_like(X)
            call = lambda: mhc_streams.head_backward(dU, dx, False, config=cfg)  # noqa: E731
            call()
            return call, (dx,)
    else:
        nbytes = 3 * X.nbytes + dU.nbytes + 2 * fn.nbytes + stats.nbytes + gs.nbytes

        def run(cfg):
            outs = (torch.empty_like(X), torch.empty_like(fn), torch.empty(3, device=device),
                    torch.empty(24, device=device))
            call = lambda: mhc_backward.backward_finish(X, dY, dU, fn, scale, base, stats, gs, *HP, *outs,  # noqa: E731
                                                        config=cfg)
            call()
            return call, outs
    rows, reference = [], None
    for cfg, name in selected(variants, match):
        try:
            call, outs = run(cfg)
            if reference is None:
                reference = [t.clone() for t in outs]
            err = max(rel_err(o, r) for o, r in zip(outs, reference))
            ms = median_ms(call)
            rows.append({"op": op, "variant": name or _label(cfg), "ms": ms, "gbps": gbps(nbytes, ms), "max_rel_diff": err,
                         "kernels_us": kernel_us(call), "registers": kernel_regs(call)})
        except Exception as exc:  # a variant that does not compile (registers, shared memory) is reported, not fatal
            rows.append({"op": op, "variant": name or _label(cfg), "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
        r = rows[-1]
        print(f"{op:17s} {r['variant']:70s} " + (f"{r['ms']:.3f} ms {r['gbps']:6.0f} GB/s diff {r['max_rel_diff']:.1e}"
                                                 f"\n{'':19s}us: {r['kernels_us']}\n{'':19s}regs: {r['registers']}" if "ms" in r else r["error"]),
              flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cakeops.bench.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="prepare,backward_prepare,backward_finish,head_backward")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--T", type=int, default=16384, help="tokens (default 16384)")
    p.add_argument("--C", type=int, default=4096, help="hidden size per stream (default 4096)")
    p.add_argument("--match", default="", help="only the variants whose label contains this (and the default)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune needs a CUDA device: it times launch shapes (nothing to learn from the CPU)")
        return 0
    device = torch.device("cuda")
    inputs = _inputs(device, args.T, args.C)
    rows = []
    for op in [o.strip() for o in args.ops.split(",") if o.strip()]:
        rows += sweep(op, device, inputs, args.match)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune.json").write_text(json.dumps(rows, indent=1))
    print("\nfastest per op (max rel diff vs the default <= 1e-2):")
    for op in dict.fromkeys(r["op"] for r in rows):
        ok = [r for r in rows if r["op"] == op and "ms" in r and r["max_rel_diff"] <= 1e-2]
        for r in sorted(ok, key=lambda r: r["ms"])[:3]:
            print(f"  {op:17s} {r['ms']:.3f} ms {r['gbps']:6.0f} GB/s  {r['variant']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
