"""The mHC reference math (cakeops.reference.mhc): Sinkhorn, coefficients, the explicit backward vs
torch.autograd, dtype handling, stats records, head, T == 0. CPU, fp64 oracle."""
import math
import zlib

import pytest
import torch

from cakeops.meta.mhc_layout import (
    COMB, DCOMB, DPOST, GRAD_STATS_USED, GRAD_STATS_WIDTH, MIX, N_LOGITS, N_STREAMS, POST, PRE, RSTD,
    STATS_USED, STATS_WIDTH,
)
from cakeops.reference import mhc as R
from cakeops.testing import rel_err

N = N_STREAMS
F64 = torch.float64
# (rms_eps, hc_eps): large enough that a misplaced eps shows, and the defaults.
EPS = [pytest.param(0.5, 0.05, id="large_eps"), pytest.param(1e-5, 1e-6, id="default_eps")]


@pytest.fixture
def gen(request):
    """A generator seeded from the test id: every parametrization draws different inputs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def make_inputs(gen, T, C, scale=(1.0, 1.0, 3.0)):
    """fp64 X, fn, scale, base with mix ~ N(0, 1): the res logits (scale ~3, base ~N(0,1)) are far from uniform."""
    K = N * C
    X = torch.randn(T, N, C, generator=gen, dtype=F64)
    fn = torch.randn(N_LOGITS, K, generator=gen, dtype=F64) / math.sqrt(K)
    scale = torch.tensor(scale, dtype=F64) * (1.0 + 0.1 * torch.randn(3, generator=gen, dtype=F64))
    base = torch.randn(N_LOGITS, generator=gen, dtype=F64)
    return X, fn, scale, base


def tanh_branch(gen, C):
    """B = tanh(U @ W), in fp64 with one rounding to U.dtype: the branch adds no error of its own."""
    W = torch.randn(C, C, generator=gen, dtype=F64) / math.sqrt(C)
    return lambda U: torch.tanh(U.double() @ W).to(U.dtype)


def explicit_layer_grads(X, fn, scale, base, branch, gY, rms_eps, hc_eps, iters):
    """Forward and backward through the reference ops, the branch's vjp by autograd: (Y, dX, dfn, dscale, dbase)."""
    U, stats = R.forward_prepare(X, fn, scale, base, rms_eps, hc_eps, iters)
    U = U.detach().requires_grad_()
    with torch.enable_grad():
        B = branch(U)
    Y = R.forward_finish(X, B.detach(), stats)
    dB, grad_stats = R.backward_prepare(gY, B.detach(), X, stats)
    (dU,) = torch.autograd.grad(B, U, dB)
    return (Y, *R.backward_finish(X, gY, dU, fn, scale, base, stats, grad_stats, rms_eps, hc_eps, iters))


# --- Sinkhorn -----------------------------------------------------------------------------------

def sinkhorn_literal(a, eps, iters):
    """design.md §2 step 3 for one token, scalar loops."""
    n = len(a)
    P = [[math.exp(v) for v in row] for row in a]
    P = [[v / sum(row) + eps for v in row] for row in P]

    def cols(P):
        s = [sum(P[i][j] for i in range(n)) + eps for j in range(n)]
        return [[P[i][j] / s[j] for j in range(n)] for i in range(n)]

    P = cols(P)
    for _ in range(iters - 1):
        P = [[v / (sum(row) + eps) for v in row] for row in P]
        P = cols(P)
    return P


@pytest.mark.parametrize("iters", [1, 2, 5])
@pytest.mark.parametrize("hc_eps", [0.05, 1e-6])
def test_sinkhorn_matches_spec_literal(gen, iters, hc_eps):
    a = 3.0 * torch.randn(3, N, N, generator=gen, dtype=F64)
    comb = R.sinkhorn(a, hc_eps, iters)
    lit = torch.tensor([sinkhorn_literal(t.tolist(), hc_eps, iters) for t in a], dtype=F64)
    assert rel_err(comb, lit) < 1e-13


@pytest.mark.parametrize("iters", [3, 20])
@pytest.mark.parametrize("hc_eps", [0.05, 1e-6])
def test_sinkhorn_is_nearly_doubly_stochastic(gen, iters, hc_eps):
    a = 3.0 * torch.randn(256, N, N, generator=gen, dtype=F64)  # far from uniform
    comb = R.sinkhorn(a, hc_eps, iters)
    assert (comb > 0).all()
    col, row = comb.sum(-2), comb.sum(-1)
    # The last step divides columns by (sum + eps): sums fall short of 1 by about eps, never exceed it.
    assert (col <= 1).all() and (col >= 1 - 1.2 * hc_eps - 1e-5).all()
    if iters == 20:
        assert (row - 1).abs().max() < hc_eps + 0.1
        assert (row - 1).abs().mean() < hc_eps + 1e-2


@pytest.mark.parametrize("iters", [1, 3, 20])
@pytest.mark.parametrize("hc_eps", [0.05, 1e-6])
def test_sinkhorn_gradcheck(gen, iters, hc_eps):
    a = (2.0 * torch.randn(2, N, N, generator=gen, dtype=F64)).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: R.sinkhorn(t, hc_eps, iters), (a,))


@pytest.mark.parametrize("iters", [1, 3, 20])
@pytest.mark.parametrize("hc_eps", [0.05, 1e-6])
def test_sinkhorn_backward_matches_autograd(gen, iters, hc_eps):
    a = (3.0 * torch.randn(32, N, N, generator=gen, dtype=F64)).requires_grad_()
    dcomb = torch.randn(32, N, N, generator=gen, dtype=F64)
    (ref,) = torch.autograd.grad(R.sinkhorn(a, hc_eps, iters), a, dcomb)
    assert rel_err(R.sinkhorn_backward(a.detach(), dcomb, hc_eps, iters), ref) < 1e-12


@pytest.mark.parametrize("iters", [3, 20])
@pytest.mark.parametrize("rms_eps,hc_eps", EPS)
def test_coefficients_gradcheck(gen, iters, rms_eps, hc_eps):
    inputs = tuple(t.requires_grad_() for t in make_inputs(gen, T=2, C=3))
    assert torch.autograd.gradcheck(lambda *a: R.coefficients(*a, rms_eps, hc_eps, iters), inputs)


# --- Explicit backward vs autograd through the whole layer ---------------------------------------

@pytest.mark.parametrize("branch_kind", ["identity", "tanh"])
@pytest.mark.parametrize("iters", [1, 3, 20])
@pytest.mark.parametrize("rms_eps,hc_eps", EPS)
def test_explicit_backward_matches_autograd(gen, branch_kind, iters, rms_eps, hc_eps):
    T, C = 24, 32
    X, fn, scale, base = make_inputs(gen, T, C)
    branch = (lambda U: U) if branch_kind == "identity" else tanh_branch(gen, C)
    gY = torch.randn(T, N, C, generator=gen, dtype=F64)

    leaves = [t.clone().requires_grad_() for t in (X, fn, scale, base)]
    Y_ref = R.layer(*leaves, branch, rms_eps, hc_eps, iters)
    grads_ref = torch.autograd.grad(Y_ref, leaves, gY)

    Y, *grads = explicit_layer_grads(X, fn, scale, base, branch, gY, rms_eps, hc_eps, iters)
    assert rel_err(Y, Y_ref) < 1e-13
    for name, got, ref in zip(("dX", "dfn", "dscale", "dbase"), grads, grads_ref):
        assert got.dtype == F64 and got.shape == ref.shape, name
        assert rel_err(got, ref) < 1e-10, name


# --- Dtype handling: fp32 / bf16 / fp16 data vs the fp64 oracle ------------------------------------
# Each op gets the same inputs as the oracle (which reads them upcast), so the only differences are the
# compute dtype (fp32) and the one rounding of each data-dtype output. Bounds: data-dtype outputs
# (U, Y, dB, dX) within design.md §3's forward bound for bf16/fp16 data; FP32 records and parameter gradients
# within 1e-5, tighter than design.md §3 grants the kernels (the reference has no TF32/bf16 projection).
ROUNDED_TOL = {torch.float32: 1e-6, torch.bfloat16: 4e-3, torch.float16: 1e-3}


def assert_rounded_once(out, ref64, dtype):
    """A data-dtype output computed in fp32 and rounded once: close to the fp64 value and, for 16-bit
    data, equal to that value's rounding almost everywhere (fp32 and fp64 sums only part ways next to a
    rounding boundary). 16-bit arithmetic, or a rounded intermediate, breaks the second property."""
    assert out.dtype == dtype
    assert rel_err(out, ref64) < ROUNDED_TOL[dtype]
    if dtype != torch.float32:
        assert (out != ref64.to(dtype)).double().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rms_eps,hc_eps", EPS)
def test_low_precision_ops_match_fp64(gen, dtype, rms_eps, hc_eps):
    T, C, iters = 32, 64, 20
    X, fn, scale, base = make_inputs(gen, T, C)
    fn, scale, base = fn.float(), scale.float(), base.float()
    X, B, dU = X.to(dtype), torch.randn(T, C, generator=gen).to(dtype), torch.randn(T, C, generator=gen).to(dtype)
    dY = torch.randn(T, N, C, generator=gen).to(dtype)

    def both(op, *args):
        """op on the data as given, and on the same values upcast to fp64."""
        up = [a.double() if isinstance(a, torch.Tensor) and a.dtype == dtype else a for a in args]
        return op(*args), op(*up)

    (U, stats), (U64, stats64) = both(R.forward_prepare, X, fn, scale, base, rms_eps, hc_eps, iters)
    assert (stats.dtype, stats64.dtype) == (torch.float32, F64) and rel_err(stats, stats64) < 1e-5
    assert_rounded_once(U, U64, dtype)

    Y, Y64 = both(R.forward_finish, X, B, stats)
    assert_rounded_once(Y, Y64, dtype)

    (dB, gs), (dB64, gs64) = both(R.backward_prepare, dY, B, X, stats)
    assert gs.dtype == torch.float32 and rel_err(gs, gs64) < 1e-5
    assert_rounded_once(dB, dB64, dtype)

    out, ref = both(R.backward_finish, X, dY, dU, fn, scale, base, stats, gs, rms_eps, hc_eps, iters)
    assert_rounded_once(out[0], ref[0], dtype)
    assert all(g.dtype == torch.float32 for g in out[1:])
    for name, got, want in zip(("dfn", "dscale", "dbase"), out[1:], ref[1:]):
        assert rel_err(got, want) < 1e-5, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_low_precision_layer_within_spec(gen, dtype):
    """End to end (prepare, tanh branch, finish and both backwards) against the all-fp64 chain, design.md §3 bounds.

    dscale is left out for bf16: it is three sums over tokens with cancellation, and the bf16 rounding of
    U/B/dB/dU between the ops alone moves it by up to ~2e-2 relative at T=32 -- not a property of the ops.
    """
    T, C, rms_eps, hc_eps, iters = 32, 64, 0.5, 0.05, 20
    X, fn, scale, base = make_inputs(gen, T, C)
    fn, scale, base = fn.float(), scale.float(), base.float()
    X, gY = X.to(dtype), torch.randn(T, N, C, generator=gen).to(dtype)
    branch = tanh_branch(gen, C)
    tol_fwd, tol_grad = (1e-5, 1e-4) if dtype == torch.float32 else (4e-3, 1e-2)
    out = explicit_layer_grads(X, fn, scale, base, branch, gY, rms_eps, hc_eps, iters)
    ref = explicit_layer_grads(X.double(), fn, scale, base, branch, gY.double(), rms_eps, hc_eps, iters)
    assert rel_err(out[0], ref[0]) < tol_fwd
    for name, got, want in zip(("dX", "dfn", "dscale", "dbase"), out[1:], ref[1:]):
        if name != "dscale" or dtype == torch.float32:
            assert rel_err(got, want) < tol_grad, name


# --- Records, finish, head ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_stats_records(gen, dtype):
    T, C, rms_eps, hc_eps, iters = 16, 32, 0.5, 0.05, 20
    X, fn, scale, base = make_inputs(gen, T, C)
    X, fn, scale, base = X.to(dtype), fn.float(), scale.float(), base.float()
    U, stats = R.forward_prepare(X, fn, scale, base, rms_eps, hc_eps, iters)
    assert stats.shape == (T, STATS_WIDTH) and stats.dtype == torch.float32
    assert torch.equal(R.forward_stats(X, fn, scale, base, rms_eps, hc_eps, iters), stats)
    assert (stats[:, STATS_USED:] == 0).all()

    pre, post, comb, rstd, mix = R.coefficients(X, fn, scale, base, rms_eps, hc_eps, iters)
    assert torch.equal(stats[:, PRE:PRE + N], pre) and torch.equal(stats[:, POST:POST + N], post)
    assert torch.equal(stats[:, COMB:COMB + N * N], comb.reshape(T, N * N))
    assert torch.equal(stats[:, RSTD], rstd) and torch.equal(stats[:, MIX:MIX + N_LOGITS], mix)

    gY = torch.randn(T, N, C, generator=gen).to(dtype)
    B = torch.randn(T, C, generator=gen).to(dtype)
    _, gs = R.backward_prepare(gY, B, X, stats)
    assert gs.shape == (T, GRAD_STATS_WIDTH) and (gs[:, GRAD_STATS_USED:] == 0).all()
    assert rel_err(gs[:, DPOST:DPOST + N], torch.einsum("tjc,tc->tj", gY.double(), B.double())) < 1e-6
    assert rel_err(gs[:, DCOMB:DCOMB + N * N].reshape(T, N, N),
                   torch.einsum("tic,tjc->tij", X.double(), gY.double())) < 1e-6


def test_finish_and_prepare_formulas(gen):
    T, C = 8, 16
    X, fn, scale, base = make_inputs(gen, T, C)
    U, stats = R.forward_prepare(X, fn, scale, base, 0.5, 0.05, 3)
    B = torch.randn(T, C, generator=gen, dtype=F64)
    pre, post = stats[:, PRE:PRE + N], stats[:, POST:POST + N]
    comb = stats[:, COMB:COMB + N * N].reshape(T, N, N)
    U_loop = sum(pre[:, i, None] * X[:, i] for i in range(N))
    Y_loop = torch.stack([post[:, j, None] * B + sum(comb[:, i, j, None] * X[:, i] for i in range(N))
                          for j in range(N)], dim=1)
    assert rel_err(U, U_loop) < 1e-14
    assert rel_err(R.forward_finish(X, B, stats), Y_loop) < 1e-14


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_head_is_mean_bitwise(gen, dtype):
    # A wide exponent range, so a different summation order or an early rounding would show.
    spread = 1.5 if dtype == torch.float16 else 6.0
    X = torch.randn(64, N, 96, generator=gen) * torch.exp(spread * torch.randn(64, N, 96, generator=gen))
    X = X.to(dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for layout in (X, X.transpose(1, 2).contiguous().transpose(1, 2)):
        assert torch.equal(R.head_forward(layout).view(bits), layout.mean(dim=1).view(bits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_head_backward(gen, dtype):
    dY = torch.randn(8, 40, generator=gen).to(dtype)
    dX = R.head_backward(dY, N)
    assert dX.shape == (8, N, 40) and dX.dtype == dtype and dX.is_contiguous()
    want = (dY.float() / N).to(dtype)
    assert all(torch.equal(dX[:, i], want) for i in range(N))
    X = torch.randn(8, N, 40, generator=gen, dtype=F64, requires_grad=True)
    (auto,) = torch.autograd.grad(R.head_forward(X), X, dY.double())
    assert torch.equal(R.head_backward(dY.double(), N), auto)


def test_records_need_a_supported_stream_count(gen):
    X = torch.randn(2, 3, 8, generator=gen)
    fn = torch.randn(2 * 3 + 9, 24, generator=gen)
    with pytest.raises(NotImplementedError, match=r"n = 3 .*\{2, 4, 8\}"):
        R.forward_stats(X, fn, torch.ones(3), torch.zeros(15), 1e-5, 1e-6, 3)
    # The coefficient math itself takes any n.
    pre, post, comb, rstd, mix = R.coefficients(X, fn, torch.ones(3), torch.zeros(15), 1e-5, 1e-6, 3)
    assert comb.shape == (2, 3, 3) and mix.shape == (2, 15)


# --- T == 0 ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_empty_tokens(gen, dtype):
    C = 16
    _, fn, scale, base = make_inputs(gen, 1, C)
    fn, scale, base = fn.float(), scale.float(), base.float()
    X = torch.empty(0, N, C, dtype=dtype)
    dY, B = torch.empty(0, N, C, dtype=dtype), torch.empty(0, C, dtype=dtype)
    U, stats = R.forward_prepare(X, fn, scale, base, 1e-5, 1e-6, 20)
    assert U.shape == (0, C) and U.dtype == dtype and stats.shape == (0, STATS_WIDTH)
    assert R.forward_finish(X, B, stats).shape == (0, N, C)
    assert R.head_forward(X).shape == (0, C) and R.head_backward(B, N).shape == (0, N, C)
    dB, gs = R.backward_prepare(dY, B, X, stats)
    assert dB.shape == (0, C) and gs.shape == (0, GRAD_STATS_WIDTH)
    dX, dfn, dscale, dbase = R.backward_finish(X, dY, dB, fn, scale, base, stats, gs, 1e-5, 1e-6, 20)
    assert dX.shape == (0, N, C) and dX.dtype == dtype
    for got, like in ((dfn, fn), (dscale, scale), (dbase, base)):
        assert got.shape == like.shape and got.dtype == torch.float32 and (got == 0).all()

    leaves = [t.clone().requires_grad_() for t in (X, fn, scale, base)]
    Y = R.layer(*leaves, lambda u: u, 1e-5, 1e-6, 20)
    grads = torch.autograd.grad(Y, leaves, dY)
    assert Y.shape == (0, N, C) and all((g == 0).all() for g in grads[1:])
