"""RMSNorm custom ops (``torch.ops.cakeops.rmsnorm_*``): device kernels, fakes and autograd registration.

The ``*_impl`` functions are the single place that picks Triton (CUDA, or CPU under the interpreter) or
the reference math; the custom ops and the eager autograd.Function both call them, so compiled and eager
results are the same bits. Inputs arrive flattened to [T, H] with unit column stride.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from cakeops.meta import checks
from cakeops.meta import rmsnorm as fake

from .. import _backend
from ..reference import rmsnorm as reference_math
from . import inductor
from .determinism import alert_not_deterministic
from .strides import unit_last

reference = _backend.AutocastOff(reference_math)  # the CPU path: FP32 inside autocast regions too


_kernels = None


def _triton_kernels():
    """The Triton launchers' module, imported on first use (importing cakeops never imports triton); kept in a
    global because an ``import`` statement costs a module-table walk on every call."""
    global _kernels
    if _kernels is None:
        from .._triton import rmsnorm

        _kernels = rmsnorm
    return _kernels


def forward_impl(x: Tensor, w: Tensor, eps: float, residual: Optional[Tensor] = None,
                 y: Optional[Tensor] = None, rstd: Optional[Tensor] = None,
                 h_out: Optional[Tensor] = None):
    x, w = unit_last(x), unit_last(w)
    residual = None if residual is None else unit_last(residual)
    T, H = x.shape
    # new_empty with the sizes as separate ints: half the host time of torch.empty((T, H), dtype=, device=)
    y = x.new_empty(T, H) if y is None else y
    rstd = x.new_empty(T, dtype=torch.float32) if rstd is None else rstd
    if residual is not None and h_out is None:
        h_out = x.new_empty(T, H)
    if _backend.use_triton(x):
        switch, device = _backend.device_switch(x)
        if switch is None:
            _triton_kernels().forward(x, w, eps, y, rstd, residual, h_out, device=device)
        else:
            with switch:
                _triton_kernels().forward(x, w, eps, y, rstd, residual, h_out, device=device)
    else:
        outs = reference.forward(x, w, eps, residual)
        y.copy_(outs[0])
        rstd.copy_(outs[1])
        if residual is not None:
            h_out.copy_(outs[2])
    return (y, rstd) if residual is None else (y, rstd, h_out)


def backward_impl(g: Tensor, x: Tensor, w: Tensor, rstd: Tensor, g_residual: Optional[Tensor] = None,
                  deterministic: bool = True, workspace: Optional[Tensor] = None,
                  dx: Optional[Tensor] = None, dw: Optional[Tensor] = None,
                  dw_dtype: torch.dtype = torch.float32) -> Tuple[Tensor, Tensor]:
    """``dw_dtype``: the dtype of a dw allocated here. The FP32 sum is rounded once into it by the deterministic
    reduction (the bits of ``dw.to(dw_dtype)``, one launch fewer); FP32 where the kernels cannot round it:
    ``deterministic=False`` (atomics) and Triton's interpreter (``ROUNDS_TO_NEAREST``). The caller casts the rest."""
    if not deterministic:
        alert_not_deterministic("cakeops rmsnorm backward with deterministic=False")
    g, x, w = unit_last(g), unit_last(x), unit_last(w)
    g_residual = None if g_residual is None else unit_last(g_residual)
    T, H = x.shape
    kernels = _triton_kernels() if _backend.use_triton(x) else None
    dx = x.new_empty(T, H) if dx is None else dx
    if dw is None:
        rounds = deterministic and (kernels is None or kernels.ROUNDS_TO_NEAREST)
        dw = x.new_empty(H, dtype=dw_dtype if rounds else torch.float32)
    if kernels is not None:
        switch, device = _backend.device_switch(x)
        if switch is None:
            kernels.backward(g, x, w, rstd, dx, dw, g_residual, deterministic, workspace, device=device)
        else:
            with switch:
                kernels.backward(g, x, w, rstd, dx, dw, g_residual, deterministic, workspace, device=device)
    else:
        ref_dx, ref_dw = reference.backward(g, x, w, rstd, g_residual)
        dx.copy_(ref_dx)
        dw.copy_(ref_dw)
    return dx, dw


def eager_backward(g: Tensor, x: Tensor, w: Tensor, rstd: Tensor, g_residual: Optional[Tensor],
                   deterministic: bool) -> Tuple[Tensor, Tensor]:
    """The eager Function's backward entry: ``backward_impl`` with dw in w's dtype, straight from the kernels
    where they round it (the eager and compiled paths give the same bits either way)."""
    dX, dw = backward_impl(g, x, w, rstd, g_residual, deterministic, dw_dtype=w.dtype)
    return dX, (dw if dw.dtype == w.dtype else dw.to(w.dtype))


# The ops' bodies without their argument checks: what compiled graphs call (inductor.define_unchecked).

def _rmsnorm_fwd(x: Tensor, w: Tensor, eps: float, deterministic: bool) -> Tuple[Tensor, Tensor]:
    return forward_impl(x, w, eps)


def _add_rmsnorm_fwd(x: Tensor, residual: Tensor, w: Tensor, eps: float,
                     deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    return forward_impl(x, w, eps, residual)


def _rmsnorm_bwd(g: Tensor, x: Tensor, w: Tensor, rstd: Tensor, g_residual: Optional[Tensor],
                 deterministic: bool) -> Tuple[Tensor, Tensor]:
    return eager_backward(g, x, w, rstd, g_residual, deterministic)


@torch.library.custom_op("cakeops::rmsnorm_fwd", mutates_args=())
def rmsnorm_fwd(x: Tensor, w: Tensor, eps: float, deterministic: bool) -> Tuple[Tensor, Tensor]:
    """y, rstd = RMSNorm(x) * w. ``deterministic`` only rides along for the backward."""
    checks.rmsnorm_fwd("cakeops::rmsnorm_fwd", x, w, eps)
    return _rmsnorm_fwd(x, w, eps, deterministic)


@torch.library.custom_op("cakeops::add_rmsnorm_fwd", mutates_args=())
def add_rmsnorm_fwd(x: Tensor, residual: Tensor, w: Tensor, eps: float,
                    deterministic: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """h_new = x + residual; y, rstd = RMSNorm(h_new) * w."""
    checks.rmsnorm_fwd("cakeops::add_rmsnorm_fwd", x, w, eps, residual)
    return _add_rmsnorm_fwd(x, residual, w, eps, deterministic)


@torch.library.custom_op("cakeops::rmsnorm_bwd", mutates_args=())
def rmsnorm_bwd(g: Tensor, x: Tensor, w: Tensor, rstd: Tensor, g_residual: Optional[Tensor],
                deterministic: bool) -> Tuple[Tensor, Tensor]:
    """dx (g_residual folded in, one rounding) and dw in w's dtype (the FP32 sum rounded once, by the reduction
    kernel itself: a compiled backward has no cast kernel after it)."""
    checks.rmsnorm_bwd("cakeops::rmsnorm_bwd", g, x, w, rstd, g_residual)
    return _rmsnorm_bwd(g, x, w, rstd, g_residual, deterministic)


inductor.register_fake(rmsnorm_fwd, fake.rmsnorm_fwd, unchecked=_rmsnorm_fwd)
inductor.register_fake(add_rmsnorm_fwd, fake.add_rmsnorm_fwd, unchecked=_add_rmsnorm_fwd)
inductor.register_fake(rmsnorm_bwd, fake.rmsnorm_bwd, unchecked=_rmsnorm_bwd)

# On a GPU torch.compile traces the ops' bodies, their kernels launched by Inductor's code (inductor.py)
for _op, _body in ((rmsnorm_fwd, _rmsnorm_fwd), (add_rmsnorm_fwd, _add_rmsnorm_fwd), (rmsnorm_bwd, _rmsnorm_bwd)):
    inductor.register_visible_kernels(_op, _body, gpu_checked=True, backward=_op is rmsnorm_bwd)


# ---- autograd: one formula for the eager Function and the registered autograd ----

def backward_formula(bwd, h: Tensor, w: Tensor, rstd: Tensor, grad_y: Optional[Tensor], grad_h: Optional[Tensor],
                     has_residual: bool, deterministic: bool):
    """(dx, dw, dresidual) from the saved (x or h_new, w, rstd) and the incoming gradients of y and h_new.

    ``bwd`` is the backward entry: ``eager_backward`` (eager, the kernels directly) or the ``rmsnorm_bwd`` op
    (compiled, so the AOT backward graph holds it); both take (g, x, w, rstd, g_residual, deterministic) and give
    dw in w's dtype.
    Gradients are not materialized: a missing grad_h adds nothing (no zero tensor read), a missing grad_y
    means y was unused, and then h_new's gradient passes straight to x and residual with no kernel at all.
    """
    if grad_y is None:
        return grad_h, None, grad_h
    dx, dw = bwd(rows(grad_y), rows(h), w, rstd if rstd.dim() == 1 else rstd.reshape(-1),
                 None if grad_h is None else rows(grad_h), deterministic)
    dx = dx if h.dim() == 2 else dx.view(h.shape)
    return dx, dw, (dx if has_residual else None)


def rows(t: Tensor) -> Tensor:
    """[..., H] -> [T, H], a view whenever the layout allows (the kernels' entry copies what they cannot read)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _setup(ctx, inputs, output):
    has_residual = len(inputs) == 5
    w, deterministic = inputs[-3], inputs[-1]
    # With a residual the backward reads h_new (an output), never x or residual: nothing else of size
    # [T, H] is kept.
    ctx.save_for_backward(output[2] if has_residual else inputs[0], w, output[1])
    ctx.deterministic, ctx.has_residual = deterministic, has_residual
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_y, grad_rstd, grad_h=None):
    h, w, rstd = ctx.saved_tensors
    dx, dw, dres = backward_formula(torch.ops.cakeops.rmsnorm_bwd, h, w, rstd, grad_y, grad_h, ctx.has_residual,
                                    ctx.deterministic)
    if ctx.has_residual:  # (x, residual, w, eps, deterministic)
        return dx, dres, dw, None, None
    return dx, dw, None, None


rmsnorm_fwd.register_autograd(_backward, setup_context=_setup)
add_rmsnorm_fwd.register_autograd(_backward, setup_context=_setup)
