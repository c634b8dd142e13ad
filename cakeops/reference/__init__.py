"""The math of every cakeops op in plain torch: the CPU implementation and the tests' oracle.

Dtype-generic: float64 inputs compute in float64 (the oracle), anything else in float32; outputs the
design.md §2 rounds to the input dtype are cast once at the end.
"""
import torch


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32
