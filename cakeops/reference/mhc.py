"""The mHC math in plain torch: the CPU implementation of every mHC op and the tests' fp64 oracle.

Dtype rule (every function): the math runs in float64 when any tensor argument is float64, else in
float32. Outputs that design.md §2 rounds to the data dtype (U, Y, dB, dX, head) are cast once, at the end;
the records (stats, grad_stats) and the parameter gradients (dfn, dscale, dbase) stay in the compute
dtype (float32, or float64 for the oracle).

Shapes: X [T, n, C], fn [M, K=n*C], scale [3], base [M], B / U / dU [T, C], dY [T, n, C], M = 2n + n*n.
`sinkhorn`, `sinkhorn_backward`, `coefficients` and `layer` take any n; the functions that read or write
the stats records need an n with a record layout, n in {2, 4, 8} (cakeops.meta.mhc_layout.layout_for).

Sinkhorn recompute strategy: the forward keeps only `mix` (in stats); the backward rebuilds the logits
from mix/scale/base and replays the Sinkhorn iteration, keeping every normalization's input in a
[2*iters-1, T, n, n] buffer, then walks it in reverse. The backward kernel does the same per token block,
with a per-program scratch buffer of the same iterates (cakeops/_triton/mhc_backward_dlogits.py): linear in
iters, where replaying steps 0..s-1 for every reverse step s would be quadratic.
"""
import functools
from typing import Callable, Tuple

import torch

from . import compute_dtype
from ..meta.mhc_layout import layout_for

Tensor = torch.Tensor


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    """The package's rule over several arguments: float64 if any of them computes in float64."""
    return functools.reduce(torch.promote_types, (compute_dtype(t) for t in tensors))


def _group_of_logits(n: int, device) -> Tensor:
    """Logit m belongs to group 0 (pre), 1 (post) or 2 (res): the index into `scale`."""
    # from sizes alone (no repeat_interleave by a tensor of counts: meta / fake tensors have no data to read them)
    return torch.tensor([0] * n + [1] * n + [2] * (n * n), device=device)


# ---------------------------------------------------------------------------------------------
# Sinkhorn: a row softmax, then 2*iters - 1 normalizations alternating columns, rows, columns, ...
# Step s normalizes columns (sum over i, dim -2) when s is even and rows (sum over j, dim -1) when odd.
# ---------------------------------------------------------------------------------------------

def _norm_dim(step: int) -> int:
    return -2 if step % 2 == 0 else -1


def _normalize(P: Tensor, dim: int, hc_eps: float) -> Tensor:
    return P / (P.sum(dim, keepdim=True) + hc_eps)


def _normalize_backward(dQ: Tensor, P: Tensor, dim: int, hc_eps: float) -> Tensor:
    """Q = P / d with d = sum_dim P + eps: dP = (dQ - sum_dim(dQ * Q)) / d."""
    d = P.sum(dim, keepdim=True) + hc_eps
    Q = P / d
    return (dQ - (dQ * Q).sum(dim, keepdim=True)) / d


def _sinkhorn_replay(a: Tensor, hc_eps: float, iters: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(softmax S, inputs of every normalization [2*iters-1, T, n, n], comb)."""
    S = torch.softmax(a, dim=-1)
    P = S + hc_eps
    inputs = []
    for step in range(2 * iters - 1):
        inputs.append(P)
        P = _normalize(P, _norm_dim(step), hc_eps)
    return S, torch.stack(inputs), P


def sinkhorn(a: Tensor, hc_eps: float, iters: int) -> Tensor:
    """a [T, n, n] logits -> comb [T, n, n] (design.md §2 step 3). Differentiable by autograd."""
    return _sinkhorn_replay(a, hc_eps, iters)[2]


def sinkhorn_backward(a: Tensor, dcomb: Tensor, hc_eps: float, iters: int) -> Tensor:
    """da [T, n, n] from the upstream gradient of comb: the exact unrolled Sinkhorn backward.

    Replays the forward from the logits, then reverses each normalization (eps in the denominator
    included) and finally the row softmax (the +eps after it has gradient one).
    """
    S, inputs, _ = _sinkhorn_replay(a, hc_eps, iters)
    dP = dcomb
    for step in reversed(range(2 * iters - 1)):
        dP = _normalize_backward(dP, inputs[step], _norm_dim(step), hc_eps)
    return S * (dP - (dP * S).sum(-1, keepdim=True))


# ---------------------------------------------------------------------------------------------
# Per-token coefficients
# ---------------------------------------------------------------------------------------------

def _logits(mix: Tensor, scale: Tensor, base: Tensor, n: int) -> Tensor:
    """z_m = mix_m * scale[group(m)] + base_m, [T, M]."""
    return mix * scale[_group_of_logits(n, mix.device)] + base


def coefficients(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
                 iters: int) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(pre [T,n], post [T,n], comb [T,n,n], rstd [T], mix [T,M]) in the compute dtype.

    Differentiable by autograd in every input (the tests' oracle). Matmul first, divide after.
    """
    T, n, C = X.shape
    cdt = _compute_dtype(X, fn, scale, base)
    x = X.reshape(T, n * C).to(cdt)
    rstd = 1.0 / torch.sqrt(x.square().mean(-1) + rms_eps)
    mix = rstd[:, None] * (x @ fn.to(cdt).T)
    z = _logits(mix, scale.to(cdt), base.to(cdt), n)
    pre = torch.sigmoid(z[:, :n]) + hc_eps
    post = 2.0 * torch.sigmoid(z[:, n:2 * n])
    comb = sinkhorn(z[:, 2 * n:].reshape(T, n, n), hc_eps, iters)
    return pre, post, comb, rstd, mix


def _unpack_stats(stats: Tensor, n: int):
    """(pre [T,n], post [T,n], comb [T,n,n], rstd [T], mix [T,M]) views of a stats record."""
    T = stats.shape[0]
    L = layout_for(n)
    return (stats[:, L.PRE:L.PRE + n], stats[:, L.POST:L.POST + n],
            stats[:, L.COMB:L.COMB + n * n].reshape(T, n, n), stats[:, L.RSTD], stats[:, L.MIX:L.MIX + L.N_LOGITS])


# ---------------------------------------------------------------------------------------------
# Forward ops
# ---------------------------------------------------------------------------------------------

def forward_stats(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
                  iters: int) -> Tensor:
    """stats [T, STATS_WIDTH] in the compute dtype, padding columns zero (layout: meta/mhc_layout.py)."""
    T, n, _ = X.shape
    L = layout_for(n)
    pre, post, comb, rstd, mix = coefficients(X, fn, scale, base, rms_eps, hc_eps, iters)
    stats = torch.zeros(T, L.STATS_WIDTH, dtype=pre.dtype, device=X.device)
    s_pre, s_post, s_comb, _, s_mix = _unpack_stats(stats, n)
    s_pre.copy_(pre)
    s_post.copy_(post)
    s_comb.copy_(comb)
    stats[:, L.RSTD] = rstd
    s_mix.copy_(mix)
    return stats


def forward_prepare(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float,
                    iters: int) -> Tuple[Tensor, Tensor]:
    """(U [T,C] in X.dtype, stats [T,STATS_WIDTH]): U[t,c] = round(sum_i pre_i * X[t,i,c])."""
    stats = forward_stats(X, fn, scale, base, rms_eps, hc_eps, iters)
    pre = _unpack_stats(stats, X.shape[1])[0]
    U = torch.einsum("ti,tic->tc", pre, X.to(stats.dtype))
    return U.to(X.dtype), stats


def forward_finish(X: Tensor, B: Tensor, stats: Tensor) -> Tensor:
    """Y [T,n,C] = round(post_j * B + sum_i comb[i,j] * X_i)."""
    n = X.shape[1]
    cdt = _compute_dtype(X, B, stats)
    _, post, comb, _, _ = _unpack_stats(stats.to(cdt), n)
    Y = post[:, :, None] * B.to(cdt)[:, None, :] + torch.einsum("tij,tic->tjc", comb, X.to(cdt))
    return Y.to(X.dtype)


def head_forward(X: Tensor) -> Tensor:
    """Y [T,C] = round((sum_i X_i, in stream order from zero) / n).

    For bf16 / fp16 / fp32 this is bitwise X.mean(dim=1) on CPU (torch 2.13 accumulates the
    reduction in fp32 in stream order and divides before the one rounding; checked by the tests).
    """
    cdt = _compute_dtype(X)
    acc = torch.zeros(X.shape[0], X.shape[2], dtype=cdt, device=X.device)
    for i in range(X.shape[1]):
        acc = acc + X[:, i].to(cdt)
    return (acc / X.shape[1]).to(X.dtype)


def head_backward(dY: Tensor, n: int) -> Tensor:
    """dX [T,n,C] = round(dY / n) for every stream (a fresh contiguous tensor)."""
    dx = (dY.to(_compute_dtype(dY)) / n).to(dY.dtype)
    return dx[:, None, :].expand(dY.shape[0], n, dY.shape[1]).contiguous()


# ---------------------------------------------------------------------------------------------
# Backward ops
# ---------------------------------------------------------------------------------------------

def backward_prepare(dY: Tensor, B: Tensor, X: Tensor, stats: Tensor) -> Tuple[Tensor, Tensor]:
    """The finish node's backward: (dB [T,C] in B.dtype, grad_stats [T,GRAD_STATS_WIDTH] = dpost | dcomb | zeros)."""
    T, n, _ = X.shape
    L = layout_for(n)
    cdt = _compute_dtype(dY, B, X, stats)
    dYc = dY.to(cdt)
    post = _unpack_stats(stats.to(cdt), n)[1]
    dB = torch.einsum("tj,tjc->tc", post, dYc).to(B.dtype)
    grad_stats = torch.zeros(T, L.GRAD_STATS_WIDTH, dtype=cdt, device=X.device)
    grad_stats[:, L.DPOST:L.DPOST + n] = torch.einsum("tjc,tc->tj", dYc, B.to(cdt))
    grad_stats[:, L.DCOMB:L.DCOMB + n * n] = torch.einsum("tic,tjc->tij", X.to(cdt), dYc).reshape(T, n * n)
    return dB, grad_stats


def _dlogits(dpre: Tensor, dpost: Tensor, dcomb: Tensor, z: Tensor, n: int, hc_eps: float,
             iters: int) -> Tensor:
    """dz [T, M] from the gradients of pre, post, comb, through sigmoid+eps, 2*sigmoid and Sinkhorn.

    The sigmoids are recomputed from the logits z rather than recovered from the stored pre/post:
    pre - hc_eps loses the small sigmoid values that large eps would swamp.
    """
    T = z.shape[0]
    s_pre = torch.sigmoid(z[:, :n])
    s_post = torch.sigmoid(z[:, n:2 * n])
    dz_pre = dpre * s_pre * (1.0 - s_pre)
    dz_post = dpost * 2.0 * s_post * (1.0 - s_post)
    da = sinkhorn_backward(z[:, 2 * n:].reshape(T, n, n), dcomb, hc_eps, iters)
    return torch.cat([dz_pre, dz_post, da.reshape(T, n * n)], dim=1)


def backward_finish(X: Tensor, dY: Tensor, dU: Tensor, fn: Tensor, scale: Tensor, base: Tensor,
                    stats: Tensor, grad_stats: Tensor, rms_eps: float, hc_eps: float,
                    iters: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The prepare node's backward, explicit math: (dX [T,n,C] in X.dtype, dfn [M,K], dscale [3], dbase [M]).

    dX is the layer's whole gradient of X: collapse (pre_i*dU), residual mixing (sum_j comb[i,j]*dY_j)
    and the mapping's contribution through rstd and mix, summed in the compute dtype and rounded once.
    rms_eps is not read: rstd comes from stats.
    """
    del rms_eps
    T, n, C = X.shape
    L = layout_for(n)
    K = n * C
    cdt = _compute_dtype(X, dY, dU, fn, scale, base, stats, grad_stats)
    Xc, dYc, dUc = X.to(cdt), dY.to(cdt), dU.to(cdt)
    fn_c, scale_c, base_c = fn.to(cdt), scale.to(cdt), base.to(cdt)
    pre, _, comb, rstd, mix = _unpack_stats(stats.to(cdt), n)
    gs = grad_stats.to(cdt)
    dpost = gs[:, L.DPOST:L.DPOST + n]
    dcomb = gs[:, L.DCOMB:L.DCOMB + n * n].reshape(T, n, n)

    dpre = torch.einsum("tc,tic->ti", dUc, Xc)
    z = _logits(mix, scale_c, base_c, n)
    dlogit = _dlogits(dpre, dpost, dcomb, z, n, hc_eps, iters)

    group = _group_of_logits(n, X.device)
    dscale = torch.zeros(3, dtype=cdt, device=X.device).index_add_(0, group, (dlogit * mix).sum(0))
    dbase = dlogit.sum(0)
    dmix = dlogit * scale_c[group]

    x = Xc.reshape(T, K)
    dz = rstd[:, None] * dmix
    dfn = dz.T @ x
    dx_map = dz @ fn_c - x * (rstd.square() / K * (dmix * mix).sum(-1))[:, None]

    dX = pre[:, :, None] * dUc[:, None, :] + torch.einsum("tij,tjc->tic", comb, dYc) + dx_map.reshape(T, n, C)
    return dX.to(X.dtype), dfn, dscale, dbase


# ---------------------------------------------------------------------------------------------
# The whole layer, differentiable: the autograd oracle for the custom autograd plumbing
# ---------------------------------------------------------------------------------------------

def layer(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, branch: Callable[[Tensor], Tensor],
          rms_eps: float, hc_eps: float, iters: int) -> Tensor:
    """Y [T,n,C] = finish(X, branch(U)) with U from prepare, in differentiable torch ops.

    Rounds where the ops round: U to X.dtype before the branch, Y to X.dtype at the end.
    """
    pre, post, comb, _, _ = coefficients(X, fn, scale, base, rms_eps, hc_eps, iters)
    Xc = X.to(pre.dtype)
    U = torch.einsum("ti,tic->tc", pre, Xc).to(X.dtype)
    B = branch(U)
    Y = post[:, :, None] * B.to(pre.dtype)[:, None, :] + torch.einsum("tij,tic->tjc", comb, Xc)
    return Y.to(X.dtype)
