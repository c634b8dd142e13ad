"""FlashInfer 0.7.4 drop-in (issue 49): the stats record in FlashInfer's column order checked against fp64 math by
its definitions, the ``deterministic=`` keyword with FlashInfer's fallback (mHC) and refusal (RMSNorm) under
``torch.use_deterministic_algorithms``, the det modules' names (the very objects), ``route_key`` / ``ARCHES`` /
``cake_mhc_train_reset_workspace``, and RMSNorm's 0.7.4 additions (non-deterministic dw, ``[..., H]`` inputs, FP32
weights)."""
import contextlib
import warnings

import pytest
import torch

import cakeops
from cakeops import cake_mhc_det_train as det
from cakeops import cake_mhc_train as mhc
from cakeops import cake_rmsnorm_det_train as rms_det
from cakeops import cake_rmsnorm_train as rms
from cakeops._ops import determinism
from cakeops.reference import rmsnorm as rms_ref
from cakeops.testing import rel_err
from conftest import DEVICE, ON_GPU

HP = dict(rms_eps=0.5, hc_eps=0.05, sinkhorn_iters=7)  # eps large enough to matter
# FP32 records: the GPU projection may go through TF32 / split bf16 (SPEC section 5); the CPU paths are FP32
RECORD_TOL = 1e-3 if ON_GPU else 1e-5


def _mhc_inputs(n, T=6, C=40, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = 2 * n + n * n
    X = torch.randn(T, n, C, generator=g).to(DEVICE, dtype)
    fn = (torch.randn(M, n * C, generator=g) * 0.3).to(DEVICE)
    scale = torch.tensor([1.5, 0.7, 2.5], device=DEVICE)  # far from uniform Sinkhorn input
    base = torch.randn(M, generator=g).to(DEVICE)
    return X, fn, scale, base


def _flashinfer_math(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters):
    """FlashInfer 0.7.4's documented function in fp64 (flashinfer.cake_mhc_det_train's docstring): u the
    flattened streams, ``r = rsqrt(mean(u*u) + rms_eps)``, ``z = (u * r) @ fn.T``, the gates from z * scale + base,
    ``C`` the Sinkhorn of the residual logits (row softmax + eps, column normalize, then iters - 1 row / column
    rounds). Returns (r, z, pre, post, C) -- written here, not cakeops' reference."""
    T, n, C_ = X.shape
    u = X.double().reshape(T, n * C_)
    r = torch.rsqrt((u * u).mean(-1) + rms_eps)
    z = (u * r[:, None]) @ fn.double().T
    s, b = scale.double(), base.double()
    pre = torch.sigmoid(z[:, :n] * s[0] + b[:n]) + hc_eps
    post = 2 * torch.sigmoid(z[:, n:2 * n] * s[1] + b[n:2 * n])
    a = (z[:, 2 * n:] * s[2] + b[2 * n:]).reshape(T, n, n)
    P = torch.softmax(a, dim=-1) + hc_eps
    P = P / (P.sum(1, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        P = P / (P.sum(2, keepdim=True) + hc_eps)
        P = P / (P.sum(1, keepdim=True) + hc_eps)
    return r, z, pre, post, P.reshape(T, n * n)


def _flashinfer_columns(n):
    """FlashInfer's record ``r | z[M] | pre[n] | post[n] | C[n*n] | pad`` as (name, first, last + 1), by its
    widths alone (its STATS_LAYOUT for n = 4: r (0, 1), z (1, 25), pre (25, 29), post (29, 33), C (33, 49), pad to
    64)."""
    M = 2 * n + n * n
    widths = (("r", 1), ("z", M), ("pre", n), ("post", n), ("C", n * n))
    out, at = [], 0
    for name, w in widths:
        out.append((name, at, at + w))
        at += w
    return out, {2: 32, 4: 64, 8: 256}[n]


def test_flashinfers_n4_columns_are_its_stats_layout():
    cols, width = _flashinfer_columns(4)
    assert cols == [("r", 0, 1), ("z", 1, 25), ("pre", 25, 29), ("post", 29, 33), ("C", 33, 49)] and width == 64


@pytest.mark.parametrize("n", (2, 4, 8))
@pytest.mark.parametrize("seed", (1, 2))
def test_stats_columns_are_flashinfers(backend, n, seed):
    """forward_prepare's record (reference math, and the Triton kernels: the interpreter on CPU) read by
    FlashInfer's columns equals FlashInfer's definitions in fp64 (fresh inputs per seed)."""
    X, fn, scale, base = _mhc_inputs(n, seed=seed)
    U, stats = mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, **HP)
    want = dict(zip(("r", "z", "pre", "post", "C"), _flashinfer_math(X, fn, scale, base, **HP)))
    cols, width = _flashinfer_columns(n)
    assert stats.shape == (X.shape[0], width) and stats.dtype == torch.float32
    for name, lo, hi in cols:
        got = stats[:, lo:hi].double()
        assert rel_err(got, want[name].reshape(got.shape)) <= RECORD_TOL, name
    assert (stats[:, cols[-1][2]:] == 0).all()  # pad
    assert (want["C"] - 1.0 / n).abs().max() > 0.05  # the Sinkhorn had work to do
    # U = sum_i pre_i X_i with the gates read from FlashInfer's pre columns
    pre = stats[:, cols[2][1]:cols[2][2]]
    assert rel_err(U, torch.einsum("ti,tic->tc", pre.double(), X.double())) <= RECORD_TOL
    assert torch.equal(mhc.cake_mhc_train_forward_stats(X, fn, scale, base, **HP), stats)


@pytest.mark.parametrize("n", (2, 4, 8))
def test_a_record_in_flashinfers_columns_drives_finish_and_backward(backend, n):
    """A record written from FlashInfer's definitions in its columns (no cakeops code involved) gives finish and
    backward_prepare the outputs of FlashInfer's formulas: what the kernels read is what FlashInfer's columns hold."""
    X, fn, scale, base = _mhc_inputs(n, seed=7)
    cols, width = _flashinfer_columns(n)
    parts = _flashinfer_math(X, fn, scale, base, **HP)
    stats = torch.zeros(X.shape[0], width, dtype=torch.float64, device=DEVICE)
    for (name, lo, hi), value in zip(cols, parts):
        stats[:, lo:hi] = value.reshape(X.shape[0], -1)
    stats = stats.float()
    B = torch.randn(X.shape[0], X.shape[2], device=DEVICE)
    _, _, pre, post, comb = (p.double() for p in parts)
    comb = comb.reshape(-1, n, n)
    Y = mhc.cake_mhc_train_forward_finish(X, B, stats)
    want = post[:, :, None] * B.double()[:, None, :] + torch.einsum("tij,tic->tjc", comb, X.double())
    assert rel_err(Y, want) <= 1e-5
    dY = torch.randn_like(X)
    dB, _ = mhc.cake_mhc_train_backward_prepare(dY, B, X, stats)
    assert rel_err(dB, torch.einsum("tj,tjc->tc", post, dY.double())) <= 1e-5


# ---------------------------------------------------------------------------------------------
# deterministic= and torch.use_deterministic_algorithms
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _deterministic_algorithms(warn_only=False):
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(True, warn_only=warn_only)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


@pytest.fixture
def fresh_warning(monkeypatch):
    """The mHC fallback warns once per process: start from 'not yet warned'."""
    monkeypatch.setattr(determinism, "_fallback_warned", False)
    monkeypatch.setattr(determinism, "_warned", set())


def _layer_grads(X, fn, scale, base, deterministic, gY):
    Xg, fng, sg, bg = (t.detach().clone().requires_grad_() for t in (X, fn, scale, base))
    U, handle = mhc.cake_mhc_train_prepare(Xg, fng, sg, bg, **HP, deterministic=deterministic)
    Y = mhc.cake_mhc_train_finish(Xg, torch.tanh(U), handle)
    Y.backward(gY)
    return [t.grad for t in (Xg, fng, sg, bg)]


def test_mhc_fallback_runs_deterministic_and_warns_once(backend, fresh_warning):
    X, fn, scale, base = _mhc_inputs(4, seed=3)
    gY = torch.randn_like(X)
    U, stats = mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, **HP)
    B, dY = torch.tanh(U), torch.randn_like(X)
    dB, gs = mhc.cake_mhc_train_backward_prepare(dY, B, X, stats)
    want_bwd = mhc.cake_mhc_train_backward_finish(X, dY, dB, B, fn, scale, base, stats, gs, **HP)
    want_layer = _layer_grads(X, fn, scale, base, True, gY)
    with _deterministic_algorithms(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        U2, stats2 = mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, **HP, deterministic=False)
        got_bwd = mhc.cake_mhc_train_backward_finish(X, dY, dB, B, fn, scale, base, stats, gs, **HP,
                                                     deterministic=False)
        got_layer = _layer_grads(X, fn, scale, base, False, gY)  # a deterministic layer: its backward runs
        mhc.cake_mhc_train_forward_stats(X, fn, scale, base, **HP, deterministic=False)
        mhc.cake_mhc_train_forward_finish(X, B, stats, deterministic=False)
        mhc.cake_mhc_train_backward_prepare(dY, B, X, stats, deterministic=False)
        assert mhc.cake_mhc_train_backward_workspace_bytes(8, DEVICE, hidden=40, deterministic=False) == \
            mhc.cake_mhc_train_backward_workspace_bytes(8, DEVICE, hidden=40)  # the deterministic layout's size
        assert mhc.is_cake_mhc_train_supported(DEVICE, deterministic=False)
    fallbacks = [w for w in caught if "deterministic=False runs the deterministic path" in str(w.message)]
    assert len(fallbacks) == 1 and fallbacks[0].category is UserWarning  # once per process, all entries together
    assert "cake_mhc_train_forward_prepare" in str(fallbacks[0].message)
    assert torch.equal(U2, U) and torch.equal(stats2, stats)
    for got, want in zip(got_bwd, want_bwd):
        assert torch.equal(got, want)
    for got, want in zip(got_layer, want_layer):
        assert torch.equal(got, want)


def test_mhc_nondeterministic_backward_itself_still_raises(backend, fresh_warning):
    """FlashInfer's non-deterministic package never falls back: cakeops' op with deterministic=False, and the
    backward of a layer prepared with deterministic=False before the deterministic algorithms were enabled, raise
    PyTorch's alert."""
    X, fn, scale, base = _mhc_inputs(4, seed=4)
    U, stats = mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, **HP)
    B, dY = torch.tanh(U), torch.randn_like(X)
    dB, gs = mhc.cake_mhc_train_backward_prepare(dY, B, X, stats)
    Xg = X.detach().requires_grad_()
    U, handle = mhc.cake_mhc_train_prepare(Xg, fn, scale, base, **HP, deterministic=False)
    Y = mhc.cake_mhc_train_finish(Xg, torch.tanh(U), handle)
    with _deterministic_algorithms():
        with pytest.raises(RuntimeError, match="deterministic"):
            torch.ops.cakeops.mhc_backward_finish(X, dY, dB, fn, scale, base, stats, gs, *HP.values(), False)
        with pytest.raises(RuntimeError, match="deterministic"):
            Y.backward(torch.randn_like(Y))


def test_deterministic_must_be_a_bool():
    X, fn, scale, base = _mhc_inputs(2, T=2, C=8)
    with pytest.raises(TypeError, match="deterministic"):
        mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, deterministic=1)
    with pytest.raises(TypeError, match="deterministic"):
        mhc.is_cake_mhc_train_supported("cpu", deterministic="yes")
    with pytest.raises(TypeError, match="deterministic"):
        rms.cake_rmsnorm_train_forward(torch.randn(2, 8), torch.ones(8), 1e-6, deterministic=None)


def test_rmsnorm_refuses_nondeterministic_under_deterministic_algorithms(backend, fresh_warning):
    """flashinfer.cake_rmsnorm_train's rule (no silent fallback): deterministic=False raises RuntimeError; with
    warn_only=True it warns and runs the deterministic path; the support query answers regardless."""
    x, w = torch.randn(6, 48, device=DEVICE), torch.randn(48, device=DEVICE)
    y, rstd = rms.cake_rmsnorm_train_forward(x, w, 1e-6)
    g = torch.randn_like(y)
    want = rms.cake_rmsnorm_train_backward(g, x, w, rstd)
    with _deterministic_algorithms():
        for call in (lambda: rms.cake_rmsnorm_train_forward(x, w, 1e-6, deterministic=False),
                     lambda: rms.cake_rmsnorm_train_backward(g, x, w, rstd, deterministic=False),
                     lambda: rms.cake_rmsnorm_train_backward_workspace_bytes(6, 48, DEVICE, deterministic=False),
                     lambda: rms.cake_rmsnorm_train_backward_workspace(6, 48, DEVICE, deterministic=False),
                     lambda: rms.cake_rmsnorm(x, w, 1e-6, None, False)):
            with pytest.raises(RuntimeError, match="deterministic"):
                call()
        assert rms.is_cake_rmsnorm_train_supported(DEVICE, 48, deterministic=False)
    with _deterministic_algorithms(warn_only=True), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = rms.cake_rmsnorm_train_backward(g, x, w, rstd, deterministic=False)
        rms.cake_rmsnorm_train_backward(g, x, w, rstd, deterministic=False)
    assert sum("deterministic=False" in str(c.message) for c in caught) == 1
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])  # the deterministic backward ran


def test_rmsnorm_det_module_exports_only_the_deterministic_reduction(backend):
    x = torch.randn(5, 32, device=DEVICE, requires_grad=True)
    w = torch.randn(32, device=DEVICE, requires_grad=True)
    y, rstd = rms_det.cake_rmsnorm_det_train_forward(x.detach(), w.detach(), 1e-6)
    with pytest.raises(ValueError, match="only the deterministic"):
        rms_det.cake_rmsnorm_det_train_backward(torch.randn_like(y), x.detach(), w.detach(), rstd,
                                                deterministic=False)
    out = rms_det.cake_rmsnorm_det(x, w, 1e-6, None, False)  # FlashInfer: the forward runs, the backward refuses
    with pytest.raises(ValueError, match="only the deterministic"):
        out.backward(torch.randn_like(out))
    out = rms_det.cake_rmsnorm_det(x, w, 1e-6)
    gy = torch.randn_like(out)
    out.backward(gy)
    dx, dw = rms.cake_rmsnorm_train_backward(gy, x.detach(), w.detach(), rstd)
    assert torch.equal(x.grad, dx) and torch.equal(w.grad, dw)


# ---------------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------------

def test_det_module_names_are_the_same_objects():
    pairs = {name: name.replace("cake_mhc_det_train", "cake_mhc_train").replace("MHCDetTrain", "MHCTrain")
                       .replace("is_cake_mhc_det_train", "is_cake_mhc_train") for name in det.__all__}
    for det_name, name in pairs.items():
        assert getattr(det, det_name) is getattr(mhc, name), det_name
        if det_name not in cakeops._MODULE_ONLY:
            assert getattr(cakeops, det_name) is getattr(mhc, name), det_name  # at the top, as FlashInfer's
    assert det.CakeMHCDetTrainPrepareFunction is mhc.CakeMHCTrainPrepareFunction
    for name in rms._PREVIOUS_DET_NAMES:  # flashinfer.cake_rmsnorm_train's previous det names
        assert getattr(rms, name) is getattr(rms_det, name), name
    for name in ("CakeRMSNormDetFunction", "cake_rmsnorm_det", "cake_rmsnorm_det_train_forward",
                 "cake_rmsnorm_det_train_backward", "cake_rmsnorm_det_train_backward_workspace_bytes"):
        assert getattr(cakeops, name) is getattr(rms_det, name)  # flashinfer's top level has these
    assert rms_det.cake_rmsnorm_det_train_forward is rms.cake_rmsnorm_train_forward
    assert rms_det.cake_rmsnorm is rms_det.cake_rmsnorm_det  # the names before FlashInfer's det rename


def test_reset_workspace():
    ws = mhc.cake_mhc_train_backward_workspace(8, "cpu", hidden=32)
    ws.fill_(3)
    assert mhc.cake_mhc_train_reset_workspace(ws) is None and not ws.any()
    for bad in (torch.zeros(4, 4, dtype=torch.uint8), torch.zeros(16, dtype=torch.float32), "workspace", None):
        with pytest.raises(ValueError, match="1-D uint8"):
            det.cake_mhc_det_train_reset_workspace(bad)


def test_route_keys_and_arches():
    assert mhc.route_key(4096, "fwd_prepare") == "fwd_prepare_h4096"  # FlashInfer's format
    assert mhc.route_key(1000, "bwd_finish") == "bwd_finish_h1000"    # any hidden size
    assert rms.route_key(4096, "bwd", True, "f32") == "bwd_w32_residual_h4096"
    assert rms.route_key(96, "fwd", False) == "fwd_h96"
    with pytest.raises(ValueError, match="kind"):
        mhc.route_key(4096, "head")
    with pytest.raises(ValueError, match="w_dtype"):
        rms.route_key(4096, "fwd", False, "fp8")
    with pytest.raises(ValueError, match="hidden"):
        mhc.route_key(0, "fwd_finish")
    for module in (mhc, det, rms, rms_det):
        assert set(module.ARCHES) >= {"sm_80", "sm_90", "sm_100", "sm_120", "cpu"}
        assert set(module.SUPPORTED_COMPUTE_CAPABILITIES) >= {(8, 0), (9, 0), (10, 0), (12, 0)}
    assert rms_det.weight_dtypes("sm_90", 4096, "fwd", False) == ("bf16", "f16", "f32")
    assert rms_det.program_windows("cpu", 96, "bwd", True) == ((0, None, "_rmsnorm_bwd_kernel"),)
    with pytest.raises(ValueError, match="arch"):
        rms_det.program_windows("sm_75", 96, "bwd", True)


# ---------------------------------------------------------------------------------------------
# RMSNorm: what 0.7.4 added (non-deterministic dw, [..., H] inputs, FP32 weights)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("deterministic", (True, False))
@pytest.mark.parametrize("residual", (False, True))
def test_rmsnorm_nd_inputs_and_fp32_weights(backend, deterministic, residual):
    """A [T, heads, H] view of a wider buffer (FlashInfer's example) with a shared FP32 weight: rstd in the leading
    shape, dw summed over every row, in either mode; fp64 reference math."""
    g = torch.Generator().manual_seed(11)
    wide = torch.randn(5, 3, 80, generator=g).to(DEVICE, torch.bfloat16)
    x = wide[..., :64]  # leading dims contiguous with one another, last dim contiguous
    w = torch.randn(64, generator=g).to(DEVICE)  # FP32 weight, bf16 x
    u = torch.randn(5, 3, 64, generator=g).to(DEVICE, torch.bfloat16) if residual else None
    outs = rms.cake_rmsnorm_train_forward(x, w, 1e-5, residual=u, deterministic=deterministic)
    y, rstd = outs[0], outs[1]
    h = outs[2] if residual else x
    assert y.shape == x.shape and rstd.shape == (5, 3) and y.dtype == torch.bfloat16
    h64 = h.double().reshape(15, 64)
    r64 = torch.rsqrt(h64.square().mean(-1) + 1e-5)
    assert rel_err(rstd.reshape(-1), r64) <= 1e-5
    assert rel_err(y.reshape(15, 64), h64 * r64[:, None] * w.double()) <= 4e-3
    gy = torch.randn(5, 3, 64, generator=g).to(DEVICE, torch.bfloat16)
    dx, dw = rms.cake_rmsnorm_train_backward(gy, h, w, rstd, deterministic=deterministic)
    dx64, dw64 = rms_ref.backward(gy.double().reshape(15, 64), h64, w.double(), r64)
    assert dx.shape == x.shape and dw.dtype == torch.float32
    assert rel_err(dx.reshape(15, 64), dx64) <= 1e-2 and rel_err(dw, dw64) <= 1e-4


def test_rmsnorm_nondeterministic_dw_agrees(backend):
    g = torch.Generator().manual_seed(12)
    x = torch.randn(33, 96, generator=g).to(DEVICE)
    w = torch.randn(96, generator=g).to(DEVICE)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    gy = torch.randn(33, 96, generator=g).to(DEVICE)
    rms.cake_rmsnorm(xg, wg, 1e-6, None, False).backward(gy)
    y, rstd = rms.cake_rmsnorm_train_forward(x, w, 1e-6)
    dx, dw = rms.cake_rmsnorm_train_backward(gy, x, w, rstd)
    assert torch.equal(xg.grad, dx) and rel_err(wg.grad, dw) <= 1e-6
