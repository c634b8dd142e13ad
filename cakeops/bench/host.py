"""``python -m cakeops.bench.host [--T 16384] [--C 4096] [--calls 20] [--reps 5] [--no-kernels | --fake-driver]``: the
host (CPU) cost of one mHC layer forward + backward (identity branch, bf16), eager and under
``torch.compile(fullgraph=True)``.
``--op rmsnorm``: the public RMSNorm path instead, next to torch's (``bench/host_rmsnorm.py``).

Below some size a layer is host-bound: its kernels finish before the CPU has issued the next ones, and the CPU
time per call is the step time. On a GPU each rep keeps the device busy (``torch.cuda._sleep``) while ``calls``
layers are issued, so the clock measures issuing only; the paths alternate rep by rep, because a shared host's
speed drifts between runs (the H200 host measured the same code 2x apart on one day). ``--no-kernels`` (the
default without a GPU) replaces the four launchers with no-ops and routes CPU tensors through the kernel path:
what remains is the Python of cakeops and torch (checks, autograd, custom-op dispatch, Dynamo guards,
AOTAutograd and Inductor wrappers), measurable on any machine. ``--fake-driver`` (CPU only) runs the launchers
too, and Triton's launch path behind them (``FastKernel``'s cached routes, ``JITFunction.run`` on a first call)
against ``host_rmsnorm.fake_driver``'s stand-in driver, whose compiled kernels do nothing: what a layer's dozen
launches cost the host, short of the compiled launcher itself. Without a GPU the clock is this process's CPU time
(the host is shared: time spent descheduled is not ours).
"""
import argparse
import contextlib
import statistics
import sys
import time
from typing import Callable, Dict, List

import torch

from .. import _backend
from .core import host_time_per_call
from .mhc_cases import _layer_forward
from .profile import _inputs

_LAUNCHERS = {"mhc_forward": ("prepare", "finish"), "mhc_backward": ("backward_prepare", "backward_finish")}


@contextlib.contextmanager
def no_kernels():
    """The mHC launchers do nothing and CPU tensors take the kernel path: the host cost without launches."""
    import importlib

    saved = []
    for module_name, names in _LAUNCHERS.items():
        module = importlib.import_module(f"cakeops._triton.{module_name}")
        for name in names:
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, lambda *args, **kwargs: None)
    runs_triton, _backend._cpu_runs_triton = _backend._cpu_runs_triton, True
    try:
        yield
    finally:
        _backend._cpu_runs_triton = runs_triton
        for module, name, fn in saved:
            setattr(module, name, fn)


def paths(T: int, C: int, device: torch.device) -> Dict[str, Callable[[], object]]:
    X, fn, scale, base, dY = _inputs(T, C, device)
    leaves = (X, fn, scale, base)
    compiled = torch.compile(_layer_forward, dynamic=False, fullgraph=True)
    return {
        "eager": lambda: torch.autograd.grad(_layer_forward(*leaves), leaves, dY),
        "compiled": lambda: torch.autograd.grad(compiled(*leaves), leaves, dY),
    }


def cpu_ms_per_call(runs: Dict[str, Callable[[], object]], calls: int, reps: int,
                    on_gpu: bool) -> Dict[str, List[float]]:
    """CPU milliseconds per call, one list of ``reps`` values per path; the paths alternate rep by rep."""
    return host_time_per_call(runs, calls, reps, on_gpu, time.perf_counter if on_gpu else time.process_time, 1e3)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cakeops.bench.host", description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=None, help="tokens (default 16384; with no kernels 64)")
    p.add_argument("--C", type=int, default=None, help="hidden size per stream (default 4096; with no kernels 64)")
    p.add_argument("--calls", type=int, default=20, help="layers issued per timed rep")
    p.add_argument("--reps", type=int, default=5, help="timed reps per path (alternating)")
    p.add_argument("--no-kernels", action="store_true", help="launchers as no-ops (the default without a GPU)")
    p.add_argument("--op", choices=("mhc", "rmsnorm"), default="mhc", help="what to measure (default: an mHC layer)")
    p.add_argument("--H", type=int, default=None, help="rmsnorm: hidden size (default: the issue's shapes on a GPU)")
    p.add_argument("--fake-driver", action="store_true",
                   help="CPU: run the launchers and triton's launch path against a stand-in driver")
    args = p.parse_args(argv)
    if min(args.calls, args.reps) < 1:
        p.error("--calls and --reps must be >= 1")
    if args.op == "rmsnorm":
        from . import host_rmsnorm

        return host_rmsnorm.main(args)
    if args.H is not None:
        p.error("--H applies to --op rmsnorm")
    if args.fake_driver and args.no_kernels:
        p.error("--fake-driver runs the launchers, --no-kernels replaces them: pick one")
    on_gpu = torch.cuda.is_available() and not (args.no_kernels or args.fake_driver)
    if on_gpu:
        device, ctx, T, C = torch.device("cuda"), contextlib.nullcontext(), args.T or 16384, args.C or 4096
        what = f"{torch.cuda.get_device_name()}, kernels launched, GPU kept busy"
    elif args.fake_driver:
        from .host_rmsnorm import fake_driver

        device, ctx, T, C = torch.device("cpu"), fake_driver(), args.T or 64, args.C or 64
        what = "CPU tensors, launchers and triton's launch path against a stand-in driver (no compiled launcher)"
    else:  # the host cost does not depend on the size: small tensors keep the reference-free path cheap
        device, ctx, T, C = torch.device("cpu"), no_kernels(), args.T or 64, args.C or 64
        what = "CPU tensors, launchers replaced by no-ops (the Python layers alone)"
    with ctx:
        times = cpu_ms_per_call(paths(T, C, device), args.calls, args.reps, on_gpu)
    print(f"host time of one mHC layer fwd+bwd, T={T} C={C} bf16 ({what}); {args.reps} reps of {args.calls} calls")
    for name, values in times.items():
        print(f"  {name:9s} CPU ms/call: min {min(values):.3f}  median {statistics.median(values):.3f}  "
              f"reps {' '.join(f'{v:.3f}' for v in values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
