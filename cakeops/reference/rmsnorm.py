"""RMSNorm with optional residual add, forward and backward (design.md §1), in plain torch on [T, H] rows."""
from typing import Optional

import torch

from . import compute_dtype


def forward(x: torch.Tensor, w: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None):
    """Returns (y, rstd) or, with residual, (y, rstd, h_new). rstd is [T] in the compute dtype."""
    acc = compute_dtype(x)
    if residual is not None:
        h_new = (x.to(acc) + residual.to(acc)).to(x.dtype)
        h = h_new.to(acc)
    else:
        h = x.to(acc)
    rstd = 1.0 / torch.sqrt(h.square().mean(dim=-1) + eps)
    y = ((h * rstd.unsqueeze(-1)) * w.to(acc)).to(x.dtype)
    return (y, rstd) if residual is None else (y, rstd, h_new)


def backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
             g_residual: Optional[torch.Tensor] = None):
    """Returns (dx in x.dtype, dw in the compute dtype). ``x`` is the normalized input (h_new in residual mode)."""
    acc = compute_dtype(x)
    gf, xf, wf = g.to(acc), x.to(acc), w.to(acc)
    r = rstd.to(acc).reshape(-1).unsqueeze(-1)
    gw = gf * wf
    dx = r * gw - xf * r.pow(3) * (gw * xf).mean(dim=-1, keepdim=True)
    if g_residual is not None:
        dx = dx + g_residual.to(acc)
    dw = (gf * xf * r).sum(dim=0)
    return dx.to(x.dtype), dw
