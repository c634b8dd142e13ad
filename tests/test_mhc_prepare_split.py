"""The experimental split-K prepare kernel: same function as the default one (to rounding), any split count,
stats-only bitwise equal to prepare, every output written. Not the default until it is timed on a GPU."""
import pytest
import torch

from cakeops._triton import mhc_prepare as kernels
from cakeops.reference import mhc as reference
from cakeops.testing import rel_err
from conftest import DEVICE, ON_GPU

HP = (0.5, 0.05)  # rms_eps, hc_eps: large enough to matter


def _inputs(T, C, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, 4, C, generator=g).to(DEVICE, dtype)
    fn = (torch.randn(24, 4 * C, generator=g) / (4 * C) ** 0.5).to(DEVICE)
    scale = torch.tensor([1.0, 1.0, 3.0], device=DEVICE)
    base = torch.randn(24, generator=g).to(DEVICE)
    return X, fn, scale, base


def _run(X, fn, scale, base, iters, write_u=True, **kw):
    T, _, C = X.shape
    stats = torch.full((T, 64), float("nan"), device=DEVICE)
    U = torch.full((T, C), float("nan"), device=DEVICE, dtype=X.dtype) if write_u else None
    kernels.prepare(X, fn, scale, base, *HP, iters, stats, U, **kw)
    return U, stats


@pytest.mark.parametrize("T,C,split_k,block_c", [(17, 40, 2, 16), (33, 100, 3, 16), (5, 64, 4, 16), (1, 8, 2, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_k_matches_reference_and_default(triton_kernels, T, C, split_k, block_c, dtype):
    X, fn, scale, base = _inputs(T, C, dtype, seed=T * C + split_k)
    iters = 20 if T > 5 else 3
    U, stats = _run(X, fn, scale, base, iters, split_k=split_k, block_t=16, block_c=block_c)
    assert not torch.isnan(U).any() and not torch.isnan(stats).any()
    ref_U, ref_stats = reference.forward_prepare(X.double(), fn.double(), scale.double(), base.double(), *HP, iters)
    u_tol = 8e-3 if dtype == torch.bfloat16 else 1e-5  # bf16: two ulps (the interpreter truncates)
    assert rel_err(U, ref_U) <= (u_tol if not ON_GPU else 4e-3 if dtype == torch.bfloat16 else 1e-3)
    assert rel_err(stats, ref_stats) <= (1e-4 if not ON_GPU else 1e-3)
    assert torch.equal(stats[:, 49:], torch.zeros_like(stats[:, 49:]))
    default_U, default_stats = _run(X, fn, scale, base, iters, block_t=16, block_c=block_c)
    assert rel_err(stats, default_stats) <= 1e-5
    only_stats = _run(X, fn, scale, base, iters, write_u=False, split_k=split_k, block_t=16, block_c=block_c)[1]
    assert torch.equal(only_stats, stats)


def test_split_k_is_deterministic_and_relaunchable(triton_kernels):
    """The arrival counters reset themselves and the partial sums are added in split order."""
    X, fn, scale, base = _inputs(40, 96, torch.bfloat16, seed=3)
    runs = [_run(X, fn, scale, base, 20, split_k=3, block_t=16, block_c=32) for _ in range(3)]
    for U, stats in runs[1:]:
        assert torch.equal(U, runs[0][0]) and torch.equal(stats, runs[0][1])


@pytest.mark.skipif(not ON_GPU, reason="real sizes need a GPU")
@pytest.mark.parametrize("split_k", [4, 8, 16])
def test_split_k_real_size(split_k):
    X, fn, scale, base = _inputs(1024, 4096, torch.bfloat16, seed=split_k)
    U, stats = _run(X, fn, scale, base, 20, split_k=split_k)
    ref_U, ref_stats = reference.forward_prepare(X.double(), fn.double(), scale.double(), base.double(), *HP, 20)
    assert rel_err(U, ref_U) <= 4e-3 and rel_err(stats, ref_stats) <= 1e-3
    again = _run(X, fn, scale, base, 20, split_k=split_k)
    assert torch.equal(again[0], U) and torch.equal(again[1], stats)
