"""Every launch config the tuner may pick computes the default's results: each candidate of every config class
runs its launcher on small shapes (GPU or interpreter) against the default config's outputs."""
import functools

import pytest
import torch

from cakeops._triton import mhc_backward_prepare, mhc_prepare, mhc_streams, rmsnorm
from cakeops.testing import rel_err
from conftest import DEVICE


def _close(outs, want, tol=2e-2):
    for o, w in zip(outs, want):
        assert rel_err(o, w) <= tol


def _mhc_inputs(T=20, C=100):
    # T = 20: tails in every token tiling (the CPU default's 16-token tiles, the gates' 8-token blocks); a program
    # per token in backward_prepare, so no more tokens than that
    g = torch.Generator().manual_seed(3)
    X = torch.randn(T, 4, C, generator=g).to(DEVICE, torch.bfloat16)
    fn = (torch.randn(24, 4 * C, generator=g) * 0.1).to(DEVICE)
    scale = torch.tensor([1.0, 1.0, 3.0], device=DEVICE)
    base = torch.randn(24, generator=g).to(DEVICE)
    return X, fn, scale, base


def _prepare(config):
    X, fn, scale, base = _mhc_inputs()
    stats = torch.empty(X.shape[0], 64, device=DEVICE)
    U = torch.empty(X.shape[0], X.shape[2], device=DEVICE, dtype=X.dtype)
    mhc_prepare.prepare(X, fn, scale, base, 1e-5, 1e-6, 3, stats, U, config=config)
    return U, stats


def _backward_prepare(config):
    X, fn, scale, base = _mhc_inputs()
    _, stats = _default_outputs(_prepare)
    g = torch.Generator().manual_seed(4)
    dY = torch.randn(X.shape, generator=g).to(DEVICE, X.dtype)
    B = torch.randn(X.shape[0], X.shape[2], generator=g).to(DEVICE, X.dtype)
    dB, gs = torch.empty_like(B), torch.empty(X.shape[0], 32, device=DEVICE)
    mhc_backward_prepare.backward_prepare(dY, B, X, stats, dB, gs, config=config)
    return dB, gs[:, :20]


def _head_backward(config):
    dY = torch.randn(40, 100, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    dX = torch.empty(40, 4, 100, device=DEVICE, dtype=torch.bfloat16)
    mhc_streams.head_backward(dY, dX, False, config=config)
    return (dX,)


def _rmsnorm(config):
    g = torch.Generator().manual_seed(6)
    x = torch.randn(33, 300, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(300, generator=g).to(DEVICE)
    y, rstd = torch.empty_like(x), torch.empty(33, device=DEVICE)
    rmsnorm.forward(x, w, 1e-6, y, rstd, config=config)
    dx, dw = torch.empty_like(x), torch.empty(300, device=DEVICE)
    rmsnorm.backward(torch.randn_like(x), x, w, rstd, dx, dw, config=config)
    return y, rstd, dx, dw


@functools.lru_cache(maxsize=None)
def _default_outputs(run):
    """The default config's outputs, computed once per launcher: every candidate is compared with the same ones."""
    torch.manual_seed(0)
    return run(None)


CASES = [(mhc_prepare.PrepareConfig, _prepare), (mhc_backward_prepare.BackwardPrepareConfig, _backward_prepare),
         (mhc_streams.StreamConfig, _head_backward), (rmsnorm.RMSNormConfig, _rmsnorm)]
PARAMS = [pytest.param(cls, run, cfg, id=f"{cls.__name__}-{i}") for cls, run in CASES
          for i, cfg in enumerate(cls.candidates())]


@pytest.mark.parametrize("cls, run, config", PARAMS)
def test_candidate_matches_the_default(triton_kernels, cls, run, config):
    want = _default_outputs(run)
    torch.manual_seed(0)
    _close(run(config), want)
