"""GPU time of one training step by kind of kernel: what ``python -m cakeops bench model --profile`` reports.

The mHC overhead of a model is the difference of two step times; this splits each step's kernel time into the
kinds that can make it up -- cakeops' own kernels (mHC, RMSNorm), the kernels Inductor generated for the glue
torch ops around them, GEMMs, attention, the rest -- plus the time the GPU sat idle, so the overhead reads as
"this much is mHC kernels, this much is glue, this much is launch gaps". Names are matched, not guessed: cakeops'
kernels are the ``triton.jit`` functions of ``cakeops._triton``; Inductor names its kernels ``triton_*``.
"""
import functools
import importlib
import pkgutil
import re
from typing import Callable, Dict, Tuple

import torch

KINDS = ("cakeops mHC", "cakeops RMSNorm", "cakeops partial sums", "Inductor (fused torch ops)", "GEMM",
         "attention", "other")
# partials.py's reduction serves both families (the RMSNorm dw, the mHC parameter gradients)
_MODULE_KIND = {"rmsnorm": "cakeops RMSNorm", "partials": "cakeops partial sums"}
_GEMM = re.compile(r"gemm|cutlass|xmma|nvjet|cublas|wgmma|_mma_|sm90_|sm80_|splitk", re.I)
_ATTENTION = re.compile(r"flash|fmha|attention|sdpa|mem_eff", re.I)


@functools.lru_cache(maxsize=None)
def cakeops_kernels() -> Dict[str, str]:
    """Kernel name -> its kind, for every ``triton.jit`` function in ``cakeops._triton`` (a JITFunction, or an
    InterpretedFunction under TRITON_INTERPRET=1)."""
    from .. import _triton

    names: Dict[str, str] = {}
    for info in pkgutil.iter_modules(_triton.__path__):
        module = importlib.import_module(f"{_triton.__name__}.{info.name}")
        kind = _MODULE_KIND.get(info.name, "cakeops mHC" if info.name.startswith("mhc") else None)
        for value in vars(module).values():
            fn = getattr(value, "fn", None)
            if kind and type(value).__name__ in ("JITFunction", "InterpretedFunction") and callable(fn) \
                    and fn.__module__ == module.__name__:
                names[fn.__name__] = kind
    return names


def kind_of(name: str, ours: Dict[str, str]) -> str:
    """The kind of one GPU kernel, from its name as the profiler reports it."""
    if name in ours:
        return ours[name]
    if name.startswith("triton_"):
        return "Inductor (fused torch ops)"
    if _ATTENTION.search(name):
        return "attention"
    if _GEMM.search(name):
        return "GEMM"
    return "other"


def breakdown(step: Callable[[], object], device: torch.device) -> Tuple[Dict[str, float], Dict[str, float]]:
    """(ms of GPU time per kind, ms per cakeops kernel, largest first) in one call of ``step`` (after it has been
    warmed up). The first also has "kernels" (the kinds' sum), "wall" (the step between two synchronizations) and
    "idle" (wall - kernels, >= 0: launch gaps and host waits; kernels on several streams would overlap and make it
    an underestimate)."""
    import time

    from torch.profiler import ProfilerActivity, profile

    from .core import self_time_us

    ours = cakeops_kernels()
    totals: Dict[str, float] = dict.fromkeys(KINDS, 0.0)
    per_kernel: Dict[str, float] = {}
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        wall = 1e3 * (time.perf_counter() - t)
    for event in prof.key_averages():  # one entry per kernel name, its calls' device time summed
        if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(event, "is_user_annotation", False):
            ms = self_time_us(event, True) / 1e3
            totals[kind_of(event.key, ours)] += ms
            if event.key in ours:
                per_kernel[event.key] = ms
    totals["kernels"] = sum(totals[k] for k in KINDS)
    totals["wall"] = wall
    totals["idle"] = max(0.0, wall - totals["kernels"])
    return totals, dict(sorted(per_kernel.items(), key=lambda kv: -kv[1]))

