"""Modules users put in models."""
from typing import Optional

import torch
from torch import nn

from .cake_rmsnorm_train import cake_rmsnorm


class RMSNorm(nn.Module):
    """Drop-in for ``torch.nn.RMSNorm(hidden_size, eps)`` with an affine weight, on the fused cakeops kernels.

    ``forward(x)`` returns ``y``; ``forward(x, residual)`` adds first and returns ``(y, h_new)`` with
    ``h_new = x + residual`` -- the pre-norm transformer's residual stream, in one pass over memory.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, deterministic: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size: expected an int >= 1, got {hidden_size!r}")
        self.hidden_size = hidden_size
        self.eps = eps
        self.deterministic = deterministic
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        return cake_rmsnorm(x, self.weight, self.eps, residual, self.deterministic)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, deterministic={self.deterministic}"
