"""FlashInfer 0.7.4's deterministic RMSNorm module, ``flashinfer.cake_rmsnorm_det_train``, over cakeops' one
implementation (``cakeops.cake_rmsnorm_train``).

The forward, the workspace helpers and the support query are ``cakeops.cake_rmsnorm_train``'s objects (identity;
their ``deterministic`` keyword defaults to True, the deterministic path). What this module pins, as FlashInfer's
does: ``cake_rmsnorm_det_train_backward(..., deterministic=False)`` raises ValueError (only the fixed-order dw
reduction is exported), and so does the backward of a ``CakeRMSNormDetFunction`` / ``cake_rmsnorm_det`` node made
with ``deterministic=False`` (FlashInfer rejects it "during backward"; the forward runs). ``[..., H]`` inputs and
FP32 (or fp16, cakeops' extension) weights are accepted, as FlashInfer 0.7.4's det module accepts them.
``program_windows`` / ``weight_dtypes`` / ``route_key``: FlashInfer's registry queries with cakeops' answers (one
Triton program per route for every token count, every float weight dtype; cakeops/_support.py).

>>> x, w = torch.randn(4, 64), torch.ones(64)
>>> y, rstd = cake_rmsnorm_det_train_forward(x, w, 1e-6)
>>> dx, dw = cake_rmsnorm_det_train_backward(torch.randn_like(y), x, w, rstd)
>>> program_windows("cpu", 64, "bwd", False)
((0, None, '_rmsnorm_bwd_kernel'),)
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ._function import first_order
from ._support import ARCHES, SUPPORTED_COMPUTE_CAPABILITIES, WEIGHT_DTYPES  # noqa: F401
from ._support import rmsnorm_route_key as route_key  # noqa: F401
from .cake_rmsnorm_train import CakeRMSNormFunction as _RMSNormFunction
from .cake_rmsnorm_train import _check_flags
from .cake_rmsnorm_train import cake_rmsnorm_train_backward as _backward
from .cake_rmsnorm_train import cake_rmsnorm_train_backward_workspace as cake_rmsnorm_det_train_backward_workspace
from .cake_rmsnorm_train import (  # noqa: F401
    cake_rmsnorm_train_backward_workspace_bytes as cake_rmsnorm_det_train_backward_workspace_bytes,
)
from .cake_rmsnorm_train import cake_rmsnorm_train_forward as cake_rmsnorm_det_train_forward
from .cake_rmsnorm_train import is_cake_rmsnorm_train_supported as is_cake_rmsnorm_det_train_supported

_ONLY_DETERMINISTIC = "{}: cakeops.cake_rmsnorm_det_train exports only the deterministic dw reduction (as FlashInfer's " \
                      "cake_rmsnorm_det_train); use cakeops.cake_rmsnorm_train for deterministic=False"


def cake_rmsnorm_det_train_backward(g: Tensor, x: Tensor, w: Tensor, rstd: Tensor, *, deterministic: bool = True,
                                    g_residual: Optional[Tensor] = None, workspace: Optional[Tensor] = None,
                                    dx: Optional[Tensor] = None, dw: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``cake_rmsnorm_train_backward`` with the deterministic dw reduction only: ``deterministic=False`` raises
    ValueError, as FlashInfer's ``cake_rmsnorm_det_train_backward`` does. Arguments (g, x, w, rstd, g_residual,
    workspace, dx, dw) and results as there.

    >>> x, w = torch.randn(4, 64), torch.ones(64)
    >>> y, rstd = cake_rmsnorm_det_train_forward(x, w, 1e-6)
    >>> cake_rmsnorm_det_train_backward(torch.randn_like(y), x, w, rstd)[1].dtype
    torch.float32
    """
    _check_flags(deterministic)
    if not deterministic:
        raise ValueError(_ONLY_DETERMINISTIC.format("cake_rmsnorm_det_train_backward"))
    return _backward(g, x, w, rstd, deterministic=True, g_residual=g_residual,
                     workspace=workspace, dx=dx, dw=dw)


class CakeRMSNormDetFunction(_RMSNormFunction):
    """``CakeRMSNormFunction`` whose backward refuses ``deterministic=False`` (ValueError), as FlashInfer's
    ``CakeRMSNormDetFunction``: ``forward(ctx, x, w, eps, residual=None, deterministic=True)`` returns ``y`` or
    ``(y, h_new)`` and saves only ``(x or h_new, w, rstd)``."""
    what = "cakeops RMSNorm (cake_rmsnorm_det)"

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, eps: float, residual: Optional[Tensor] = None, deterministic: bool = True):
        _check_flags(deterministic)
        ctx.refused = not deterministic  # FlashInfer runs the forward and rejects False in the backward
        return _RMSNormFunction.forward(ctx, x, w, eps, residual, True)

    @staticmethod
    @first_order(what)
    def backward(ctx, grad_y, grad_h=None):
        if ctx.refused:
            raise ValueError(_ONLY_DETERMINISTIC.format("CakeRMSNormDetFunction.backward"))
        return _RMSNormFunction.backward.__wrapped__(ctx, grad_y, grad_h)


def cake_rmsnorm_det(x: Tensor, w: Tensor, eps: float = 1e-6, residual: Optional[Tensor] = None,
                     deterministic: bool = True):
    """``cake_rmsnorm`` (autograd) with the deterministic dw reduction only: x, w, eps, residual as there;
    ``deterministic=False`` is rejected by the backward (ValueError), as FlashInfer's ``cake_rmsnorm_det``.
    Under torch.compile it is ``cake_rmsnorm`` with ``deterministic=True`` (a False call raises at once there).

    >>> x = torch.randn(2, 8, 64, requires_grad=True)
    >>> cake_rmsnorm_det(x, torch.ones(64)).shape
    torch.Size([2, 8, 64])
    """
    from . import _traced
    from .cake_rmsnorm_train import cake_rmsnorm

    _check_flags(deterministic)
    if _traced.through_ops():
        if not deterministic:
            raise ValueError(_ONLY_DETERMINISTIC.format("cake_rmsnorm_det"))
        return cake_rmsnorm(x, w, eps, residual, True)
    return CakeRMSNormDetFunction.apply(x, w, eps, residual, deterministic)


def _route(arch: str, hidden: int, kind: str, residual: bool, w_dtype: str = "bf16") -> str:
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}, got {arch!r}")
    return route_key(hidden, kind, residual, w_dtype)


def weight_dtypes(arch: str, hidden: int, kind: str, residual: bool) -> Tuple[str, ...]:
    """The weight dtypes (``"bf16"``, ``"f16"``, ``"f32"``) the route of (``hidden``, ``kind``, ``residual``) takes on
    ``arch`` (one of ``ARCHES``): every one, for every route (FlashInfer 0.7.4 ships FP32-weight programs on some
    routes only).

    >>> weight_dtypes("sm_90", 4096, "fwd", True)
    ('bf16', 'f16', 'f32')
    """
    _route(arch, hidden, kind, residual)
    return WEIGHT_DTYPES


def program_windows(arch: str, hidden: int, kind: str, residual: bool,
                    w_dtype: str = "bf16") -> Tuple[Tuple[int, Optional[int], str], ...]:
    """The row-count windows of one route and the program each launches, ``(above, at_most, program)`` with
    ``at_most`` None for unbounded (FlashInfer 0.7.4's format; the dw reduce shares its owner's window), of the
    route of (``hidden``, ``kind``, ``residual``, ``w_dtype``) on ``arch`` (one of ``ARCHES``): cakeops runs one Triton
    kernel per route for every token count, so one window, ``(0, None, kernel name)``.

    >>> program_windows("sm_100", 4096, "fwd", False)
    ((0, None, '_rmsnorm_fwd_kernel'),)
    """
    _route(arch, hidden, kind, residual, w_dtype)
    return ((0, None, "_rmsnorm_fwd_kernel" if kind == "fwd" else "_rmsnorm_bwd_kernel"),)


# The names before FlashInfer's det rename, the same objects as this module's det names (not in __all__), as
# flashinfer.cake_rmsnorm_det_train has them.
CakeRMSNormFunction = CakeRMSNormDetFunction
cake_rmsnorm = cake_rmsnorm_det
cake_rmsnorm_train_backward = cake_rmsnorm_det_train_backward
cake_rmsnorm_train_backward_workspace = cake_rmsnorm_det_train_backward_workspace
cake_rmsnorm_train_backward_workspace_bytes = cake_rmsnorm_det_train_backward_workspace_bytes
cake_rmsnorm_train_forward = cake_rmsnorm_det_train_forward
is_cake_rmsnorm_train_supported = is_cake_rmsnorm_det_train_supported

__all__ = [
    "ARCHES", "SUPPORTED_COMPUTE_CAPABILITIES", "CakeRMSNormDetFunction", "cake_rmsnorm_det",
    "cake_rmsnorm_det_train_backward", "cake_rmsnorm_det_train_backward_workspace",
    "cake_rmsnorm_det_train_backward_workspace_bytes", "cake_rmsnorm_det_train_forward",
    "is_cake_rmsnorm_det_train_supported", "program_windows", "route_key", "weight_dtypes",
]
