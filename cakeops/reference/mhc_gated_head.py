"""The gated head (DeepSeek-V4's hc_head) in plain torch: its CPU implementation and the tests' fp64 oracle.

    x = X[t].reshape(n*C); rstd = 1/sqrt(mean(x^2) + rms_eps); mix_i = rstd * (fn_i . x)
    g_i = sigmoid(mix_i * scale[0] + base_i) + hc_eps;   Y[t, c] = round(sum_i g_i * X[t, i, c])

Shapes: X [T, n, C] (n in 2, 4, 8), fn [n, n*C], scale [1], base [n], dY / Y [T, C]. Dtype rule as in
reference/mhc.py: float64 when any tensor argument is float64, else float32; Y and dX are rounded to X's dtype
once, at the end; the record and the parameter gradients stay in the compute dtype. The record's layout:
meta/mhc_head_layout.py.
"""
import functools
from typing import Tuple

import torch

from . import compute_dtype
from ..meta.mhc_head_layout import GATE, HEAD_STATS_WIDTH, MIX, RSTD

Tensor = torch.Tensor


def _cdt(*tensors: Tensor) -> torch.dtype:
    return functools.reduce(torch.promote_types, (compute_dtype(t) for t in tensors))


def coefficients(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float,
                 hc_eps: float) -> Tuple[Tensor, Tensor, Tensor]:
    """(gate [T, n], rstd [T], mix [T, n]) in the compute dtype; differentiable by autograd (the oracle).
    Matmul first, scaled by rstd after, as the mHC prepare."""
    T, n, C = X.shape
    cdt = _cdt(X, fn, scale, base)
    x = X.reshape(T, n * C).to(cdt)
    rstd = 1.0 / torch.sqrt(x.square().mean(-1) + rms_eps)
    mix = rstd[:, None] * (x @ fn.to(cdt).T)
    gate = torch.sigmoid(mix * scale.to(cdt)[0] + base.to(cdt)) + hc_eps
    return gate, rstd, mix


def gated_head(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float) -> Tensor:
    """Y [T, C] = round(sum_i g_i * X_i), in differentiable torch ops (the autograd oracle)."""
    gate, _, _ = coefficients(X, fn, scale, base, rms_eps, hc_eps)
    return torch.einsum("ti,tic->tc", gate, X.to(gate.dtype)).to(X.dtype)


def unpack(stats: Tensor, n: int) -> Tuple[Tensor, Tensor, Tensor]:
    """(gate [T, n], rstd [T], mix [T, n]) views of a head record."""
    return stats[:, GATE:GATE + n], stats[:, RSTD], stats[:, MIX:MIX + n]


def forward_stats(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float, hc_eps: float) -> Tensor:
    """The record [T, HEAD_STATS_WIDTH] in the compute dtype, unused columns zero."""
    T, n, _ = X.shape
    gate, rstd, mix = coefficients(X, fn, scale, base, rms_eps, hc_eps)
    stats = torch.zeros(T, HEAD_STATS_WIDTH, dtype=gate.dtype, device=X.device)
    s_gate, _, s_mix = unpack(stats, n)
    s_gate.copy_(gate)
    s_mix.copy_(mix)
    stats[:, RSTD] = rstd
    return stats


def forward(X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, rms_eps: float,
            hc_eps: float) -> Tuple[Tensor, Tensor]:
    """(Y [T, C] in X.dtype, stats [T, HEAD_STATS_WIDTH])."""
    stats = forward_stats(X, fn, scale, base, rms_eps, hc_eps)
    gate = unpack(stats, X.shape[1])[0]
    return torch.einsum("ti,tic->tc", gate, X.to(stats.dtype)).to(X.dtype), stats


def backward(dY: Tensor, X: Tensor, fn: Tensor, scale: Tensor, base: Tensor, stats: Tensor,
             hc_eps: float) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dX [T, n, C] in X.dtype, dfn [n, n*C], dscale [1], dbase [n]), explicit math:

    dg_i = sum_c dY*X_i; dlogit = dg * s'(z) with z = mix*scale + base (the sigmoid from the logits, not from
    g - hc_eps); dscale = sum_t sum_i dlogit*mix; dbase = sum_t dlogit; dmix = dlogit*scale; dz = rstd*dmix;
    dfn = dz^T x; dX = round(g_i*dY + (dz @ fn)_i - x_i * rstd^2/K * sum_i dmix_i*mix_i), one rounding.
    hc_eps only enters through the stored gates; it is taken for symmetry with the forward.
    """
    del hc_eps
    T, n, C = X.shape
    K = n * C
    cdt = _cdt(dY, X, fn, scale, base, stats)
    Xc, dYc, fn_c, scale_c, base_c = X.to(cdt), dY.to(cdt), fn.to(cdt), scale.to(cdt), base.to(cdt)
    gate, rstd, mix = unpack(stats.to(cdt), n)
    dg = torch.einsum("tc,tic->ti", dYc, Xc)
    sg = torch.sigmoid(mix * scale_c[0] + base_c)
    dlogit = dg * sg * (1.0 - sg)
    dscale = (dlogit * mix).sum().reshape(1)
    dbase = dlogit.sum(0)
    dmix = dlogit * scale_c[0]
    x = Xc.reshape(T, K)
    dz = rstd[:, None] * dmix
    dfn = dz.T @ x
    dx_map = dz @ fn_c - x * (rstd.square() / K * (dmix * mix).sum(-1))[:, None]
    dX = gate[:, :, None] * dYc[:, None, :] + dx_map.reshape(T, n, C)
    return dX.to(X.dtype), dfn, dscale, dbase
