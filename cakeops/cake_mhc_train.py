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
(``out``, ``dX`` ...) may have any layout (cakeops/_buffers.py) and are overwritten, except dfn/dscale/dbase
with ``accumulate=True`` (and ``dX`` of the head backward) which are added into. Under torch.compile the stats are
always kept for the backward (``save_stats`` applies to the eager path); the gradients are the same bits either way.
Workspaces (``workspace=``, ``backward_workspace=``, ``cake_mhc_train_*_workspace[_bytes]``): FlashInfer's
signatures; the layouts are cakeops' own (docs/design.md §2), sized for every token count up to T, zero-filled
uint8 like FlashInfer's though the kernels need no zeroing; size-checked everywhere, unused by the CPU reference
and under torch.compile.
cakeops' extensions to FlashInfer's signatures are keyword arguments only (``deterministic``, and
``sinkhorn_iters`` / ``deterministic`` of the backward workspace size); ``forward_stats`` still takes its
older ``out=`` for ``stats_out=``.
"""
import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _checks, _traced
from ._function import EagerFunction, first_order
from . import _mhc_args as args
from ._buffers import out_tensor, written
from ._checks import FLOAT_DTYPES, tensor
from ._ops import mhc as ops
from ._ops import mhc_gated_head as head_ops
from ._ops.sharding import any_dtensor
from ._ops.strides import in_shape, unit_last
from .meta import mhc as fake
from .meta import mhc_layout as layout
from .meta import mhc_head_layout as head_layout

__all__ = [
    "cake_mhc_train_forward_prepare", "cake_mhc_train_forward_stats", "cake_mhc_train_forward_finish",
    "cake_mhc_train_head_forward", "cake_mhc_train_head_backward", "cake_mhc_train_backward_prepare",
    "cake_mhc_train_backward_finish", "cake_mhc_train_prepare", "cake_mhc_train_finish", "cake_mhc_train_head",
    "CakeMHCTrainPrepareFunction", "CakeMHCTrainFinishFunction", "CakeMHCTrainHeadFunction", "MHCTrainHandle",
    "cake_mhc_train_gated_head_forward", "cake_mhc_train_gated_head_backward", "cake_mhc_train_gated_head",
    "CakeMHCTrainGatedHeadFunction",
    "is_cake_mhc_train_supported", "is_cake_mhc_train_head_supported", "cake_mhc_train_forward_workspace_bytes",
    "cake_mhc_train_forward_workspace", "cake_mhc_train_backward_workspace_bytes", "cake_mhc_train_backward_workspace",
]


def _check_prepare_inputs(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters):
    args.streams("X", X)
    args.mapping(X, fn, scale, base)
    return args.hparams(rms_eps, hc_eps, sinkhorn_iters)


# ---------------------------------------------------------------------------------------------
# FlashInfer-style functions
# ---------------------------------------------------------------------------------------------
def _workspace_for(name: str, workspace, X: Tensor, need, helper: str) -> Optional[Tensor]:
    """The caller's workspace as checked uint8 bytes; ``need()`` gives the bytes this call carves. Its size is
    checked on the reference path too (CPU tensors without the interpreter, which leave it unused), so that code
    written on a CPU fails there as it would on the GPU."""
    if workspace is None:
        return None
    from . import _workspace

    ws = _workspace.as_bytes(name, workspace, X.device)
    if _traced.through_ops():
        return None  # unused: Inductor plans the scratch (cakeops/_traced.py)
    _workspace.check_size(name, ws, need(), helper)
    return ws


_FWD_HELPER = "cake_mhc_train_forward_workspace(T, device, hidden=C, n_streams=n)"
_BWD_HELPER = "cake_mhc_train_backward_workspace(T, device, hidden=C, n_streams=n)"


def _forward_need(X: Tensor):
    def forward() -> int:
        from ._triton.mhc_prepare import workspace_bytes
        return workspace_bytes(X)
    return forward


def _backward_need(X: Tensor, sinkhorn_iters: int, deterministic: bool):
    def backward() -> int:
        from ._triton.mhc_backward import backward_finish_workspace_numel
        return 4 * backward_finish_workspace_numel(X.shape[0], X.shape[2], sinkhorn_iters, X.device, deterministic,
                                                   n=X.shape[1])
    return backward


def cake_mhc_train_forward_prepare(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, rms_eps: float = 1e-5,
                                   hc_eps: float = 1e-6, sinkhorn_iters: int = 20, out: Optional[Tensor] = None,
                                   stats_out: Optional[Tensor] = None,
                                   workspace: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Forward of one mHC layer up to the branch: ``(U, stats)`` (no autograd; see cake_mhc_train_prepare).

    Per token, ``x = X[t]`` flattened (``n*C``) is RMS-normalized and projected by ``fn`` to M = 2n + n*n logits
    (24 for n = 4), which give the pre gates, the post gates and, through ``sinkhorn_iters`` Sinkhorn steps, the
    n x n mixing matrix.
    ``U[t] = sum_i pre_i * X[t, i]`` is the branch's input.

    Args:
        X: ``[T, n, C]`` residual streams, n in {2, 4, 8} (others raise NotImplementedError), bf16 / fp16 /
            fp32, any C >= 1, unit stride along C (other layouts are copied once). T == 0 gives empty outputs.
        fn: ``[M, n*C]`` mapping (column ``i*C + c`` reads ``X[t, i, c]``; ``[24, 4C]`` for n = 4); scale:
            ``[3]`` (pre, post, res group scales); base: ``[M]`` logit offsets. Any float dtype; the math is FP32.
        rms_eps, hc_eps: finite floats > 0 (defaults 1e-5, 1e-6). sinkhorn_iters: 1..64 (default 20; more
            raises NotImplementedError).
        out: optional ``[T, C]`` buffer in X's dtype for U; stats_out: optional FP32 ``[T, S]`` for stats
            (S = 32 / 64 / 256 for n = 2 / 4 / 8; any layout, overwritten, returned).
        workspace: optional caller-owned scratch (``cake_mhc_train_forward_workspace``): with it and the output
            buffers the call allocates nothing (CUDA-graph capture, static buffers). Unused by the CPU reference.

    Returns:
        ``U [T, C]`` in X's dtype and ``stats [T, S]`` FP32 (the record finish and the backward read: pre,
        post, comb, rstd, mix; layout in ``cakeops.meta.mhc_layout.layout_for(n)``).

    >>> T, C = 5, 32
    >>> X = torch.randn(T, 4, C, dtype=torch.bfloat16)
    >>> fn, scale, base = torch.randn(24, 4 * C) * 0.01, torch.full((3,), 0.01), torch.zeros(24)
    >>> U, stats = cake_mhc_train_forward_prepare(X, fn, scale, base)
    >>> U.shape, U.dtype, stats.shape, stats.dtype
    (torch.Size([5, 32]), torch.bfloat16, torch.Size([5, 64]), torch.float32)
    """
    hp = _check_prepare_inputs(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    T, n, C = X.shape
    out = out_tensor("out", out, shape=(T, C), dtype=X.dtype, device=X.device)
    stats_out = out_tensor("stats_out", stats_out, shape=(T, layout.stats_width(n)), dtype=torch.float32,
                           device=X.device)
    ws = _workspace_for("workspace", workspace, X, _forward_need(X), _FWD_HELPER)
    if _traced.through_ops():
        return _traced.mhc_prepare(X, fn, scale, base, hp, out, stats_out)
    return written(lambda U, stats: ops.prepare_impl(X, fn, scale, base, *hp, U=U, stats=stats, workspace=ws),
                   out, stats_out)


def cake_mhc_train_forward_stats(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, rms_eps: float = 1e-5,
                                 hc_eps: float = 1e-6, sinkhorn_iters: int = 20, stats_out: Optional[Tensor] = None,
                                 workspace: Optional[Tensor] = None, out: Optional[Tensor] = None) -> Tensor:
    """The ``stats [T, S]`` FP32 record alone (S = 32 / 64 / 256 for n = 2 / 4 / 8), bitwise equal to forward_prepare's (checkpoint replay: the
    backward of a layer whose record was dropped).

    Arguments as in cake_mhc_train_forward_prepare (X, fn, scale, base; rms_eps, hc_eps > 0 with defaults 1e-5,
    1e-6; sinkhorn_iters 1..64, default 20: those of the forward being replayed). ``stats_out``: optional FP32 ``[T, S]`` buffer
    (``out`` is cakeops' older name for it, still accepted; give one of the two). ``workspace``: as in
    forward_prepare (the same layout and helper).

    >>> T, C = 5, 32
    >>> X = torch.randn(T, 4, C, dtype=torch.bfloat16)
    >>> fn, scale, base = torch.randn(24, 4 * C) * 0.01, torch.full((3,), 0.01), torch.zeros(24)
    >>> stats = cake_mhc_train_forward_stats(X, fn, scale, base)
    >>> torch.equal(stats, cake_mhc_train_forward_prepare(X, fn, scale, base)[1])
    True
    """
    hp = _check_prepare_inputs(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    if out is not None:
        if stats_out is not None:
            raise ValueError("out: an older name of stats_out; give stats_out only")
        stats_out, name = out, "out"
    else:
        name = "stats_out"
    stats_out = out_tensor(name, stats_out, shape=(X.shape[0], layout.stats_width(X.shape[1])), dtype=torch.float32,
                           device=X.device)
    ws = _workspace_for("workspace", workspace, X, _forward_need(X), _FWD_HELPER)
    if _traced.through_ops():
        return _traced.mhc_stats(X, fn, scale, base, hp, stats_out)
    return written(lambda stats: ops.prepare_impl(X, fn, scale, base, *hp, stats=stats, write_U=False,
                                                  workspace=ws)[1], stats_out)


def cake_mhc_train_forward_finish(X: Tensor, B: Tensor, stats: Tensor, *, out: Optional[Tensor] = None) -> Tensor:
    """The layer output ``Y[t, j, c] = round(post_j * B[t, c] + sum_i comb[i, j] * X[t, i, c])``.

    Args:
        X: ``[T, n, C]`` streams as given to forward_prepare (n in {2, 4, 8}); B: ``[T, C]`` the branch's
            output (any float dtype); stats: FP32 ``[T, S]`` from forward_prepare / forward_stats.
        out: optional ``[T, n, C]`` buffer in X's dtype.

    Returns:
        ``Y [T, n, C]`` in X's dtype (FP32 inside, rounded once).

    >>> T, C = 5, 32
    >>> X = torch.randn(T, 4, C, dtype=torch.bfloat16)
    >>> fn, scale, base = torch.randn(24, 4 * C) * 0.01, torch.full((3,), 0.01), torch.zeros(24)
    >>> U, stats = cake_mhc_train_forward_prepare(X, fn, scale, base)
    >>> Y = cake_mhc_train_forward_finish(X, torch.tanh(U), stats)
    >>> Y.shape, Y.dtype
    (torch.Size([5, 4, 32]), torch.bfloat16)
    """
    args.streams("X", X)
    T, n, C = X.shape
    args.like("B", B, X, (T, C))
    args.stats("stats", stats, X, layout.stats_width(n))
    out = out_tensor("out", out, shape=X.shape, dtype=X.dtype, device=X.device)
    if _traced.through_ops():
        return _traced.mhc_finish(X, B, stats, out)
    return written(lambda Y: ops.finish_impl(X, B, stats, Y), out)


def cake_mhc_train_head_forward(X: Tensor, *, out: Optional[Tensor] = None) -> Tensor:
    """The model's final collapse ``Y[t, c] = round((sum_i X[t, i, c]) / n)``, summed in stream order from zero:
    bit for bit ``X.mean(1)`` on a GPU.

    X: ``[T, n, C]`` (n in {2, 4, 8}) bf16 / fp16 / fp32; out: optional ``[T, C]`` buffer in X's dtype.
    Returns ``Y [T, C]`` in X's dtype.

    >>> X = torch.randn(5, 4, 32)
    >>> torch.allclose(cake_mhc_train_head_forward(X), X.mean(1))
    True
    """
    args.streams("X", X)
    T, n, C = X.shape
    out = out_tensor("out", out, shape=(T, C), dtype=X.dtype, device=X.device)
    if _traced.through_ops():
        return _traced.mhc_head_forward(X, out)
    return written(lambda Y: ops.head_forward_impl(X, Y), out)


def cake_mhc_train_head_backward(dY: Tensor, *, dX: Optional[Tensor] = None, accumulate: bool = False,
                                 n_streams: Optional[int] = None) -> Tensor:
    """The head's gradient ``dX[t, i, c] = round(dY[t, c] / n)`` for each of the n streams.

    dY: ``[T, C]`` bf16 / fp16 / fp32. dX: optional ``[T, n, C]`` buffer in dY's dtype, overwritten,
    or with ``accumulate=True`` (default False) added into (then required). Returns dX. ``n_streams`` (cakeops'
    extension): n, the streams the head's forward collapsed (2, 4 or 8); dY does not tell it, so it comes from
    here, else from a given ``dX``, else it is 4.

    >>> dX = cake_mhc_train_head_backward(torch.ones(5, 32))
    >>> dX.shape, dX[0, 0, 0].item()
    (torch.Size([5, 4, 32]), 0.25)
    """
    tensor("dY", dY, dtypes=FLOAT_DTYPES, ndim=2)
    args.flag("accumulate", accumulate)
    if n_streams is None:
        n_streams = dX.shape[1] if isinstance(dX, Tensor) and dX.dim() == 3 else args.N
    n = args.n_streams("n_streams", n_streams)
    T, C = dY.shape
    dX = out_tensor("dX", dX, shape=(T, n, C), dtype=dY.dtype, device=dY.device)
    if accumulate and dX is None:
        raise ValueError("dX: accumulate=True needs the dX to add into")
    if _traced.through_ops():
        return _traced.mhc_head_backward(dY, n, dX, accumulate)
    return written(lambda dX: ops.head_backward_impl(dY, n, dX, accumulate), dX, added=(accumulate,))


def cake_mhc_train_backward_prepare(dY: Tensor, B: Tensor, X: Tensor, stats: Tensor, *, dB: Optional[Tensor] = None,
                                    grad_stats_out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """The finish node's backward, before the branch's: ``(dB, grad_stats)``.

    ``dB[t, c] = round(sum_j post_j * dY[t, j, c])`` is the gradient to send into the branch's backward;
    ``grad_stats [T, G]`` FP32 = ``dpost[n] | dcomb[n*n] | zeros`` (G = 8 / 32 / 128 for n = 2 / 4 / 8) (``dpost_j = sum_c dY[t,j,c]*B[t,c]``,
    ``dcomb_ij = sum_c X[t,i,c]*dY[t,j,c]``) is what backward_finish needs. No cross-token sum: deterministic.

    Args:
        dY: ``[T, n, C]`` gradient of Y in X's dtype; B: ``[T, C]`` the branch output of the forward;
        X: ``[T, n, C]`` the forward's streams (n in {2, 4, 8}); stats: FP32 ``[T, S]`` of the forward.
        dB: optional ``[T, C]`` buffer in B's dtype; grad_stats_out: optional FP32 ``[T, G]``.

    >>> T, C = 5, 32
    >>> X = torch.randn(T, 4, C, dtype=torch.bfloat16)
    >>> fn, scale, base = torch.randn(24, 4 * C) * 0.01, torch.full((3,), 0.01), torch.zeros(24)
    >>> U, stats = cake_mhc_train_forward_prepare(X, fn, scale, base)
    >>> dY = torch.randn_like(X)
    >>> dB, grad_stats = cake_mhc_train_backward_prepare(dY, torch.tanh(U), X, stats)
    >>> dB.shape, grad_stats.shape
    (torch.Size([5, 32]), torch.Size([5, 32]))
    """
    args.streams("X", X)
    T, n, C = X.shape
    args.like("dY", dY, X, X.shape)
    _check_branch_output("B", B, X)
    args.stats("stats", stats, X, layout.stats_width(n))
    dB = out_tensor("dB", dB, shape=(T, C), dtype=B.dtype, device=X.device)
    grad_stats_out = out_tensor("grad_stats_out", grad_stats_out, shape=(T, layout.grad_stats_width(n)),
                                dtype=torch.float32, device=X.device)
    if _traced.through_ops():
        return _traced.mhc_backward_prepare(dY, B, X, stats, dB, grad_stats_out)
    return written(lambda dB, gs: ops.backward_prepare_impl(dY, B, X, stats, dB, gs), dB, grad_stats_out)


def _check_branch_output(name: str, B, X: Tensor) -> None:
    args.like(name, B, X, tuple(X.shape[:-2]) + (X.shape[-1],), dtypes=FLOAT_DTYPES)


def cake_mhc_train_backward_finish(X: Tensor, dY: Tensor, dU: Tensor, B: Optional[Tensor], fn: Tensor, scale: Tensor,
                                   base: Tensor, stats: Tensor, grad_stats: Tensor, *, rms_eps: float = 1e-5,
                                   hc_eps: float = 1e-6, sinkhorn_iters: int = 20, accumulate: bool = False,
                                   workspace: Optional[Tensor] = None, dX: Optional[Tensor] = None,
                                   dfn: Optional[Tensor] = None, dscale: Optional[Tensor] = None,
                                   dbase: Optional[Tensor] = None,
                                   deterministic: bool = True) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The prepare node's backward, after the branch produced ``dU``: ``(dX, dfn, dscale, dbase)``.

    dX sums the collapse, residual-mixing and mapping contributions in FP32 and is rounded once (X's whole
    gradient for this layer); the parameter gradients are FP32 sums over the tokens, through the exact unrolled
    Sinkhorn.

    Args:
        X, dY: ``[T, n, C]`` the forward's streams and Y's gradient (n in {2, 4, 8}); dU: ``[T, C]`` U's gradient from the
            branch's backward (X's dtype); B: the branch output ``[T, C]`` or None (checked when given, not read).
        fn, scale, base, rms_eps, hc_eps, sinkhorn_iters: those of the forward.
        stats: FP32 ``[T, S]`` of the forward (saved, or recomputed by forward_stats: same bits);
        grad_stats: FP32 ``[T, G]`` from backward_prepare.
        accumulate: add into the given dfn, dscale, dbase (all three required) instead of overwriting them.
        workspace: optional caller-owned scratch (``cake_mhc_train_backward_workspace``); with it and dX, dfn,
            dscale, dbase given, the call allocates nothing. Unused by the CPU reference.
        dX: optional ``[T, n, C]`` in X's dtype; dfn ``[M, n*C]``, dscale ``[3]``, dbase ``[M]``:
            optional FP32 buffers.
        deterministic: (cakeops' extension, default True) fixed-order sums over the tokens, bitwise
            reproducible; False adds with atomics (raises under ``torch.use_deterministic_algorithms(True)``).

    >>> T, C = 5, 32
    >>> X = torch.randn(T, 4, C, dtype=torch.bfloat16)
    >>> fn, scale, base = torch.randn(24, 4 * C) * 0.01, torch.full((3,), 0.01), torch.zeros(24)
    >>> U, stats = cake_mhc_train_forward_prepare(X, fn, scale, base)
    >>> B, dY = torch.tanh(U), torch.randn_like(X)
    >>> dB, grad_stats = cake_mhc_train_backward_prepare(dY, B, X, stats)
    >>> dU = dB * (1 - B.float() ** 2).to(B.dtype)                  # the branch's backward (tanh)
    >>> dX, dfn, dscale, dbase = cake_mhc_train_backward_finish(X, dY, dU, B, fn, scale, base, stats, grad_stats)
    >>> dX.shape, dX.dtype, dfn.shape, dscale.shape, dbase.shape
    (torch.Size([5, 4, 32]), torch.bfloat16, torch.Size([24, 128]), torch.Size([3]), torch.Size([24]))
    """
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
    ws = _workspace_for("workspace", workspace, X, _backward_need(X, hp[2], deterministic), _BWD_HELPER)
    if _traced.through_ops():
        return _traced.mhc_backward_finish(X, dY, dU, fn, scale, base, stats, grad_stats, hp, deterministic,
                                           accumulate, (dX, dfn, dscale, dbase))
    return written(lambda dX, dfn, dscale, dbase: ops.backward_finish_impl(
        X, dY, dU, fn, scale, base, stats, grad_stats, *hp, deterministic=deterministic, accumulate=accumulate,
        dX=dX, dfn=dfn, dscale=dscale, dbase=dbase, workspace=ws), dX, dfn, dscale, dbase,
        added=(False,) + (accumulate,) * 3)


# ---------------------------------------------------------------------------------------------
# Workspaces and support queries
# ---------------------------------------------------------------------------------------------

def _size_args(T, device, hidden) -> torch.device:
    if isinstance(T, bool) or not isinstance(T, int) or T < 0:
        raise ValueError(f"T: expected the largest token count the buffer serves, an int >= 0, got {T!r}")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"hidden: expected the hidden size C (X.shape[-1]), an int >= 1, got {hidden!r}")
    return torch.device(device)


def cake_mhc_train_forward_workspace_bytes(T: int, device, *, hidden: int = 4096, n_streams: int = 4) -> int:
    """Bytes of the caller-owned forward workspace (forward_prepare, forward_stats, cake_mhc_train_prepare's
    ``workspace``) serving every call of up to ``T`` tokens of hidden size ``hidden`` (X.shape[-1]) on
    ``device``, any dtype of X, with ``n_streams`` streams (cakeops' extension: 2, 4 or 8, default 4). T == 0
    needs none (0).

    Layout (regions at 256-byte offsets): the bf16 hi / lo pieces of fn ``[2, M, n*hidden]`` (M = 2n + n*n; the
    projection feeds them to tensor cores; used for bf16 X), then the projection's FP32 partials
    ``[slices, T, M_PAD]`` (M_PAD = 16 / 32 / 128 for n = 2 / 4 / 8; ``slices``: column slices per token block,
    1 to 8, more when T is small next to the GPU). For n = 4 about ``384*hidden + 128*T*slices`` bytes. The kernels write before they read: no zeroing needed.

    >>> cake_mhc_train_forward_workspace_bytes(1024, "cpu", hidden=4096) > 0
    True
    """
    from ._triton.mhc_prepare import workspace_bytes_max

    device = _size_args(T, device, hidden)
    return workspace_bytes_max(T, args.n_streams("n_streams", n_streams), hidden, device)


def cake_mhc_train_forward_workspace(T: int, device, *, hidden: int = 4096, n_streams: int = 4) -> Tensor:
    """A zero-filled uint8 forward workspace of ``cake_mhc_train_forward_workspace_bytes(T, device,
    hidden=hidden, n_streams=n_streams)`` bytes on ``device``: reusable by every later forward call of at most T tokens.

    >>> ws = cake_mhc_train_forward_workspace(5, "cpu", hidden=32)
    >>> X = torch.randn(5, 4, 32, dtype=torch.bfloat16)
    >>> U, stats = cake_mhc_train_forward_prepare(X, torch.zeros(24, 128), torch.ones(3), torch.zeros(24),
    ...                                           workspace=ws)
    >>> ws.dtype, U.shape
    (torch.uint8, torch.Size([5, 32]))
    """
    return torch.zeros(cake_mhc_train_forward_workspace_bytes(T, device, hidden=hidden, n_streams=n_streams),
                       dtype=torch.uint8, device=device)


def cake_mhc_train_backward_workspace_bytes(T: int, device, *, hidden: int = 4096,
                                            sinkhorn_iters: Optional[int] = None, deterministic: bool = True,
                                            n_streams: int = 4) -> int:
    """Bytes of the caller-owned backward workspace (backward_finish's ``workspace``, cake_mhc_train_prepare's
    ``backward_workspace``) serving every call of up to ``T`` tokens of hidden size ``hidden`` on ``device``.

    Layout (FP32, one region after the other; n = 4 shown, M_PAD = 16 / 32 / 128 and M = 2n + n*n in general):
    per-token ``dz`` rows ``[T, 32]`` | the dlogits kernel's per-program dscale/dbase partials ``[P, 64]`` | its
    Sinkhorn scratch ``[P, 2*iters - 1, 8, 16]`` (P persistent programs, at most 64 MiB in all) | the dfn
    partials ``[splits, 24, 4*hidden]`` (deterministic only) | the dpre partials ``[slices, T, 4]``. cakeops'
    extensions (keywords FlashInfer lacks): ``n_streams`` (2, 4 or 8, default 4),
    ``sinkhorn_iters`` (None: sized for every count 1..64; give the count to size it for that count alone) and
    ``deterministic`` (False needs no dfn partials; a deterministic workspace serves both).

    >>> cake_mhc_train_backward_workspace_bytes(1024, "cpu", hidden=4096) > 0
    True
    """
    from ._triton.mhc_backward_finish import backward_finish_workspace_bytes_max

    device = _size_args(T, device, hidden)
    if sinkhorn_iters is not None:
        args.hparams(1.0, 1.0, sinkhorn_iters)
    args.flag("deterministic", deterministic)
    return backward_finish_workspace_bytes_max(T, hidden, device, deterministic, sinkhorn_iters,
                                               n=args.n_streams("n_streams", n_streams))


def cake_mhc_train_backward_workspace(T: int, device, *, hidden: int = 4096, sinkhorn_iters: Optional[int] = None,
                                      deterministic: bool = True, n_streams: int = 4) -> Tensor:
    """A zero-filled uint8 backward workspace of ``cake_mhc_train_backward_workspace_bytes(T, device,
    hidden=hidden, sinkhorn_iters=sinkhorn_iters, deterministic=deterministic, n_streams=n_streams)`` bytes on ``device``, reusable by
    every later backward call of at most T tokens.

    >>> cake_mhc_train_backward_workspace(5, "cpu", hidden=32).dtype
    torch.uint8
    """
    return torch.zeros(cake_mhc_train_backward_workspace_bytes(T, device, hidden=hidden, sinkhorn_iters=sinkhorn_iters,
                                                               deterministic=deterministic, n_streams=n_streams),
                       dtype=torch.uint8, device=device)


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

    def saved_X(self, ctx):
        """(X, the other saved tensors) of a node that saved X first unless the layer rebuilds it."""
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
        kept = (stats,) if state.save_stats or state.rebuilds_X else ()  # a rebuilt X needs the record's bits
        ctx.save_for_backward(*(() if state.rebuilds_X else (X,)), fn, scale, base, *kept)
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
        kept = (stats,) if state.save_stats or state.rebuilds_X else ()
        ctx.save_for_backward(*(() if state.rebuilds_X else (X,)), B, *kept)
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

    def __init__(self, X: Tensor, edges, state: Optional[_LayerState] = None, stats: Optional[Tensor] = None):
        self.X = X  # as the user gave it, leading dims and all
        self.edges = edges
        self.state = state
        self.stats = stats
        self.used = False


def cake_mhc_train_prepare(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, rms_eps: float = 1e-5,
                           hc_eps: float = 1e-6, sinkhorn_iters: int = 20, save_stats: bool = True,
                           workspace: Optional[Tensor] = None, backward_workspace: Optional[Tensor] = None,
                           deterministic: bool = True) -> Tuple[Tensor, MHCTrainHandle]:
    """``U, handle``: the layer input U (feed it to the branch) and the handle its finish needs (autograd).

    X: the residual streams ``[..., n, C]`` (any leading dims, e.g. ``[batch, seq, 4, C]``), bf16, fp16 or fp32,
    n in {2, 4, 8}. fn ``[M, n*C]``, scale ``[3]``, base ``[M]`` with M = 2n + n*n (``[24, 4*C]`` and ``[24]`` for
    n = 4): the mapping, in any float dtype (the math is FP32).
    rms_eps, hc_eps: finite floats > 0 (defaults 1e-5, 1e-6); sinkhorn_iters: 1..64 (default 20). U is
    ``[..., C]`` in X's dtype. ``save_stats=False`` keeps only X for the backward and recomputes the stats there
    (same bits). ``workspace`` / ``backward_workspace``: optional caller-owned scratch of the forward (and of a
    stats recompute) and of the backward (``cake_mhc_train_forward_workspace`` /
    ``cake_mhc_train_backward_workspace``), kept by the layer until its backward ran; checked here, unused by
    the CPU reference, and under torch.compile (Inductor plans memory there). ``deterministic`` (cakeops'
    extension, default True): False sums the parameter gradients with atomics.

    >>> C = 32
    >>> X = torch.randn(2, 5, 4, C, requires_grad=True)
    >>> fn, scale, base = torch.randn(24, 4 * C) * 0.01, torch.full((3,), 0.01), torch.zeros(24)
    >>> U, handle = cake_mhc_train_prepare(X, fn, scale, base)
    >>> Y = cake_mhc_train_finish(X, torch.tanh(U), handle)      # the branch here: tanh
    >>> U.shape, Y.shape, cake_mhc_train_head(Y).shape
    (torch.Size([2, 5, 32]), torch.Size([2, 5, 4, 32]), torch.Size([2, 5, 32]))
    """
    return _prepare(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, save_stats, workspace, backward_workspace,
                    deterministic)


def _prepare(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, save_stats, workspace, backward_workspace,
             deterministic, recompute=None):
    """cake_mhc_train_prepare's body; ``recompute``: nn.MHC's stream-recompute plan (_recompute.RecomputePlan),
    which gives the eager layer its place in a group."""
    args.streams("X", X, leading_dims=True)
    X3 = ops.flat(X, 3)
    hp = _check_prepare_inputs(X3, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    args.flag("save_stats", save_stats)
    args.flag("deterministic", deterministic)
    if _traced.through_ops() or any_dtensor(X=X, fn=fn, scale=scale, base=base):
        if recompute is not None:
            recompute.close()  # compiled and DTensor layers keep their streams (design.md §6)
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
        handle = MHCTrainHandle(X, (e_dy, e_gs), state=state)
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
        return torch.ops.cakeops.mhc_finish(X, B, handle.stats, *handle.edges)
    # X enters detached: the finish node has no edge to X at all (its X gradient travels as dY through the
    # edges), so no engine -- compiled autograd included -- ever sums a None into X's gradient.
    return CakeMHCTrainFinishFunction.apply(X.detach(), B, handle.state, *handle.edges)


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


def is_cake_mhc_train_supported(device, hidden: Optional[int] = None, n_streams: int = layout.N_STREAMS) -> bool:
    """True where the layer ops run on ``device``: CPU (reference math) and CUDA GPUs of compute capability 8.0 or newer;
    ``hidden`` (C, optional): any int >= 1; ``n_streams`` (cakeops' extension): 2, 4 or 8.

    >>> is_cake_mhc_train_supported("cpu", hidden=4096), is_cake_mhc_train_supported("cpu", hidden=0)
    (True, False)
    """
    from .cake_rmsnorm_train import is_cake_rmsnorm_train_supported
    supported = not isinstance(n_streams, bool) and n_streams in layout.SUPPORTED_STREAMS
    return supported and is_cake_rmsnorm_train_supported(device, hidden)


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


def is_cake_mhc_train_head_supported(device, hidden: Optional[int] = None) -> bool:
    """True where the head (cake_mhc_train_head_forward / _backward / cake_mhc_train_head) runs: the devices of
    is_cake_mhc_train_supported, any hidden size >= 1.

    >>> is_cake_mhc_train_head_supported("cpu", hidden=5120)
    True
    """
    return is_cake_mhc_train_supported(device, hidden)
