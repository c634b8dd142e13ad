"""Property tests (hypothesis): any shape the API admits, the kernels agree with the reference math."""
import contextlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cakeops import _backend
from cakeops.cake_mhc_train import cake_mhc_train_forward_finish, cake_mhc_train_forward_prepare
from cakeops.cake_rmsnorm_train import cake_rmsnorm_train_backward, cake_rmsnorm_train_forward
from cakeops.meta import mhc_layout
from cakeops.reference import mhc as mhc_ref
from cakeops.reference import rmsnorm as rms_ref
from cakeops.testing import rel_err
from conftest import DEVICE, ON_GPU

DTYPES = st.sampled_from([torch.bfloat16, torch.float16, torch.float32])
TOL = {torch.bfloat16: 2.0 ** -7, torch.float16: 1e-3, torch.float32: 1e-5}  # bf16: interpreter truncation


def _kernels():
    return contextlib.nullcontext() if ON_GPU else _backend.cpu_kernels("triton")


@settings(max_examples=25, deadline=None)
@given(T=st.integers(0, 9), H=st.integers(2, 300), dtype=DTYPES, residual=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_rmsnorm_kernels_match_reference_at_any_shape(T, H, dtype, residual, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    r = torch.randn(T, H, generator=g).to(DEVICE, dtype) if residual else None
    w = torch.randn(H, generator=g).to(DEVICE, dtype)
    with _kernels():
        outs = cake_rmsnorm_train_forward(x, w, 1e-2, residual=r)
        h = outs[2] if residual else x
        gy = torch.randn(T, H, generator=g).to(DEVICE, dtype)
        dx, dw = cake_rmsnorm_train_backward(gy, h, w, outs[1])
    ref_y, ref_rstd = rms_ref.forward(h.double(), w.double(), 1e-2)
    ref_dx, ref_dw = rms_ref.backward(gy.double(), h.double(), w.double(), ref_rstd)
    assert rel_err(outs[0], ref_y) <= TOL[dtype] and rel_err(outs[1], ref_rstd) <= 1e-5
    assert rel_err(dx, ref_dx) <= 1e-2 and rel_err(dw, ref_dw) <= 1e-2


@settings(max_examples=15, deadline=None)
@given(T=st.integers(0, 6), C=st.integers(1, 48), iters=st.integers(1, 30), hc_eps=st.sampled_from([1e-6, 0.05]),
       seed=st.integers(0, 2**31 - 1))
def test_mhc_forward_kernels_match_reference_and_sinkhorn_holds(T, C, iters, hc_eps, seed):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, 4, C, generator=g).to(DEVICE)
    fn = (torch.randn(24, 4 * C, generator=g) / (4 * C) ** 0.5).to(DEVICE)
    scale = torch.tensor([1.0, 1.0, 3.0], device=DEVICE)
    base = torch.randn(24, generator=g).to(DEVICE)
    B = torch.randn(T, C, generator=g).to(DEVICE)
    with _kernels():
        U, stats = cake_mhc_train_forward_prepare(X, fn, scale, base, hc_eps=hc_eps, sinkhorn_iters=iters)
        Y = cake_mhc_train_forward_finish(X, B, stats)
    ref_U, ref_stats = mhc_ref.forward_prepare(X.double(), fn.double(), scale.double(), base.double(), 1e-5, hc_eps,
                                               iters)
    assert rel_err(U, ref_U) <= 1e-3 and rel_err(stats, ref_stats) <= 1e-3
    assert rel_err(Y, mhc_ref.forward_finish(X.double(), B.double(), ref_stats)) <= 1e-3
    L = mhc_layout.layout_for(4)
    comb = stats[:, L.COMB:L.COMB + 16].reshape(T, 4, 4)
    assert (comb >= 0).all()
    # the last Sinkhorn step normalizes columns: each sums to S / (S + hc_eps) < 1; with many iterations and a
    # small eps the matrix is doubly stochastic
    col = comb.sum(1)
    assert ((col <= 1 + 1e-5) & (col > 0)).all()
    if iters >= 20 and hc_eps < 1e-3:
        assert ((col - 1).abs() <= 1e-3).all()
