"""The mHC backward Triton kernels (cakeops/_triton/mhc_backward*.py) called through their launchers, vs the
fp64 reference math and vs fp64 autograd through the reference layer. On CPU they run under the Triton
interpreter (small shapes), on a GPU on CUDA tensors.

Interpreter caveats (docs/design.md §5): fp32 -> bf16 casts truncate there, and fp32 tl.dot is exact, so on CPU the
bf16 outputs get design.md §3's tolerance while everything computed in fp32 end to end gets a tight one; on a GPU
the TF32 projections get design.md §3's (1e-2 with bf16/fp16 data, 2e-3 with fp32 data).
"""
import math
import zlib

import pytest
import torch

from cakeops._triton import mhc_backward as K
from cakeops.meta.mhc_layout import (
    DCOMB, DPOST, GRAD_STATS_USED, GRAD_STATS_WIDTH, N_LOGITS, N_STREAMS,
)
from cakeops.reference import mhc as R
from cakeops.testing import rel_err
from conftest import DEVICE, ON_GPU

N = N_STREAMS
F64 = torch.float64
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
EPS = {"large_eps": (0.5, 0.05), "default_eps": (1e-5, 1e-6)}


def dtype_id(d):
    return str(d).replace("torch.", "")


@pytest.fixture
def gen(request):
    """A generator seeded from the test id: every parametrization draws different inputs."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


def data_tol(dtype):
    """dX / dB: design.md §3 for 16-bit data; fp32 data is exact up to fp32 rounding on CPU, TF32 on a GPU."""
    if dtype != torch.float32:
        return 1e-2
    return 2e-3 if ON_GPU else 1e-5


def param_tol(dtype):
    """dfn / dscale / dbase (FP32 whatever the data dtype): the TF32 projection is the only GPU loss."""
    if ON_GPU:
        return 2e-3 if dtype == torch.float32 else 1e-2
    return 1e-5


RECORD_TOL = 1e-5  # grad_stats: FP32 sums of exact products


def randn(gen, *shape, dtype=F64):
    return torch.randn(*shape, generator=gen, dtype=F64).to(dtype).to(DEVICE)


def poisoned(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


class Case:
    """One layer's inputs and upstream gradients, in the data dtype (and FP32 parameters), plus fp64 records.

    X has tokens of different scales (rstd varies); fn ~ N(0, 1/K) puts mix ~ N(0, 1); the residual logits
    (scale ~3, base ~ N(0, 1)) put the Sinkhorn input far from uniform, where its gradient is not ~0.
    """

    def __init__(self, gen, T, C, dtype, iters=20, eps="large_eps"):
        self.T, self.C, self.dtype, self.iters = T, C, dtype, iters
        self.rms_eps, self.hc_eps = EPS[eps]
        Kd = N * C
        self.X = (torch.randn(T, N, C, generator=gen, dtype=F64)
                  * torch.exp(0.5 * torch.randn(T, 1, 1, generator=gen, dtype=F64))).to(dtype).to(DEVICE)
        self.fn = randn(gen, N_LOGITS, Kd, dtype=torch.float32) / math.sqrt(Kd)
        self.scale = (torch.tensor([1.0, 1.0, 3.0], dtype=F64)
                      * (1.0 + 0.1 * torch.randn(3, generator=gen, dtype=F64))).float().to(DEVICE)
        self.base = randn(gen, N_LOGITS, dtype=torch.float32)
        self.dY = randn(gen, T, N, C, dtype=dtype)
        self.B = randn(gen, T, C, dtype=dtype)
        self.dU = randn(gen, T, C, dtype=dtype)
        self.stats64 = R.forward_stats(*self.f64(self.X, self.fn, self.scale, self.base), self.rms_eps, self.hc_eps,
                                       iters)
        self.stats = self.stats64.float()
        self.grad_stats64 = R.backward_prepare(*self.f64(self.dY, self.B, self.X), self.stats64)[1]
        self.grad_stats = self.grad_stats64.float()

    @staticmethod
    def f64(*tensors):
        return [t.double() for t in tensors]

    def finish(self, dX=None, grads=None, X=None, dY=None, dU=None, stats=None, grad_stats=None, **kwargs):
        """Runs the backward_finish launcher into poisoned (or given) buffers; returns (dX, dfn, dscale, dbase)."""
        X = self.X if X is None else X
        dX = poisoned(*X.shape, dtype=self.dtype) if dX is None else dX
        if grads is None:
            grads = (poisoned(N_LOGITS, N * self.C), poisoned(3), poisoned(N_LOGITS))
        K.backward_finish(X, self.dY if dY is None else dY, self.dU if dU is None else dU, self.fn, self.scale,
                          self.base, self.stats if stats is None else stats,
                          self.grad_stats if grad_stats is None else grad_stats, self.rms_eps, self.hc_eps,
                          self.iters, dX, *grads, **kwargs)
        return (dX, *grads)

    def reference_finish(self):
        return R.backward_finish(*self.f64(self.X, self.dY, self.dU, self.fn, self.scale, self.base), self.stats64,
                                 self.grad_stats64, self.rms_eps, self.hc_eps, self.iters)


def assert_finish_close(outs, refs, dtype, rounded_upstream=False):
    """rounded_upstream: the kernels saw B and dU rounded to the data dtype, the oracle exact values, so the
    parameter gradients also carry the data dtype's rounding."""
    for name, out, ref in zip(("dX", "dfn", "dscale", "dbase"), outs, refs):
        assert not out.isnan().any(), f"{name} has unwritten (NaN) entries"
        tol = data_tol(dtype) if name == "dX" or rounded_upstream else param_tol(dtype)
        err = rel_err(out, ref)
        assert err <= tol, f"{name}: rel err {err:.3g} > {tol}"


# ------------------------------------------------------------------------------------------------
# backward_prepare
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("T, C, block_c", [(13, 40, None), (13, 40, 16), (1, 1, None), (0, 8, None)],
                         ids=["T13-C40", "T13-C40-chunked", "T1-C1", "T0"])
def test_backward_prepare_matches_reference(triton_kernels, gen, dtype, T, C, block_c):
    case = Case(gen, T, C, dtype)
    dB, gs = poisoned(T, C, dtype=dtype), poisoned(T, GRAD_STATS_WIDTH)
    K.backward_prepare(case.dY, case.B, case.X, case.stats, dB, gs, config=K.BackwardPrepareConfig(block_c=block_c))
    dB_ref, gs_ref = R.backward_prepare(*case.f64(case.dY, case.B, case.X), case.stats64)
    assert not dB.isnan().any() and not gs.isnan().any(), "unwritten (NaN) entries"
    assert rel_err(dB, dB_ref) <= data_tol(dtype)
    for name, lo, hi in (("dpost", DPOST, DPOST + N), ("dcomb", DCOMB, DCOMB + N * N)):
        err = rel_err(gs[:, lo:hi], gs_ref[:, lo:hi])
        assert err <= RECORD_TOL, f"grad_stats {name}: rel err {err:.3g}"
    assert torch.equal(gs[:, GRAD_STATS_USED:], torch.zeros_like(gs[:, GRAD_STATS_USED:])), "padding not zeroed"


# ------------------------------------------------------------------------------------------------
# backward_finish vs the fp64 reference
# ------------------------------------------------------------------------------------------------

# (T, C, iters, eps, config): every iters / eps / C / T value, tails, several C chunks and token splits.
# small tiles: several C chunks and dfn column tiles at C = 40; with "splits" several token ranges for B and C
SMALL = {"dpre_block_c": 16, "block_c": 16, "block_t": 16, "dfn_block_c": 16, "dfn_block_t": 16}
FINISH_CASES = [
    pytest.param(13, 40, 20, "large_eps", {}, id="T13-C40-it20-large"),
    pytest.param(13, 40, 3, "default_eps", {}, id="T13-C40-it3-default"),
    pytest.param(13, 8, 1, "large_eps", {}, id="T13-C8-it1-large"),
    pytest.param(1, 1, 20, "default_eps", {}, id="T1-C1-it20-default"),
    pytest.param(24, 40, 3, "large_eps", {**SMALL, "splits": 2, "dfn_splits": 2, "dlogits_block_t": 4}, id="T24-C40-it3-split"),
    pytest.param(0, 8, 20, "default_eps", {}, id="T0"),
    # dpre in its own kernel: 3 column slices of 16 at C = 40 (the last one partial), token blocks past T
    pytest.param(13, 40, 20, "large_eps", {"dpre_slices": 3, "dpre_block_c": 16, "dpre_block_t": 8},
                 id="T13-C40-it20-large-dpre3"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("T, C, iters, eps, config", FINISH_CASES)
def test_backward_finish_matches_reference(triton_kernels, gen, dtype, T, C, iters, eps, config):
    case = Case(gen, T, C, dtype, iters, eps)
    outs = case.finish(config=K.FinishConfig(**config))
    assert_finish_close(outs, case.reference_finish(), dtype)


def _tune_variants():
    return list(K.FinishConfig.candidates())


@pytest.mark.parametrize("config", _tune_variants(), ids=lambda cfg: f"B{cfg.block_t}x{cfg.block_c}w{cfg.warps}p{cfg.per_sm}"
                         f"-C{cfg.dfn_block_c}-A{cfg.dlogits_per_sm}")
def test_backward_finish_tune_variants(triton_kernels, gen, config):
    """Every launch shape the tuner times is correct (taller token blocks than T's tail, wider columns than C)."""
    case = Case(gen, 70, 40, torch.bfloat16, 3)
    assert_finish_close(case.finish(config=config), case.reference_finish(), torch.bfloat16)


@pytest.mark.parametrize("T, splits", [(70, None), (24, 2)])
def test_dfn_on_bf16_pieces_of_dz(triton_kernels, gen, T, splits):
    """Kernel C with dz split into bf16 hi + lo (FinishConfig.dfn_split_bf16, bf16 X): dfn within the pieces'
    ~16 mantissa bits of the fp64 oracle (TF32 on a GPU has 10), everything else as the default computes it."""
    case = Case(gen, T, 40, torch.bfloat16, 3)
    config = dict(SMALL, dfn_splits=splits)
    split = case.finish(config=K.FinishConfig(**config, dfn_split_bf16=True))
    default = case.finish(config=K.FinishConfig(**config))
    ref = case.reference_finish()
    assert rel_err(split[1], ref[1]) <= (1e-2 if ON_GPU else 1e-4)
    assert rel_err(split[1], default[1]) <= (1e-2 if ON_GPU else 1e-4)
    for name, k in (("dX", 0), ("dscale", 2), ("dbase", 3)):
        a, b = split[k], default[k]
        assert torch.equal(a, b), f"{name}: the dfn kernel's arithmetic changed another output"


def test_backward_finish_max_iters(triton_kernels, gen):
    """64 Sinkhorn iterations: the largest scratch, far from uniform logits, tiny eps."""
    case = Case(gen, 3, 8, torch.float32, 64, "default_eps")
    assert_finish_close(case.finish(), case.reference_finish(), torch.float32)


# ------------------------------------------------------------------------------------------------
# The two launchers chained vs fp64 autograd through the reference layer
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
@pytest.mark.parametrize("iters, eps", [(20, "large_eps"), (3, "default_eps"), (1, "default_eps")],
                         ids=["it20-large", "it3-default", "it1-default"])
def test_kernels_match_autograd_of_layer(triton_kernels, gen, dtype, iters, eps):
    """Branch B = U * w (per channel): the kernels' dX, dfn, dscale, dbase equal autograd's gradients of
    sum(Y * gY) for a random upstream gY, every path through the layer included."""
    case = Case(gen, 13, 40, dtype, iters, eps)
    w = randn(gen, case.C)
    X64, fn64, scale64, base64 = (t.double().requires_grad_() for t in (case.X, case.fn, case.scale, case.base))
    Y = R.layer(X64, fn64, scale64, base64, lambda U: U * w, case.rms_eps, case.hc_eps, iters)
    Y.backward(case.dY.double())

    U = R.forward_prepare(*case.f64(case.X, case.fn, case.scale, case.base), case.rms_eps, case.hc_eps, iters)[0]
    B = (U * w).to(dtype)
    dB, grad_stats = poisoned(case.T, case.C, dtype=dtype), poisoned(case.T, GRAD_STATS_WIDTH)
    K.backward_prepare(case.dY, B, case.X, case.stats, dB, grad_stats)
    dU = (dB.double() * w).to(dtype)  # the branch's backward
    outs = case.finish(dU=dU, grad_stats=grad_stats)
    assert_finish_close(outs, (X64.grad, fn64.grad, scale64.grad, base64.grad), dtype, rounded_upstream=True)


# ------------------------------------------------------------------------------------------------
# Reductions: determinism, atomics, accumulation
# ------------------------------------------------------------------------------------------------

SPLIT = K.FinishConfig(**SMALL, splits=2, dfn_splits=2, dlogits_block_t=4, dpre_slices=2)


def test_deterministic_is_bitwise_and_atomics_close(triton_kernels, gen):
    config = SPLIT
    case = Case(gen, 24, 40, torch.bfloat16, 20)
    runs = [case.finish(config=config) for _ in range(3)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
    fast = case.finish(config=config, deterministic=False)
    assert torch.equal(fast[0], runs[0][0])  # dX has no cross-token reduction
    for a, b in zip(fast[1:], runs[0][1:]):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
@pytest.mark.parametrize("T", [24, 0], ids=["T24", "T0"])
def test_accumulate_adds_into_parameter_grads(triton_kernels, gen, deterministic, T):
    config = SPLIT
    case = Case(gen, T, 40, torch.float32, 3)
    fresh = case.finish(config=config, deterministic=deterministic)
    given = (randn(gen, N_LOGITS, N * case.C, dtype=torch.float32), randn(gen, 3, dtype=torch.float32),
             randn(gen, N_LOGITS, dtype=torch.float32))
    acc = case.finish(grads=[g.clone() for g in given], config=config, deterministic=deterministic, accumulate=True)
    assert torch.equal(acc[0], fresh[0])
    for out, g, f in zip(acc[1:], given, fresh[1:]):
        if deterministic:  # one fp32 add onto the fixed-order sum: the same bits
            assert torch.equal(out, g + f)
        else:
            assert torch.allclose(out, g + f, rtol=1e-5, atol=1e-6)
    if T == 0:
        for f in fresh[1:]:
            assert torch.equal(f, torch.zeros_like(f))


@pytest.mark.parametrize("P", [1, 7, 600], ids=lambda p: f"P{p}")
@pytest.mark.parametrize("accumulate", [False, True], ids=["fresh", "accumulate"])
@pytest.mark.parametrize("N", [N_STREAMS, 2, 8], ids=lambda n: f"n{n}")
def test_params_reduce_sums_every_partial_row(triton_kernels, gen, P, accumulate, N):
    """dbase / dscale from kernel A's partial rows (more rows than one block of the reduction at P = 600): the
    padding columns, which kernel A leaves unwritten, are poisoned and never read."""
    from cakeops._triton.mhc_backward_finish import reduce_params
    from cakeops._triton.mhc_columns import logits_pad

    M, M_PAD = 2 * N + N * N, logits_pad(N)
    part = randn(gen, P, 2 * M_PAD, dtype=torch.float32)
    part[:, M:M_PAD] = float("nan")
    part[:, M_PAD + M:] = float("nan")
    given_base, given_scale = randn(gen, M, dtype=torch.float32), randn(gen, 3, dtype=torch.float32)
    dbase, dscale = given_base.clone(), given_scale.clone()
    reduce_params(part, dbase, dscale, P, accumulate, N)
    ref_base = part[:, :M].double().sum(0)
    per_logit = part[:, M_PAD:M_PAD + M].double().sum(0)
    ref_scale = torch.stack([per_logit[:N].sum(), per_logit[N:2 * N].sum(), per_logit[2 * N:].sum()])
    if accumulate:
        ref_base, ref_scale = ref_base + given_base.double(), ref_scale + given_scale.double()
    assert rel_err(dbase, ref_base) <= 1e-5 and rel_err(dscale, ref_scale) <= 1e-5  # FP32 sums of <= 9600 terms


@pytest.mark.parametrize("iters", [20, 64])
def test_sinkhorn_scratch_stays_within_its_budget(monkeypatch, iters):
    """On a big GPU kernel A's programs are capped so that its scratch stays below the budget; at the default
    iters the cap is not reached (every program the launch shape asks for)."""
    from cakeops._triton import mhc_backward_finish as F

    monkeypatch.setattr(F, "persistent_programs", lambda device, work, per_sm: min(work, 132 * per_sm))
    cfg = F.FinishConfig()
    plan = F._plan(16384, 4096, iters, torch.device("cpu"), True, cfg)
    assert 4 * plan.sizes[2] <= F.SCRATCH_BUDGET_BYTES
    wanted = min(-(-16384 // cfg.dlogits_block_t), 132 * cfg.dlogits_per_sm)
    assert (plan.dlogits_programs == wanted) == (iters == 20)


def test_given_workspace_is_used_in_place(triton_kernels, gen):
    """A caller's workspace full of NaN garbage: used (and nothing past the announced size), no garbage leaks."""
    case = Case(gen, 13, 40, torch.float32, 3)
    numel = K.backward_finish_workspace_numel(case.T, case.C, case.iters, case.X.device)
    workspace = poisoned(numel + 7)
    outs = case.finish(workspace=workspace)
    assert not workspace[:numel].isnan().all() and workspace[numel:].isnan().all()
    for a, b in zip(outs, case.finish()):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# Strided inputs and outputs
# ------------------------------------------------------------------------------------------------

def _rows_of_wider(gen, t):
    """t's values inside a wider buffer: every row stride differs, unit stride kept along the last dim."""
    if t.dim() == 3:
        wide = randn(gen, t.shape[0], t.shape[1] + 1, t.shape[2] + 24, dtype=t.dtype)
        view = wide[:, :t.shape[1], 8:8 + t.shape[2]]
    else:
        wide = randn(gen, t.shape[0], t.shape[1] + 24, dtype=t.dtype)
        view = wide[:, 8:8 + t.shape[1]]
    view.copy_(t)
    assert view.stride() != t.stride()
    return view


def test_row_strided_inputs_and_outputs(triton_kernels, gen):
    case = Case(gen, 13, 40, torch.bfloat16, 3)
    X, dY, B, dU, stats, grad_stats = (_rows_of_wider(gen, t) for t in (
        case.X, case.dY, case.B, case.dU, case.stats, case.grad_stats))
    dB, gs = poisoned(case.T, case.C, dtype=case.dtype), poisoned(case.T, GRAD_STATS_WIDTH)
    K.backward_prepare(case.dY, case.B, case.X, case.stats, dB, gs)
    dB_s = poisoned(case.T, 2 * case.C, dtype=case.dtype)[:, :case.C]
    gs_s = poisoned(case.T, 2 * GRAD_STATS_WIDTH)[:, GRAD_STATS_WIDTH:]
    K.backward_prepare(dY, B, X, stats, dB_s, gs_s)
    # Bitwise under the interpreter; on a GPU another row stride changes the load vectorization and so the
    # order of the FP32 row sums of grad_stats (the values agree to rounding).
    assert torch.equal(dB_s, dB) and rel_err(gs_s, gs) <= (1e-6 if ON_GPU else 0)

    dX_s = poisoned(case.T, N + 2, 2 * case.C, dtype=case.dtype)[:, 1:N + 1, case.C:]
    strided = case.finish(dX=dX_s, X=X, dY=dY, dU=dU, stats=stats, grad_stats=grad_stats)
    for a, b in zip(strided, case.finish()):
        assert torch.equal(a, b) if not ON_GPU else rel_err(a, b) <= 1e-6


# ------------------------------------------------------------------------------------------------
# GPU, real sizes
# ------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not ON_GPU, reason="real sizes need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_gpu_real_size(gen, dtype):
    case = Case(gen, 256, 4096, dtype, 20, "default_eps")
    dB, gs = poisoned(case.T, case.C, dtype=dtype), poisoned(case.T, GRAD_STATS_WIDTH)
    K.backward_prepare(case.dY, case.B, case.X, case.stats, dB, gs)
    dB_ref, gs_ref = R.backward_prepare(*case.f64(case.dY, case.B, case.X), case.stats64)
    assert rel_err(dB, dB_ref) <= data_tol(dtype) and rel_err(gs, gs_ref) <= RECORD_TOL
    outs = case.finish()
    assert_finish_close(outs, case.reference_finish(), dtype)
    for a, b in zip(outs, case.finish()):
        assert torch.equal(a, b)
    fast = case.finish(deterministic=False)
    for a, b in zip(fast[1:], outs[1:]):
        assert rel_err(a, b) <= 1e-5


@pytest.mark.parametrize("n", [2, 4, 8])
def test_workspace_max_serves_every_smaller_token_count_on_a_132_sm_gpu(monkeypatch, n):
    """backward_finish_workspace_bytes_max(T) holds every call of T' <= T tokens on an H200 (132 SMs, no GPU
    needed: sizes only). The dpre partials are [slices, T', n] with more column slices at small T' (fewer token
    blocks than 2 programs per SM), so their largest size is not at T' = T."""
    from cakeops._triton import mhc_backward_finish as F

    monkeypatch.setattr(F, "persistent_programs", lambda device, work, per_sm=2: max(1, min(work, 132 * per_sm)))
    device, C = torch.device("cuda"), 4096
    for T in (100, 2080, 4096, 9000):
        cap = F.backward_finish_workspace_bytes_max(T, C, device, sinkhorn_iters=20, n=n)
        for t in sorted({1, 15, 16, 17, T // 3, T // 2, T - 1, T} | set(range(16, T + 1, 16))):
            assert 4 * F.backward_finish_workspace_numel(t, C, 20, device, n=n) <= cap, (T, t)
