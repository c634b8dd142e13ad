"""Gluon (``triton.experimental.gluon``) kernels for sm_90: today backward_finish's kernel B (dX, mhc_backward_dx.py).

The Triton kernels stay: the interpreter runs them on CPU (Gluon has no interpreter), every other GPU runs them, and
they are the Gluon kernels' numerical twins. A launcher asks ``available`` and takes the Gluon kernel where it says
so. This module imports without Gluon (cakeops imports and runs on CPU and on tritons without it); the kernels'
modules import it, and are imported only once ``available`` holds.
"""
import functools
import os

import torch

# The tritons whose Gluon the kernels are written for (3.6's names and the 3.7 breaks written around:
# compat.py); any other triton takes the Triton kernels.
SUPPORTED_TRITON = ((3, 6), (3, 7), (3, 8))
DTYPES = (torch.bfloat16, torch.float16)
# Off by default until a GPU has run the kernels against their Triton twins (built and checked for sm_90 on CPU
# only, 2026-12-04: docs/internals.md); CAKEOPS_GLUON=1 takes them, =0 never.
DEFAULT_ON = False
STREAMS = (2, 4, 8)


@functools.lru_cache(maxsize=None)
def importable() -> bool:
    """Whether this triton is in SUPPORTED_TRITON and its Gluon, with the Hopper modules the kernels use, imports."""
    try:
        import triton

        version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2])
        if version not in SUPPORTED_TRITON:
            return False
        from . import compat  # noqa: F401
    except Exception:  # no triton, no gluon, a triton whose gluon lacks a name the kernels use
        return False
    return True


@functools.lru_cache(maxsize=None)
def _capability(index: int):
    return torch.cuda.get_device_capability(index)


def switched_on() -> bool:
    """``CAKEOPS_GLUON``: "1" on, "0" off, unset: ``DEFAULT_ON``."""
    chosen = os.environ.get("CAKEOPS_GLUON")
    return DEFAULT_ON if chosen is None else chosen != "0"


def available(device: torch.device, dtype: torch.dtype, n: int) -> bool:
    """Whether a Gluon kernel serves tensors of ``dtype`` with ``n`` streams on ``device``: a CUDA device of
    capability (9, 0) (H100 / H200: the kernels use sm_90's TMA and wgmma, built and checked for it alone), bf16
    or fp16, n in {2, 4, 8}, a triton whose Gluon imports (``importable``), not the interpreter, and
    ``switched_on`` (read on each call: the bench and tests time and test both kernels on the same GPU)."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in DTYPES or n not in STREAMS:
        return False
    if not switched_on() or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) == (9, 0) and importable()


def takes_dx(X: torch.Tensor, dY: torch.Tensor, dU: torch.Tensor, stats: torch.Tensor, dz: torch.Tensor,
             dX: torch.Tensor) -> bool:
    """Whether backward_finish's kernel B runs in Gluon for these tensors (``available``, TMA can address them,
    and the launch is not being traced for Inductor: ``torch.library.wrap_triton`` takes Triton kernels only)."""
    from .._triton.fast_launch import tracing

    if tracing() or not available(X.device, X.dtype, X.shape[1]):
        return False
    from .mhc_backward_dx import takes

    return takes(X, dY, dU, stats, dz, dX)


def dx(*args, **kwargs) -> None:
    """mhc_backward_dx.dx: kernel B in Gluon (import it only where ``takes_dx`` holds)."""
    from .mhc_backward_dx import dx as launch

    launch(*args, **kwargs)
