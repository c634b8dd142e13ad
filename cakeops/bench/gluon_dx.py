"""``python -m cakeops.bench.gluon_dx [--n 2,4,8] [--T 16384] [--C 4096,2048] [--dtype bfloat16] [--sweep]
[--out FILE]``:
backward_finish's kernel B (dX) as Triton's kernel and as the Gluon kernel (cakeops/_gluon, sm_90), each timed
alone on the same inputs, beside a torch copy of the same bytes.

Kernel B reads X, dY (n*C each), dU (C) and writes dX (n*C) per token: (3n + 1) * C elements, the bytes counted
here (its per-token records, fn's columns and dz are small beside them). Each time is the median of triton's
``do_bench`` (CUDA events, L2 flushed before every call; warm-up 25 ms, 100 ms of reps) of
``mhc_backward_finish.launch_dx``, the launcher's own call of kernel B, with ``CAKEOPS_GLUON=0`` (Triton's
``_dx_kernel``, or at n = 8 ``_dx_stream_kernel`` with its fn^T copy, as backward_finish runs it) and without
(the Gluon kernel). The copy ceiling: ``dst.copy_(src)`` moving the same bytes (half read, half written). Each row
also says whether the two dX are the same bits, and times the whole backward_finish op with either kernel B
(its minimal bytes are kernel B's: the project bench's GB/s).

Prints a markdown table and writes it to ``--out``. Needs a CUDA device of capability (9, 0) and a triton whose
Gluon imports (``cakeops._gluon.available``).
"""
import argparse
import contextlib
import math
import os
import sys
from typing import Dict, List, Optional

import torch

from .core import gbps, median_ms


@contextlib.contextmanager
def kernel_b(which: str):
    """Within: backward_finish runs kernel B as ``which`` says ("triton": CAKEOPS_GLUON=0, "gluon": =1)."""
    before = os.environ.get("CAKEOPS_GLUON")
    os.environ["CAKEOPS_GLUON"] = "0" if which == "triton" else "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("CAKEOPS_GLUON", None)
        else:
            os.environ["CAKEOPS_GLUON"] = before


class KernelB:
    """Kernel B's inputs as backward_finish hands them to it, drawn from ``gen``: X, dY, dU in ``dtype``; fn FP32
    ~ N(0, 9 / K); a stats record whose gates are in (0, 1); kernel A's dz rows (logits ~ N(0, 0.01), s at column
    M, the padding past it NaN: neither kernel may read it). ``run()`` is one call of kernel B."""

    def __init__(self, T: int, n: int, C: int, dtype: torch.dtype, device, gen: torch.Generator):
        from .._triton import mhc_backward_finish as F
        from .._triton.mhc_columns import logits_pad
        from ..meta import mhc_layout

        M, m_pad = 2 * n + n * n, logits_pad(n)

        def randn(*shape, dtype=torch.float32, scale=1.0):
            return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

        self.X, self.dY, self.dU = randn(T, n, C, dtype=dtype), randn(T, n, C, dtype=dtype), randn(T, C, dtype=dtype)
        self.fn = randn(M, n * C, scale=3 / math.sqrt(n * C))
        self.stats = torch.rand(T, mhc_layout.stats_width(n), generator=gen, device=device)
        dz = randn(T, m_pad, scale=0.1)
        dz[:, M + 1:] = float("nan")
        self.dz = dz.reshape(-1)
        self.dX = torch.empty_like(self.X)
        self.cfg = F.FinishConfig().resolve(n)
        self.split = F._plan(T, C, 20, self.X.device, True, self.cfg, n).dx
        self.fn_t = torch.empty(max(1, F._fn_t_numel(self.cfg, n, C)), device=device)
        self.nbytes = (3 * n + 1) * T * C * self.X.element_size()
        self._launch = F.launch_dx

    def run(self, gluon_config=None) -> torch.Tensor:
        """One call of kernel B as backward_finish makes it, or (``gluon_config``: a DxConfig) the Gluon kernel at
        that launch shape."""
        if gluon_config is not None:
            from .._gluon.mhc_backward_dx import dx

            dx(self.X, self.dY, self.dU, self.fn, self.stats, self.dz, self.dX, config=gluon_config)
        else:
            self._launch(self.X, self.dY, self.dU, self.fn, self.stats, self.dz, self.dX, self.fn_t, self.cfg,
                         self.split, "tf32")
        return self.dX


def _finish_op(T: int, n: int, C: int, dtype: torch.dtype, device, gen: torch.Generator):
    """A call of the whole backward_finish (the public function) on one layer's inputs made by the forward
    kernels (hc_eps / rms_eps and scales as the tests use)."""
    from .. import cake_mhc_train as mhc

    M = 2 * n + n * n
    hp = dict(rms_eps=0.5, hc_eps=0.05, sinkhorn_iters=20)
    X = torch.randn(T, n, C, generator=gen, device=device).to(dtype)
    fn = torch.randn(M, n * C, generator=gen, device=device) * (3 / math.sqrt(n * C))
    scale, base = torch.tensor([1.0, 1.5, 4.0], device=device), torch.randn(M, generator=gen, device=device)
    B, dU = (torch.randn(T, C, generator=gen, device=device).to(dtype) for _ in range(2))
    dY = torch.randn(T, n, C, generator=gen, device=device).to(dtype)
    _, stats = mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, **hp)
    _, gs = mhc.cake_mhc_train_backward_prepare(dY, B, X, stats)
    return lambda: mhc.cake_mhc_train_backward_finish(X, dY, dU, None, fn, scale, base, stats, gs, **hp)


def copy_ms(nbytes: int, device) -> float:
    """Median ms of a device copy moving ``nbytes`` (nbytes / 2 read, nbytes / 2 written)."""
    src = torch.empty(nbytes // 4, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return median_ms(lambda: dst.copy_(src))


def measure(T: int, n: int, C: int, dtype: torch.dtype, device, with_op: bool = True,
            sweep: bool = False) -> Dict[str, object]:
    """One row: kernel B's time and GB/s as Triton's and as Gluon's, the copy ceiling of its bytes, whether the
    two dX are the same bits, and the whole backward_finish with either; ``sweep``: the Gluon kernel at each of
    ``DxConfig.candidates(n)`` too."""
    gen = torch.Generator(device=device).manual_seed(T * 1000003 + n * 1009 + C)
    case = KernelB(T, n, C, dtype, device, gen)
    row: Dict[str, object] = dict(n=n, T=T, C=C, dtype=str(dtype).replace("torch.", ""), mb=case.nbytes / 1e6)
    outs = {}
    for which in ("triton", "gluon"):
        with kernel_b(which):
            outs[which] = case.run().clone()
            row[f"{which}_us"] = 1000 * median_ms(case.run)
    row["copy_us"] = 1000 * copy_ms(case.nbytes, device)
    for which in ("triton", "gluon", "copy"):
        row[f"{which}_gbps"] = gbps(case.nbytes, row[f"{which}_us"] / 1000)
    row["equal"] = bool(torch.equal(outs["triton"], outs["gluon"]))
    if not row["equal"]:
        row["max_abs_diff"] = (outs["triton"].float() - outs["gluon"].float()).abs().max().item()
    if sweep:  # the Gluon kernel at its other launch shapes: us, and whether dX is still Triton's
        from .._gluon.mhc_backward_dx import DxConfig

        row["sweep"] = [(cfg, 1000 * median_ms(lambda: case.run(cfg)), bool(torch.equal(case.run(cfg),
                                                                                          outs["triton"])))
                        for cfg in DxConfig.candidates(n)]
    del case, outs
    if with_op:
        op = _finish_op(T, n, C, dtype, device, gen)
        for which in ("triton", "gluon"):
            with kernel_b(which):
                op()
                row[f"op_{which}_us"] = 1000 * median_ms(op)
    torch.cuda.empty_cache()
    return row


def table(rows: List[Dict[str, object]], device_name: str) -> str:
    import triton

    lines = [f"Kernel B (dX) of backward_finish, Triton vs Gluon: {device_name}, torch {torch.__version__}, triton "
             f"{triton.__version__}. GB/s of kernel B's bytes ((3n + 1) * T * C elements); copy: a torch copy of "
             f"the same bytes. op: the whole backward_finish with either kernel B, GB/s of the same bytes.", "",
             "| n | T | C | dtype | MB | copy GB/s | Triton B us (GB/s) | Gluon B us (GB/s) | Gluon / copy | speed-up "
             "| dX equal | op Triton us (GB/s) | op Gluon us (GB/s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mb = r["mb"]
        op = ("| — | — |" if "op_triton_us" not in r else
              f"| {r['op_triton_us']:.0f} ({mb * 1e3 / r['op_triton_us']:.0f}) "
              f"| {r['op_gluon_us']:.0f} ({mb * 1e3 / r['op_gluon_us']:.0f}) |")
        equal = "yes" if r["equal"] else f"no (max abs {r['max_abs_diff']:.3g})"
        lines.append(f"| {r['n']} | {r['T']} | {r['C']} | {r['dtype']} | {mb:.0f} | {r['copy_gbps']:.0f} "
                     f"| {r['triton_us']:.0f} ({r['triton_gbps']:.0f}) | {r['gluon_us']:.0f} ({r['gluon_gbps']:.0f}) "
                     f"| {100 * r['gluon_gbps'] / r['copy_gbps']:.0f} % | {r['triton_us'] / r['gluon_us']:.2f}x "
                     f"| {equal} " + op)
    per_c = {}
    for r in rows:
        per_c.setdefault((r["C"], r["dtype"]), {})[r["n"]] = r["gluon_gbps"]
    notes = [f"C={c} {dt}: Gluon kernel B at n = 8 runs at {100 * g[8] / g[4]:.0f} % of n = 4's GB/s (target >= 85 %)"
             for (c, dt), g in per_c.items() if 4 in g and 8 in g]
    for r in rows:
        for cfg, us, equal in r.get("sweep", ()):
            notes.append(f"n={r['n']} C={r['C']} Gluon at block_c={cfg.block_c} warps_c={cfg.warps_c}: {us:.0f} us "
                         f"({r['mb'] * 1e3 / us:.0f} GB/s; default {r['gluon_us']:.0f} us), dX equal: {equal}")
    return "\n".join(lines + ([""] + notes if notes else [])) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cakeops.bench.gluon_dx", description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="2,4,8")
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--C", default="4096,2048")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--no-op", action="store_true", help="kernel B only, not the whole backward_finish")
    p.add_argument("--sweep", action="store_true", help="also time the Gluon kernel at DxConfig.candidates(n)")
    p.add_argument("--out", default=None, help="write the markdown table to this file")
    args = p.parse_args(argv)
    from .. import _gluon

    device = torch.device("cuda")
    if not torch.cuda.is_available() or not _gluon.available(device, getattr(torch, args.dtype), 4):
        reason = ("no CUDA device" if not torch.cuda.is_available() else
                  f"capability {torch.cuda.get_device_capability()}, triton Gluon importable: {_gluon.importable()}, "
                  f"CAKEOPS_GLUON={os.environ.get('CAKEOPS_GLUON')!r}")
        print(f"the Gluon kernels do not run here ({reason}): they need sm_90 and a triton in "
              f"{_gluon.SUPPORTED_TRITON}", file=sys.stderr)
        return 2
    rows = []
    for C in (int(c) for c in args.C.split(",")):
        for n in (int(v) for v in args.n.split(",")):
            rows.append(measure(args.T, n, C, getattr(torch, args.dtype), device, with_op=not args.no_op,
                                sweep=args.sweep))
            r = rows[-1]
            print(f"n={n} C={C}: Triton {r['triton_us']:.0f} us, Gluon {r['gluon_us']:.0f} us, copy "
                  f"{r['copy_us']:.0f} us, dX equal: {r['equal']}", flush=True)
    text = table(rows, torch.cuda.get_device_name())
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
