"""The gated head (DeepSeek-V4's hc_head): forward, backward and autograd against fp64 math with random upstream
gradients; n in 2, 4, 8; bf16 / fp32 data; fp32 and bf16 parameters; eps large enough to matter and logit scales
far from 0; the Triton kernels (CUDA, or the interpreter on CPU) and the reference path; determinism, accumulate,
T = 0, strided inputs, errors, and the nn.MHCHead(gated=True) module.

Tolerances: docs/design.md §3. On CPU the interpreter truncates fp32 -> bf16 (two bf16 ulps for bf16 outputs)
and its fp32 dots are exact (fp32 data: 1e-5); on a GPU the projections go through TF32 / bf16 pieces.
"""
import math
import zlib

import pytest
import torch

import cakeops
from cakeops import _backend
from cakeops._triton import mhc_gated_head as K
from cakeops._triton.mhc_prepare import PrepareConfig
from cakeops.cake_mhc_train import (
    cake_mhc_train_gated_head, cake_mhc_train_gated_head_backward, cake_mhc_train_gated_head_forward,
)
from cakeops.meta.mhc_head_layout import GATE, HEAD_STATS_USED, HEAD_STATS_WIDTH, MIX, RSTD
from cakeops.reference import mhc_gated_head as R
from cakeops.testing import rel_err
from conftest import DEVICE, ON_GPU

F64 = torch.float64
NS = [2, 4, 8]
EPS = {"large_eps": (0.5, 0.05), "default_eps": (1e-5, 1e-6)}


def out_tol(dtype):
    """Y: bf16 two ulps where the interpreter truncates (design.md §3's 4e-3 on a GPU); fp32 data 1e-3 through the
    GPU's TF32 projection, exact up to fp32 rounding on CPU."""
    if dtype == torch.bfloat16:
        return 4e-3 if ON_GPU else 8e-3
    return 1e-3 if ON_GPU else 1e-5


def grad_tol(dtype, name=""):
    """dscale is one sum over T*n terms of both signs: its relative error is the fp32 rounding times that sum's
    cancellation (~1e2 here), so fp32 on CPU gets 1e-4 for it."""
    if dtype == torch.bfloat16:
        return 1e-2
    return 2e-3 if ON_GPU else (1e-4 if name == "dscale" else 1e-5)


STATS_TOL = 1e-3 if ON_GPU else 2e-5  # CPU: bf16 X's projection goes through bf16 hi + lo pieces of fn


@pytest.fixture
def gen(request):
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


class Case:
    """Inputs of one head: tokens of different scales (rstd varies), fn ~ N(0, 1/K) so mix ~ N(0, 1), and a logit
    scale of ~3 with base ~ N(0, 1): the gates spread over (0, 1), sigmoid slopes far from 1/4."""

    def __init__(self, gen, T, n, C, dtype, param_dtype=torch.float32, eps="large_eps", lead=()):
        self.rms_eps, self.hc_eps = EPS[eps]
        shape = (*lead, T, n, C)
        self.X = (torch.randn(*shape, generator=gen, dtype=F64)
                  * torch.exp(0.5 * torch.randn(*shape[:-2], 1, 1, generator=gen, dtype=F64))).to(dtype).to(DEVICE)
        self.fn = (torch.randn(n, n * C, generator=gen, dtype=F64) / math.sqrt(n * C)).to(param_dtype).to(DEVICE)
        self.scale = (3.0 * (1 + 0.1 * torch.randn(1, generator=gen, dtype=F64))).to(param_dtype).to(DEVICE)
        self.base = torch.randn(n, generator=gen, dtype=F64).to(param_dtype).to(DEVICE)
        self.dY = torch.randn(*shape[:-2], C, generator=gen, dtype=F64).to(dtype).to(DEVICE)

    @property
    def params(self):
        return self.fn, self.scale, self.base

    @property
    def hp(self):
        return dict(rms_eps=self.rms_eps, hc_eps=self.hc_eps)

    def f64(self, *tensors):
        return [t.double() for t in tensors]

    def ref_forward(self):
        return R.forward(*self.f64(self.X, *self.params), self.rms_eps, self.hc_eps)

    def ref_backward(self):
        stats = R.forward_stats(*self.f64(self.X, *self.params), self.rms_eps, self.hc_eps)
        return R.backward(*self.f64(self.dY, self.X, *self.params), stats, self.hc_eps)


def assert_close(name, got, want, tol):
    assert not got.isnan().any(), f"{name} has unwritten (NaN) entries"
    err = rel_err(got, want)
    assert err <= tol, f"{name}: rel err {err:.3g} > {tol}"


# ------------------------------------------------------------------------------------------------
# the reference math itself
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", NS)
def test_reference_backward_is_the_gradient_of_the_forward(gen, n):
    """The explicit backward (the CPU path and the kernels' oracle) against fp64 autograd through the forward."""
    case = Case(gen, 7, n, 12, F64, param_dtype=F64)
    leaves = [t.detach().clone().requires_grad_() for t in (case.X, *case.params)]
    Y = R.gated_head(*leaves, case.rms_eps, case.hc_eps)
    want = torch.autograd.grad(Y, leaves, case.dY)
    got = case.ref_backward()
    for name, g, w in zip(("dX", "dfn", "dscale", "dbase"), got, want):
        assert rel_err(g, w) <= 1e-12, name
    assert torch.allclose(Y, case.ref_forward()[0], rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# function API: the kernels (interpreter on CPU) and the reference path vs fp64
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("eps", list(EPS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n", NS)
def test_forward_matches_fp64(backend, gen, n, dtype, eps):
    case = Case(gen, 13, n, 40, dtype, eps=eps)
    Y, stats = cake_mhc_train_gated_head_forward(case.X, *case.params, **case.hp)
    Y_ref, stats_ref = case.ref_forward()
    assert Y.dtype == dtype and Y.shape == (13, 40) and stats.shape == (13, HEAD_STATS_WIDTH)
    assert_close("Y", Y, Y_ref, out_tol(dtype))
    for name, lo, hi in (("gate", GATE, GATE + n), ("mix", MIX, MIX + n), ("rstd", RSTD, RSTD + 1)):
        assert_close(name, stats[:, lo:hi], stats_ref[:, lo:hi], STATS_TOL)
    unused = torch.ones(HEAD_STATS_WIDTH, dtype=torch.bool)
    unused[GATE:GATE + n] = unused[MIX:MIX + n] = unused[RSTD] = False
    assert torch.equal(stats[:, unused], torch.zeros_like(stats[:, unused])), "unused record columns not zeroed"


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n", NS)
def test_backward_matches_fp64(backend, gen, n, dtype, param_dtype):
    case = Case(gen, 13, n, 40, dtype, param_dtype=param_dtype)
    _, stats = cake_mhc_train_gated_head_forward(case.X, *case.params, **case.hp)
    got = cake_mhc_train_gated_head_backward(case.dY, case.X, *case.params, stats, **case.hp)
    assert got[0].dtype == dtype and all(g.dtype == torch.float32 for g in got[1:])
    for name, g, w in zip(("dX", "dfn", "dscale", "dbase"), got, case.ref_backward()):
        assert_close(name, g, w, grad_tol(dtype, name))


@pytest.mark.parametrize("n", NS)
def test_kernels_with_slices_chunks_and_token_splits(triton_kernels, gen, n):
    """Launch shapes that the default CPU config does not reach: several column slices in the projection and the
    dgate pass, several C chunks and token splits in the dX kernel, tails everywhere."""
    case = Case(gen, 37, n, 40, torch.float32)
    X, (fn, scale, base) = case.X, (p.float() for p in case.params)
    cfg = K.GatedHeadConfig(projection=PrepareConfig(block_t=16, block_c=16, num_warps=4, slices=2),
                            gates_block_t=16, dgate_elems=8 * n, dgate_block_c=16, dgate_slices=3,
                            dx_elems=16 * n, dx_splits=2)
    stats = torch.full((37, HEAD_STATS_WIDTH), float("nan"), device=DEVICE)
    Y = torch.full((37, 40), float("nan"), device=DEVICE)
    K.forward(X, fn, scale, base, case.rms_eps, case.hc_eps, stats, Y, config=cfg)
    Y_ref, stats_ref = case.ref_forward()
    assert_close("Y", Y, Y_ref, out_tol(torch.float32))
    assert_close("stats", stats, stats_ref, STATS_TOL)
    for deterministic in (True, False):
        outs = [torch.full(s, float("nan"), device=DEVICE) for s in (X.shape, fn.shape, (1,), (n,))]
        K.backward(case.dY, X, fn, scale, base, stats, *outs, deterministic=deterministic, config=cfg)
        for name, g, w in zip(("dX", "dfn", "dscale", "dbase"), outs, case.ref_backward()):
            assert_close(f"{name} (deterministic={deterministic})", g, w, grad_tol(torch.float32, name))


CANDIDATES = list(K.GatedHeadConfig.candidates())


def _label(cfg):
    import dataclasses
    return ",".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                    if getattr(cfg, f.name) != f.default)


def _backward_with(case, stats, cfg, deterministic=True):
    X, (fn, scale, base) = case.X, (p.float() for p in case.params)
    n = X.shape[1]
    outs = [torch.full(s, float("nan"), device=DEVICE) for s in (fn.shape, (1,), (n,))]
    dX = torch.full(X.shape, float("nan"), device=DEVICE, dtype=X.dtype)
    K.backward(case.dY, X, fn, scale, base, stats, dX, *outs, deterministic=deterministic, config=cfg)
    return [dX, *outs]


@pytest.mark.parametrize("cfg", CANDIDATES, ids=[_label(c) for c in CANDIDATES])
def test_every_tuner_candidate_computes_the_defaults_results(triton_kernels, gen, cfg):
    """What ``python -m cakeops.bench.tune --ops gated_head`` may pick: dX bitwise the default's where the math is
    the same (the FMA or the tensor-core dX form, dg reduced per chunk or not), else and dfn / dscale / dbase within
    FP32 rounding of it (other summation orders), all against fp64."""
    case = Case(gen, 37, 4, 72, torch.float32)
    stats = R.forward_stats(*case.f64(case.X, *case.params), case.rms_eps, case.hc_eps).float()
    want = _backward_with(case, stats, None)
    got = _backward_with(case, stats, cfg)
    default = K.GatedHeadConfig()
    same_form = cfg.dgate_reduce_per_chunk == default.dgate_reduce_per_chunk and (cfg.dfn == "columns") == (
        default.dfn == "columns")  # the same dX form and dg order
    # on the H200 the one-pass kernel's dX at 4 or 8 tokens per step and the dgate pass at other tiles differ from
    # the defaults' in the last bits (other builds, FMAs contracted otherwise): bitwise only for the default's tiles
    same_tiles = not ON_GPU or cfg.dfn != "columns" or (
        cfg.columns_shape(4)[0] == default.columns_shape(4)[0] and cfg.dgate_elems == default.dgate_elems)
    if same_form and same_tiles:
        assert torch.equal(got[0], want[0]), "dX"
    for name, g, w, r in zip(("dX", "dfn", "dscale", "dbase"), got, want, case.ref_backward()):
        assert_close(f"{name} vs the default", g, w, 2e-3 if ON_GPU else 1e-5)
        assert_close(name, g, r, grad_tol(torch.float32, name))


@pytest.mark.parametrize("n", NS)
def test_the_dgate_pass_keeps_its_own_tokens_per_program(n):
    """The dgate pass runs dgate_elems // n tokens per program whatever the dX kernel's tokens per step (the plan
    once handed it the one-pass kernel's 2 tokens at n = 4)."""
    G = K.GatedHeadConfig
    for cfg in (G(), G(dgate_elems=64), G(columns_block_t=8), G(columns_block_t=1), G(dfn="separate", dx_block_t=64)):
        plan = K._plan(16384, n, 4096, torch.device("cpu"), True, cfg)
        assert plan.dgate_block_t == cfg.dgate_elems // n, cfg


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("deterministic", [True, False])
def test_separate_dfn_and_per_chunk_dgate_at_other_stream_counts(triton_kernels, gen, n, deterministic):
    case = Case(gen, 37, n, 40, torch.float32)
    stats = R.forward_stats(*case.f64(case.X, *case.params), case.rms_eps, case.hc_eps).float()
    cfg = K.GatedHeadConfig(dfn="separate", dgate_reduce_per_chunk=True, dgate_block_c=16, dfn_block_t=16,
                            dfn_block_c=16, dfn_splits=2, dx_elems=16 * n, dx_splits=2)
    for name, g, r in zip(("dX", "dfn", "dscale", "dbase"), _backward_with(case, stats, cfg, deterministic),
                          case.ref_backward()):
        assert_close(name, g, r, grad_tol(torch.float32, name))


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("prefetch,loop_stages", [(True, 1), (False, 3), (False, 1)],
                         ids=["prefetch", "pipelined", "plain"])
def test_columns_form_computes_dx_and_dfn_in_one_pass(triton_kernels, gen, n, dtype, deterministic, prefetch,
                                                      loop_stages):
    """dfn="columns" (dX and dfn from one read of X, as FMAs): several column blocks with a tail (C = 40 at 16
    columns), three token splits with a tail (37 tokens in steps of 4: the prefetch form's loads past a split's end
    and past T masked; the pipelined loop's on a GPU), against fp64, deterministic and atomic."""
    case = Case(gen, 37, n, 40, dtype)
    stats = R.forward_stats(*case.f64(case.X, *case.params), case.rms_eps, case.hc_eps).float()
    cfg = K.GatedHeadConfig(dfn="columns", columns_elems=16 * n, columns_block_t=4, columns_splits=3,
                            columns_prefetch=prefetch, columns_loop_stages=loop_stages)
    for name, g, r in zip(("dX", "dfn", "dscale", "dbase"), _backward_with(case, stats, cfg, deterministic),
                          case.ref_backward()):
        assert_close(name, g, r, grad_tol(dtype, name))


def test_projection_shape_per_n_and_dtype(monkeypatch):
    """On a GPU, n = 8's bf16 projection runs one stream per loop step on 128 x 128 tiles of 8 warps, never with the
    layer's logit split (n logits); fp32 X, n = 4 and fields the caller gives keep their forms; the interpreter keeps
    its small tiles."""
    from types import SimpleNamespace

    from cakeops._triton import mhc_prepare as P

    monkeypatch.setattr(P, "persistent_programs", lambda device, work, per_sm: min(work, 132 * per_sm))

    def resolved(n, dtype, cuda=True, config=K.GatedHeadConfig()):
        X = SimpleNamespace(shape=(8192, n, 4096), dtype=dtype, is_cuda=cuda,
                            device=torch.device("cuda" if cuda else "cpu"))
        return K._projection(config, X)

    wide = resolved(8, torch.bfloat16)
    assert (wide.stream_steps, wide.block_t, wide.block_c, wide.num_warps, wide.num_stages) == (True, 128, 128, 8, 3)
    assert not wide.logit_split and wide.maxnreg is None
    for n, other in ((8, resolved(8, torch.float32)), (4, resolved(4, torch.bfloat16)),
                     (8, resolved(8, torch.bfloat16, cuda=False)),
                     (8, resolved(8, torch.bfloat16,
                                  config=K.GatedHeadConfig(projection=PrepareConfig(stream_steps=False))))):
        assert not other.stream_steps and other.block_c == 256 // n and not other.logit_split
    given = resolved(8, torch.bfloat16, config=K.GatedHeadConfig(projection=PrepareConfig(block_c=64, num_stages=4)))
    assert (given.stream_steps, given.block_t, given.block_c, given.num_stages) == (True, 128, 64, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_projection_one_stream_per_step_matches_fp64(triton_kernels, gen, dtype):
    """The forward's projection one stream per loop step (n = 8's default for bf16 X on a GPU) and all n streams
    per step (every other default): both against fp64 and FP32 rounding apart from each other; column slices with a
    partial last one, token blocks with a tail."""
    case = Case(gen, 37, 8, 40, dtype)
    X, (fn, scale, base) = case.X, (p.float() for p in case.params)
    Y_ref, stats_ref = case.ref_forward()
    got = {}
    for stream_steps in (False, True):
        cfg = K.GatedHeadConfig(projection=PrepareConfig(block_t=16, block_c=16, num_warps=4, slices=2,
                                                         stream_steps=stream_steps))
        stats = torch.full((37, HEAD_STATS_WIDTH), float("nan"), device=DEVICE)
        Y = torch.full((37, 40), float("nan"), device=DEVICE, dtype=dtype)
        K.forward(X, fn, scale, base, case.rms_eps, case.hc_eps, stats, Y, config=cfg)
        assert_close("Y", Y, Y_ref, out_tol(dtype))
        assert_close("stats", stats, stats_ref, STATS_TOL)
        got[stream_steps] = stats
    assert_close("stats, one stream per step vs all", got[True], got[False], 1e-5)


def test_kernels_fit_shared_memory_on_sm90_and_sm80():
    """Every n's projection (the kernel whose pipeline grows with n) and the backward's big kernels, compiled for
    sm_90 and sm_80 by triton's own compiler at the launch shapes the launchers pick for a 132-SM GPU (no GPU
    used: python -m cakeops.bench.build_check). A subprocess: the interpreter's triton.jit compiles nothing."""
    import os
    import subprocess
    import sys

    import triton

    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("triton without its NVIDIA backend's ptxas")
    code = ("import sys; from cakeops.bench.build_check import check; "
            "heavy = {'_head_project_kernel', '_head_dx_kernel', '_head_dgate_kernel'}; "
            "shapes = [(4096, n, 1024) for n in (2, 4, 8)]; "
            "ok = check(shapes, sm=90, kernels=heavy) & check(shapes, sm=80, kernels={'_head_project_kernel'}); "
            "sys.exit(0 if ok else 1)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]


def test_strided_inputs_are_read_in_place_and_give_the_same_bits(backend, gen):
    """Row-strided X and dY (unit stride along C) give the bits of their contiguous copies."""
    case = Case(gen, 9, 4, 24, torch.bfloat16)
    wide = torch.randn(9, 4, 40, device=DEVICE).to(torch.bfloat16)
    wide[:, :, :24] = case.X
    X = wide[:, :, :24]
    dY = torch.randn(9, 48, device=DEVICE).to(torch.bfloat16)[:, ::2]  # last stride 2: copied once
    assert X.stride(-1) == 1 and not X.is_contiguous()
    Y, stats = cake_mhc_train_gated_head_forward(X, *case.params, **case.hp)
    Y_c, stats_c = cake_mhc_train_gated_head_forward(X.contiguous(), *case.params, **case.hp)
    assert torch.equal(Y, Y_c) and torch.equal(stats, stats_c)
    got = cake_mhc_train_gated_head_backward(dY, X, *case.params, stats, **case.hp)
    want = cake_mhc_train_gated_head_backward(dY.contiguous(), X.contiguous(), *case.params, stats, **case.hp)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


# ------------------------------------------------------------------------------------------------
# determinism, accumulate, T == 0
# ------------------------------------------------------------------------------------------------

def test_deterministic_backward_is_bitwise_reproducible(backend, gen):
    T = 2048 if ON_GPU else 40
    case = Case(gen, T, 4, 64, torch.bfloat16)
    _, stats = cake_mhc_train_gated_head_forward(case.X, *case.params, **case.hp)
    first = cake_mhc_train_gated_head_backward(case.dY, case.X, *case.params, stats, **case.hp)
    for _ in range(2):
        again = cake_mhc_train_gated_head_backward(case.dY, case.X, *case.params, stats, **case.hp)
        for g, w in zip(again, first):
            assert torch.equal(g, w)
    loose = cake_mhc_train_gated_head_backward(case.dY, case.X, *case.params, stats, deterministic=False, **case.hp)
    for name, g, w in zip(("dX", "dfn", "dscale", "dbase"), loose, first):
        assert rel_err(g, w) <= 1e-5, name


def test_non_deterministic_backward_honours_use_deterministic_algorithms(gen):
    case = Case(gen, 5, 4, 8, torch.float32)
    _, stats = cake_mhc_train_gated_head_forward(case.X, *case.params, **case.hp)
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError, match="deterministic=True"):
            cake_mhc_train_gated_head_backward(case.dY, case.X, *case.params, stats, deterministic=False, **case.hp)
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("deterministic", [True, False])
def test_accumulate_adds_into_the_given_parameter_gradients(backend, gen, deterministic):
    case = Case(gen, 11, 2, 24, torch.float32)
    _, stats = cake_mhc_train_gated_head_forward(case.X, *case.params, **case.hp)
    fresh = cake_mhc_train_gated_head_backward(case.dY, case.X, *case.params, stats, deterministic=deterministic,
                                               **case.hp)
    before = [torch.randn(g.shape, device=DEVICE) for g in fresh[1:]]
    bufs = [b.clone() for b in before]
    dX = torch.full_like(case.X, float("nan"))
    out = cake_mhc_train_gated_head_backward(case.dY, case.X, *case.params, stats, deterministic=deterministic,
                                             accumulate=True, dX=dX, dfn=bufs[0], dscale=bufs[1], dbase=bufs[2],
                                             **case.hp)
    assert out[0] is dX and all(o is b for o, b in zip(out[1:], bufs))
    assert torch.equal(dX, fresh[0])  # dX is overwritten, never accumulated
    for name, b, f, g in zip(("dfn", "dscale", "dbase"), before, fresh[1:], bufs):
        assert torch.allclose(g, b + f, rtol=1e-6, atol=1e-6), name


def test_zero_tokens(backend):
    X = torch.empty(0, 4, 8, device=DEVICE)
    fn, scale, base = torch.randn(4, 32, device=DEVICE), torch.ones(1, device=DEVICE), torch.zeros(4, device=DEVICE)
    Y, stats = cake_mhc_train_gated_head_forward(X, fn, scale, base)
    assert Y.shape == (0, 8) and stats.shape == (0, HEAD_STATS_WIDTH)
    dX, dfn, dscale, dbase = cake_mhc_train_gated_head_backward(torch.empty(0, 8, device=DEVICE), X, fn, scale, base,
                                                                stats)
    assert dX.shape == (0, 4, 8) and not dfn.any() and not dscale.any() and not dbase.any()
    bufs = [torch.ones(4, 32, device=DEVICE), torch.ones(1, device=DEVICE), torch.ones(4, device=DEVICE)]
    cake_mhc_train_gated_head_backward(torch.empty(0, 8, device=DEVICE), X, fn, scale, base, stats, accumulate=True,
                                       dfn=bufs[0], dscale=bufs[1], dbase=bufs[2])
    assert all(bool((b == 1).all()) for b in bufs)
    Xg = torch.empty(2, 0, 4, 8, device=DEVICE, requires_grad=True)
    leaves = [fn.requires_grad_(), scale.requires_grad_(), base.requires_grad_()]
    Yg = cake_mhc_train_gated_head(Xg, *leaves)
    assert Yg.shape == (2, 0, 8)
    grads = torch.autograd.grad(Yg, [Xg, *leaves], torch.empty_like(Yg))
    assert grads[0].shape == Xg.shape and not any(g.any() for g in grads[1:])


# ------------------------------------------------------------------------------------------------
# autograd
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("eps", list(EPS))
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("n", NS)
def test_autograd_matches_fp64_autograd(backend, gen, n, dtype, param_dtype, eps):
    """Leading dims [2, T, n, C]; parameter gradients come back in the parameters' dtype."""
    case = Case(gen, 5, n, 24, dtype, param_dtype=param_dtype, eps=eps, lead=(2,))
    leaves = [t.detach().clone().requires_grad_() for t in (case.X, *case.params)]
    Y = cake_mhc_train_gated_head(*leaves, **case.hp)
    assert Y.shape == (2, 5, 24) and Y.dtype == dtype
    got = torch.autograd.grad(Y, leaves, case.dY)
    ref_leaves = [t.detach().double().requires_grad_() for t in (case.X, *case.params)]
    Y_ref = R.gated_head(ref_leaves[0].reshape(10, n, 24), *ref_leaves[1:], case.rms_eps, case.hc_eps)
    want = torch.autograd.grad(Y_ref, ref_leaves, case.dY.double().reshape(10, 24))
    assert_close("Y", Y.reshape(10, 24), Y_ref, out_tol(dtype))
    for name, leaf, g, w in zip(("dX", "dfn", "dscale", "dbase"), leaves, got, want):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape, name
        # bf16 parameters: their gradients are rounded to bf16 once more (<= 2^-9 relative)
        tol = grad_tol(dtype, name) + (4e-3 if param_dtype == torch.bfloat16 and name != "dX" else 0.0)
        assert_close(name, g, w, tol)


def test_eager_function_and_custom_op_give_the_same_bits(backend, gen):
    """The eager autograd.Function and the op's registered autograd share one backward formula and the kernels."""
    case = Case(gen, 6, 4, 16, torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_() for t in (case.X, *case.params)]
    Y = cake_mhc_train_gated_head(*leaves, **case.hp)
    eager = torch.autograd.grad(Y, leaves, case.dY)
    Y_op = torch.ops.cakeops.mhc_gated_head_fwd(*leaves, case.rms_eps, case.hc_eps, True)[0]
    assert torch.equal(Y, Y_op)
    for g, w in zip(torch.autograd.grad(Y_op, leaves, case.dY), eager):
        assert torch.equal(g, w)


def test_only_some_inputs_need_grad(backend, gen):
    case = Case(gen, 6, 4, 16, torch.float32)
    X = case.X.detach().requires_grad_()
    Y = cake_mhc_train_gated_head(X, *case.params, **case.hp)
    (dX,) = torch.autograd.grad(Y, [X], case.dY)
    assert_close("dX", dX, case.ref_backward()[0], grad_tol(torch.float32))


# ------------------------------------------------------------------------------------------------
# errors
# ------------------------------------------------------------------------------------------------

def _good(n=4, C=8):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(5, n, C, generator=g).to(DEVICE, torch.bfloat16), (torch.randn(n, n * C, generator=g) * 0.1)
            .to(DEVICE), torch.ones(1, device=DEVICE), torch.zeros(n, device=DEVICE))


def _fwd(X=None, fn=None, scale=None, base=None, **kw):
    gX, gfn, gs, gb = _good()
    return cake_mhc_train_gated_head_forward(gX if X is None else X, gfn if fn is None else fn,
                                             gs if scale is None else scale, gb if base is None else base, **kw)


def _bwd(dY=None, stats=None, **kw):
    X, fn, scale, base = _good()
    good_stats = torch.zeros(5, HEAD_STATS_WIDTH, device=DEVICE)
    return cake_mhc_train_gated_head_backward(torch.randn(5, 8, device=DEVICE).to(X.dtype) if dY is None else dY,
                                              X, fn, scale, base, good_stats if stats is None else stats, **kw)


BAD = [
    ("X", TypeError, lambda: _fwd(X=[[1.0]])),
    ("X", ValueError, lambda: _fwd(X=torch.zeros(5, 32, device=DEVICE))),
    ("X", NotImplementedError, lambda: _fwd(X=torch.zeros(5, 3, 8, device=DEVICE))),
    ("X", ValueError, lambda: _fwd(X=torch.zeros(5, 4, 8, device=DEVICE, dtype=torch.float64))),
    ("fn", ValueError, lambda: _fwd(fn=torch.zeros(24, 32, device=DEVICE))),  # an mHC layer's fn
    ("fn", ValueError, lambda: _fwd(fn=torch.zeros(4, 32, device="meta"))),
    ("scale", ValueError, lambda: _fwd(scale=torch.ones(3, device=DEVICE))),
    ("base", ValueError, lambda: _fwd(base=torch.zeros(2, device=DEVICE))),
    ("rms_eps", ValueError, lambda: _fwd(rms_eps=0.0)),
    ("hc_eps", ValueError, lambda: _fwd(hc_eps=float("inf"))),
    ("hc_eps", TypeError, lambda: _fwd(hc_eps="1e-6")),
    ("out", ValueError, lambda: _fwd(out=torch.empty(5, 9, device=DEVICE, dtype=torch.bfloat16))),
    ("stats_out", ValueError, lambda: _fwd(stats_out=torch.empty(5, 64, device=DEVICE))),
    ("dY", ValueError, lambda: _bwd(dY=torch.zeros(4, 8, device=DEVICE, dtype=torch.bfloat16))),
    ("dY", ValueError, lambda: _bwd(dY=torch.zeros(5, 8, device=DEVICE))),  # fp32 dY for bf16 X
    ("stats", ValueError, lambda: _bwd(stats=torch.zeros(5, 64, device=DEVICE))),  # an mHC layer's record
    ("deterministic", TypeError, lambda: _bwd(deterministic=1)),
    ("dfn", ValueError, lambda: _bwd(accumulate=True)),
    ("dscale", ValueError, lambda: _bwd(dscale=torch.zeros(3, device=DEVICE))),
]


@pytest.mark.parametrize("name,exc,call", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_arguments_name_the_argument(name, exc, call):
    with pytest.raises(exc, match=rf"^{name}:"):
        call()


def test_unsupported_streams_say_which_are_supported():
    with pytest.raises(NotImplementedError, match=r"\(2, 4, 8\)"):
        _fwd(X=torch.zeros(5, 3, 8, device=DEVICE))


def test_nan_inputs_propagate(backend):
    X, fn, scale, base = _good()
    X = X.clone()
    X[2, 1, 3] = float("nan")
    Y, stats = cake_mhc_train_gated_head_forward(X, fn, scale, base)
    assert Y[2].isnan().all() and not Y[[0, 1, 3, 4]].isnan().any()


# ------------------------------------------------------------------------------------------------
# nn.MHCHead(gated=True)
# ------------------------------------------------------------------------------------------------

def test_module_starts_near_the_mean_and_trains(backend):
    torch.manual_seed(0)
    head = cakeops.nn.MHCHead(gated=True, hidden_size=16, n_streams=4, rms_eps=1e-6, hc_eps=1e-6).to(DEVICE)
    assert {name for name, _ in head.named_parameters()} == {"fn", "scale", "base"}
    X = torch.randn(3, 7, 4, 16, device=DEVICE, requires_grad=True)
    Y = head(X)
    assert Y.shape == (3, 7, 16)
    assert rel_err(Y, X.mean(-2)) < 0.05  # gates 1/n + hc_eps, moved by scale 0.01 * mix
    Y.backward(torch.randn_like(Y))
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())


def test_module_state_dict_round_trips():
    a = cakeops.nn.MHCHead(gated=True, hidden_size=8, n_streams=2)
    b = cakeops.nn.MHCHead(gated=True, hidden_size=8, n_streams=2)
    with torch.no_grad():
        for p in b.parameters():
            p.add_(1.0)
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert set(a.state_dict()) == {"fn", "scale", "base"}
    assert a.fn.shape == (2, 16) and a.scale.shape == (1,) and a.base.shape == (2,)


def test_plain_head_is_unchanged():
    head = cakeops.nn.MHCHead()
    assert list(head.parameters()) == [] and head.state_dict() == {}
    X = torch.randn(5, 4, 8, device=DEVICE)
    assert torch.equal(head(X), cakeops.cake_mhc_train.cake_mhc_train_head(X))


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(gated=True), ValueError, "hidden_size"),
    (dict(gated=True, hidden_size=0), ValueError, "hidden_size"),
    (dict(gated=True, hidden_size=8, n_streams=3), NotImplementedError, "n_streams"),
    (dict(gated=True, hidden_size=8, rms_eps=-1.0), ValueError, "rms_eps"),
    (dict(gated=True, hidden_size=8, hc_eps=None), TypeError, "hc_eps"),
    (dict(gated="yes"), TypeError, "gated"),
    (dict(hidden_size=8), ValueError, "hidden_size"),
])
def test_module_validates_its_arguments_at_construction(kwargs, exc, name):
    with pytest.raises(exc, match=rf"^{name}:"):
        cakeops.nn.MHCHead(**kwargs)


def test_module_rejects_streams_of_another_shape():
    head = cakeops.nn.MHCHead(gated=True, hidden_size=8)
    with pytest.raises(ValueError, match=r"\[\.\.\., 4, 8\]"):
        head(torch.randn(3, 4, 16))


# ------------------------------------------------------------------------------------------------
# GPU only: real sizes (the lead's run)
# ------------------------------------------------------------------------------------------------

@pytest.mark.skipif(not ON_GPU, reason="CUDA only: real sizes through the compiled kernels")
@pytest.mark.parametrize("n", NS)
def test_real_size_on_gpu(gen, n):
    case = Case(gen, 4096, n, 4096 // n * 2, torch.bfloat16)
    Y, stats = cake_mhc_train_gated_head_forward(case.X, *case.params, **case.hp)
    Y_ref, stats_ref = case.ref_forward()
    assert_close("Y", Y, Y_ref, 4e-3)
    assert_close("stats", stats, stats_ref, 1e-3)
    got = cake_mhc_train_gated_head_backward(case.dY, case.X, *case.params, stats, **case.hp)
    for name, g, w in zip(("dX", "dfn", "dscale", "dbase"), got, case.ref_backward()):
        assert_close(name, g, w, 1e-2)
    again = cake_mhc_train_gated_head_backward(case.dY, case.X, *case.params, stats, **case.hp)
    assert all(torch.equal(g, w) for g, w in zip(got, again))


@pytest.mark.skipif(ON_GPU, reason="CPU: the reference path and the interpreter agree")
def test_reference_and_interpreter_agree(gen):
    case = Case(gen, 9, 8, 16, torch.float32)
    outs = {}
    for kind in ("triton", "reference"):
        with _backend.cpu_kernels(kind):
            Y, stats = cake_mhc_train_gated_head_forward(case.X, *case.params, **case.hp)
            outs[kind] = (Y, stats, *cake_mhc_train_gated_head_backward(case.dY, case.X, *case.params, stats,
                                                                         **case.hp))
    for a, b in zip(outs["triton"], outs["reference"]):
        assert rel_err(a, b) <= 1e-5
    assert HEAD_STATS_USED <= HEAD_STATS_WIDTH


# ------------------------------------------------------------------------------------------------
# DTensor sequence parallelism (2 CPU processes over gloo; NCCL on 2 GPUs with CAKEOPS_DIST_BACKEND=nccl)
# ------------------------------------------------------------------------------------------------

def _dtensor_worker(rank, init_file, backend):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    device_type = "cuda" if backend == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh(device_type, (2,))
        torch.manual_seed(0)
        head = cakeops.nn.MHCHead(gated=True, hidden_size=8, n_streams=4, rms_eps=0.5, hc_eps=0.05).to(device_type)
        with torch.no_grad():
            head.scale.fill_(3.0)
        sharded = distribute_module(head, mesh)  # parameters replicated
        g = torch.Generator().manual_seed(2)
        X = torch.randn(10, 4, 8, generator=g).to(device_type)
        gy = torch.randn(10, 8, generator=g).to(device_type)
        leaves = [X.clone().requires_grad_(), *(p.detach().full_tensor().requires_grad_() for p in head.parameters())]
        Y_ref = cake_mhc_train_gated_head(*leaves, rms_eps=0.5, hc_eps=0.05)
        want = torch.autograd.grad(Y_ref, leaves, gy)
        X_d = distribute_tensor(X, mesh, [Shard(0)]).requires_grad_()
        Y_d = sharded(X_d)
        assert Y_d.placements == (Shard(0),), Y_d.placements
        Y_d.backward(distribute_tensor(gy, mesh, [Shard(0)]))
        torch.testing.assert_close(Y_d.full_tensor(), Y_ref)
        got = [X_d.grad.full_tensor()] + [p.grad.full_tensor() for p in sharded.parameters()]
        for g_, w in zip(got, want):
            torch.testing.assert_close(g_, w, rtol=1e-5, atol=1e-6)
        with pytest.raises(ValueError, match=r"redistribute"):
            sharded(distribute_tensor(X, mesh, [Shard(2)]))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_sequence_parallel_dtensor_matches_one_device():
    import os

    import torch.distributed as dist

    from cakeops.testing import spawn_ranks

    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    backend = os.environ.get("CAKEOPS_DIST_BACKEND", "gloo")
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs 2 GPUs")
    spawn_ranks(_dtensor_worker, 2, backend)
