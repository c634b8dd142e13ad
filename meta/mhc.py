"""Fake implementations of the mHC ops: output shapes, dtypes and strides only.

X, dY: [T, n, C] (finish and head: [..., n, C], any leading dims); B, U, dU: [T, C] (finish: [..., C]); fn [M, n*C], scale [3], base [M] (any float dtype; their gradients FP32); stats [T, STATS_WIDTH(n)] and
grad_stats [T, GRAD_STATS_WIDTH(n)] FP32 (layout: mhc_layout.py, n in {2, 4, 8}). Outputs are fresh and contiguous, except the
two *edges* of the training prepare op, which carry no data (see ``edges``).
"""
import torch

from . import checks
from .mhc_layout import grad_stats_width, stats_width


def edges(X: torch.Tensor):
    """The prepare node's two outputs that exist only to be the finish node's inputs, so that the finish
    node's backward can hand ``dY`` and ``grad_stats`` to the prepare node as their gradients.

    They must have the gradients' shapes ([T, n, C] and [T, GRAD_STATS_WIDTH(n)]) but hold nothing: every
    stride is 0, so each is one element of storage (zeroed, so the op's outputs are deterministic) and costs
    no HBM traffic: a zero-dimensional zero, expanded. (``zero_()`` on a zero-stride tensor would visit all T*n*C
    positions, a 268M-element fill at T=16384, C=4096; zeroing its one element through an ``as_strided`` view
    is what AOTAutograd cannot keep: where torch.compile traces the op's body, it materialized the edges as
    full contiguous tensors, garbage but the one element.)
    """
    T, n, C = X.shape
    e_dy = torch.zeros((), dtype=X.dtype, device=X.device).expand(T, n, C)
    e_gs = torch.zeros((), dtype=torch.float32, device=X.device).expand(T, grad_stats_width(checks.n_streams(X)))
    return e_dy, e_gs


def _stats(X):
    return torch.empty((X.shape[0], stats_width(checks.n_streams(X))), dtype=torch.float32, device=X.device)


def mhc_prepare(X, fn, scale, base, rms_eps: float, hc_eps: float, sinkhorn_iters: int, deterministic: bool):
    checks.mhc_prepare("cakeops::mhc_prepare", X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    T, n, C = X.shape
    return (torch.empty((T, C), dtype=X.dtype, device=X.device), _stats(X)) + edges(X)


def mhc_stats(X, fn, scale, base, rms_eps: float, hc_eps: float, sinkhorn_iters: int):
    checks.mhc_prepare("cakeops::mhc_stats", X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    return _stats(X)


def mhc_finish(X, B, stats, edge_dy, edge_gs):
    checks.mhc_finish("cakeops::mhc_finish", X, B, stats)
    return torch.empty_like(X, memory_format=torch.contiguous_format)


def mhc_head_fwd(X):
    checks.streams("cakeops::mhc_head_fwd", "X", X, leading_dims=True)
    return torch.empty(X.shape[:-2] + X.shape[-1:], dtype=X.dtype, device=X.device)


def mhc_head_bwd(dY, n: int):
    checks.mhc_head_bwd("cakeops::mhc_head_bwd", dY, n)
    T, C = dY.shape
    return torch.empty((T, n, C), dtype=dY.dtype, device=dY.device)


def mhc_backward_prepare(dY, B, X, stats):
    checks.mhc_backward_prepare("cakeops::mhc_backward_prepare", dY, B, X, stats)
    T, n, C = X.shape
    return (torch.empty((T, C), dtype=B.dtype, device=X.device),
            torch.empty((T, grad_stats_width(checks.n_streams(X))), dtype=torch.float32, device=X.device))


def mhc_backward_finish(X, dY, dU, fn, scale, base, stats, grad_stats, rms_eps: float, hc_eps: float,
                        sinkhorn_iters: int, deterministic: bool):
    checks.mhc_backward_finish("cakeops::mhc_backward_finish", X, dY, dU, fn, scale, base, stats, grad_stats,
                               rms_eps, hc_eps, sinkhorn_iters)
    # parameter gradients in FP32 whatever the parameters' dtype (autograd casts them back)
    return (torch.empty_like(X, memory_format=torch.contiguous_format),
            *(torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in (fn, scale, base)))


# ---- stream recompute on the custom-op path (torch.compile, dispatch modes): _ops/mhc_recompute.py ----

def mhc_prepare_rc(X, fn, scale, base, rms_eps: float, hc_eps: float, sinkhorn_iters: int, deterministic: bool):
    """mhc_prepare's outputs and a third edge, ``edge_X`` [T, n, C] (no data), whose gradient brings the layer's
    streams -- kept or rebuilt by the finish node -- to the prepare node's backward."""
    checks.mhc_prepare("cakeops::mhc_prepare_rc", X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    T, n, C = X.shape
    return (torch.empty((T, C), dtype=X.dtype, device=X.device), _stats(X)) + edges(X) + edges(X)[:1]


def mhc_finish_rc(X, B, stats, edge_dy, edge_gs, edge_x, group_size: int):
    checks.mhc_finish("cakeops::mhc_finish_rc", X, B, stats)
    checks.group_size("cakeops::mhc_finish_rc", group_size)
    return torch.empty_like(X, memory_format=torch.contiguous_format)


def mhc_rebuild(X0, Bs, records, after):
    checks.mhc_rebuild("cakeops::mhc_rebuild", X0, Bs, records)
    return torch.empty(X0.shape, dtype=X0.dtype, device=X0.device)


def mhc_rebuild_every(X0, Bs, records, after):
    checks.mhc_rebuild("cakeops::mhc_rebuild_every", X0, Bs, records)
    return [torch.empty(X0.shape, dtype=X0.dtype, device=X0.device) for _ in Bs]


def stream_expand(h, n: int):
    checks.stream_expand("cakeops::stream_expand", h, n)
    return torch.empty((*h.shape[:-1], n, h.shape[-1]), dtype=h.dtype, device=h.device)
