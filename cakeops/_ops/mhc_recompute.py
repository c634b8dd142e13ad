"""Stream recompute on the custom-op path (``torch.ops.cakeops.mhc_prepare_rc`` / ``mhc_finish_rc`` /
``mhc_rebuild``): what ``nn.MHC`` layers under ``recompute_mhc`` dispatch under torch.compile and dispatch modes,
where the eager path's groups (_recompute.StreamGroup) cannot exist.

The pair computes what ``mhc_prepare`` / ``mhc_finish`` compute (the same bodies, kernels and fakes); only their
autograd differs:
- the finish node decides the layer's place in a group (``_recompute.op_chain``, as its autograd is set up, in
  forward order) and keeps X where the layer starts a group, else the group's first input X0 and the earlier
  layers' branch outputs and records -- tensors those layers keep anyway;
- its backward gets X back (kept, or ``mhc_rebuild`` of X0 through the earlier layers' finishes: the forward's
  bits) and hands it to the prepare node as the gradient of a third edge, ``edge_X`` (no data, like the other
  two: ops/mhc.py), so the prepare node keeps no X at all and the layer's streams are rebuilt once. Where as many
  layers as the group's followed it (_recompute.Rebuilt), the first of its backwards to run rebuilds every layer's
  streams (``mhc_rebuild_every``, one pass) and the group's other layers take theirs from it: Python state shared
  by the group's nodes, read while the backward is traced (or run), so the graph carries the one op's outputs to
  each layer's nodes.
A compiled graph is functional and AOTAutograd saves exactly what the backward formulas read, so the saved
activations are X0, the B's and the records, and the rebuilt X lives from the layer's finish backward to its
prepare backward. ``mhc_rebuild`` takes the layer's incoming gradient as ``after``, read by nobody: a node that
depends on a tangent is placed in the backward graph by every partitioner, where a node on forward values alone
could be computed in the forward and its output kept -- the very streams recompute drops.
"""
from typing import List, Tuple

import torch
from torch import Tensor

from cakeops.meta import checks
from cakeops.meta import mhc as fake

from .. import _recompute
from . import inductor
from .mhc import _mhc_finish, _mhc_prepare, flat, prepare_backward, finish_backward, rebuild_impl


def _mhc_prepare_rc(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
                    sinkhorn_iters: int, deterministic: bool):
    outs = _mhc_prepare(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, deterministic)
    return outs + fake.edges(X)[:1]


def _mhc_finish_rc(X: Tensor, B: Tensor, stats: Tensor, edge_dy: Tensor, edge_gs: Tensor, edge_x: Tensor,
                   group_size: int) -> Tensor:
    return _mhc_finish(X, B, stats, edge_dy, edge_gs)


def _mhc_rebuild(X0: Tensor, Bs: List[Tensor], records: List[Tensor], after: Tensor) -> Tensor:
    return rebuild_impl(X0, list(zip(Bs, records)))


def _mhc_rebuild_every(X0: Tensor, Bs: List[Tensor], records: List[Tensor], after: Tensor) -> List[Tensor]:
    return rebuild_impl(X0, list(zip(Bs, records)), every=True)


@torch.library.custom_op("cakeops::mhc_prepare_rc", mutates_args=())
def mhc_prepare_rc(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
                   sinkhorn_iters: int, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(U, stats, edge_dY, edge_grad_stats, edge_X): mhc_prepare's and the edge that brings X to the backward."""
    checks.mhc_prepare("cakeops::mhc_prepare_rc", X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    return _mhc_prepare_rc(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, deterministic)


@torch.library.custom_op("cakeops::mhc_finish_rc", mutates_args=())
def mhc_finish_rc(X: Tensor, B: Tensor, stats: Tensor, edge_dy: Tensor, edge_gs: Tensor, edge_x: Tensor,
                  group_size: int) -> Tensor:
    """mhc_finish's Y; the layer joins a stream-recompute group of at most ``group_size`` layers."""
    checks.mhc_finish("cakeops::mhc_finish_rc", X, B, stats)
    checks.group_size("cakeops::mhc_finish_rc", group_size)
    return _mhc_finish_rc(X, B, stats, edge_dy, edge_gs, edge_x, group_size)


@torch.library.custom_op("cakeops::mhc_rebuild", mutates_args=())
def mhc_rebuild(X0: Tensor, Bs: List[Tensor], records: List[Tensor], after: Tensor) -> Tensor:
    """The streams after the forward_finishes of X0 [T, n, C] with (Bs[k], records[k]) in order, bitwise the
    forward's. ``after`` is read by nobody (module docstring)."""
    checks.mhc_rebuild("cakeops::mhc_rebuild", X0, Bs, records)
    return _mhc_rebuild(X0, Bs, records, after)


@torch.library.custom_op("cakeops::mhc_rebuild_every", mutates_args=())
def mhc_rebuild_every(X0: Tensor, Bs: List[Tensor], records: List[Tensor], after: Tensor) -> List[Tensor]:
    """mhc_rebuild's streams after every layer: the l-th after the first l + 1 finishes (a whole group in one
    pass)."""
    checks.mhc_rebuild("cakeops::mhc_rebuild_every", X0, Bs, records)
    return _mhc_rebuild_every(X0, Bs, records, after)


for _op, _fake, _unchecked in ((mhc_prepare_rc, fake.mhc_prepare_rc, _mhc_prepare_rc),
                               (mhc_finish_rc, fake.mhc_finish_rc, _mhc_finish_rc),
                               (mhc_rebuild, fake.mhc_rebuild, _mhc_rebuild),
                               (mhc_rebuild_every, fake.mhc_rebuild_every, _mhc_rebuild_every)):
    inductor.register_fake(_op, _fake, unchecked=_unchecked)
# The pair's bodies are mhc_prepare's and mhc_finish's, traced as their kernels alike. The rebuilds stay ops:
# traced as its kernel, the launch would not read ``after`` and could move into the forward.
inductor.register_visible_kernels(mhc_prepare_rc, _mhc_prepare_rc, gpu_checked=True)
inductor.register_visible_kernels(mhc_finish_rc, _mhc_finish_rc, gpu_checked=True)


def _setup_prepare(ctx, inputs, output):
    X, fn, scale, base, rms_eps, hc_eps, iters, deterministic = inputs
    ctx.save_for_backward(fn, scale, base, output[1])
    ctx.hparams = (rms_eps, hc_eps, iters)
    ctx.deterministic = deterministic
    ctx.set_materialize_grads(False)


def _backward_prepare_node(ctx, dU, d_stats, dY, grad_stats, X):
    if dU is None and dY is None:
        return (None,) * 8
    if X is None:
        raise RuntimeError("cakeops.nn.recompute_mhc: an mHC layer's branch input got a gradient but its output "
                           "did not; the layer's streams come back through its output's backward. Use the "
                           "layer's output, or turn recompute off: cakeops.nn.recompute_mhc(model, group_size=1)")
    fn, scale, base, stats = ctx.saved_tensors
    grads = prepare_backward(torch.ops.cakeops.mhc_backward_finish, X, fn, scale, base, stats, dU, dY, grad_stats,
                             ctx.hparams, ctx.deterministic)
    return grads + (None,) * 4


def _setup_finish(ctx, inputs, output):
    X, B, stats, _, _, _, group_size = inputs
    group = _recompute.op_chain.enter(X, group_size)
    ctx.rebuilds, ctx.k, ctx.n = group is not None, 0, X.shape[-2]
    if group is None:
        ctx.save_for_backward(X, B, stats)
    else:
        X0, links, ctx.rooted, ctx.rebuilt = group
        ctx.k = len(links)
        ctx.save_for_backward(X0, B, stats, *(b for b, _ in links), *(s for _, s in links))
    _recompute.op_chain.leave(output, B, stats)
    ctx.set_materialize_grads(False)


def _backward_finish_node(ctx, dY):
    if dY is None:
        return (None,) * 7
    saved, k = ctx.saved_tensors, ctx.k
    X, B, stats = saved[:3]
    dY3 = flat(dY, 3)
    if ctx.rebuilds:  # X is the group's X0 (or its root h): rebuild through the k layers before this one
        X0 = _recompute.root_streams(X, ctx.n) if ctx.rooted else flat(X, 3)
        Bs, records = [flat(b, 2) for b in saved[3:3 + k]], list(saved[3 + k:])
        X = ctx.rebuilt.streams.pop(k, None)  # made by a later layer's backward of the group
        if X is None and ctx.rebuilt.at_once(k):  # the group's first backward: its layers 1..k at once
            every = torch.ops.cakeops.mhc_rebuild_every(X0, Bs, records, dY3)
            ctx.rebuilt.streams.update(enumerate(every[:-1], 1))
            X = every[-1]
        elif X is None:
            X = torch.ops.cakeops.mhc_rebuild(X0, Bs, records, dY3)
    grads = finish_backward(torch.ops.cakeops.mhc_backward_prepare, X, B, stats, dY)
    return grads + (flat(X, 3), None)


# ---- StreamExpand's op on the same path: its output noted as a group's possible root ----

def _stream_expand(h: Tensor, n: int) -> Tensor:
    return _recompute.stream_copies(h, n).clone(memory_format=torch.contiguous_format)


@torch.library.custom_op("cakeops::stream_expand", mutates_args=())
def stream_expand(h: Tensor, n: int) -> Tensor:
    """h [..., C] copied into n streams [..., n, C] (nn.StreamExpand under recompute_mhc, on the op path)."""
    checks.stream_expand("cakeops::stream_expand", h, n)
    return _stream_expand(h, n)


inductor.register_fake(stream_expand, fake.stream_expand, unchecked=_stream_expand)


def _setup_expand(ctx, inputs, output):
    _recompute.expanded.note(output, inputs[0])
    ctx.set_materialize_grads(False)


def _backward_expand(ctx, dX):
    return (None if dX is None else dX.sum(-2)), None  # expand's own backward: the sum over the streams


stream_expand.register_autograd(_backward_expand, setup_context=_setup_expand)


mhc_prepare_rc.register_autograd(_backward_prepare_node, setup_context=_setup_prepare)
mhc_finish_rc.register_autograd(_backward_finish_node, setup_context=_setup_finish)
