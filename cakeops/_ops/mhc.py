"""mHC custom ops (``torch.ops.cakeops.mhc_*``): device kernels, fakes and autograd registration.

The ``*_impl`` functions pick Triton (CUDA, or CPU under the interpreter) or the reference math and write
into caller buffers when given; the custom ops and the eager autograd.Functions both call them.

The training pair ``mhc_prepare`` / ``mhc_finish`` is wired so that X gets one gradient per layer:
``mhc_finish``'s backward returns *no* gradient for X; it returns ``dY`` and ``grad_stats`` as the gradients
of two *edges* -- outputs of ``mhc_prepare`` that ``mhc_finish`` takes as inputs -- and so autograd delivers
them, next to ``dU``, to ``mhc_prepare``'s backward, which writes X's whole gradient once
(``mhc_backward_finish``). A custom op's outputs may not alias its inputs, so the edges cannot be views of
X; they are fresh tensors whose strides are all 0 (one element of storage each, see ``meta/mhc.py``), so
they cost no HBM traffic, and the incoming ``dY`` tangent goes straight into the backward kernel (the AOT
backward graph shows no copy: compile_tests snapshot it).
"""
import math
from typing import Optional, Tuple

import torch
from torch import Tensor

from cakeops.meta import checks
from cakeops.meta import mhc as fake
from cakeops.meta import mhc_layout as layout

from .. import _backend
from ..reference import mhc as reference_math
from . import inductor
from .determinism import alert_not_deterministic
from .strides import in_shape, unit_last

reference = _backend.AutocastOff(reference_math)  # the CPU path: FP32 inside autocast regions too


def _empty_stats(X: Tensor) -> Tensor:
    return torch.empty((X.shape[0], layout.stats_width(X.shape[-2])), dtype=torch.float32, device=X.device)


def prepare_impl(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
                 iters: int, U: Optional[Tensor] = None, stats: Optional[Tensor] = None,
                 write_U: bool = True, workspace: Optional[Tensor] = None) -> Tuple[Optional[Tensor], Tensor]:
    """(U, stats); with write_U=False only stats (forward_stats: the same kernel, bitwise the same record).
    ``workspace``: a checked uint8 buffer the kernels carve their scratch from (unused by the reference)."""
    X = unit_last(X)
    fn, scale, base = fp32_params(fn, scale, base)
    T, n, C = X.shape
    stats = _empty_stats(X) if stats is None else stats
    if write_U and U is None:
        U = torch.empty((T, C), dtype=X.dtype, device=X.device)
    if _backend.use_triton(X):
        from .._triton import mhc_forward as kernels
        with _backend.kernel_device(X):
            kernels.prepare(X, fn, scale, base, rms_eps, hc_eps, iters, stats, U if write_U else None,
                            workspace=workspace)
    else:
        ref_U, ref_stats = reference.forward_prepare(X, fn, scale, base, rms_eps, hc_eps, iters)
        stats.copy_(ref_stats)
        if write_U:
            U.copy_(ref_U)
    return (U if write_U else None), stats


def fp32_params(*params: Tensor):
    """The mapping parameters as the kernels read them: FP32, rows unit-stride. Parameters cast to bf16/fp16 by
    mixed precision are widened here (exactly: every bf16/fp16 value is an FP32 value), a copy of 2n+n*n rows."""
    return tuple(unit_last(p if p.dtype == torch.float32 else p.float()) for p in params)


def param_grad_buffers(params, grads, accumulate: bool):
    """(grads, accumulate) for a backward writing parameter gradients: ``grads`` as given; when any is missing, a
    new buffer like its parameter for each missing one and ``accumulate`` off (nothing given to add into)."""
    if any(grad is None for grad in grads):
        return tuple(torch.empty_like(p) if grad is None else grad for p, grad in zip(params, grads)), False
    return grads, accumulate


def store_reference_grads(outs, dX: Tensor, grads, accumulate: bool) -> None:
    """The reference backward's (dX, *parameter gradients) into dX and ``grads``: the parameter gradients copied,
    or added into ``grads`` with ``accumulate``."""
    dX.copy_(outs[0])
    for buf, value in zip(grads, outs[1:]):
        if accumulate:
            buf.add_(value)
        else:
            buf.copy_(value)


def flat(t: Tensor, dims: int) -> Tensor:
    """[..., *last] -> [T, *last] with ``dims`` dims in all: leading dims are tokens (a view when possible)."""
    return t if t.dim() == dims else t.reshape(-1, *t.shape[t.dim() - dims + 1:])


def empty_tokens(shape: torch.Size, dims: int, like: Tensor) -> Tensor:
    """An output of ``shape`` ([..., *last]) allocated in the form the kernels write, [T, *last] with ``dims`` dims;
    ``unflat`` then gives it ``shape``. Not ``flat(torch.empty(shape))``: traced by torch.compile (the kernels made
    visible to Inductor), the kernels' write into that view makes the output a view of an intermediate, which
    AOTAutograd hands back as a view (``strides.in_shape``)."""
    lead = len(shape) - dims + 1
    return torch.empty((math.prod(shape[:lead]), *shape[lead:]), dtype=like.dtype, device=like.device)


def unflat(t: Tensor, shape: torch.Size) -> Tensor:
    """``t`` [T, *last] from ``empty_tokens`` in ``shape``, as no view (``strides.in_shape``)."""
    return t if t.shape == shape else in_shape(t, shape)


def finish_impl(X: Tensor, B: Tensor, stats: Tensor, Y: Optional[Tensor] = None) -> Tensor:
    """Y in X's shape: X [..., n, C] and B [..., C] with any leading dims (a module's output is then Y itself,
    not a view of it)."""
    Y3 = empty_tokens(X.shape, 3, X) if Y is None else flat(Y, 3)
    # the kernel reads the record's rows at its width (no row stride): a row-strided record is copied once
    X3, B2, stats = unit_last(flat(X, 3)), unit_last(flat(B, 2)), stats.contiguous()
    if _backend.use_triton(X3):
        from .._triton import mhc_forward as kernels
        with _backend.kernel_device(X3):
            kernels.finish(X3, B2, stats, Y3)
    else:
        Y3.copy_(reference.forward_finish(X3, B2, stats))
    return unflat(Y3, X.shape) if Y is None else Y


def rebuild_link(B: Tensor, stats: Tensor) -> Tuple[Tensor, Tensor]:
    """One layer's (B, stats) as a rebuild reads them, [T, C] with unit stride along C and the record rows unit
    stride: the tensors forward_finish read (kept by the stream-recompute group, so that a rebuild table's addresses
    stay valid)."""
    return unit_last(flat(B, 2)), unit_last(stats)


def _kernel_rebuilds(X0: Tensor, links) -> bool:
    """The Triton rebuild kernel can run: Triton's device, one branch dtype, no CUDA graph being captured (its
    table of addresses is a host-to-device copy)."""
    return (_backend.use_triton(X0) and len({B.dtype for B, _ in links}) == 1
            and not (X0.is_cuda and torch.cuda.is_current_stream_capturing()))


def rebuild_table(X0: Tensor, links) -> Optional[Tensor]:
    """The rebuild kernel's table of the layers ``links`` (from ``rebuild_link``), whose first k columns serve a
    rebuild through k of them; None where the kernel does not run."""
    if not links or not _kernel_rebuilds(X0, links):
        return None
    from .._triton import mhc_forward as kernels
    return kernels.rebuild_table([B for B, _ in links], [stats for _, stats in links], X0.device)


def rebuild_impl(X0: Tensor, links, table: Optional[Tensor] = None, every: bool = False):
    """The streams after the forward_finishes of X0 [T, n, C] with ``links`` [(B, stats), ...] in order (stream
    recompute, _recompute.py): bitwise the forward's. ``every``: the list of every layer's streams instead, the
    l-th after l + 1 finishes (a whole group rebuilt in one pass, each written once). One pass of the Triton
    rebuild kernel where it can run (``table``: ``rebuild_table`` of these layers or of a longer run starting with
    them, else made here; never with ``every``, whose table holds the outputs), else the finishes chained (the
    finish kernel reads a token's streams before it writes them: in place is exact)."""
    X0 = unit_last(X0)
    links = [rebuild_link(B, stats) for B, stats in links]
    if not links:  # a group's first layer rebuilt from its root (StreamExpand's h, X0 its stride-0 view)
        return [] if every else X0.clone(memory_format=torch.contiguous_format)
    if _kernel_rebuilds(X0, links):
        from .._triton import mhc_forward as kernels
        Ys = [torch.empty(X0.shape, dtype=X0.dtype, device=X0.device) for _ in (links if every else links[:1])]
        with _backend.kernel_device(X0):
            kernels.rebuild(X0, [B for B, _ in links], [stats for _, stats in links], Ys if every else Ys[0],
                            None if every else table)
        return Ys if every else Ys[0]
    Y, Ys = X0, []
    for B, stats in links:  # in one buffer, in place, unless every layer's streams are kept
        Y = finish_impl(Y, B, stats, Y=None if every or Y is X0 else Y)
        Ys.append(Y)
    return Ys if every else Y


def head_forward_impl(X: Tensor, Y: Optional[Tensor] = None) -> Tensor:
    """Y [..., C] from X [..., n, C], any leading dims."""
    shape = X.shape[:-2] + X.shape[-1:]
    Y2 = empty_tokens(shape, 2, X) if Y is None else flat(Y, 2)
    X3 = unit_last(flat(X, 3))
    if _backend.use_triton(X3):
        from .._triton import mhc_forward as kernels
        with _backend.kernel_device(X3):
            kernels.head_forward(X3, Y2)
    else:
        Y2.copy_(reference.head_forward(X3))
    return unflat(Y2, shape) if Y is None else Y


def head_backward_impl(dY: Tensor, n: int, dX: Optional[Tensor] = None, accumulate: bool = False) -> Tensor:
    dY = unit_last(dY)
    T, C = dY.shape
    if dX is None:
        dX = torch.empty((T, n, C), dtype=dY.dtype, device=dY.device)
        accumulate = False
    if _backend.use_triton(dY):
        from .._triton import mhc_forward as kernels
        with _backend.kernel_device(dY):
            kernels.head_backward(dY, dX, accumulate)
    elif accumulate:
        dX.copy_((dX.float() + dY.float()[:, None, :] / n).to(dX.dtype))
    else:
        dX.copy_(reference.head_backward(dY, n))
    return dX


def backward_prepare_impl(dY: Tensor, B: Tensor, X: Tensor, stats: Tensor, dB: Optional[Tensor] = None,
                          grad_stats: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    T, n, C = X.shape
    dB = torch.empty((T, C), dtype=B.dtype, device=X.device) if dB is None else dB
    if grad_stats is None:
        grad_stats = torch.empty((T, layout.grad_stats_width(n)), dtype=torch.float32, device=X.device)
    dY, B, X, stats = unit_last(dY), unit_last(B), unit_last(X), unit_last(stats)
    if _backend.use_triton(X):
        from .._triton import mhc_backward as kernels
        with _backend.kernel_device(X):
            kernels.backward_prepare(dY, B, X, stats, dB, grad_stats)
    else:
        ref_dB, ref_gs = reference.backward_prepare(dY, B, X, stats)
        dB.copy_(ref_dB)
        grad_stats.copy_(ref_gs)
    return dB, grad_stats


def backward_finish_impl(X: Tensor, dY: Tensor, dU: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
                         stats: Tensor, grad_stats: Tensor, rms_eps: float, hc_eps: float, iters: int,
                         deterministic: bool = True, accumulate: bool = False, dX: Optional[Tensor] = None,
                         dfn: Optional[Tensor] = None, dscale: Optional[Tensor] = None,
                         dbase: Optional[Tensor] = None,
                         workspace: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    if not deterministic:
        alert_not_deterministic("cakeops mHC backward_finish with deterministic=False")
    dX = torch.empty(X.shape, dtype=X.dtype, device=X.device) if dX is None else dX
    fn, scale, base = fp32_params(fn, scale, base)  # gradients FP32 too (autograd casts them back)
    (dfn, dscale, dbase), accumulate = param_grad_buffers((fn, scale, base), (dfn, dscale, dbase), accumulate)
    X, dY, dU, stats, grad_stats = (unit_last(t) for t in (X, dY, dU, stats, grad_stats))
    if _backend.use_triton(X):
        from .._triton import mhc_backward as kernels
        with _backend.kernel_device(X):
            kernels.backward_finish(X, dY, dU, fn, scale, base, stats, grad_stats, rms_eps, hc_eps, iters,
                                    dX, dfn, dscale, dbase, deterministic=deterministic, accumulate=accumulate,
                                    workspace=workspace)
    else:
        outs = reference.backward_finish(X, dY, dU, fn, scale, base, stats, grad_stats, rms_eps, hc_eps, iters)
        store_reference_grads(outs, dX, (dfn, dscale, dbase), accumulate)
    return dX, dfn, dscale, dbase


# ---- custom ops ----
# Each op's body is a check of its arguments, then an unchecked function: the kernel of the op's twin that
# compiled graphs call (inductor.define_unchecked).

def _mhc_prepare(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
                 sinkhorn_iters: int, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    U, stats = prepare_impl(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    return (U, stats) + fake.edges(X)


def _mhc_stats(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
               sinkhorn_iters: int) -> Tensor:
    return prepare_impl(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, write_U=False)[1]


def _mhc_finish(X: Tensor, B: Tensor, stats: Tensor, edge_dy: Tensor, edge_gs: Tensor) -> Tensor:
    return finish_impl(X, B, stats)


def _mhc_head_fwd(X: Tensor) -> Tensor:
    return head_forward_impl(X)


def _mhc_head_bwd(dY: Tensor, n: int) -> Tensor:
    return head_backward_impl(dY, n)


def _mhc_backward_prepare(dY: Tensor, B: Tensor, X: Tensor, stats: Tensor) -> Tuple[Tensor, Tensor]:
    return backward_prepare_impl(dY, B, X, stats)


def _mhc_backward_finish(X: Tensor, dY: Tensor, dU: Tensor, fn: Tensor, scale: Tensor, base: Tensor, stats: Tensor,
                         grad_stats: Tensor, rms_eps: float, hc_eps: float, sinkhorn_iters: int,
                         deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    return backward_finish_impl(X, dY, dU, fn, scale, base, stats, grad_stats, rms_eps, hc_eps, sinkhorn_iters,
                                deterministic)


@torch.library.custom_op("cakeops::mhc_prepare", mutates_args=())
def mhc_prepare(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
                sinkhorn_iters: int, deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(U, stats, edge_dY, edge_grad_stats). ``deterministic`` rides along for the backward."""
    checks.mhc_prepare("cakeops::mhc_prepare", X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    return _mhc_prepare(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, deterministic)


@torch.library.custom_op("cakeops::mhc_stats", mutates_args=())
def mhc_stats(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
              sinkhorn_iters: int) -> Tensor:
    checks.mhc_prepare("cakeops::mhc_stats", X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    return _mhc_stats(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)


@torch.library.custom_op("cakeops::mhc_finish", mutates_args=())
def mhc_finish(X: Tensor, B: Tensor, stats: Tensor, edge_dy: Tensor, edge_gs: Tensor) -> Tensor:
    """Y = post * B + comb^T X. The edges are read by nobody: they route gradients (module docstring)."""
    checks.mhc_finish("cakeops::mhc_finish", X, B, stats)
    return _mhc_finish(X, B, stats, edge_dy, edge_gs)


@torch.library.custom_op("cakeops::mhc_head_fwd", mutates_args=())
def mhc_head_fwd(X: Tensor) -> Tensor:
    checks.streams("cakeops::mhc_head_fwd", "X", X, leading_dims=True)
    return _mhc_head_fwd(X)


@torch.library.custom_op("cakeops::mhc_head_bwd", mutates_args=())
def mhc_head_bwd(dY: Tensor, n: int) -> Tensor:
    checks.mhc_head_bwd("cakeops::mhc_head_bwd", dY, n)
    return _mhc_head_bwd(dY, n)


@torch.library.custom_op("cakeops::mhc_backward_prepare", mutates_args=())
def mhc_backward_prepare(dY: Tensor, B: Tensor, X: Tensor, stats: Tensor) -> Tuple[Tensor, Tensor]:
    checks.mhc_backward_prepare("cakeops::mhc_backward_prepare", dY, B, X, stats)
    return _mhc_backward_prepare(dY, B, X, stats)


@torch.library.custom_op("cakeops::mhc_backward_finish", mutates_args=())
def mhc_backward_finish(X: Tensor, dY: Tensor, dU: Tensor, fn: Tensor, scale: Tensor, base: Tensor, stats: Tensor,
                        grad_stats: Tensor, rms_eps: float, hc_eps: float, sinkhorn_iters: int,
                        deterministic: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    checks.mhc_backward_finish("cakeops::mhc_backward_finish", X, dY, dU, fn, scale, base, stats, grad_stats,
                               rms_eps, hc_eps, sinkhorn_iters)
    return _mhc_backward_finish(X, dY, dU, fn, scale, base, stats, grad_stats, rms_eps, hc_eps, sinkhorn_iters,
                                deterministic)


for _op, _fake, _unchecked in (
        (mhc_prepare, fake.mhc_prepare, _mhc_prepare), (mhc_stats, fake.mhc_stats, _mhc_stats),
        (mhc_finish, fake.mhc_finish, _mhc_finish), (mhc_head_fwd, fake.mhc_head_fwd, _mhc_head_fwd),
        (mhc_head_bwd, fake.mhc_head_bwd, _mhc_head_bwd),
        (mhc_backward_prepare, fake.mhc_backward_prepare, _mhc_backward_prepare),
        (mhc_backward_finish, fake.mhc_backward_finish, _mhc_backward_finish)):
    inductor.register_fake(_op, _fake, unchecked=_unchecked)
    inductor.register_visible_kernels(_op, _unchecked, gpu_checked=True,
                                      backward=_op in (mhc_head_bwd, mhc_backward_prepare, mhc_backward_finish))


# ---- autograd: one formula per node, for the eager Functions and the registered autograd ----
# ``bwd`` is the backward entry: the ``*_impl`` function (eager: the kernels directly) or the custom op (compiled:
# the AOT backward graph holds it); both take the same positional arguments. Gradients are not materialized
# (set_materialize_grads(False)): a node whose outputs got no gradient launches nothing.

def zeros_for_missing(X: Tensor, dU: Optional[Tensor], dY: Optional[Tensor], grad_stats: Optional[Tensor]):
    """The prepare node's incoming gradients with zeros where none arrived: U used but the finish's output
    not (dY, grad_stats), or the finish's output used but not U (dU)."""
    if dU is None:
        dU = X.new_zeros(X.shape[0], X.shape[2])
    if dY is None:
        dY = torch.zeros_like(X)
    if grad_stats is None:
        grad_stats = X.new_zeros((X.shape[0], layout.grad_stats_width(X.shape[1])), dtype=torch.float32)
    return dU, dY, grad_stats


def prepare_backward(bwd, X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, stats: Tensor, dU: Optional[Tensor],
                     dY: Optional[Tensor], grad_stats: Optional[Tensor], hparams, deterministic: bool):
    """The prepare node: (dX, dfn, dscale, dbase) from dU and, through the edges, the finish node's dY and
    grad_stats; X's whole gradient written once. Parameter gradients in the parameters' dtypes."""
    if dU is None and dY is None:
        return None, None, None, None
    dU, dY, grad_stats = zeros_for_missing(X, dU, dY, grad_stats)
    dX, dfn, dscale, dbase = bwd(X, dY, dU, fn, scale, base, stats, grad_stats, *hparams, deterministic)
    return dX, _as_dtype(dfn, fn.dtype), _as_dtype(dscale, scale.dtype), _as_dtype(dbase, base.dtype)


def _as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    # ``t.to(dtype)`` is t itself at its own dtype, but its dispatch costs a layer's backward a microsecond a call
    return t if t.dtype == dtype else t.to(dtype)


def finish_backward(bwd, X: Tensor, B: Tensor, stats: Tensor, dY: Optional[Tensor]):
    """The finish node: gradients of (X, B, stats or state, edge_dY, edge_grad_stats). None for X: dY travels
    to the prepare node as the first edge's gradient, grad_stats as the second's (module docstring). X, B, dY
    may have leading dims; the backward ops and the edges take them flattened to tokens."""
    if dY is None:
        return None, None, None, None, None
    dY3 = flat(dY, 3)
    dB, grad_stats = bwd(dY3, flat(B, 2), flat(X, 3), stats)
    return None, (dB if B.dim() == 2 else dB.view(B.shape)), None, dY3, grad_stats


def head_backward(bwd, dY: Optional[Tensor], n: int) -> Optional[Tensor]:
    """dX [..., n, C] from dY [..., C]."""
    if dY is None:
        return None
    dX = bwd(flat(dY, 2), n)
    return dX if dY.dim() == 2 else dX.view(*dY.shape[:-1], n, dY.shape[-1])


def _setup_prepare(ctx, inputs, output):
    """Under torch.compile the stats record is always saved (``save_stats`` is an eager-path option): what a
    compiled graph keeps for its backward is the partitioner's choice, and activation checkpointing
    (torch.utils.checkpoint, selective checkpointing) is how a compiled model trades memory for recompute."""
    X, fn, scale, base, rms_eps, hc_eps, iters, deterministic = inputs
    ctx.save_for_backward(X, fn, scale, base, output[1])
    ctx.hparams = (rms_eps, hc_eps, iters)
    ctx.deterministic = deterministic
    ctx.set_materialize_grads(False)


def _backward_prepare_node(ctx, dU, d_stats, dY, grad_stats):
    X, fn, scale, base, stats = ctx.saved_tensors
    grads = prepare_backward(torch.ops.cakeops.mhc_backward_finish, X, fn, scale, base, stats, dU, dY, grad_stats,
                             ctx.hparams, ctx.deterministic)
    return grads + (None, None, None, None)


def _setup_finish(ctx, inputs, output):
    X, B, stats, _, _ = inputs
    ctx.save_for_backward(X, B, stats)
    ctx.set_materialize_grads(False)


def _backward_finish_node(ctx, dY):
    X, B, stats = ctx.saved_tensors
    return finish_backward(torch.ops.cakeops.mhc_backward_prepare, X, B, stats, dY)


def _setup_head(ctx, inputs, output):
    ctx.n = inputs[0].shape[-2]
    ctx.set_materialize_grads(False)


def _backward_head(ctx, dY):
    return head_backward(torch.ops.cakeops.mhc_head_bwd, dY, ctx.n)


mhc_prepare.register_autograd(_backward_prepare_node, setup_context=_setup_prepare)
mhc_finish.register_autograd(_backward_finish_node, setup_context=_setup_finish)
mhc_head_fwd.register_autograd(_backward_head, setup_context=_setup_head)
