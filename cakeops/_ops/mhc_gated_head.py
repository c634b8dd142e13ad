"""The gated head's custom ops (``torch.ops.cakeops.mhc_gated_head_fwd`` / ``_bwd``): device kernels (Triton on
CUDA or under the interpreter, the reference math on CPU), fakes, and one backward formula that the eager
autograd.Function (_mhc/gated_head.py) and ``register_autograd`` share."""
from typing import Optional, Tuple

import torch
from torch import Tensor

from cakeops.meta import checks
from cakeops.meta import mhc_gated_head as fake
from cakeops.meta import mhc_head_layout as layout

from .. import _backend
from ..reference import mhc_gated_head as reference_math
from . import inductor
from .determinism import alert_not_deterministic
from .mhc import empty_tokens, flat, fp32_params, param_grad_buffers, store_reference_grads, unflat
from .strides import unit_last

reference = _backend.AutocastOff(reference_math)  # the CPU path: FP32 inside autocast regions too


def forward_impl(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
                 Y: Optional[Tensor] = None, stats: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(Y [..., C], stats [T, HEAD_STATS_WIDTH]) from X [..., n, C], any leading dims; into Y / stats when given."""
    X3 = unit_last(flat(X, 3))
    fn, scale, base = fp32_params(fn, scale, base)
    T, n, C = X3.shape
    shape = X.shape[:-2] + X.shape[-1:]
    Y2 = empty_tokens(shape, 2, X) if Y is None else flat(Y, 2)
    stats = torch.empty((T, layout.HEAD_STATS_WIDTH), dtype=torch.float32, device=X.device) if stats is None else stats
    if _backend.use_triton(X3):
        from .._triton import mhc_gated_head as kernels
        with _backend.kernel_device(X3):
            kernels.forward(X3, fn, scale, base, rms_eps, hc_eps, stats, Y2)
    else:
        ref_Y, ref_stats = reference.forward(X3, fn, scale, base, rms_eps, hc_eps)
        Y2.copy_(ref_Y)
        stats.copy_(ref_stats)
    return (unflat(Y2, shape) if Y is None else Y), stats


def backward_impl(dY: Tensor, X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, stats: Tensor, rms_eps: float,
                  hc_eps: float, deterministic: bool = True, accumulate: bool = False, dX: Optional[Tensor] = None,
                  dfn: Optional[Tensor] = None, dscale: Optional[Tensor] = None,
                  dbase: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dX [T, n, C], dfn, dscale, dbase FP32) from dY [T, C] and X [T, n, C]; the parameter gradients added into
    the given ones with ``accumulate``. ``rms_eps`` is not read (rstd comes from the record)."""
    del rms_eps
    if not deterministic:
        alert_not_deterministic("cakeops gated head backward with deterministic=False")
    dX = torch.empty(X.shape, dtype=X.dtype, device=X.device) if dX is None else dX
    fn, scale, base = fp32_params(fn, scale, base)  # gradients FP32 too (autograd casts them back)
    (dfn, dscale, dbase), accumulate = param_grad_buffers((fn, scale, base), (dfn, dscale, dbase), accumulate)
    dY, X, stats = unit_last(dY), unit_last(X), stats.contiguous()
    if _backend.use_triton(X):
        from .._triton import mhc_gated_head as kernels
        with _backend.kernel_device(X):
            kernels.backward(dY, X, fn, scale, base, stats, dX, dfn, dscale, dbase, deterministic=deterministic,
                             accumulate=accumulate)
    else:
        outs = reference.backward(dY, X, fn, scale, base, stats, hc_eps)
        store_reference_grads(outs, dX, (dfn, dscale, dbase), accumulate)
    return dX, dfn, dscale, dbase


def _mhc_gated_head_fwd(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
                        deterministic: bool) -> Tuple[Tensor, Tensor]:
    return forward_impl(X, fn, scale, base, rms_eps, hc_eps)


def _mhc_gated_head_bwd(dY: Tensor, X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, stats: Tensor,
                        rms_eps: float, hc_eps: float, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return backward_impl(dY, X, fn, scale, base, stats, rms_eps, hc_eps, deterministic)


@torch.library.custom_op("cakeops::mhc_gated_head_fwd", mutates_args=())
def mhc_gated_head_fwd(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
                       deterministic: bool) -> Tuple[Tensor, Tensor]:
    """(Y, stats). ``deterministic`` rides along for the backward."""
    checks.mhc_gated_head_fwd("cakeops::mhc_gated_head_fwd", X, fn, scale, base, rms_eps, hc_eps)
    return _mhc_gated_head_fwd(X, fn, scale, base, rms_eps, hc_eps, deterministic)


@torch.library.custom_op("cakeops::mhc_gated_head_bwd", mutates_args=())
def mhc_gated_head_bwd(dY: Tensor, X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, stats: Tensor,
                       rms_eps: float, hc_eps: float, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    checks.mhc_gated_head_bwd("cakeops::mhc_gated_head_bwd", dY, X, fn, scale, base, stats, rms_eps, hc_eps)
    return _mhc_gated_head_bwd(dY, X, fn, scale, base, stats, rms_eps, hc_eps, deterministic)


# the unchecked bodies: what compiled graphs call (inductor.define_unchecked)
inductor.register_fake(mhc_gated_head_fwd, fake.mhc_gated_head_fwd, unchecked=_mhc_gated_head_fwd)
inductor.register_fake(mhc_gated_head_bwd, fake.mhc_gated_head_bwd, unchecked=_mhc_gated_head_bwd)
inductor.register_visible_kernels(mhc_gated_head_fwd, _mhc_gated_head_fwd, gpu_checked=True)
inductor.register_visible_kernels(mhc_gated_head_bwd, _mhc_gated_head_bwd, gpu_checked=True, backward=True)


def gated_head_backward(bwd, dY: Optional[Tensor], X: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
                        stats: Tensor, hparams, deterministic: bool):
    """The head node: (dX in X's shape, dfn, dscale, dbase in the parameters' dtypes) from dY [..., C]. ``bwd`` is
    backward_impl (eager) or the custom op (compiled); both take the same positional arguments."""
    if dY is None:
        return None, None, None, None
    dX, dfn, dscale, dbase = bwd(flat(dY, 2), flat(X, 3), fn, scale, base, stats, *hparams, deterministic)
    return (dX if X.dim() == 3 else dX.view(X.shape)), dfn.to(fn.dtype), dscale.to(scale.dtype), dbase.to(base.dtype)


def _setup(ctx, inputs, output):
    X, fn, scale, base, rms_eps, hc_eps, deterministic = inputs
    ctx.save_for_backward(X, fn, scale, base, output[1])
    ctx.hparams = (rms_eps, hc_eps)
    ctx.deterministic = deterministic
    ctx.set_materialize_grads(False)


def _backward(ctx, dY, d_stats):
    X, fn, scale, base, stats = ctx.saved_tensors
    return gated_head_backward(torch.ops.cakeops.mhc_gated_head_bwd, dY, X, fn, scale, base, stats, ctx.hparams,
                               ctx.deterministic) + (None, None, None)


mhc_gated_head_fwd.register_autograd(_backward, setup_context=_setup)
