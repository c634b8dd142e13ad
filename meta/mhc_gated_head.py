"""Fake implementations of the gated head ops: output shapes, dtypes and strides only.

X [..., n, C] (forward; the backward takes [T, n, C]), n in mhc_head_layout.SUPPORTED_N; fn [n, n*C], scale [1],
base [n] in any float dtype (their gradients FP32); Y [..., C] and dX in X's dtype; the record
stats [T, HEAD_STATS_WIDTH] FP32 (layout: mhc_head_layout.py). Outputs are fresh and contiguous.
"""
import math

import torch

from . import checks
from .mhc_head_layout import HEAD_STATS_WIDTH


def mhc_gated_head_fwd(X, fn, scale, base, rms_eps: float, hc_eps: float, deterministic: bool):
    checks.mhc_gated_head_fwd("cakeops::mhc_gated_head_fwd", X, fn, scale, base, rms_eps, hc_eps)
    T = math.prod(X.shape[:-2])
    return (torch.empty(X.shape[:-2] + X.shape[-1:], dtype=X.dtype, device=X.device),
            torch.empty((T, HEAD_STATS_WIDTH), dtype=torch.float32, device=X.device))


def mhc_gated_head_bwd(dY, X, fn, scale, base, stats, rms_eps: float, hc_eps: float, deterministic: bool):
    checks.mhc_gated_head_bwd("cakeops::mhc_gated_head_bwd", dY, X, fn, scale, base, stats, rms_eps, hc_eps)
    return (torch.empty_like(X, memory_format=torch.contiguous_format),
            *(torch.empty(p.shape, dtype=torch.float32, device=p.device) for p in (fn, scale, base)))
