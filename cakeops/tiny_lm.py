"""A small decoder-only language model built from cakeops modules: the demo's model and the compile tests'.

``TinyLM(..., hyper_connections=True)`` widens the residual stream to ``n_streams`` mHC streams (4; 2 or 8
too) (``StreamExpand`` -> ``MHC`` around every attention and MLP branch -> ``MHCHead``); ``False`` gives the
same model with plain residual connections, for comparison. Pre-norms are ``cakeops.nn.RMSNorm``.
"""
import math

import torch
from torch import nn

from .nn import MHC, MHCHead, RMSNorm, StreamExpand


class CausalSelfAttention(nn.Module):
    """Plain causal attention (matmul + softmax): the same aten ops in eager and compiled runs."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D // self.heads)
        causal = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        y = scores.softmax(-1) @ v
        return self.out(y.transpose(1, 2).reshape(B, S, D))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


class PreNorm(nn.Module):
    """``branch(RMSNorm(x))``: the branch as mHC (or a plain residual) wraps it."""

    def __init__(self, dim: int, branch: nn.Module):
        super().__init__()
        self.norm = RMSNorm(dim, eps=1e-6)
        self.branch = branch

    def forward(self, x):
        return self.branch(self.norm(x))


class Residual(nn.Module):
    def __init__(self, branch: nn.Module):
        super().__init__()
        self.branch = branch

    def forward(self, x):
        return x + self.branch(x)


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, layers: int = 2, heads: int = 4, max_len: int = 256,
                 hyper_connections: bool = True, sinkhorn_iters: int = 20, n_streams: int = 4):
        super().__init__()
        self.hyper_connections = hyper_connections
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        blocks = []
        for _ in range(layers):
            for branch in (CausalSelfAttention(dim, heads), MLP(dim)):
                body = PreNorm(dim, branch)
                blocks.append(MHC(body, dim, n_streams, sinkhorn_iters=sinkhorn_iters) if hyper_connections
                              else Residual(body))
        self.blocks = nn.ModuleList(blocks)
        self.expand = StreamExpand(n_streams) if hyper_connections else nn.Identity()
        self.head = MHCHead() if hyper_connections else nn.Identity()
        self.norm = RMSNorm(dim, eps=1e-6)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.expand(self.embed(tokens) + self.pos(positions))
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.norm(self.head(h)))

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
