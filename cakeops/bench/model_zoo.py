"""The model of ``python -m cakeops bench model``: a Llama-like decoder whose residual scheme is the only variable.

Token embedding -> ``blocks`` x (pre-norm causal attention, pre-norm SwiGLU MLP) -> final norm -> LM head.
Attention is one fused QKV projection, ``F.scaled_dot_product_attention(is_causal=True)`` and an output
projection; no RoPE and no positional embedding (they cost the same in every variant, and the benchmark measures
the residual scheme). No biases. The pre-norms and the final norm are one norm class for all variants
(``cakeops.nn.RMSNorm`` by default, ``torch.nn.RMSNorm`` with ``norm="torch"``).

Variants (the residual scheme around every attention and MLP branch):

- ``plain``: ``h = h + branch(norm(h))``, one stream.
- ``cakeops``: ``StreamExpand`` -> ``cakeops.nn.MHC(branch)`` per branch -> ``MHCHead``; mappings kept FP32.
- ``cakeops-recompute``: ``cakeops`` with stream recompute (``cakeops.nn.recompute_mhc``, its default groups):
  the same weights and the same gradients, fewer residual streams kept for the backward
  (eager and compiled).
- ``math``: the same layer, the same parameters and initialisation (``MathMHC`` subclasses ``nn.MHC``), written
  in plain differentiable torch ops -- ``cakeops.reference.mhc.layer``, the SPEC math with its 20-step Sinkhorn --
  for torch.compile to fuse. Streams ``[..., n, C]`` as cakeops; the head is the mean of the streams.
- ``te``: TransformerEngine's Triton mHC functions (``transformer_engine.pytorch.triton.mhc``) when importable.
  TE keeps the streams last, ``[..., C, n]``, so its mapping's columns are ordered (C, n); ``te_state_dict``
  converts a cakeops state dict to that layout (the agreement check uses it). TE's gates have no ``hc_eps`` and its
  Sinkhorn runs in log space, so it computes nearly, not exactly, the cakeops function.
"""
import importlib
import importlib.util
import inspect
from dataclasses import asdict, dataclass
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ..nn import MHC, MHCHead, RMSNorm, StreamExpand, recompute_mhc
from ..reference import mhc as reference_mhc

VARIANTS = ("plain", "cakeops", "cakeops-recompute", "math", "te")
TE_MODULE = "transformer_engine.pytorch.triton.mhc"


@dataclass(frozen=True)
class Config:
    dim: int
    blocks: int
    ffn: int
    heads: int
    batch: int
    seq: int
    vocab: int = 32000
    streams: int = 4
    sinkhorn_iters: int = 20

    @property
    def label(self) -> str:
        return f"C={self.dim}, {self.blocks} blocks, SwiGLU {self.ffn}, B={self.batch} S={self.seq}"

    def as_dict(self) -> Dict[str, int]:
        return asdict(self)


# The two configs of the issue, and the CPU check's tiny one.
PRESETS: Dict[str, Config] = {
    "c2048": Config(dim=2048, blocks=4, ffn=5632, heads=16, batch=2, seq=4096),
    "c4096": Config(dim=4096, blocks=2, ffn=11008, heads=32, batch=2, seq=4096),
    "deep": Config(dim=2048, blocks=16, ffn=5632, heads=16, batch=1, seq=4096),  # groups of recompute matter
    "tiny": Config(dim=64, blocks=2, ffn=172, heads=4, batch=2, seq=32, vocab=256),
}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        if dim % heads:
            raise ValueError(f"heads: {heads} does not divide dim {dim}")
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, S, C]
        B, S, C = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, S, C))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ffn: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class PreNorm(nn.Module):
    def __init__(self, norm: nn.Module, body: nn.Module):
        super().__init__()
        self.norm, self.body = norm, body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(self.norm(x))


class Residual(nn.Module):
    """The plain residual connection: ``x + branch(x)``."""

    def __init__(self, branch: nn.Module):
        super().__init__()
        self.branch = branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(x)


class MathMHC(MHC):
    """``nn.MHC``'s layer in plain torch ops (the reference math), same parameters, same initialisation."""

    def forward(self, X: torch.Tensor) -> torch.Tensor:  # [..., n, C]
        n, C = self.n_streams, self.hidden_size
        lead = X.shape[:-2]

        def branch(U: torch.Tensor) -> torch.Tensor:  # U [T, C] -> the branch sees X's leading dims
            return self.branch(U.reshape(*lead, C)).reshape(-1, C)

        Y = reference_mhc.layer(X.reshape(-1, n, C), self.fn, self.scale, self.base, branch, self.rms_eps,
                                self.hc_eps, self.sinkhorn_iters)
        return Y.reshape(X.shape)


class MeanHead(nn.Module):
    """The mean of the streams, ``[..., n, C] -> [..., C]`` (``dim=-2``) or ``[..., C, n] -> [..., C]`` (-1)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim

    def forward(self, X: torch.Tensor) -> torch.Tensor:
        return X.mean(self.dim)


class StreamsLast(nn.Module):
    """``[..., C] -> [..., C, n]``: the embedding copied into n streams, TE's layout."""

    def __init__(self, n_streams: int):
        super().__init__()
        self.n_streams = n_streams

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h.unsqueeze(-1).expand(*h.shape, self.n_streams).contiguous()


def _te():
    return importlib.import_module(TE_MODULE)


def te_status() -> Tuple[bool, str]:
    """(usable, why): whether TransformerEngine's Triton mHC functions can be imported, and a line saying so."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False, "not installed"
    try:
        te = _te()
    except Exception as exc:  # installed without its mHC ops, or a broken install: reported, never raised
        return False, f"no mHC ops ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    missing = [f for f in ("mhc_fused_projection", "mhc_fused_scale", "mhc_fused_sinkhorn", "mhc_fused_aggregate",
                           "mhc_fused_expand_combine") if not hasattr(te, f)]
    if missing:
        return False, f"{TE_MODULE} lacks {', '.join(missing)}"
    try:
        version = importlib.import_module("transformer_engine").__version__
    except Exception:
        version = "?"
    return True, f"transformer_engine {version}"


class TEMHC(MHC):
    """One mHC layer on TransformerEngine's Triton mHC functions; streams ``[B, S, C, n]``.

    ``fn`` holds TE's ``phi`` (columns in (C, n) order), ``scale`` its ``alpha`` and ``base`` its ``beta``.
    The TE module and its signature are looked up here, once, not in ``forward`` (Dynamo traces forward).
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._te = _te()
        # TE's first release took n in expand_combine; later ones read it from x's shape
        takes_n = "n" in inspect.signature(self._te.mhc_fused_expand_combine).parameters
        self._combine_kwargs = {"n": self.n_streams} if takes_n else {}

    def forward(self, X: torch.Tensor) -> torch.Tensor:  # [B, S, C, n]
        te, n = self._te, self.n_streams
        s, b, C = X.shape[0], X.shape[1], X.shape[2]
        H, ms = te.mhc_fused_projection(X.reshape(s * b, C * n), self.fn)
        h_pre, h_post, h_res = te.mhc_fused_scale(H, self.scale, self.base.view(1, -1), ms, n)
        comb = te.mhc_fused_sinkhorn(h_res.reshape(s, b, n, n), n, iters=self.sinkhorn_iters)
        U = te.mhc_fused_aggregate(X, h_pre.reshape(s, b, n), n)
        out = self.branch(U)
        return te.mhc_fused_expand_combine(out, None, h_post.reshape(s, b, n), X, comb, **self._combine_kwargs)


def te_state_dict(state: Dict[str, torch.Tensor], n: int) -> Dict[str, torch.Tensor]:
    """A cakeops/math model's state dict in the TE variant's layout: every mapping's columns (n, C) -> (C, n)."""
    out = {}
    for name, t in state.items():
        if name.endswith(".fn") and t.dim() == 2:
            t = t.reshape(t.shape[0], n, -1).transpose(1, 2).reshape(t.shape[0], -1).contiguous()
        out[name] = t
    return out


class DecoderLM(nn.Module):
    def __init__(self, cfg: Config, variant: str, norm: str = "cakeops", recompute_group: Optional[int] = None):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant: expected one of {', '.join(VARIANTS)}, got {variant!r}")
        Norm = {"cakeops": RMSNorm, "torch": nn.RMSNorm}[norm]
        C, n = cfg.dim, cfg.streams
        self.cfg, self.variant = cfg, variant
        self.embed = nn.Embedding(cfg.vocab, C)
        layers = []
        for _ in range(cfg.blocks):
            for body in (Attention(C, cfg.heads), SwiGLU(C, cfg.ffn)):
                branch = PreNorm(Norm(C, eps=1e-6), body)
                if variant == "plain":
                    layers.append(Residual(branch))
                else:
                    cls = {"cakeops": MHC, "cakeops-recompute": MHC, "math": MathMHC, "te": TEMHC}[variant]
                    layers.append(cls(branch, C, n, sinkhorn_iters=cfg.sinkhorn_iters, keep_fp32_mapping=True))
        self.layers = nn.ModuleList(layers)
        family = "cakeops" if variant.startswith("cakeops") else variant
        self.expand = {"plain": nn.Identity(), "cakeops": StreamExpand(n), "math": StreamExpand(n),
                       "te": StreamsLast(n)}[family]
        self.collapse = {"plain": nn.Identity(), "cakeops": MHCHead(), "math": MeanHead(-2),
                         "te": MeanHead(-1)}[family]
        self.norm = Norm(C, eps=1e-6)
        self.lm_head = nn.Linear(C, cfg.vocab, bias=False)
        if variant == "cakeops-recompute":
            recompute_mhc(self, recompute_group)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.expand(self.embed(tokens))
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.norm(self.collapse(h)))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def build(cfg: Config, variant: str, device, dtype: torch.dtype, norm: str = "cakeops", seed: int = 0,
          state: Optional[Dict[str, torch.Tensor]] = None, recompute_group: Optional[int] = None) -> DecoderLM:
    """The model, its weights drawn from ``seed`` (the same weights for every mHC variant: same parameters, same
    order), cast to ``dtype`` with the mHC mappings kept FP32. ``state``: load these weights instead (cakeops
    layout; converted for ``te``)."""
    torch.manual_seed(seed)
    with torch.device(device):  # initialised where it runs: no multi-GB copy from the host
        model = DecoderLM(cfg, variant, norm, recompute_group)
    model.to(dtype)
    if state is not None:
        model.load_state_dict(te_state_dict(state, cfg.streams) if variant == "te" else state)
    return model
