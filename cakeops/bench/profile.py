"""``python -m cakeops.bench.profile [--T 16384] [--C 4096] [--n 4] [--steps 5] [--out DIR]``: where one mHC layer's
forward + backward (identity branch, bf16, sinkhorn_iters=20) spends its time.

Prints every kernel (or, without a GPU, every CPU op) with its time per step from torch.profiler, their sum, and
the wall time of a step: on a GPU, wall minus kernel time is time the device waited for the host (launches,
autograd, allocator) or ran something unlisted. Writes OUT/layer_trace.json (Chrome trace),
OUT/layer_profile.json and, with matplotlib, OUT/layer_profile.png. ``--replot JSON`` only draws the PNG of
an earlier run's layer_profile.json (e.g. one fetched from a GPU host).

``--ncu-step`` runs one step (after the warm-up) between cudaProfilerStart / Stop and nothing else, for Nsight
Compute's hardware counters (stall reasons per instruction, bytes per cache level):
``ncu --clock-control none --profile-from-start off --set full --import-source yes -o layer
python -m cakeops.bench.profile --ncu-step``.
"""
import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

from . import plot
from .core import self_time_us


def _layer_step(X, fn, scale, base, dY):
    from .mhc_cases import _layer_forward

    return torch.autograd.grad(_layer_forward(X, fn, scale, base), (X, fn, scale, base), dY)


def _inputs(T: int, C: int, device: torch.device, n: int = 4):
    g = torch.Generator(device=device).manual_seed(0)
    M = 2 * n + n * n
    X = torch.randn(T, n, C, device=device, generator=g).bfloat16().requires_grad_()
    fn = (torch.randn(M, n * C, device=device, generator=g) / (n * C) ** 0.5).requires_grad_()
    scale = torch.tensor([1.0, 1.0, 3.0], device=device, requires_grad=True)
    base = torch.randn(M, device=device, generator=g).requires_grad_()
    dY = torch.randn(T, n, C, device=device, generator=g).bfloat16()
    return X, fn, scale, base, dY


def profile_layer(T: int, C: int, steps: int, device: torch.device, n: int = 4) -> Dict:
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    args = _inputs(T, C, device, n)
    for _ in range(3):  # compile / autotune / allocator warm-up
        _layer_step(*args)
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        _layer_step(*args)
    sync()
    wall_us = (time.perf_counter() - t0) / steps * 1e6
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            _layer_step(*args)
        sync()
    rows: List[Dict] = []
    for e in prof.key_averages():
        us = self_time_us(e, on_gpu)
        if us <= 0:
            continue
        if on_gpu and getattr(e, "device_type", None) is not None and "CUDA" not in str(e.device_type):
            continue
        rows.append({"name": e.key, "calls_per_step": e.count / steps, "us_per_step": us / steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    listed = sum(r["us_per_step"] for r in rows)
    return {"T": T, "C": C, "n": n, "device": str(device), "steps": steps, "wall_us_per_step": wall_us,
            "listed_us_per_step": listed, "rows": rows, "trace": prof}


def ncu_step(T: int, C: int, device: torch.device, n: int = 4) -> None:
    """One layer step inside the CUDA profiler range (ncu --profile-from-start off), after a warm-up outside it."""
    args = _inputs(T, C, device, n)
    for _ in range(2):  # compile / allocator warm-up, outside the range
        _layer_step(*args)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    _layer_step(*args)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def _print(result: Dict, top: int = 25) -> None:
    what = "kernels (GPU time)" if result["device"].startswith("cuda") else "CPU ops (self CPU time)"
    print(f"mHC layer fwd+bwd, identity branch, n={result.get('n', 4)} T={result['T']} C={result['C']} bf16, {result['device']}: {what}")
    print(f"{'us/step':>10} {'calls':>6}  name")
    for r in result["rows"][:top]:
        print(f"{r['us_per_step']:10.1f} {r['calls_per_step']:6.1f}  {r['name'][:100]}")
    if len(result["rows"]) > top:
        print(f"{'':>10} {'':>6}  ... {len(result['rows']) - top} more")
    listed, wall = result["listed_us_per_step"], result["wall_us_per_step"]
    print(f"sum of the above: {listed:.1f} us/step; wall time of a step: {wall:.1f} us"
          + (f"; not kernel time: {wall - listed:.1f} us" if result["device"].startswith("cuda") else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cakeops.bench.profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=None, help="tokens (default 16384 on a GPU, 16 on a CPU)")
    p.add_argument("--C", type=int, default=None, help="hidden size (default 4096 on a GPU, 64 on a CPU)")
    p.add_argument("--n", type=int, default=4, help="streams: 2, 4 or 8 (default 4)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    p.add_argument("--replot", type=Path, default=None, metavar="JSON", help="draw OUT/layer_profile.png from JSON")
    p.add_argument("--ncu-step", action="store_true",
                   help="only one step inside the CUDA profiler range, for ncu --profile-from-start off (GPU)")
    args = p.parse_args(argv)
    if args.replot is not None:
        if not plot.available():
            p.error("--replot needs matplotlib")
        try:
            result = json.loads(args.replot.read_text())
        except (OSError, ValueError) as exc:
            p.error(f"--replot: cannot read {args.replot}: {exc}")
        print(f"wrote {plot.profile_plot(args.out / 'layer_profile.png', result)}")
        return 0
    if args.steps < 1:
        p.error("--steps must be >= 1")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    big = device.type == "cuda"
    T = args.T if args.T is not None else (16384 if big else 16)
    C = args.C if args.C is not None else (4096 if big else 64)
    if T < 1 or C < 1:
        p.error("--T and --C must be >= 1")
    if args.n not in (2, 4, 8):
        p.error(f"--n must be 2, 4 or 8, got {args.n}")
    if args.ncu_step:
        if not big:
            p.error("--ncu-step needs a GPU")
        ncu_step(T, C, device, args.n)
        print(f"ran one layer step (n={args.n}, T={T}, C={C}) inside the CUDA profiler range")
        return 0
    result = profile_layer(T, C, args.steps, device, args.n)
    _print(result)
    args.out.mkdir(parents=True, exist_ok=True)
    result.pop("trace").export_chrome_trace(str(args.out / "layer_trace.json"))
    (args.out / "layer_profile.json").write_text(json.dumps(result, indent=1))
    written = [args.out / "layer_trace.json", args.out / "layer_profile.json"]
    if plot.available():
        written.append(plot.profile_plot(args.out / "layer_profile.png", result))
    print("wrote " + ", ".join(str(w) for w in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
