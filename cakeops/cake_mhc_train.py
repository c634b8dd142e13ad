"""mHC (manifold-constrained hyper-connections) training ops, FlashInfer ``cake_mhc_train``-compatible API.

The residual stream is widened to n streams ``X [T, n, C]``, n in {2, 4, 8} (4 is the usual choice; other n
raise NotImplementedError). Per token, the RMS-normalized flattened streams are projected by
``fn [2n + n*n, n*C]`` (``[24, 4C]`` for n = 4) to logits that give the ``pre`` gates (collapse to the layer input
``U = sum_i pre_i X_i``), the ``post`` gates and a doubly-stochastic mixing matrix ``comb`` (Sinkhorn), and the
layer output is ``Y = post * B + comb^T X`` with ``B = branch(U)``.

Layers of this module: the FlashInfer-style functions (no autograd, explicit records, caller buffers), the
autograd.Functions (eager path, calling the kernels directly), and ``cake_mhc_train_prepare`` /
``cake_mhc_train_finish`` / ``cake_mhc_train_head``, which become the ``torch.ops.cakeops.mhc_*`` custom ops
under torch.compile.

Decisions where FlashInfer leaves room: inputs X, B, dY, dU may be row-strided (unit last stride) and are read
in place, other layouts are copied once (by the ``*_impl`` entry, eager and compiled alike); caller buffers
(``out``, ``dX`` ...) must be contiguous and are overwritten, except dfn/dscale/dbase with ``accumulate=True``
(and ``dX`` of the head backward) which are added into. Under torch.compile the stats are always kept for
the backward (``save_stats`` applies to the eager path); the gradients are the same bits either way.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _mhc_args as args
from ._checks import FLOAT_DTYPES, out_tensor, tensor
from ._ops import mhc as ops
from ._ops.sharding import any_dtensor
from ._ops.strides import unit_last
from .meta import mhc as fake
from .meta import mhc_layout as layout

__all__ = [
    "cake_mhc_train_forward_prepare", "cake_mhc_train_forward_stats", "cake_mhc_train_forward_finish",
    "cake_mhc_train_head_forward", "cake_mhc_train_head_backward", "cake_mhc_train_backward_prepare",
    "cake_mhc_train_backward_finish", "cake_mhc_train_prepare", "cake_mhc_train_finish", "cake_mhc_train_head",
    "CakeMHCTrainPrepareFunction", "CakeMHCTrainFinishFunction", "CakeMHCTrainHeadFunction", "MHCTrainHandle",
    "is_cake_mhc_train_supported",
]


def _check_prepare_inputs(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters):
    args.streams("X", X)
    args.mapping(X, fn, scale, base)
    return args.hparams(rms_eps, hc_eps, sinkhorn_iters)


# ---------------------------------------------------------------------------------------------
# FlashInfer-style functions
# ---------------------------------------------------------------------------------------------

def cake_mhc_train_forward_prepare(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, rms_eps: float = 1e-5,
                                   hc_eps: float = 1e-6, sinkhorn_iters: int = 20, out: Optional[Tensor] = None,
                                   stats_out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """``(U [T, C] in X.dtype, stats [T, S] FP32)``: coefficients of every token and the collapse U. n in {2, 4, 8};
    S = 32 / 64 / 256 for n = 2 / 4 / 8 (``meta.mhc_layout.layout_for(n).STATS_WIDTH``)."""
    hp = _check_prepare_inputs(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    T, n, C = X.shape
    out = out_tensor("out", out, shape=(T, C), dtype=X.dtype, device=X.device)
    stats_out = out_tensor("stats_out", stats_out, shape=(T, layout.stats_width(n)), dtype=torch.float32,
                           device=X.device)
    return ops.prepare_impl(X, fn, scale, base, *hp, U=out, stats=stats_out)


def cake_mhc_train_forward_stats(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, rms_eps: float = 1e-5,
                                 hc_eps: float = 1e-6, sinkhorn_iters: int = 20,
                                 out: Optional[Tensor] = None) -> Tensor:
    """``stats`` alone, bitwise equal to forward_prepare's (checkpoint replay)."""
    hp = _check_prepare_inputs(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    out = out_tensor("out", out, shape=(X.shape[0], layout.stats_width(X.shape[1])), dtype=torch.float32,
                     device=X.device)
    return ops.prepare_impl(X, fn, scale, base, *hp, stats=out, write_U=False)[1]


def cake_mhc_train_forward_finish(X: Tensor, B: Tensor, stats: Tensor, *, out: Optional[Tensor] = None) -> Tensor:
    """``Y[t, j, c] = round(post_j * B[t, c] + sum_i comb[i, j] * X[t, i, c])``."""
    args.streams("X", X)
    T, n, C = X.shape
    args.like("B", B, X, (T, C))
    args.stats("stats", stats, X, layout.stats_width(n))
    out = out_tensor("out", out, shape=X.shape, dtype=X.dtype, device=X.device)
    return ops.finish_impl(X, B, stats, out)


def cake_mhc_train_head_forward(X: Tensor, *, out: Optional[Tensor] = None) -> Tensor:
    """``Y[t, c] = round((sum_i X[t, i, c]) / n)``, summed in stream order: for n = 4, bit for bit X.mean(1)."""
    args.streams("X", X)
    T, n, C = X.shape
    out = out_tensor("out", out, shape=(T, C), dtype=X.dtype, device=X.device)
    return ops.head_forward_impl(X, out)


def cake_mhc_train_head_backward(dY: Tensor, *, dX: Optional[Tensor] = None, accumulate: bool = False,
                                 n_streams: Optional[int] = None) -> Tensor:
    """``dX[t, i, c] = round(dY[t, c] / n)``; with ``accumulate=True`` added into the given dX.

    ``n_streams``: n, the streams the head's forward collapsed (2, 4 or 8). dY [T, C] does not tell it, so it
    comes from here, else from a given ``dX`` [T, n, C], else it is 4 (the default stream count)."""
    tensor("dY", dY, dtypes=FLOAT_DTYPES, ndim=2)
    args.flag("accumulate", accumulate)
    if n_streams is None:
        n_streams = dX.shape[1] if isinstance(dX, Tensor) and dX.dim() == 3 else args.N
    n = args.n_streams("n_streams", n_streams)
    T, C = dY.shape
    dX = out_tensor("dX", dX, shape=(T, n, C), dtype=dY.dtype, device=dY.device)
    if accumulate and dX is None:
        raise ValueError("dX: accumulate=True needs the dX to add into")
    return ops.head_backward_impl(dY, n, dX, accumulate)


def cake_mhc_train_backward_prepare(dY: Tensor, B: Tensor, X: Tensor, stats: Tensor, *, dB: Optional[Tensor] = None,
                                    grad_stats_out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The finish node's backward: ``(dB [T, C], grad_stats [T, G] FP32 = dpost | dcomb | 0)``, G = 8 / 32 / 128
    for n = 2 / 4 / 8."""
    args.streams("X", X)
    T, n, C = X.shape
    args.like("dY", dY, X, X.shape)
    _check_branch_output("B", B, X)
    args.stats("stats", stats, X, layout.stats_width(n))
    dB = out_tensor("dB", dB, shape=(T, C), dtype=B.dtype, device=X.device)
    grad_stats_out = out_tensor("grad_stats_out", grad_stats_out, shape=(T, layout.grad_stats_width(n)),
                                dtype=torch.float32, device=X.device)
    return ops.backward_prepare_impl(dY, B, X, stats,
                                     dB, grad_stats_out)


def _check_branch_output(name: str, B, X: Tensor) -> None:
    args.like(name, B, X, tuple(X.shape[:-2]) + (X.shape[-1],), dtypes=FLOAT_DTYPES)


def cake_mhc_train_backward_finish(X: Tensor, dY: Tensor, dU: Tensor, B: Optional[Tensor], fn: Tensor, scale: Tensor,
                                   base: Tensor, stats: Tensor, grad_stats: Tensor, *, rms_eps: float = 1e-5,
                                   hc_eps: float = 1e-6, sinkhorn_iters: int = 20, deterministic: bool = True,
                                   accumulate: bool = False, dX: Optional[Tensor] = None,
                                   dfn: Optional[Tensor] = None, dscale: Optional[Tensor] = None,
                                   dbase: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The prepare node's backward: ``(dX, dfn, dscale, dbase)``; dX written once (single cast), the parameter
    gradients FP32 (added into the given ones with ``accumulate=True``). ``B`` is accepted for symmetry, unread."""
    hp = _check_prepare_inputs(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    T, n, C = X.shape
    args.like("dY", dY, X, X.shape)
    args.like("dU", dU, X, (T, C))
    if B is not None:
        _check_branch_output("B", B, X)
    args.stats("stats", stats, X, layout.stats_width(n))
    args.stats("grad_stats", grad_stats, X, layout.grad_stats_width(n))
    args.flag("deterministic", deterministic)
    args.flag("accumulate", accumulate)
    dX = out_tensor("dX", dX, shape=X.shape, dtype=X.dtype, device=X.device)
    dfn = out_tensor("dfn", dfn, shape=fn.shape, dtype=torch.float32, device=X.device)
    dscale = out_tensor("dscale", dscale, shape=(3,), dtype=torch.float32, device=X.device)
    dbase = out_tensor("dbase", dbase, shape=base.shape, dtype=torch.float32, device=X.device)
    if accumulate and (dfn is None or dscale is None or dbase is None):
        raise ValueError("dfn: accumulate=True needs dfn, dscale and dbase to add into")
    return ops.backward_finish_impl(X, dY, dU, fn, scale, base, stats, grad_stats, *hp,
                                    deterministic=deterministic, accumulate=accumulate, dX=dX, dfn=dfn,
                                    dscale=dscale, dbase=dbase)


# ---------------------------------------------------------------------------------------------
# Autograd: eager Functions
# ---------------------------------------------------------------------------------------------

class _LayerState:
    """What one prepare shares with its finish: the mapping, hyper-parameters and, between the two forwards
    (and from the finish's backward to the prepare's, when stats are recomputed), the stats record."""

    def __init__(self, fn, scale, base, hparams, save_stats, deterministic):
        self.fn, self.scale, self.base = fn, scale, base
        self.hparams = hparams
        self.save_stats = save_stats
        self.deterministic = deterministic
        self.stats = None

    def recompute_stats(self, X: Tensor) -> Tensor:
        return ops.prepare_impl(X, self.fn, self.scale, self.base, *self.hparams, write_U=False)[1]


class CakeMHCTrainPrepareFunction(torch.autograd.Function):
    """``forward(ctx, X, fn, scale, base, state) -> (U, edge_dY, edge_grad_stats)``.

    The edges hold no data (all strides 0); the finish node takes them as inputs and returns ``dY`` and
    ``grad_stats`` as their gradients, so this node's backward sees ``dU, dY, grad_stats`` and writes X's
    whole gradient once."""

    @staticmethod
    def forward(ctx, X, fn, scale, base, state: _LayerState):
        X = unit_last(X)
        U, stats = ops.prepare_impl(X, fn, scale, base, *state.hparams)
        state.stats = stats
        ctx.state = state
        ctx.save_for_backward(X, fn, scale, base, *((stats,) if state.save_stats else ()))
        ctx.set_materialize_grads(False)
        return (U,) + fake.edges(X)

    @staticmethod
    def backward(ctx, dU, dY, grad_stats):
        X, fn, scale, base, *kept = ctx.saved_tensors
        state = ctx.state
        if dU is None and dY is None:  # neither U nor the finish's output reached the loss
            state.stats = None
            return None, None, None, None, None
        if kept:
            stats = kept[0]
        else:  # recomputed by the finish node's backward, else here
            stats = state.stats if state.stats is not None else state.recompute_stats(X)
            state.stats = None
        return ops.prepare_backward(ops.backward_finish_impl, X, fn, scale, base, stats, dU, dY, grad_stats,
                                    state.hparams, state.deterministic) + (None,)


class CakeMHCTrainFinishFunction(torch.autograd.Function):
    """``forward(ctx, X, B, state, *edges) -> Y``. Its backward returns no gradient for X: ``dY`` and
    ``grad_stats`` go to the prepare node through the edges."""

    @staticmethod
    def forward(ctx, X, B, state: _LayerState, *edges):
        stats = state.stats
        Y = ops.finish_impl(X, B, stats)  # in X's shape, leading dims and all: Y itself, never a view
        ctx.state = state
        if state.save_stats:
            ctx.save_for_backward(X, B, stats)
        else:
            ctx.save_for_backward(X, B)
        state.stats = None  # the record lives on only where it was saved
        ctx.set_materialize_grads(False)
        return Y

    @staticmethod
    def backward(ctx, dY):
        X, B, *kept = ctx.saved_tensors
        state = ctx.state
        if dY is None:
            return None, None, None, None, None
        if kept:
            stats = kept[0]
        else:  # save_stats=False: recompute once, and hand it on to the prepare node's backward
            stats = state.stats = state.recompute_stats(ops.flat(X, 3))
        return ops.finish_backward(ops.backward_prepare_impl, X, B, stats, dY)


class CakeMHCTrainHeadFunction(torch.autograd.Function):
    """The model's final collapse ``Y = mean over streams``; saves no tensor."""

    @staticmethod
    def forward(ctx, X):
        ctx.n = X.shape[-2]
        ctx.set_materialize_grads(False)
        return ops.head_forward_impl(X)

    @staticmethod
    def backward(ctx, dY):
        return ops.head_backward(ops.head_backward_impl, dY, ctx.n)


# ---------------------------------------------------------------------------------------------
# Autograd: the user-facing pair and the head (custom ops under torch.compile)
# ---------------------------------------------------------------------------------------------

class MHCTrainHandle:
    """Returned by ``cake_mhc_train_prepare``; serves exactly one ``cake_mhc_train_finish`` of the same X."""

    def __init__(self, X: Tensor, edges, state: Optional[_LayerState] = None, stats: Optional[Tensor] = None):
        self.X = X  # as the user gave it, leading dims and all
        self.edges = edges
        self.state = state
        self.stats = stats
        self.used = False


def cake_mhc_train_prepare(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, rms_eps: float = 1e-5,
                           hc_eps: float = 1e-6, sinkhorn_iters: int = 20, save_stats: bool = True,
                           deterministic: bool = True) -> Tuple[Tensor, MHCTrainHandle]:
    """``U, handle``: the layer input U (feed it to the branch) and the handle its finish needs.

    X: the residual streams ``[..., n, C]`` (any leading dims, e.g. ``[batch, seq, 4, C]``), bf16, fp16 or fp32,
    n in {2, 4, 8}. fn ``[M, n*C]``, scale ``[3]``, base ``[M]`` with M = 2n + n*n (``[24, 4*C]`` and ``[24]`` for
    n = 4): the mapping, in any float dtype (the math is FP32).
    rms_eps, hc_eps: finite floats > 0; sinkhorn_iters: 1..64. U is ``[..., C]`` in X's dtype.
    ``save_stats=False`` keeps only X for the backward and recomputes the stats there (same bits);
    ``deterministic=False`` sums the parameter gradients with atomics.

    >>> C = 32
    >>> X = torch.randn(2, 5, 4, C, requires_grad=True)
    >>> fn, scale, base = torch.randn(24, 4 * C) * 0.01, torch.full((3,), 0.01), torch.zeros(24)
    >>> U, handle = cake_mhc_train_prepare(X, fn, scale, base)
    >>> Y = cake_mhc_train_finish(X, torch.tanh(U), handle)      # the branch here: tanh
    >>> U.shape, Y.shape, cake_mhc_train_head(Y).shape
    (torch.Size([2, 5, 32]), torch.Size([2, 5, 4, 32]), torch.Size([2, 5, 32]))
    """
    args.streams("X", X, leading_dims=True)
    X3 = ops.flat(X, 3)
    hp = _check_prepare_inputs(X3, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    args.flag("save_stats", save_stats)
    args.flag("deterministic", deterministic)
    if torch.compiler.is_compiling() or any_dtensor(X=X, fn=fn, scale=scale, base=base):
        U, stats, e_dy, e_gs = torch.ops.cakeops.mhc_prepare(X3, fn, scale, base, *hp, deterministic)
        handle = MHCTrainHandle(X, (e_dy, e_gs), stats=stats)
    else:
        state = _LayerState(fn, scale, base, hp, save_stats, deterministic)
        U, e_dy, e_gs = CakeMHCTrainPrepareFunction.apply(X3, fn, scale, base, state)
        handle = MHCTrainHandle(X, (e_dy, e_gs), state=state)
    return (U if X.dim() == 3 else U.view(*X.shape[:-2], X.shape[-1])), handle


def cake_mhc_train_finish(X: Tensor, B: Tensor, handle: MHCTrainHandle) -> Tensor:
    """``Y = post * B + comb^T X`` with autograd; ``handle`` from the prepare of this same X, used once.
    X [..., n, C] and B [..., C] with the same leading dims; Y has X's shape (and is no view)."""
    if not isinstance(handle, MHCTrainHandle):
        raise TypeError(f"handle: expected the MHCTrainHandle returned by cake_mhc_train_prepare, "
                        f"got {type(handle).__name__}")
    if handle.used:
        raise RuntimeError("handle: this handle was already used by a finish; each prepare serves one finish")
    if X is not handle.X:
        raise ValueError("handle: it belongs to the prepare of another X; pass the X given to that prepare")
    args.streams("X", X, leading_dims=True)
    _check_branch_output("B", B, X)
    handle.used = True
    if handle.state is None:  # the prepare took the custom-op path (torch.compile, DTensors)
        any_dtensor(B=B)
        return torch.ops.cakeops.mhc_finish(X, B, handle.stats, *handle.edges)
    # X enters detached: the finish node has no edge to X at all (its X gradient travels as dY through the
    # edges), so no engine -- compiled autograd included -- ever sums a None into X's gradient.
    return CakeMHCTrainFinishFunction.apply(X.detach(), B, handle.state, *handle.edges)


def cake_mhc_train_head(X: Tensor) -> Tensor:
    """The model's final collapse of the streams, with autograd: [..., n, C] -> [..., C]."""
    args.streams("X", X, leading_dims=True)
    if torch.compiler.is_compiling() or any_dtensor(X=X):
        return torch.ops.cakeops.mhc_head_fwd(X)
    return CakeMHCTrainHeadFunction.apply(X)


def is_cake_mhc_train_supported(device, hidden: Optional[int] = None, n_streams: int = layout.N_STREAMS) -> bool:
    """True where the ops run: CPU (reference math) and CUDA GPUs Triton supports; n_streams in {2, 4, 8}, any
    C >= 1."""
    from .cake_rmsnorm_train import is_cake_rmsnorm_train_supported
    supported = not isinstance(n_streams, bool) and n_streams in layout.SUPPORTED_STREAMS
    return supported and is_cake_rmsnorm_train_supported(device, hidden)
