"""The mHC forward Triton kernels (cakeops/_triton/mhc_forward.py) called through their launchers, vs the
fp64 reference math. On CPU they run under the Triton interpreter (small shapes), on a GPU on CUDA tensors.

Interpreter caveats (docs/design.md §5): fp32 -> bf16 casts truncate there, so bf16 outputs get twice the rounding
error of a GPU and no bitwise bf16 claims are made on CPU; fp32 tl.dot is exact there, so the CPU tolerances
of FP32 records are the tight ones (the GPU's TF32 projection gets design.md §3's 1e-3).
"""
import math
import zlib

import pytest
import torch

from cakeops._triton import mhc_forward as K
from cakeops.meta.mhc_layout import COMB, MIX, N_LOGITS, N_STREAMS, POST, PRE, RSTD, STATS_USED, STATS_WIDTH
from cakeops.reference import mhc as R
from cakeops.testing import rel_err
from conftest import DEVICE, ON_GPU

N = N_STREAMS
F64 = torch.float64
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = {"large_eps": (0.5, 0.05), "default_eps": (1e-5, 1e-6)}
STATS_GROUPS = {"pre": (PRE, N), "post": (POST, N), "comb": (COMB, N * N), "rstd": (RSTD, 1), "mix": (MIX, N_LOGITS)}


@pytest.fixture
def gen(request):
    """A generator seeded from the test id: every parametrization draws different inputs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def stats_tol(dtype):
    """bf16 X: bf16 MMA with fn split hi + lo (~1e-5 measured). Others: TF32 on a GPU (design.md §3's 1e-3), the
    interpreter's exact fp32 dot on CPU."""
    if dtype == torch.bfloat16:
        return 2e-4
    return 1e-3 if ON_GPU else 1e-5


def out_tol(dtype):
    """design.md §3 for the data outputs; the interpreter's truncating bf16 cast doubles the rounding error."""
    if dtype == torch.float32:
        return 1e-3 if ON_GPU else 1e-5
    return 4e-3 if (ON_GPU or dtype != torch.bfloat16) else 8e-3


def make_inputs(gen, T, C, dtype):
    """X (tokens of different scales, so rstd varies), fn, scale, base with mix ~ N(0, 1): the residual
    logits (scale ~3, base ~ N(0, 1)) put the Sinkhorn input far from uniform."""
    Kd = N * C
    X = torch.randn(T, N, C, generator=gen, dtype=F64) * torch.exp(0.5 * torch.randn(T, 1, 1, generator=gen, dtype=F64))
    fn = torch.randn(N_LOGITS, Kd, generator=gen, dtype=F64) / math.sqrt(Kd)
    scale = torch.tensor([1.0, 1.0, 3.0], dtype=F64) * (1.0 + 0.1 * torch.randn(3, generator=gen, dtype=F64))
    base = torch.randn(N_LOGITS, generator=gen, dtype=F64)
    X = X.to(dtype).to(DEVICE)
    return X, fn.float().to(DEVICE), scale.float().to(DEVICE), base.float().to(DEVICE)


def poisoned(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def reference_prepare(X, fn, scale, base, rms_eps, hc_eps, iters):
    return R.forward_prepare(X.double(), fn.double(), scale.double(), base.double(), rms_eps, hc_eps, iters)


def assert_stats_close(stats, ref, dtype):
    assert not stats.isnan().any(), "stats has unwritten (NaN) entries"
    tol = stats_tol(dtype)
    for name, (start, width) in STATS_GROUPS.items():
        err = rel_err(stats[:, start:start + width], ref[:, start:start + width])
        assert err <= tol, f"stats {name}: rel err {err:.3g} > {tol}"
    assert torch.equal(stats[:, STATS_USED:], torch.zeros_like(stats[:, STATS_USED:])), "padding not zeroed"


def run_prepare(X, fn, scale, base, rms_eps, hc_eps, iters, with_u=True, **config):
    T, _, C = X.shape
    stats = poisoned(T, STATS_WIDTH, dtype=torch.float32)
    U = poisoned(T, C, dtype=X.dtype) if with_u else None
    K.prepare(X, fn, scale, base, rms_eps, hc_eps, iters, stats, U, config=K.PrepareConfig(**config))
    return U, stats


# (T, C, sinkhorn_iters, eps, launcher config): tails in T and C, one and many C chunks, every iters bound.
PREPARE_CASES = [
    pytest.param(17, 100, 20, "large_eps", {}, id="T17-C100-it20-large"),
    pytest.param(17, 100, 2, "default_eps", {"block_t": 8, "block_c": 16, "collapse_block_c": 32},
                 id="T17-C100-it2-default-chunked"),
    pytest.param(1, 1, 1, "large_eps", {}, id="T1-C1-it1-large"),
    pytest.param(17, 8, 64, "large_eps", {}, id="T17-C8-it64-large"),
    pytest.param(1, 8, 20, "default_eps", {}, id="T1-C8-it20-default"),
    pytest.param(40, 8, 3, "large_eps", {"block_t": 8, "gates_block_t": 16, "gates_warps": 4},
                 id="T40-C8-it3-large-gates16"),
    pytest.param(0, 8, 20, "default_eps", {}, id="T0"),
    # the projection split over column slices (a partial slice at C=100)
    pytest.param(17, 100, 20, "large_eps", {"slices": 3, "block_t": 16, "block_c": 16, "gates_block_t": 4},
                 id="T17-C100-it20-large-slices3"),
    pytest.param(17, 100, 20, "default_eps", {"presplit": False, "block_c": 16},
                 id="T17-C100-it20-default-tile-split"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("T, C, iters, eps, config", PREPARE_CASES)
def test_prepare_matches_reference(triton_kernels, gen, dtype, T, C, iters, eps, config):
    rms_eps, hc_eps = EPS[eps]
    X, fn, scale, base = make_inputs(gen, T, C, dtype)
    U, stats = run_prepare(X, fn, scale, base, rms_eps, hc_eps, iters, **config)
    U_ref, stats_ref = reference_prepare(X, fn, scale, base, rms_eps, hc_eps, iters)
    assert_stats_close(stats, stats_ref, dtype)
    assert not U.isnan().any(), "U has unwritten (NaN) entries"
    assert U.dtype == X.dtype and rel_err(U, U_ref) <= out_tol(dtype)


@pytest.mark.parametrize("T, C, iters, config", [
    (17, 100, 20, {}), (40, 8, 3, {"block_t": 8, "block_c": 16, "gates_block_t": 16}),
    (17, 100, 20, {"slices": 2, "block_t": 16, "block_c": 16, "collapse_block_c": 64}),
    (17, 100, 20, {"presplit": False}),
])
def test_stats_only_is_bitwise_prepare(triton_kernels, gen, T, C, iters, config):
    X, fn, scale, base = make_inputs(gen, T, C, torch.bfloat16)
    _, stats = run_prepare(X, fn, scale, base, 0.5, 0.05, iters, **config)
    _, stats_only = run_prepare(X, fn, scale, base, 0.5, 0.05, iters, with_u=False, **config)
    assert torch.equal(stats, stats_only)
    assert torch.equal(stats[:, STATS_USED:], torch.zeros_like(stats[:, STATS_USED:]))


@pytest.mark.parametrize("T, C, want", [
    (16384, 4096, (128, 64, 8, 3, 1)),  # 128 blocks of 128 tokens: one per multiprocessor
    (8192, 4096, (128, 64, 8, 3, 2)),   # 64 blocks: the columns in 2 slices
    (1024, 4096, (64, 64, 4, 2, 8)),    # 8 blocks: 8 slices, then shorter blocks
    (8192, 16, (64, 16, 4, 2, 1)),      # one column chunk: no slices, shorter blocks
])
def test_projection_shape_fills_the_multiprocessors(monkeypatch, T, C, want):
    from types import SimpleNamespace
    from cakeops._triton import mhc_prepare
    from cakeops._triton import arch
    monkeypatch.setattr(mhc_prepare, "persistent_programs", lambda device, work, per_sm: min(work, 132 * per_sm))
    X = SimpleNamespace(is_cuda=True, device=None, shape=(T, 4, C), dtype=torch.bfloat16)  # an sm_90 GPU
    cfg = mhc_prepare.PrepareConfig().resolve(X)
    assert (cfg.block_t, cfg.block_c, cfg.num_warps, cfg.num_stages, cfg.slices) == want
    # fp32 X (FP32 fn tiles) takes 2 stages: 3 would not fit (build_check)
    assert mhc_prepare.PrepareConfig().resolve(SimpleNamespace(**dict(vars(X), dtype=torch.float32))).num_stages == 2
    # a GPU whose shared memory the 3 stages' build exceeds falls back to 2 (sm_80, 163 KB: mma.sync's pipeline
    # takes stages - 1 buffers of the 128 x 64 tile's 96 KB; tests/test_arch_builds.py builds the real ones)
    monkeypatch.setattr(arch, "built_shared_memory", lambda target, kernel, args, kw: (kw["num_stages"] - 1) * 98304)
    monkeypatch.setattr(mhc_prepare, "_fit", mhc_prepare._fit.__wrapped__)  # no cached fits of the stand-in
    with arch.assume(arch.TARGETS[80]):
        assert mhc_prepare.PrepareConfig().resolve(X).num_stages == (2 if want[3] == 3 else want[3])


def test_presplit_fn_gives_the_in_kernel_split_bits(triton_kernels, gen):
    """fn split into bf16 hi / lo once per call feeds the same operands to the same dots as the per-tile split."""
    X, fn, scale, base = make_inputs(gen, 40, 100, torch.bfloat16)
    U, stats = run_prepare(X, fn, scale, base, 1e-5, 1e-6, 20, block_c=32, presplit=False)
    U_pre, stats_pre = run_prepare(X, fn, scale, base, 1e-5, 1e-6, 20, block_c=32, presplit=True)
    assert torch.equal(stats, stats_pre) and torch.equal(U, U_pre)


def test_comb_is_doubly_stochastic(triton_kernels, gen):
    X, fn, scale, base = make_inputs(gen, 17, 64, torch.bfloat16)
    _, stats = run_prepare(X, fn, scale, base, 1e-5, 1e-6, 64, with_u=False)
    comb = stats[:, COMB:COMB + N * N].reshape(-1, N, N).double()
    assert (comb >= 0).all()
    assert (comb.sum(1) - 1).abs().max() <= 1e-5  # the last step normalizes columns
    # Rows converge slowly when the logits are this far from uniform (the reference does the same).
    assert (comb.sum(2) - 1).abs().max() <= 2e-2
    uniform = torch.full_like(comb, 1.0 / N)
    assert (comb - uniform).abs().max() >= 0.2, "the test inputs should put comb far from uniform"


def reference_stats(gen, X, rms_eps=0.5, hc_eps=0.05, iters=20):
    _, fn, scale, base = make_inputs(gen, 0, X.shape[2], torch.float32)
    return R.forward_stats(X.double(), fn.double(), scale.double(), base.double(), rms_eps, hc_eps, iters).float()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("T, C, block_c", [(17, 100, None), (17, 100, 32), (1, 1, None), (0, 8, None)])
def test_finish_matches_reference(triton_kernels, gen, dtype, T, C, block_c):
    X = torch.randn(T, N, C, generator=gen).to(dtype).to(DEVICE)
    B = torch.randn(T, C, generator=gen).to(dtype).to(DEVICE)
    stats = reference_stats(gen, X)
    Y = poisoned(T, N, C, dtype=dtype)
    K.finish(X, B, stats, Y, config=K.StreamConfig(block_c=block_c))
    assert not Y.isnan().any()
    assert rel_err(Y, R.forward_finish(X.double(), B.double(), stats.double())) <= out_tol(dtype)


def assert_within_ulps(out, ref, ulps):
    """|out - ref| <= ulps units in the last place of out's dtype, elementwise."""
    ref = ref.double()
    spacing = torch.finfo(out.dtype).eps * torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))))
    assert ((out.double() - ref).abs() <= ulps * spacing).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("T, C, block_c", [(17, 100, None), (5, 100, 32), (1, 1, None), (0, 8, None)])
def test_head_forward(triton_kernels, gen, dtype, T, C, block_c):
    X = torch.randn(T, N, C, generator=gen).to(dtype).to(DEVICE)
    Y = poisoned(T, C, dtype=dtype)
    K.head_forward(X, Y, config=K.StreamConfig(block_c=block_c))
    assert not Y.isnan().any()
    assert rel_err(Y, R.head_forward(X.double())) <= out_tol(dtype)
    if ON_GPU or dtype != torch.bfloat16:
        assert torch.equal(Y, X.mean(dim=1))
    else:
        assert_within_ulps(Y, X.mean(dim=1), 2)


@pytest.mark.parametrize("accumulate", [False, True], ids=["write", "accumulate"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("T, C", [(17, 100), (1, 1), (0, 8)])
@pytest.mark.parametrize("block_c", [None, 32], ids=["one-block", "c-blocks"])
def test_head_backward(triton_kernels, gen, dtype, accumulate, T, C, block_c):
    dY = torch.randn(T, C, generator=gen).to(dtype).to(DEVICE)
    dX0 = torch.randn(T, N, C, generator=gen).to(dtype).to(DEVICE)
    dX = dX0.clone() if accumulate else poisoned(T, N, C, dtype=dtype)
    K.head_backward(dY, dX, accumulate, config=K.StreamConfig(block_c=block_c))
    ref = R.head_backward(dY.double(), N) + (dX0.double() if accumulate else 0.0)
    assert not dX.isnan().any()
    assert rel_err(dX, ref) <= out_tol(dtype)
    if not accumulate:  # dY / 4 is exact: every stream holds it bitwise
        assert torch.equal(dX, (dY / N)[:, None, :].expand_as(dX))


def test_row_strided_inputs_read_in_place(triton_kernels, gen):
    """X a slice of a wider tensor (token and stream strides != n*C, C), B / U / Y likewise: same bits."""
    T, C = 17, 40
    X, fn, scale, base = make_inputs(gen, T, C, torch.bfloat16)
    wide = torch.randn(T, N + 1, C + 24, generator=gen).to(torch.bfloat16).to(DEVICE)
    wide[:, :N, 8:8 + C] = X
    Xs = wide[:, :N, 8:8 + C]
    assert Xs.stride() != X.stride()
    U, stats = run_prepare(X, fn, scale, base, 0.5, 0.05, 20)
    Us_buf = poisoned(T, 2 * C, dtype=X.dtype)
    stats_s = poisoned(T, STATS_WIDTH, dtype=torch.float32)
    K.prepare(Xs, fn, scale, base, 0.5, 0.05, 20, stats_s, Us_buf[:, :C])
    assert torch.equal(stats_s, stats) and torch.equal(Us_buf[:, :C], U)

    B = torch.randn(T, 3 * C, generator=gen).to(X.dtype).to(DEVICE)[:, C:2 * C]
    Y = poisoned(T, N, C, dtype=X.dtype)
    Ys = poisoned(T, N, 2 * C, dtype=X.dtype)[:, :, :C]
    K.finish(X, B.contiguous(), stats, Y)
    K.finish(Xs, B, stats, Ys)
    assert torch.equal(Ys, Y)

    H, Hs = poisoned(T, C, dtype=X.dtype), poisoned(T, 2 * C, dtype=X.dtype)[:, :C]
    K.head_forward(X, H)
    K.head_forward(Xs, Hs)
    assert torch.equal(Hs, H)


@pytest.mark.skipif(not ON_GPU, reason="real sizes need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bfloat16", "float32"])
def test_gpu_real_size(gen, dtype):
    T, C = 512, 4096
    X, fn, scale, base = make_inputs(gen, T, C, dtype)
    U, stats = run_prepare(X, fn, scale, base, 1e-5, 1e-6, 20)
    U_ref, stats_ref = reference_prepare(X, fn, scale, base, 1e-5, 1e-6, 20)
    assert_stats_close(stats, stats_ref, dtype)
    assert rel_err(U, U_ref) <= out_tol(dtype)
    B = torch.randn(T, C, generator=gen).to(dtype).to(DEVICE)
    Y = poisoned(T, N, C, dtype=dtype)
    K.finish(X, B, stats, Y)
    assert rel_err(Y, R.forward_finish(X.double(), B.double(), stats.double())) <= out_tol(dtype)
    H = poisoned(T, C, dtype=dtype)
    K.head_forward(X, H)
    assert torch.equal(H, X.mean(dim=1))  # bitwise, bf16 included
