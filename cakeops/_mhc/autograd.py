"""The mHC layer with autograd: the eager autograd.Functions (which call the kernels directly) with the state a
prepare shares with its finish (``_LayerState``, its stream-recompute link included), and the entry points
``cake_mhc_train_prepare`` / ``cake_mhc_train_finish`` / ``cake_mhc_train_head`` with ``MHCTrainHandle``, which
become the ``torch.ops.cakeops.mhc_*`` custom ops under torch.compile (or with DTensors).

Re-exported by ``cakeops.cake_mhc_train`` (the public module); ``nn.MHC`` calls ``_prepare``.
"""
import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _traced
from .. import _mhc_args as args
from .._function import EagerFunction, first_order
from .._ops import mhc as ops
from .._ops.determinism import resolve_deterministic
from .._ops.sharding import any_dtensor
from .._ops.strides import in_shape, unit_last
from .._recompute import RecomputePlan
from ..meta import mhc as fake
from .functions import _check_branch_output, _check_prepare_inputs
from .workspace import _BWD_HELPER, _FWD_HELPER, _backward_need, _forward_need, _workspace_for


# ---------------------------------------------------------------------------------------------
# Autograd: eager Functions
# ---------------------------------------------------------------------------------------------

class _LayerState:
    """What one prepare shares with its finish: the mapping, hyper-parameters and, between the two forwards
    (and from the finish's backward to the prepare's, when stats are recomputed), the stats record."""

    def __init__(self, fn, scale, base, hparams, save_stats, deterministic, workspace=None,
                 backward_workspace=None):
        self.fn, self.scale, self.base = fn, scale, base
        self.hparams = hparams
        self.save_stats = save_stats
        self.deterministic = deterministic
        self.stats = None
        self.workspace = workspace  # caller-owned scratch (uint8, checked), or None: allocated per call
        self.backward_workspace = backward_workspace
        self.link = None  # the layer's place in a stream-recompute group (_recompute.StreamLink), or None

    @property
    def rebuilds_X(self) -> bool:
        """X is not kept: the backward rebuilds it from the group's first input (stream recompute)."""
        return self.link is not None and self.link.rebuilds

    def save(self, ctx, X: Tensor, *tensors: Tensor, stats: Tensor) -> None:
        """A node's ``save_for_backward``: X unless the layer rebuilds it, ``tensors``, and the record where it is
        kept (``save_stats``, or a rebuilt X: the rebuild of the next layers reads its bits)."""
        kept = (stats,) if self.save_stats or self.rebuilds_X else ()
        ctx.save_for_backward(*(() if self.rebuilds_X else (X,)), *tensors, *kept)

    def saved_X(self, ctx):
        """(X, the other saved tensors) of a node saved by ``save``."""
        saved = ctx.saved_tensors
        if self.rebuilds_X:
            return self.link.streams(), saved
        return saved[0], saved[1:]

    def release(self) -> None:
        """The prepare node's backward ran: the layer's rebuilt streams (and its group's, after the first
        layer's) may go."""
        if self.link is not None:
            self.link.release()

    def recompute_stats(self, X: Tensor) -> Tensor:
        return ops.prepare_impl(X, self.fn, self.scale, self.base, *self.hparams, write_U=False,
                                workspace=self.workspace)[1]

    def backward_finish(self):
        """backward_finish_impl, writing its scratch into the caller's backward workspace when one was given."""
        if self.backward_workspace is None:
            return ops.backward_finish_impl
        return functools.partial(ops.backward_finish_impl, workspace=self.backward_workspace)


class CakeMHCTrainPrepareFunction(EagerFunction):
    """``forward(ctx, X, fn, scale, base, state) -> (U, edge_dY, edge_grad_stats)``.

    The edges hold no data (all strides 0); the finish node takes them as inputs and returns ``dY`` and
    ``grad_stats`` as their gradients, so this node's backward sees ``dU, dY, grad_stats`` and writes X's
    whole gradient once."""
    what = "cakeops mHC layer (nn.MHC, cake_mhc_train_prepare)"

    @staticmethod
    def forward(ctx, X, fn, scale, base, state: _LayerState):
        X = unit_last(X)
        U, stats = ops.prepare_impl(X, fn, scale, base, *state.hparams, workspace=state.workspace)
        state.stats = stats
        ctx.state = state
        state.save(ctx, X, fn, scale, base, stats=stats)
        ctx.set_materialize_grads(False)
        return (U,) + fake.edges(X)

    @staticmethod
    @first_order(what)
    def backward(ctx, dU, dY, grad_stats):
        state = ctx.state
        if dU is None and dY is None:  # neither U nor the finish's output reached the loss
            state.stats = None
            state.release()
            return None, None, None, None, None
        X, (fn, scale, base, *kept) = state.saved_X(ctx)
        if kept:
            stats = kept[0]
        else:  # recomputed by the finish node's backward, else here
            stats = state.stats if state.stats is not None else state.recompute_stats(X)
            state.stats = None
        grads = ops.prepare_backward(state.backward_finish(), X, fn, scale, base, stats, dU, dY, grad_stats,
                                     state.hparams, state.deterministic)
        state.release()
        return grads + (None,)


class CakeMHCTrainFinishFunction(EagerFunction):
    """``forward(ctx, X, B, state, *edges) -> Y``. Its backward returns no gradient for X: ``dY`` and
    ``grad_stats`` go to the prepare node through the edges."""
    what = "cakeops mHC layer (nn.MHC, cake_mhc_train_finish)"

    @staticmethod
    def forward(ctx, X, B, state: _LayerState, *edges):
        stats = state.stats
        Y = ops.finish_impl(X, B, stats)  # in X's shape, leading dims and all: Y itself, never a view
        ctx.state = state
        state.save(ctx, X, B, stats=stats)
        if state.link is not None:
            state.link.finished(B, stats)
        state.stats = None  # the record lives on only where it was saved
        ctx.set_materialize_grads(False)
        return Y

    @staticmethod
    @first_order(what)
    def backward(ctx, dY):
        state = ctx.state
        if dY is None:
            return None, None, None, None, None
        X, (B, *kept) = state.saved_X(ctx)
        if kept:
            stats = kept[0]
        else:  # save_stats=False: recompute once, and hand it on to the prepare node's backward
            stats = state.stats = state.recompute_stats(ops.flat(X, 3))
        return ops.finish_backward(ops.backward_prepare_impl, X, B, stats, dY)


class CakeMHCTrainHeadFunction(EagerFunction):
    """The model's final collapse ``Y = mean over streams``; saves no tensor."""
    what = "cakeops mHC head (nn.MHCHead)"

    @staticmethod
    def forward(ctx, X):
        ctx.n = X.shape[-2]
        ctx.set_materialize_grads(False)
        return ops.head_forward_impl(X)

    @staticmethod
    @first_order(what)
    def backward(ctx, dY):
        return ops.head_backward(ops.head_backward_impl, dY, ctx.n)


# ---------------------------------------------------------------------------------------------
# Autograd: the user-facing pair and the head (custom ops under torch.compile)
# ---------------------------------------------------------------------------------------------

class MHCTrainHandle:
    """Returned by ``cake_mhc_train_prepare``; serves exactly one ``cake_mhc_train_finish`` of the same X."""

    def __init__(self, X: Tensor, edges, state: Optional[_LayerState] = None, stats: Optional[Tensor] = None,
                 group_size: int = 1, recompute=None):
        self.X = X  # as the user gave it, leading dims and all
        self.edges = edges
        self.state = state
        self.stats = stats
        self.group_size = group_size  # > 1: the custom-op pair of stream recompute (mhc_prepare_rc)
        self.recompute = recompute  # the eager path's plan: its finish tells the plan the layer's output
        self.used = False


def cake_mhc_train_prepare(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, rms_eps: float = 1e-5,
                           hc_eps: float = 1e-6, sinkhorn_iters: int = 20, save_stats: bool = True,
                           workspace: Optional[Tensor] = None, backward_workspace: Optional[Tensor] = None,
                           deterministic: bool = True, recompute=None) -> Tuple[Tensor, MHCTrainHandle]:
    """``U, handle``: the layer input U (feed it to the branch) and the handle its finish needs (autograd).

    X: the residual streams ``[..., n, C]`` (any leading dims, e.g. ``[batch, seq, 4, C]``), bf16, fp16 or fp32,
    n in {2, 4, 8}. fn ``[M, n*C]``, scale ``[3]``, base ``[M]`` with M = 2n + n*n (``[24, 4*C]`` and ``[24]`` for
    n = 4): the mapping, in any float dtype (the math is FP32).
    rms_eps, hc_eps: finite floats > 0 (defaults 1e-5, 1e-6); sinkhorn_iters: 1..64 (default 20). U is
    ``[..., C]`` in X's dtype. ``save_stats=False`` keeps only X for the backward and recomputes the stats there
    (same bits). ``workspace`` / ``backward_workspace``: optional caller-owned scratch of the forward (and of a
    stats recompute) and of the backward (``cake_mhc_train_forward_workspace`` /
    ``cake_mhc_train_backward_workspace``), kept by the layer until its backward ran; checked here, unused by
    the CPU reference, and under torch.compile (Inductor plans memory there). ``deterministic`` (default True;
    FlashInfer 0.7.4's experimental keyword): False sums the parameter gradients with atomics. False while
    ``torch.use_deterministic_algorithms(True)`` is in effect makes a deterministic layer and warns once per
    process (FlashInfer's fallback); a False layer whose backward runs after they were enabled raises there.

    ``recompute`` (cakeops' extension, default None): a ``cakeops.nn.StreamRecompute`` shared by consecutive
    layers -- stream recompute (DeepSeek's mHC paper §4.3.2) for code that calls this pair itself instead of
    using ``nn.MHC`` (e.g. forwards bound onto another library's modules). A layer whose X is the output of the
    previous layer's ``cake_mhc_train_finish`` under the same object joins its group and keeps no X: the backward
    rebuilds X from the group's first input with the mHC kernels alone, bitwise, so gradients are those without
    it bit for bit. A group whose first X is ``cakeops.nn.stream_expand(h, n, recompute=...)``'s output keeps h
    (C values per token) instead of the n streams. Eager (autograd.Functions) and under torch.compile (custom ops
    ``mhc_prepare_rc`` / ``mhc_finish_rc`` / ``stream_expand``) alike; see ``cakeops.nn.recompute_mhc`` for
    where groups end.

    >>> C = 32
    >>> X = torch.randn(2, 5, 4, C, requires_grad=True)
    >>> fn, scale, base = torch.randn(24, 4 * C) * 0.01, torch.full((3,), 0.01), torch.zeros(24)
    >>> U, handle = cake_mhc_train_prepare(X, fn, scale, base)
    >>> Y = cake_mhc_train_finish(X, torch.tanh(U), handle)      # the branch here: tanh
    >>> U.shape, Y.shape, cake_mhc_train_head(Y).shape
    (torch.Size([2, 5, 32]), torch.Size([2, 5, 4, 32]), torch.Size([2, 5, 32]))
    """
    if recompute is not None and not isinstance(recompute, RecomputePlan):
        raise TypeError(f"recompute: expected a cakeops.nn.StreamRecompute shared by the layers of a group (or "
                        f"None), got {type(recompute).__name__}")
    return _prepare(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, save_stats, workspace, backward_workspace,
                    deterministic, recompute=recompute)


def _prepare(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, save_stats, workspace, backward_workspace,
             deterministic, recompute=None):
    """cake_mhc_train_prepare's body; ``recompute``: the stream-recompute plan (_recompute.RecomputePlan: nn.MHC's
    under recompute_mhc, or a cakeops.nn.StreamRecompute given to cake_mhc_train_prepare), which gives the eager
    layer its place in a group; the finish tells it the layer's output."""
    args.streams("X", X, leading_dims=True)
    X3 = ops.flat(X, 3)
    hp = _check_prepare_inputs(X3, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    args.flag("save_stats", save_stats)
    deterministic = resolve_deterministic(deterministic, "cake_mhc_train_prepare")
    dtensor = any_dtensor(X=X, fn=fn, scale=scale, base=base)
    if _traced.through_ops() or dtensor:
        if recompute is not None and not torch.compiler.is_compiling():
            recompute.close()  # the eager path's group ends here (compiled code leaves the eager plan alone)
        if recompute is not None and not dtensor:  # the ops' own groups (_ops/mhc_recompute.py)
            U, stats, *edges = torch.ops.cakeops.mhc_prepare_rc(X3, fn, scale, base, *hp, deterministic)
            handle = MHCTrainHandle(X, tuple(edges), stats=stats, group_size=recompute.group_size)
        else:  # DTensor layers keep their streams (design.md §6)
            U, stats, e_dy, e_gs = torch.ops.cakeops.mhc_prepare(X3, fn, scale, base, *hp, deterministic)
            handle = MHCTrainHandle(X, (e_dy, e_gs), stats=stats)
    else:
        ws = bws = None
        if workspace is not None:
            ws = _workspace_for("workspace", workspace, X3, _forward_need(X3), _FWD_HELPER)
        if backward_workspace is not None:
            bws = _workspace_for("backward_workspace", backward_workspace, X3,
                                 _backward_need(X3, hp[2], deterministic), _BWD_HELPER)
        state = _LayerState(fn, scale, base, hp, save_stats, deterministic, ws, bws)
        if recompute is not None:
            state.link = recompute.enter(X, X3)
        U, e_dy, e_gs = CakeMHCTrainPrepareFunction.apply(X3, fn, scale, base, state)
        handle = MHCTrainHandle(X, (e_dy, e_gs), state=state, recompute=recompute)
    # U in X's leading dims as no view (a compiled function returning it would hand back a view: strides.in_shape)
    return (U if X.dim() == 3 else in_shape(U, (*X.shape[:-2], X.shape[-1]))), handle


def cake_mhc_train_finish(X: Tensor, B: Tensor, handle: MHCTrainHandle) -> Tensor:
    """``Y = post * B + comb^T X`` with autograd; ``handle`` from the prepare of this same X, used once.

    X ``[..., n, C]`` (the very tensor given to cake_mhc_train_prepare) and B ``[..., C]`` (the branch's output,
    any float dtype) with the same leading dims; Y has X's shape and dtype (and is no view). Its backward
    returns dB to the branch and no gradient for X: X's whole gradient is written once by the prepare node.

    >>> X = torch.randn(5, 4, 32, requires_grad=True)
    >>> U, handle = cake_mhc_train_prepare(X, torch.zeros(24, 128), torch.ones(3), torch.zeros(24))
    >>> Y = cake_mhc_train_finish(X, 2 * U, handle)
    >>> Y.sum().backward(); X.grad.shape
    torch.Size([5, 4, 32])
    """
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
        if handle.group_size > 1:
            return torch.ops.cakeops.mhc_finish_rc(X, B, handle.stats, *handle.edges, handle.group_size)
        return torch.ops.cakeops.mhc_finish(X, B, handle.stats, *handle.edges)
    # X enters detached: the finish node has no edge to X at all (its X gradient travels as dY through the
    # edges), so no engine -- compiled autograd included -- ever sums a None into X's gradient.
    Y = CakeMHCTrainFinishFunction.apply(X.detach(), B, handle.state, *handle.edges)
    if handle.recompute is not None:  # the eager path's group: the next layer joins it when it takes this Y
        handle.recompute.leave(handle.state.link, Y)
    return Y


def cake_mhc_train_head(X: Tensor) -> Tensor:
    """The model's final collapse of the streams, with autograd: ``[..., n, C] -> [..., C]``, the mean over the
    streams (bit for bit ``X.mean(-2)`` on a GPU); bf16 / fp16 / fp32. Its backward saves no tensor.

    >>> X = torch.randn(2, 5, 4, 32, requires_grad=True)
    >>> Y = cake_mhc_train_head(X)
    >>> Y.shape, torch.allclose(Y, X.mean(-2))
    (torch.Size([2, 5, 32]), True)
    """
    args.streams("X", X, leading_dims=True)
    if _traced.through_ops() or any_dtensor(X=X):
        return torch.ops.cakeops.mhc_head_fwd(X)
    return CakeMHCTrainHeadFunction.apply(X)
