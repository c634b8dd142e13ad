"""The FlashInfer-style mHC functions: no autograd, explicit stats records, caller buffers and workspaces
(forward_prepare / forward_stats / forward_finish, head_forward / head_backward, backward_prepare /
backward_finish), and the argument checks they share with the autograd layer.

Re-exported by ``cakeops.cake_mhc_train`` (the public module, whose docstring documents the API).
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import _traced
from .. import _mhc_args as args
from .._buffers import out_tensor, written
from .._checks import FLOAT_DTYPES, tensor
from .._ops import mhc as ops
from .._ops.determinism import resolve_deterministic
from ..meta import mhc_layout as layout
from .workspace import _BWD_HELPER, _FWD_HELPER, _backward_need, _forward_need, _workspace_for


def _check_prepare_inputs(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters):
    args.streams("X", X)
    args.mapping(X, fn, scale, base)
    return args.hparams(rms_eps, hc_eps, sinkhorn_iters)


def _check_branch_output(name: str, B, X: Tensor) -> None:
    args.like(name, B, X, tuple(X.shape[:-2]) + (X.shape[-1],), dtypes=FLOAT_DTYPES)


# ---------------------------------------------------------------------------------------------
# FlashInfer-style functions
# ---------------------------------------------------------------------------------------------
def cake_mhc_train_forward_prepare(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, *, rms_eps: float = 1e-5,
                                   hc_eps: float = 1e-6, sinkhorn_iters: int = 20, out: Optional[Tensor] = None,
                                   stats_out: Optional[Tensor] = None, workspace: Optional[Tensor] = None,
                                   deterministic: bool = True) -> Tuple[Tensor, Tensor]:
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
        deterministic: FlashInfer 0.7.4's keyword (its experimental namespace; default True): the forward has no
            cross-token sum, so both values give the same bits. A bool (TypeError otherwise); False under
            ``torch.use_deterministic_algorithms(True)`` warns once per process, as FlashInfer's fallback does.

    Returns:
        ``U [T, C]`` in X's dtype and ``stats [T, S]`` FP32 (the record finish and the backward read, FlashInfer's
        columns ``r | z[M] | pre[n] | post[n] | C[n*n] | pad``: rstd, the logits ``rstd * (fn @ x)`` before
        scale / base, the gates, comb row-major, zeros; ``cakeops.meta.mhc_layout.layout_for(n)``).

    >>> T, C = 5, 32
    >>> X = torch.randn(T, 4, C, dtype=torch.bfloat16)
    >>> fn, scale, base = torch.randn(24, 4 * C) * 0.01, torch.full((3,), 0.01), torch.zeros(24)
    >>> U, stats = cake_mhc_train_forward_prepare(X, fn, scale, base)
    >>> U.shape, U.dtype, stats.shape, stats.dtype
    (torch.Size([5, 32]), torch.bfloat16, torch.Size([5, 64]), torch.float32)
    """
    hp = _check_prepare_inputs(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    resolve_deterministic(deterministic, "cake_mhc_train_forward_prepare")
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
                                 workspace: Optional[Tensor] = None, deterministic: bool = True,
                                 out: Optional[Tensor] = None) -> Tensor:
    """The ``stats [T, S]`` FP32 record alone (S = 32 / 64 / 256 for n = 2 / 4 / 8), bitwise equal to forward_prepare's (checkpoint replay: the
    backward of a layer whose record was dropped).

    Arguments as in cake_mhc_train_forward_prepare (X, fn, scale, base; rms_eps, hc_eps > 0 with defaults 1e-5,
    1e-6; sinkhorn_iters 1..64, default 20: those of the forward being replayed). ``stats_out``: optional FP32 ``[T, S]`` buffer
    (``out`` is cakeops' older name for it, still accepted; give one of the two). ``workspace``: as in
    forward_prepare (the same layout and helper). ``deterministic``: as in forward_prepare (the same bits either
    way).

    >>> T, C = 5, 32
    >>> X = torch.randn(T, 4, C, dtype=torch.bfloat16)
    >>> fn, scale, base = torch.randn(24, 4 * C) * 0.01, torch.full((3,), 0.01), torch.zeros(24)
    >>> stats = cake_mhc_train_forward_stats(X, fn, scale, base)
    >>> torch.equal(stats, cake_mhc_train_forward_prepare(X, fn, scale, base)[1])
    True
    """
    hp = _check_prepare_inputs(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    resolve_deterministic(deterministic, "cake_mhc_train_forward_stats")
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


def cake_mhc_train_forward_finish(X: Tensor, B: Tensor, stats: Tensor, *, out: Optional[Tensor] = None,
                                  deterministic: bool = True) -> Tensor:
    """The layer output ``Y[t, j, c] = round(post_j * B[t, c] + sum_i comb[i, j] * X[t, i, c])``.

    Args:
        X: ``[T, n, C]`` streams as given to forward_prepare (n in {2, 4, 8}); B: ``[T, C]`` the branch's
            output (any float dtype); stats: FP32 ``[T, S]`` from forward_prepare / forward_stats.
        out: optional ``[T, n, C]`` buffer in X's dtype.
        deterministic: as in forward_prepare (no cross-token sum: the same bits either way).

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
    resolve_deterministic(deterministic, "cake_mhc_train_forward_finish")
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
                                    grad_stats_out: Optional[Tensor] = None,
                                    deterministic: bool = True) -> Tuple[Tensor, Tensor]:
    """The finish node's backward, before the branch's: ``(dB, grad_stats)``.

    ``dB[t, c] = round(sum_j post_j * dY[t, j, c])`` is the gradient to send into the branch's backward;
    ``grad_stats [T, G]`` FP32 = ``dpost[n] | dcomb[n*n] | zeros`` (G = 8 / 32 / 128 for n = 2 / 4 / 8) (``dpost_j = sum_c dY[t,j,c]*B[t,c]``,
    ``dcomb_ij = sum_c X[t,i,c]*dY[t,j,c]``) is what backward_finish needs. No cross-token sum: deterministic.

    Args:
        dY: ``[T, n, C]`` gradient of Y in X's dtype; B: ``[T, C]`` the branch output of the forward;
        X: ``[T, n, C]`` the forward's streams (n in {2, 4, 8}); stats: FP32 ``[T, S]`` of the forward.
        dB: optional ``[T, C]`` buffer in B's dtype; grad_stats_out: optional FP32 ``[T, G]``.
        deterministic: as in forward_prepare (no cross-token sum: the same bits either way).

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
    resolve_deterministic(deterministic, "cake_mhc_train_backward_prepare")
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
        deterministic: (default True) fixed-order sums over the tokens, bitwise reproducible; False adds with
            atomics. False under ``torch.use_deterministic_algorithms(True)`` runs the deterministic backward and
            warns once per process (FlashInfer 0.7.4's fallback); the op itself
            (``torch.ops.cakeops.mhc_backward_finish``) with deterministic=False still raises there.

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
    deterministic = resolve_deterministic(deterministic, "cake_mhc_train_backward_finish")
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
