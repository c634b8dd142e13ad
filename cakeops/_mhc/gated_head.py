"""The gated mHC head (DeepSeek-V4's hc_head): its FlashInfer-style forward / backward functions, its eager
autograd.Function and ``cake_mhc_train_gated_head`` (the ``torch.ops.cakeops.mhc_gated_head_*`` custom ops under
torch.compile or with DTensors).

Re-exported by ``cakeops.cake_mhc_train`` (the public module).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _checks, _traced
from .. import _mhc_args as args
from .._buffers import out_tensor, written
from .._checks import FLOAT_DTYPES, tensor
from .._function import EagerFunction, first_order
from .._ops import mhc_gated_head as head_ops
from .._ops.sharding import any_dtensor
from ..meta import mhc_head_layout as head_layout


# ---------------------------------------------------------------------------------------------
# The gated head (DeepSeek-V4's hc_head): Y = sum_i (sigmoid(rstd * (fn_i . x) * scale + base_i) + hc_eps) * X_i
# ---------------------------------------------------------------------------------------------

def _check_gated_head(X, fn, scale, base, rms_eps, hc_eps, leading_dims: bool = False):
    """The gated head's arguments in the user's terms; returns (rms_eps, hc_eps) as floats."""
    tensor("X", X, dtypes=FLOAT_DTYPES, **({"min_ndim": 3} if leading_dims else {"ndim": 3}))
    n, C = X.shape[-2], X.shape[-1]
    if n not in head_layout.SUPPORTED_N:
        raise NotImplementedError(f"X: the gated head supports n in {head_layout.SUPPORTED_N} streams "
                                  f"([{'...' if leading_dims else 'T'}, n, C]), got shape {tuple(X.shape)}")
    if C < 1:
        raise ValueError(f"X: expected a hidden size C >= 1, got shape {tuple(X.shape)}")
    args.like("fn", fn, X, (n, n * C), dtypes=FLOAT_DTYPES, per_token=False)
    args.like("scale", scale, X, (1,), dtypes=FLOAT_DTYPES, per_token=False)
    args.like("base", base, X, (n,), dtypes=FLOAT_DTYPES, per_token=False)
    return _checks.positive_float("rms_eps", rms_eps), _checks.positive_float("hc_eps", hc_eps)


def cake_mhc_train_gated_head_forward(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, rms_eps: float = 1e-5,
                                      hc_eps: float = 1e-6, out: Optional[Tensor] = None,
                                      stats_out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The gated head, forward: ``(Y [T, C] in X.dtype, stats [T, 32] FP32)``.

    X ``[T, n, C]`` (bf16, fp16 or fp32; n in 2, 4, 8, C >= 1, unit stride along C else copied once); fn
    ``[n, n*C]``, scale ``[1]``, base ``[n]`` in any float dtype (the math is FP32). Per token,
    ``x = X[t].reshape(n*C)``, ``rstd = 1/sqrt(mean(x^2) + rms_eps)``,
    ``g_i = sigmoid(rstd * (fn_i . x) * scale + base_i) + hc_eps`` and ``Y[t] = round(sum_i g_i * X[t, i])``.
    ``stats`` is the record the backward needs (g, mix = rstd * fn @ x, rstd; layout cakeops.meta.mhc_head_layout).
    rms_eps, hc_eps: finite floats > 0. ``out`` / ``stats_out``: buffers to write into.

    >>> X = torch.randn(3, 4, 8)
    >>> fn, scale, base = torch.randn(4, 32) * 0.1, torch.ones(1), torch.zeros(4)
    >>> Y, stats = cake_mhc_train_gated_head_forward(X, fn, scale, base)
    >>> Y.shape, stats.shape, stats.dtype
    (torch.Size([3, 8]), torch.Size([3, 32]), torch.float32)
    """
    hp = _check_gated_head(X, fn, scale, base, rms_eps, hc_eps)
    T, n, C = X.shape
    out = out_tensor("out", out, shape=(T, C), dtype=X.dtype, device=X.device)
    stats_out = out_tensor("stats_out", stats_out, shape=(T, head_layout.HEAD_STATS_WIDTH), dtype=torch.float32,
                           device=X.device)
    if _traced.through_ops():
        return _traced.gated_head_forward(X, fn, scale, base, hp, out, stats_out)
    return written(lambda Y, stats: head_ops.forward_impl(X, fn, scale, base, *hp, Y=Y, stats=stats), out, stats_out)


def cake_mhc_train_gated_head_backward(dY: Tensor, X: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
                                       stats: Tensor, *, rms_eps: float = 1e-5, hc_eps: float = 1e-6,
                                       deterministic: bool = True, accumulate: bool = False,
                                       dX: Optional[Tensor] = None, dfn: Optional[Tensor] = None,
                                       dscale: Optional[Tensor] = None,
                                       dbase: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The gated head, backward: ``(dX [T, n, C] in X.dtype, dfn [n, n*C], dscale [1], dbase [n] FP32)``.

    dY ``[T, C]`` in X's dtype; X, fn, scale, base, rms_eps and hc_eps as given to the forward, ``stats`` its
    record (rms_eps and hc_eps must match the forward's: the record holds rstd and the gates). dX is written
    once (``g_i*dY`` and the gates' contribution through rstd and mix summed in FP32, one rounding).
    ``deterministic=True``: the parameter gradients are summed over tokens in a fixed order (bitwise
    reproducible for a given T and device); ``False`` uses atomics. ``accumulate=True`` adds into the given
    dfn, dscale and dbase (all three needed); dX is always overwritten.

    >>> X, dY = torch.randn(3, 2, 8), torch.randn(3, 8)
    >>> fn, scale, base = torch.randn(2, 16) * 0.1, torch.ones(1), torch.zeros(2)
    >>> Y, stats = cake_mhc_train_gated_head_forward(X, fn, scale, base)
    >>> dX, dfn, dscale, dbase = cake_mhc_train_gated_head_backward(dY, X, fn, scale, base, stats)
    >>> dX.shape, dfn.shape, dscale.shape, dbase.shape
    (torch.Size([3, 2, 8]), torch.Size([2, 16]), torch.Size([1]), torch.Size([2]))
    """
    hp = _check_gated_head(X, fn, scale, base, rms_eps, hc_eps)
    T, n, C = X.shape
    args.like("dY", dY, X, (T, C))
    args.stats("stats", stats, X, head_layout.HEAD_STATS_WIDTH)
    args.flag("deterministic", deterministic)
    args.flag("accumulate", accumulate)
    dX = out_tensor("dX", dX, shape=X.shape, dtype=X.dtype, device=X.device)
    dfn = out_tensor("dfn", dfn, shape=(n, n * C), dtype=torch.float32, device=X.device)
    dscale = out_tensor("dscale", dscale, shape=(1,), dtype=torch.float32, device=X.device)
    dbase = out_tensor("dbase", dbase, shape=(n,), dtype=torch.float32, device=X.device)
    if accumulate and (dfn is None or dscale is None or dbase is None):
        raise ValueError("dfn: accumulate=True needs dfn, dscale and dbase to add into; pass all three "
                         "(FP32) or accumulate=False")
    if _traced.through_ops():
        return _traced.gated_head_backward(dY, X, fn, scale, base, stats, hp, deterministic, accumulate,
                                           (dX, dfn, dscale, dbase))
    return written(lambda dX, dfn, dscale, dbase: head_ops.backward_impl(
        dY, X, fn, scale, base, stats, *hp, deterministic=deterministic, accumulate=accumulate, dX=dX, dfn=dfn,
        dscale=dscale, dbase=dbase), dX, dfn, dscale, dbase, added=(False,) + (accumulate,) * 3)


class CakeMHCTrainGatedHeadFunction(EagerFunction):
    """``forward(ctx, X, fn, scale, base, rms_eps, hc_eps, deterministic) -> Y``: the gated head with autograd,
    X ``[..., n, C]`` -> Y ``[..., C]``. Saves X, the parameters and the FP32 record (32 floats per token)."""
    what = "cakeops gated mHC head (nn.MHCHead(gated=True))"

    @staticmethod
    def forward(ctx, X, fn, scale, base, rms_eps, hc_eps, deterministic):
        Y, stats = head_ops.forward_impl(X, fn, scale, base, rms_eps, hc_eps)
        ctx.save_for_backward(X, fn, scale, base, stats)
        ctx.hparams = (rms_eps, hc_eps)
        ctx.deterministic = deterministic
        ctx.set_materialize_grads(False)
        return Y

    @staticmethod
    @first_order(what)
    def backward(ctx, dY):
        X, fn, scale, base, stats = ctx.saved_tensors
        return head_ops.gated_head_backward(head_ops.backward_impl, dY, X, fn, scale, base, stats, ctx.hparams,
                                            ctx.deterministic) + (None, None, None)


def cake_mhc_train_gated_head(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, rms_eps: float = 1e-5,
                              hc_eps: float = 1e-6, deterministic: bool = True) -> Tensor:
    """The model's final collapse with learned, input-dependent gates (DeepSeek-V4's hc_head), with autograd:
    X ``[..., n, C]`` -> Y ``[..., C]`` in X's dtype.

    ``Y = sum_i (sigmoid(rstd * (fn_i . x) * scale + base_i) + hc_eps) * X_i`` per token, ``x`` the token's n
    streams flattened (FP32), ``rstd = 1/sqrt(mean(x^2) + rms_eps)``. X: bf16, fp16 or fp32, n in 2, 4, 8, any
    leading dims; fn ``[n, n*C]``, scale ``[1]``, base ``[n]`` in any float dtype (FP32 math; their gradients
    come back in their own dtype). rms_eps, hc_eps: finite floats > 0. ``deterministic=False`` sums the parameter
    gradients with atomics. Under torch.compile (or with DTensors) it is the ``torch.ops.cakeops.mhc_gated_head_fwd``
    custom op; its backward ``mhc_gated_head_bwd``.

    >>> X = torch.randn(2, 5, 4, 16, requires_grad=True)
    >>> fn = (torch.randn(4, 64) * 0.1).requires_grad_()
    >>> scale, base = torch.ones(1, requires_grad=True), torch.zeros(4, requires_grad=True)
    >>> Y = cake_mhc_train_gated_head(X, fn, scale, base, rms_eps=1e-6, hc_eps=1e-6)
    >>> Y.shape
    torch.Size([2, 5, 16])
    >>> Y.backward(torch.randn_like(Y))
    >>> X.grad.shape, fn.grad.shape, scale.grad.shape, base.grad.shape
    (torch.Size([2, 5, 4, 16]), torch.Size([4, 64]), torch.Size([1]), torch.Size([4]))
    """
    hp = _check_gated_head(X, fn, scale, base, rms_eps, hc_eps, leading_dims=True)
    args.flag("deterministic", deterministic)
    if _traced.through_ops() or any_dtensor(X=X, fn=fn, scale=scale, base=base):
        return torch.ops.cakeops.mhc_gated_head_fwd(X, fn, scale, base, *hp, deterministic)[0]
    return CakeMHCTrainGatedHeadFunction.apply(X, fn, scale, base, *hp, deterministic)
