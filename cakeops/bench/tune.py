"""``python -m cakeops.bench.tune [--ops OPS] [--n N] [--out DIR]``: sweep the launch shapes of the mHC kernels
(prepare, backward_prepare, backward_finish, head_backward, gated_head) on a GPU, check every variant against the
default's outputs, and print the fastest (with each kernel's GPU time).

One command so that a short lease on a GPU measures every candidate at once; the winners become the launchers'
defaults (with the numbers in docs/perf.md). Shape: T=16384, C=4096 unless --T / --C; bf16, sinkhorn_iters=20.

``--ops gated_head`` (not in the default list): the gated head's backward candidates (GatedHeadConfig) at ``--n``
(4 unless given), then the default and the fastest at the other two n, and the forward at n = 2, 4, 8; the copy ceiling of X in the same
run, per-kernel GPU times of the default and the fastest, and a last line naming the config to make default.
``--budget-s`` stops the sweep (not the final comparisons) when it has run that long.

``--n 8`` (prepare, backward_prepare, backward_finish, head_backward): inputs with n streams and n's logits, each
op's ``candidates(n)`` (built for n: ``python -m cakeops.bench.build_check --op mhc --candidates OPS --n N``
compiles them all for sm_90 without a GPU); ``--budget-s`` then shares its seconds among the ops (the default of
each op is always measured). Per-kernel GPU times are taken for the default and the fastest of each op.
"""
import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from ..testing import rel_err
from .core import gbps, median_ms

HP = (1e-5, 1e-6, 20)


def _inputs(device, T: int, C: int, n: int = 4):
    from ..meta.mhc_layout import n_logits

    M = n_logits(n)
    g = torch.Generator(device=device).manual_seed(0)
    X = torch.randn(T, n, C, device=device, generator=g).bfloat16()
    fn = torch.randn(M, n * C, device=device, generator=g) / (n * C) ** 0.5
    scale = torch.tensor([1.0, 1.0, 3.0], device=device)
    base = torch.randn(M, device=device, generator=g)
    dY = torch.randn(T, n, C, device=device, generator=g).bfloat16()
    B = torch.randn(T, C, device=device, generator=g).bfloat16()
    dU = torch.randn(T, C, device=device, generator=g).bfloat16()
    return X, fn, scale, base, dY, B, dU


def _variants(config_class, n: int = 4):
    """The default (None: the launcher's own choice), then the config class's candidates for n streams (n = 4's
    call stays ``candidates()``: StreamConfig and GatedHeadConfig take no n)."""
    yield None, "default"
    for cfg in (config_class.candidates() if n == 4 else config_class.candidates(n)):
        yield cfg, None


def config_classes():
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
    from .core import kernel_times_us

    return " | ".join(f"{name[:28]} {us:.0f}" for name, us in kernel_times_us(call, reps).items() if us > 0.5)


def _label(cfg, n: int = 4):
    """The fields of ``cfg`` that differ from n's default (FinishConfig: its resolve(n))."""
    if cfg is None:
        return "(the default config)"
    default = type(cfg)()
    if n != 4 and hasattr(default, "for_streams"):
        default = default.resolve(n)
    return " ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                    if f.name != "streams" and getattr(cfg, f.name) != getattr(default, f.name)) \
        or "(the default config)"


def selected(variants, match: str = "", n: int = 4):
    """The default and the variants whose label contains ``match`` (all when empty): a short lease on a GPU
    measures the candidates it came for."""
    for cfg, name in variants:
        if not match or name == "default" or match in _label(cfg, n):
            yield cfg, name


def _stats_for(cfg, X, fn, scale, base, stats):
    """The forward record backward_finish under ``cfg`` replays: its kernel A runs the Sinkhorn on its own tile,
    bitwise the forward's only when the forward's gates ran on that tile too (mhc_math.SINKHORN_TILE), so a
    candidate with another tile gets the record of a forward on it (what making it default would take)."""
    from .._triton import mhc_prepare
    from .._triton.mhc_backward_finish import FinishConfig

    resolved = (cfg or FinishConfig()).resolve(X.shape[1])
    tile = (resolved.dlogits_block_t, resolved.dlogits_warps)
    default = mhc_prepare.PrepareConfig()
    if tile == (default.gates_block_t, default.gates_warps):
        return stats
    own = torch.empty_like(stats)
    mhc_prepare.prepare(X, fn, scale, base, *HP, own, None,
                        config=mhc_prepare.PrepareConfig(gates_block_t=tile[0], gates_warps=tile[1]))
    return own


def sweep(op, device, inputs, match: str = "", budget_s: float = float("inf")):
    """The op's default and candidates for the inputs' n; the candidates stop after ``budget_s`` seconds. Per-kernel
    GPU times of the default and of the fastest close the rows."""
    from .._triton import mhc_backward, mhc_prepare
    from ..meta import mhc_layout

    t_start = time.perf_counter()
    X, fn, scale, base, dY, B, dU = inputs
    T, n, C = X.shape
    stats = torch.empty(T, mhc_layout.stats_width(n), device=device)
    U = torch.empty(T, C, device=device, dtype=X.dtype)
    mhc_prepare.prepare(X, fn, scale, base, *HP, stats, U)
    gs = torch.empty(T, mhc_layout.grad_stats_width(n), device=device)
    dB = torch.empty_like(B)
    mhc_backward.backward_prepare(dY, B, X, stats, dB, gs)
    variants = _variants(config_classes()[op], n)
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
                    torch.empty_like(base))
            st = _stats_for(cfg, X, fn, scale, base, stats)
            call = lambda: mhc_backward.backward_finish(X, dY, dU, fn, scale, base, st, gs, *HP, *outs,  # noqa: E731
                                                        config=cfg)
            call()
            return call, outs
    rows, reference, calls = [], None, {}
    for cfg, name in selected(variants, match, n):
        if name != "default" and time.perf_counter() - t_start > budget_s:
            print(f"{op}: budget of {budget_s:.0f} s spent, the remaining candidates are skipped", flush=True)
            break
        label = name or _label(cfg, n)
        try:
            call, outs = run(cfg)
            if reference is None:
                reference = [t.clone() for t in outs]
            err = max(rel_err(o, r) for o, r in zip(outs, reference))
            ms = median_ms(call)
            rows.append({"op": op, "n": n, "variant": label, "config": repr(cfg), "ms": ms, "gbps": gbps(nbytes, ms),
                         "max_rel_diff": err, "registers": kernel_regs(call)})
            _keep_call(calls, label, call, rows)
        except Exception as exc:  # a variant that does not compile (registers, shared memory) is reported, not fatal
            rows.append({"op": op, "n": n, "variant": label, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
        r = rows[-1]
        print(f"{op:17s} n={n} {r['variant']:70s} " + (
            f"{r['ms']:.3f} ms {r['gbps']:6.0f} GB/s diff {r['max_rel_diff']:.1e}\n{'':19s}regs: {r['registers']}"
            if "ms" in r else r["error"]), flush=True)
    _retime_default(rows, calls)
    _kernel_times(rows, calls)
    return rows


def _retime_default(rows, calls):
    """Times the default again after the candidates: its first timing opens the sweep and can come out slow (H200,
    T=8192 C=2048: backward_finish's default 0.447 ms first, its kernels 0.25 ms, every candidate 0.27-0.46: at
    that size a call is host-bound and the host's speed drifts). The row keeps the faster; "ms_first" the first."""
    timed = [r for r in rows if "ms" in r]
    if not timed or timed[0]["variant"] not in calls:
        return
    first = timed[0]
    again = median_ms(calls[first["variant"]])
    first["ms_first"] = first["ms"]
    if again < first["ms"]:
        first["ms"] = again
        first["gbps"] = first["gbps"] * first["ms_first"] / again
    print(f"{first['op']:17s} n={first['n']} {first['variant']} timed again: {again:.3f} ms (first {first['ms_first']:.3f})",
          flush=True)


def _keep_call(calls, label, call, rows):
    """Keeps the calls (and with them their outputs: n = 8's dX is 1 GB at T = 16384) of the default and of the
    fastest so far only: _kernel_times profiles those two."""
    calls[label] = call
    timed = [r for r in rows if "ms" in r and r["max_rel_diff"] <= 1e-2]
    keep = {timed[0]["variant"], min(timed, key=lambda r: r["ms"])["variant"]} if timed else set()
    for name in [k for k in calls if k not in keep]:
        del calls[name]


def _kernel_times(rows, calls):
    """Per-kernel GPU times (torch.profiler) of the default and of the fastest variant within 1e-2 of it."""
    timed = [r for r in rows if "ms" in r and r["max_rel_diff"] <= 1e-2]
    if not timed:
        return
    best = min(timed, key=lambda r: r["ms"])
    for r in [timed[0]] + ([best] if best is not timed[0] else []):
        r["kernels_us"] = kernel_us(calls[r["variant"]])
        tag = "default" if r is timed[0] else "fastest"
        print(f"{r['op']:17s} n={r['n']} {tag} ({r['variant'][:60]}) {r['ms']:.3f} ms, us per kernel: "
              f"{r['kernels_us']}", flush=True)


def _as_code(cfg) -> str:
    """The fields of ``cfg`` that differ from the class defaults, as a constructor call."""
    fields = [f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != f.default]
    return f"{type(cfg).__name__}({', '.join(fields)})"


def _gated_inputs(device, T: int, n: int, C: int):
    g = torch.Generator(device=device).manual_seed(0)
    X = torch.randn(T, n, C, device=device, generator=g).bfloat16()
    fn = torch.randn(n, n * C, device=device, generator=g) / (n * C) ** 0.5
    scale = torch.tensor([3.0], device=device)
    base = torch.randn(n, device=device, generator=g)
    dY = torch.randn(T, C, device=device, generator=g).bfloat16()
    return X, fn, scale, base, dY


def _gated_traffic(X, cfg) -> int:
    """Bytes the backward's kernels move with this config (bf16 X, dY, dX; the small FP32 rows left out):
    dgate X + dY, dX kernel X + dY + dX, the separate dfn kernel X once more."""
    T, n, C = X.shape
    x, dy = X.nbytes, T * C * X.element_size()
    from .._triton.mhc_gated_head import GatedHeadConfig

    return 3 * x + 2 * dy + (x if (cfg or GatedHeadConfig()).dfn == "separate" else 0)


def sweep_gated_head(device, T: int, C: int, match: str = "", budget_s: float = 150.0, n_swept: int = 4):
    """The gated head's backward over GatedHeadConfig's candidates at n_swept streams, then the default and the
    fastest at the other n, and the forward at every n. Returns the rows (also printed)."""
    import time

    from .._triton import mhc_gated_head as K
    from ..meta.mhc_head_layout import HEAD_STATS_WIDTH
    from .core import copy_gbps

    t_start = time.perf_counter()
    HPG = (1e-5, 1e-6)
    rows = []

    def setup(n):
        X, fn, scale, base, dY = _gated_inputs(device, T, n, C)
        stats = torch.empty(T, HEAD_STATS_WIDTH, device=device)
        K.forward(X, fn, scale, base, *HPG, stats, None)
        return X, fn, scale, base, dY, stats

    def bwd(inputs, cfg):
        X, fn, scale, base, dY, stats = inputs
        n = X.shape[1]
        outs = (torch.empty_like(X), torch.empty_like(fn), torch.empty(1, device=device), torch.empty(n, device=device))
        call = lambda: K.backward(dY, X, fn, scale, base, stats, *outs, config=cfg)  # noqa: E731
        call()
        return call, outs

    def measure(inputs, cfg, name, reference, details):
        X = inputs[0]
        n = X.shape[1]
        minimal = 2 * X.nbytes + inputs[4].nbytes  # X, dY, dX: the 2.25 X of the target at n = 4
        try:
            call, outs = bwd(inputs, cfg)
            err = 0.0 if reference is None else max(rel_err(o, r) for o, r in zip(outs, reference))
            same_dx = reference is None or torch.equal(outs[0], reference[0])
            ms = median_ms(call)
            row = {"op": f"gated_head_bwd n={n}", "variant": name, "config": cfg, "ms": ms,
                   "gbps": gbps(minimal, ms), "traffic_gbps": gbps(_gated_traffic(X, cfg), ms),
                   "max_rel_diff": err, "dx_bitwise": same_dx, "outs": outs}
            if details:
                row["kernels_us"], row["registers"] = kernel_us(call), kernel_regs(call)
        except Exception as exc:  # a variant that does not compile (registers, shared memory) is reported
            row = {"op": f"gated_head_bwd n={n}", "variant": name, "config": cfg,
                   "error": f"{type(exc).__name__}: {str(exc)[:160]}"}
        if name != "default":
            row.pop("outs", None)  # only the default's outputs are kept (the reference of the others)
        rows.append(row)
        print(f"{row['op']:17s} {name[:90]:90s} " + (
            f"{row['ms']:.3f} ms {row['gbps']:6.0f} GB/s minimal ({row['traffic_gbps']:5.0f} on its traffic) "
            f"diff {row['max_rel_diff']:.1e} dX {'bitwise' if row['dx_bitwise'] else 'differs'}"
            if "ms" in row else row["error"]), flush=True)
        for key in ("kernels_us", "registers"):
            if key in row:
                print(f"{'':19s}{key}: {row[key]}", flush=True)
        return row

    swept = setup(n_swept)
    X = swept[0]
    dst = torch.empty_like(X)
    copy_ms = median_ms(lambda: dst.copy_(X))
    ceiling = gbps(2 * X.nbytes, copy_ms)
    del dst
    minimal = 2 * X.nbytes + swept[4].nbytes
    print(f"copy ceiling: X.copy_ ({X.nbytes >> 20} MiB) {copy_ms:.3f} ms = {ceiling:.0f} GB/s; 2 GiB copy "
          f"{copy_gbps(device):.0f} GB/s. Backward minimal bytes X + dY + dX = {minimal >> 20} "
          f"MiB: {minimal / ceiling / 1e6:.3f} ms at the ceiling", flush=True)
    default = measure(swept, None, "default", None, True)
    reference = default.get("outs")
    swept_rows = [default]
    for cfg, name in selected(_variants(K.GatedHeadConfig), match):
        if cfg is None:
            continue
        if time.perf_counter() - t_start > budget_s:
            print(f"budget of {budget_s:.0f} s spent: the remaining candidates are skipped", flush=True)
            break
        swept_rows.append(measure(swept, cfg, _label(cfg), reference, False))
    ok = [r for r in swept_rows if "ms" in r and r["max_rel_diff"] <= 1e-2]
    best = min(ok, key=lambda r: r["ms"])
    if best is not default:
        print(f"the fastest at n = {n_swept}, per kernel:", flush=True)
        measure(swept, best["config"], "fastest: " + best["variant"], reference, True)
    del swept, X, reference
    for r in rows:
        r.pop("outs", None)
    for n in sorted({2, 4, 8} - {n_swept}):
        inputs = setup(n)
        ref_n = measure(inputs, None, "default", None, True).pop("outs", None)
        if best is not default:
            measure(inputs, best["config"], "fastest: " + best["variant"], ref_n, True).pop("outs", None)
        del inputs, ref_n
    for n in (2, 4, 8):  # the forward, briefly: Y + stats, minimal bytes X + Y
        X, fn, scale, base, _ = _gated_inputs(device, T, n, C)
        stats, Y = torch.empty(T, HEAD_STATS_WIDTH, device=device), torch.empty(T, C, device=device, dtype=X.dtype)
        call = lambda: K.forward(X, fn, scale, base, *HPG, stats, Y)  # noqa: E731
        call()
        ms = median_ms(call)
        row = {"op": f"gated_head_fwd n={n}", "variant": "default", "ms": ms, "gbps": gbps(X.nbytes + Y.nbytes, ms),
               "kernels_us": kernel_us(call), "registers": kernel_regs(call)}
        rows.append(row)
        print(f"{row['op']:17s} default {ms:.3f} ms {row['gbps']:6.0f} GB/s minimal\n{'':19s}kernels_us: "
              f"{row['kernels_us']}\n{'':19s}registers: {row['registers']}", flush=True)
    make = _as_code(best["config"]) if best is not default else "keep the current default"
    for r in rows:  # JSON-ready: the configs as their reprs
        r.pop("outs", None)
        if r.get("config") is not None:
            r["config"] = repr(r["config"])
    print(f"\nSUMMARY gated head bwd n={n_swept} T={T} C={C}: default {default['ms']:.3f} ms, fastest {best['ms']:.3f} ms "
          f"({best['gbps']:.0f} GB/s minimal, copy ceiling {ceiling:.0f}) with {best['variant']}; "
          f"make default: {make} "
          f"[{time.perf_counter() - t_start:.0f} s]", flush=True)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cakeops.bench.tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", default="prepare,backward_prepare,backward_finish,head_backward")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--T", type=int, default=16384, help="tokens (default 16384)")
    p.add_argument("--C", type=int, default=4096, help="hidden size per stream (default 4096)")
    p.add_argument("--match", default="", help="only the variants whose label contains this (and the default)")
    p.add_argument("--n", type=int, default=4, help="residual streams of the mHC ops' inputs and candidates (2, 4, 8)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="stop the candidate sweeps after this many seconds (mHC ops: shared among them; "
                        "gated_head: its own, 150 when not given)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune needs a CUDA device: it times launch shapes (nothing to learn from the CPU)")
        return 0
    device = torch.device("cuda")
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    inputs = _inputs(device, args.T, args.C, args.n) if any(op != "gated_head" for op in ops) else None
    rows = []
    deadline = None if args.budget_s is None else time.perf_counter() + args.budget_s
    for k, op in enumerate(ops):
        if op == "gated_head":
            rows += sweep_gated_head(device, args.T, args.C, args.match,
                                     150.0 if args.budget_s is None else args.budget_s, args.n)
        else:  # an equal share of what is left for each op still to come
            share = float("inf") if deadline is None else max(0.0, deadline - time.perf_counter()) / (len(ops) - k)
            rows += sweep(op, device, inputs, args.match, share)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune.json").write_text(json.dumps(rows, indent=1, default=str))
    print(f"\nfastest per op (max rel diff vs the default <= 1e-2), n={args.n} T={args.T} C={args.C}:")
    for op in dict.fromkeys(r["op"] for r in rows):
        ok = [r for r in rows if r["op"] == op and "ms" in r and r.get("max_rel_diff", 0.0) <= 1e-2]
        default = next((r for r in ok if r["variant"] == "default"), None)
        for r in sorted(ok, key=lambda r: r["ms"])[:3]:
            gain = f" ({default['ms'] / r['ms']:.2f}x the default)" if default else ""
            print(f"  {op:17s} {r['ms']:.3f} ms {r['gbps']:6.0f} GB/s{gain}  {r['variant']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
