"""Comparison helpers for tests of code built on cakeops."""
import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (the absolute error when ref is all zeros). NaN stays NaN."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if out.shape != ref.shape:
        raise ValueError(f"rel_err: shapes differ, {tuple(out.shape)} vs {tuple(ref.shape)}")
    diff = (out - ref).norm().item()
    denom = ref.norm().item()
    return diff if denom == 0.0 else diff / denom
