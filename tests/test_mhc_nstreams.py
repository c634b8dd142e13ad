"""n in {2, 4, 8} residual streams through every mHC layer: the record layout per n, the functions (Triton kernels
under the interpreter or on the GPU, and the reference math) against fp64 math, autograd with random upstream
gradients, the custom ops (opcheck), torch.compile, the modules; any other n raises NotImplementedError naming
the supported set. Eps values large enough to matter and logit scales far from a uniform Sinkhorn."""
import math
from dataclasses import replace

import pytest
import torch

import cakeops
from cakeops import cake_mhc_train as mhc
from cakeops.meta import mhc_layout
from cakeops.reference import mhc as ref
from cakeops.testing import rel_err
from conftest import DEVICE, ON_GPU

STREAMS = (2, 4, 8)
UNSUPPORTED = (1, 3, 5, 16)
HP = dict(rms_eps=0.5, hc_eps=0.05, sinkhorn_iters=7)
HP_ARGS = (0.5, 0.05, 7)


def _inputs(n, T=11, C=40, dtype=torch.float32):
    M = 2 * n + n * n
    X = torch.randn(T, n, C).to(DEVICE, dtype)
    fn = (torch.randn(M, n * C) * 3 / math.sqrt(n * C)).to(DEVICE)
    scale = torch.tensor([1.0, 1.5, 4.0], device=DEVICE)  # res logits spread ~4: comb far from uniform
    base = torch.randn(M).to(DEVICE)
    B, dU = torch.randn(T, C).to(DEVICE, dtype), torch.randn(T, C).to(DEVICE, dtype)
    dY = torch.randn(T, n, C).to(DEVICE, dtype)
    return X, fn, scale, base, B, dY, dU


def _f64(*ts):
    return [t.double() for t in ts]


@pytest.mark.parametrize("n", STREAMS)
def test_layout_per_n(n):
    L = mhc_layout.layout_for(n)
    M = 2 * n + n * n
    # FlashInfer 0.7.4's order r | z[M] | pre[n] | post[n] | C[n*n] | pad
    assert L.N_LOGITS == M and (L.RSTD, L.MIX, L.PRE, L.POST, L.COMB) == (0, 1, M + 1, M + n + 1, M + 2 * n + 1)
    assert L.STATS_USED == 2 * M + 1 <= L.STATS_WIDTH < 2 * L.STATS_USED
    assert (L.DPOST, L.DCOMB, L.GRAD_STATS_USED) == (0, n, n + n * n)
    assert L.GRAD_STATS_USED <= L.GRAD_STATS_WIDTH < 2 * L.GRAD_STATS_USED
    for width in (L.STATS_WIDTH, L.GRAD_STATS_WIDTH):
        assert width & (width - 1) == 0
    assert {2: (32, 8), 4: (64, 32), 8: (256, 128)}[n] == (L.STATS_WIDTH, L.GRAD_STATS_WIDTH)
    if n == 4:  # the module constants are n = 4's record (FlashInfer's [T, 64] in its order)
        L4 = mhc_layout
        assert (L4.STATS_WIDTH, L4.GRAD_STATS_WIDTH, L4.RSTD, L4.MIX, L4.PRE, L4.POST, L4.COMB) == (64, 32, 0, 1, 25, 29, 33)
        assert L == mhc_layout.layout_for(mhc_layout.N_STREAMS)


@pytest.mark.parametrize("n", STREAMS)
def test_kernel_columns_are_the_layout(n):
    """The kernels' constexpr columns (cakeops/_triton/mhc_columns.py restates the layout's formulas, so that
    Inductor's copy of a kernel needs no module global) give meta/mhc_layout.py's record."""
    from cakeops._triton import mhc_columns as cols

    L = mhc_layout.layout_for(n)
    names = ("PRE", "POST", "COMB", "RSTD", "MIX", "STATS_USED", "STATS_WIDTH", "DPOST", "DCOMB", "GRAD_STATS_USED",
             "GRAD_STATS_WIDTH")
    assert {k: getattr(cols, k)(n) for k in names} == {k: getattr(L, k) for k in names}


@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_functions_match_fp64_math(backend, n, dtype):
    """Every function, one after the other as a layer runs them, against the fp64 reference math on the same
    inputs (records from the fp64 math, so each function is checked on its own)."""
    X, fn, scale, base, B, dY, dU = _inputs(n, dtype=dtype)
    bf16 = dtype == torch.bfloat16
    out_tol, rec_tol, grad_tol = (4e-3, 1e-3, 1e-2) if bf16 else (1e-3, 1e-3, 2e-3)
    U, stats = mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, **HP)
    U64, stats64 = ref.forward_prepare(*_f64(X, fn, scale, base), *HP_ARGS)
    assert stats.shape == (X.shape[0], mhc_layout.stats_width(n))
    assert rel_err(U, U64) <= out_tol and rel_err(stats, stats64) <= rec_tol
    assert torch.equal(mhc.cake_mhc_train_forward_stats(X, fn, scale, base, **HP), stats)
    L = mhc_layout.layout_for(n)
    comb = stats64[:, L.COMB:L.COMB + n * n]
    assert (comb - 1.0 / n).abs().max() > 0.1  # the Sinkhorn had work to do
    assert (stats[:, L.STATS_USED:] == 0).all()

    Y = mhc.cake_mhc_train_forward_finish(X, B, stats64.float())
    assert rel_err(Y, ref.forward_finish(*_f64(X, B), stats64)) <= out_tol
    dB, gs = mhc.cake_mhc_train_backward_prepare(dY, B, X, stats64.float())
    dB64, gs64 = ref.backward_prepare(*_f64(dY, B, X), stats64)
    assert gs.shape == (X.shape[0], mhc_layout.grad_stats_width(n)) and (gs[:, L.GRAD_STATS_USED:] == 0).all()
    assert rel_err(dB, dB64) <= grad_tol and rel_err(gs, gs64) <= grad_tol
    got = mhc.cake_mhc_train_backward_finish(X, dY, dU, None, fn, scale, base, stats64.float(), gs64.float(), **HP)
    want = ref.backward_finish(*_f64(X, dY, dU, fn, scale, base), stats64, gs64, *HP_ARGS)
    for name, g, w in zip(("dX", "dfn", "dscale", "dbase"), got, want):
        assert rel_err(g, w) <= grad_tol, (name, rel_err(g, w))
    assert rel_err(mhc.cake_mhc_train_head_forward(X), ref.head_forward(X.double())) <= out_tol
    dX = mhc.cake_mhc_train_head_backward(dU, n_streams=n)
    assert dX.shape == X.shape and rel_err(dX, ref.head_backward(dU.double(), n)) <= out_tol
    # a given dX tells n too; accumulate adds into it
    acc = mhc.cake_mhc_train_head_backward(dU, dX=dX.clone(), accumulate=True)
    assert rel_err(acc, 2 * ref.head_backward(dU.double(), n)) <= out_tol


class _Branch(torch.nn.Module):
    def __init__(self, C):
        super().__init__()
        self.lin = torch.nn.Linear(C, C, dtype=torch.float64)

    def forward(self, u):
        return torch.tanh(self.lin(u.double())).to(u.dtype)


@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("save_stats", [True, False])
def test_autograd_layer_matches_the_differentiable_math(backend, n, save_stats):
    """prepare -> branch -> finish -> head with random upstream gradients, against the reference layer under
    torch.autograd in fp64 (the Sinkhorn differentiated by autograd, not by our backward)."""
    X, fn, scale, base, _, _, _ = _inputs(n, T=6, C=24)
    branch = _Branch(X.shape[-1]).to(DEVICE)
    g_out = torch.randn(X.shape[0], X.shape[-1]).to(DEVICE)
    g_y = torch.randn(X.shape).to(DEVICE)

    def run(X, fn, scale, base, ours):
        if ours:
            U, handle = mhc.cake_mhc_train_prepare(X, fn, scale, base, save_stats=save_stats, **HP)
            Y = mhc.cake_mhc_train_finish(X, branch(U), handle)
            return Y, mhc.cake_mhc_train_head(Y)
        Y = ref.layer(X, fn, scale, base, branch, *HP_ARGS)
        return Y, Y.mean(dim=1)

    grads = []
    for ours, leaves in ((True, [t.clone().requires_grad_() for t in (X, fn, scale, base)]),
                         (False, [t.double().requires_grad_() for t in (X, fn, scale, base)])):
        Y, head = run(*leaves, ours)
        loss = (head * g_out.to(head.dtype)).sum() + (Y * g_y.to(Y.dtype)).sum()
        grads.append(torch.autograd.grad(loss, leaves))
    for name, g, w in zip(("X", "fn", "scale", "base"), *grads):
        assert rel_err(g, w) <= 2e-3, (name, rel_err(g, w))


@pytest.mark.parametrize("n", [2, 8])
def test_opcheck(n):
    """torch.library.opcheck on every mHC op at n = 2 and 8 (n = 4: test_op_checks / compile_tests)."""
    X, fn, scale, base, B, dY, dU = _inputs(n, T=5, C=16, dtype=torch.bfloat16)
    U, stats, e_dy, e_gs = torch.ops.cakeops.mhc_prepare(X, fn, scale, base, *HP_ARGS, True)
    _, gs = torch.ops.cakeops.mhc_backward_prepare(dY, B, X, stats)
    calls = [
        (torch.ops.cakeops.mhc_prepare, (X, fn, scale, base, *HP_ARGS, True)),
        (torch.ops.cakeops.mhc_stats, (X, fn, scale, base, *HP_ARGS)),
        (torch.ops.cakeops.mhc_finish, (X, B, stats, e_dy, e_gs)),
        (torch.ops.cakeops.mhc_head_fwd, (X,)),
        (torch.ops.cakeops.mhc_head_bwd, (dU, n)),
        (torch.ops.cakeops.mhc_backward_prepare, (dY, B, X, stats)),
        (torch.ops.cakeops.mhc_backward_finish, (X, dY, dU, fn, scale, base, stats, gs, *HP_ARGS, True)),
    ]
    for op, args in calls:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("n", [2, 8])
def test_compiled_model_matches_eager(n):
    """A small model of nn modules at n streams: fullgraph torch.compile (aot_eager) gives eager's gradients."""
    torch._dynamo.reset()
    C = 16
    model = torch.nn.Sequential(cakeops.nn.StreamExpand(n),
                                cakeops.nn.MHC(torch.nn.Linear(C, C), C, n, sinkhorn_iters=5, hc_eps=0.05),
                                cakeops.nn.MHC(torch.nn.Linear(C, C), C, n_streams=n, sinkhorn_iters=5),
                                cakeops.nn.MHCHead(n)).to(DEVICE)
    x = torch.randn(2, 7, C, device=DEVICE, requires_grad=True)
    g = torch.randn(2, 7, C, device=DEVICE)  # a random upstream gradient (a sum's would hide the Sinkhorn's)

    def grads(m):
        model.zero_grad()
        x.grad = None
        m(x).backward(g)
        return [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]

    eager = grads(model)
    compiled = grads(torch.compile(model, backend="aot_eager", fullgraph=True))
    for a, b in zip(eager, compiled):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [2, 8])
def test_tiny_lm_trains_at_n_streams(n):
    from cakeops.tiny_lm import TinyLM

    model = TinyLM(vocab=32, dim=16, layers=1, heads=2, max_len=16, sinkhorn_iters=3, n_streams=n).to(DEVICE)
    assert model.blocks[0].n_streams == n and model.blocks[0].fn.shape == (2 * n + n * n, n * 16)
    loss = model.loss(torch.randint(0, 32, (2, 9), device=DEVICE))
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_supported_query():
    for n in STREAMS:
        assert mhc.is_cake_mhc_train_supported("cpu", 64, n_streams=n)
    for n in UNSUPPORTED + (True,):
        assert not mhc.is_cake_mhc_train_supported("cpu", 64, n_streams=n)


SUPPORTED_SET = r"\{2, 4, 8\}"


@pytest.mark.parametrize("n", UNSUPPORTED)
def test_unsupported_n_raises_naming_the_supported_set(n):
    T, C = 3, 8
    M = 2 * n + n * n
    X = torch.randn(T, n, C, device=DEVICE)
    fn, scale, base = torch.zeros(M, n * C, device=DEVICE), torch.ones(3, device=DEVICE), torch.zeros(M, device=DEVICE)
    B = torch.zeros(T, C, device=DEVICE)
    stats, gs = torch.zeros(T, 64, device=DEVICE), torch.zeros(T, 32, device=DEVICE)
    calls = {
        "forward_prepare": lambda: mhc.cake_mhc_train_forward_prepare(X, fn, scale, base),
        "forward_stats": lambda: mhc.cake_mhc_train_forward_stats(X, fn, scale, base),
        "forward_finish": lambda: mhc.cake_mhc_train_forward_finish(X, B, stats),
        "head_forward": lambda: mhc.cake_mhc_train_head_forward(X),
        "head_backward": lambda: mhc.cake_mhc_train_head_backward(B, n_streams=n),
        "backward_prepare": lambda: mhc.cake_mhc_train_backward_prepare(X, B, X, stats),
        "backward_finish": lambda: mhc.cake_mhc_train_backward_finish(X, X, B, None, fn, scale, base, stats, gs),
        "prepare": lambda: mhc.cake_mhc_train_prepare(X, fn, scale, base),
        "head": lambda: mhc.cake_mhc_train_head(X),
        "op mhc_prepare": lambda: torch.ops.cakeops.mhc_prepare(X, fn, scale, base, 1e-5, 1e-6, 3, True),
        "op mhc_finish": lambda: torch.ops.cakeops.mhc_finish(X, B, stats, X, gs),
        "op mhc_head_fwd": lambda: torch.ops.cakeops.mhc_head_fwd(X),
        "op mhc_head_bwd": lambda: torch.ops.cakeops.mhc_head_bwd(B, n),
        "op mhc_backward_finish": lambda: torch.ops.cakeops.mhc_backward_finish(
            X, X, B, fn, scale, base, stats, gs, 1e-5, 1e-6, 3, True),
        "nn.MHC": lambda: cakeops.nn.MHC(torch.nn.Identity(), C, n),
        "nn.MHC keyword": lambda: cakeops.nn.MHC(torch.nn.Identity(), hidden_size=C, n_streams=n),
        "nn.StreamExpand": lambda: cakeops.nn.StreamExpand(n),
        "nn.MHCHead": lambda: cakeops.nn.MHCHead(n),
        "layout": lambda: mhc_layout.layout_for(n),
    }
    for name, call in calls.items():
        with pytest.raises(NotImplementedError, match=SUPPORTED_SET):
            call()
    with pytest.raises(NotImplementedError, match=rf"n_streams: n = {n} residual streams .*{SUPPORTED_SET}"):
        cakeops.nn.MHC(torch.nn.Identity(), C, n)
    with pytest.raises(NotImplementedError, match=rf"^X: n = {n} residual streams .*{SUPPORTED_SET}.*got shape"):
        mhc.cake_mhc_train_forward_prepare(X, fn, scale, base)


def test_finish_config_for_n_keeps_n4_and_given_fields():
    from cakeops._triton.mhc_backward_finish import STREAM_DEFAULTS, FinishConfig

    assert FinishConfig().resolve(4) == FinishConfig()
    eight = FinishConfig().resolve(8)
    assert all(getattr(eight, k) == v for k, v in STREAM_DEFAULTS[8].items())
    assert FinishConfig(block_c=16).resolve(8).block_c == 16  # a field the caller set is kept
    assert FinishConfig().resolve(2).dpre_block_t == STREAM_DEFAULTS[2]["dpre_block_t"]


@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_both_forms_of_kernel_b_agree(n, dtype):
    """dX of backward_finish's kernel B forms (the batched streams-first tile, n = 2 / 4's default, and the GEMM
    per output stream, n = 8's, with fn read as it is or from its transpose) against the fp64 math and each other;
    tiles smaller than T and C, so tails and several token and column blocks are walked, the logits in several MMA
    steps."""
    from cakeops._triton import mhc_backward_finish as F

    X, fn, scale, base, _, dY, dU = _inputs(n, T=70, C=40, dtype=dtype)
    _, stats = ref.forward_prepare(*_f64(X, fn, scale, base), *HP_ARGS)
    gs = torch.randn(X.shape[0], mhc_layout.grad_stats_width(n)).to(DEVICE)
    want = ref.backward_finish(*_f64(X, dY, dU, fn, scale, base), stats, gs.double(), *HP_ARGS)
    dX = {}
    for by_stream, k_major in ((False, False), (True, False), (True, True)):
        tiles = dict(stream_block_t=64, stream_block_c=16, stream_group_t=2) if by_stream else dict(block_c=16)
        config = F.FinishConfig.for_streams(n, dx_by_stream=by_stream, stream_fn_k_major=k_major, **tiles)
        M = 2 * n + n * n
        got = (torch.full_like(X, float("nan")), torch.empty_like(fn), torch.empty(3, device=DEVICE),
               torch.empty(M, device=DEVICE))
        F.backward_finish(X, dY, dU, fn, scale, base, stats.float(), gs, *HP_ARGS, *got, config=config)
        for name, g, w in zip(("dX", "dfn", "dscale", "dbase"), got, want):
            assert rel_err(g, w) <= (1e-2 if dtype == torch.bfloat16 else 2e-3), (by_stream, name, rel_err(g, w))
        if k_major:  # the same products in the same order: bitwise
            assert torch.equal(got[0].float(), dX[True])
        else:
            dX[by_stream] = got[0].float()
    # one rounding of the same terms in another order: a bf16 ulp (2^-8 of the value) at most, apart from
    # values that cancel to near zero
    scale_ = dX[False].abs().amax()
    assert ((dX[True] - dX[False]).abs() <= 2 ** -7 * dX[False].abs() + 1e-5 * scale_).all()


@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_both_forms_of_the_projection_agree(n, dtype):
    """forward_prepare's projection with all n streams in a loop step (n = 2 / 4's default) and one stream per step
    (n = 8's) against the fp64 math and each other: column slices whose last one is partial (C = 40, 16-column
    chunks in 3 slices), two token blocks with a tail."""
    from cakeops._triton import mhc_prepare as P

    X, fn, scale, base, *_ = _inputs(n, T=21, C=40, dtype=dtype)
    want_U, want = ref.forward_prepare(*_f64(X, fn, scale, base), *HP_ARGS)
    got = {}
    for stream_steps in (False, True):
        config = P.PrepareConfig(block_t=16, block_c=16, num_warps=4, slices=3, stream_steps=stream_steps)
        stats = torch.full((X.shape[0], mhc_layout.stats_width(n)), float("nan"), device=DEVICE)
        U = torch.full_like(X[:, 0], float("nan"))
        P.prepare(X, fn, scale, base, *HP_ARGS, stats, U, config=config)
        assert rel_err(stats, want) <= 1e-3 and rel_err(U, want_U) <= (4e-3 if dtype == torch.bfloat16 else 1e-5)
        got[stream_steps] = stats
    # the same products summed in another order: FP32 rounding apart
    assert rel_err(got[True], got[False]) <= 1e-5


@pytest.mark.parametrize("stream_steps", [False, True], ids=["all_streams", "stream_steps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_projection_on_split_logits_agrees_with_one_accumulator(stream_steps, dtype):
    """n = 8's projection with its 80 logits as 64 + 16 accumulators and as one padded to 128, both against the fp64
    math and each other. Slices with a partial last one, two token blocks with a tail."""
    from cakeops._triton import mhc_prepare as P

    assert P.logit_split_widths(8, True) == (64, 16)
    X, fn, scale, base, *_ = _inputs(8, T=21, C=40, dtype=dtype)
    want_U, want = ref.forward_prepare(*_f64(X, fn, scale, base), *HP_ARGS)
    got = {}
    for split in (False, True):
        config = P.PrepareConfig(block_t=16, block_c=16, num_warps=4, slices=3, stream_steps=stream_steps,
                                 logit_split=split)
        stats = torch.full((X.shape[0], mhc_layout.stats_width(8)), float("nan"), device=DEVICE)
        U = torch.full_like(X[:, 0], float("nan"))
        P.prepare(X, fn, scale, base, *HP_ARGS, stats, U, config=config)
        assert rel_err(stats, want) <= 1e-3 and rel_err(U, want_U) <= (4e-3 if dtype == torch.bfloat16 else 1e-5)
        got[split] = stats
    # the same products; an MMA of another width may sum them in another order (the H200's do: FP32 rounding apart)
    assert rel_err(got[True], got[False]) <= 1e-5


@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
def test_kernel_c_on_dz_split_once_is_bitwise_the_per_tile_split(n, deterministic):
    """dfn from dz's bf16 pieces split once per call (n = 8's default) and per tile: the same pieces, the same
    MMAs, so bitwise equal; both against the fp64 math. Several token splits and column blocks, tails."""
    from cakeops._triton import mhc_backward_finish as F

    X, fn, scale, base, _, dY, dU = _inputs(n, T=70, C=40, dtype=torch.bfloat16)
    _, stats = ref.forward_prepare(*_f64(X, fn, scale, base), *HP_ARGS)
    gs = torch.randn(X.shape[0], mhc_layout.grad_stats_width(n)).to(DEVICE)
    want = ref.backward_finish(*_f64(X, dY, dU, fn, scale, base), stats, gs.double(), *HP_ARGS)
    dfn = {}
    for presplit in (False, True):
        config = F.FinishConfig.for_streams(n, dfn_split_bf16=True, dfn_presplit=presplit, dfn_block_t=16,
                                            dfn_block_c=16, dfn_splits=3)
        got = (torch.empty_like(X), torch.full_like(fn, float("nan")), torch.empty(3, device=DEVICE),
               torch.empty(2 * n + n * n, device=DEVICE))
        F.backward_finish(X, dY, dU, fn, scale, base, stats.float(), gs, *HP_ARGS, *got,
                          deterministic=deterministic, config=config)
        assert rel_err(got[1], want[1]) <= 1e-3
        dfn[presplit] = got[1]
    if deterministic:  # atomics add in any order
        assert torch.equal(dfn[True], dfn[False])
    else:
        assert rel_err(dfn[True], dfn[False]) <= 1e-6


@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_both_forms_of_backward_prepare_agree(n, dtype):
    """backward_prepare's dcomb gathered on rolled diagonals (n = 2 / 4's default) and from X row by row with
    the chunk loop pipelined (n = 8's) against the fp64 math and each other: three chunks, the last partial."""
    from cakeops._triton import mhc_backward_prepare as P

    T, C = 9, 40
    X, fn, scale, base, B, dY, _ = _inputs(n, T=T, C=C, dtype=dtype)
    stats = torch.randn(T, mhc_layout.stats_width(n), device=DEVICE)
    want_dB, want_gs = ref.backward_prepare(*_f64(dY, B, X, stats))
    got = {}
    for x_rows, stages in ((False, None), (True, 3)):
        dB = torch.full_like(B, float("nan"))
        gs = torch.full((T, mhc_layout.grad_stats_width(n)), float("nan"), device=DEVICE)
        P.backward_prepare(dY, B, X, stats, dB, gs,
                           config=P.BackwardPrepareConfig(block_c=16, num_warps=1, x_rows=x_rows, stages=stages))
        assert rel_err(dB, want_dB) <= (4e-3 if dtype == torch.bfloat16 else 1e-6) and rel_err(gs, want_gs) <= 1e-6
        got[x_rows] = dB, gs
    # dB: the same expression, one rounding; dcomb: the same products summed in another order
    assert rel_err(got[True][0], got[False][0]) <= (4e-3 if dtype == torch.bfloat16 else 1e-6)
    assert rel_err(got[True][1], got[False][1]) <= 1e-6


@pytest.mark.skipif(not ON_GPU, reason="GPU launch configs of n = 8 (shared memory, registers): GPU only")
def test_n8_runs_at_a_real_size():
    X, fn, scale, base, B, dY, dU = _inputs(8, T=512, C=4096, dtype=torch.bfloat16)
    U, stats = mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, **HP)
    _, gs = mhc.cake_mhc_train_backward_prepare(dY, B, X, stats)
    got = mhc.cake_mhc_train_backward_finish(X, dY, dU, None, fn, scale, base, stats, gs, **HP)
    want = ref.backward_finish(*_f64(X, dY, dU, fn, scale, base, stats, gs), *HP_ARGS)
    U64, stats64 = ref.forward_prepare(*_f64(X, fn, scale, base), *HP_ARGS)
    assert rel_err(U, U64) <= 4e-3 and rel_err(stats, stats64) <= 1e-3
    for g, w in zip(got, want):
        assert rel_err(g, w) <= 1e-2


# ------------------------------------------------------------------------------------------------
# the tuner's candidates at n = 8 (python -m cakeops.bench.tune --n 8); compiled for sm_90 by
# python -m cakeops.bench.build_check --op mhc --candidates prepare,backward_prepare,backward_finish --n 8 (4 min)
# ------------------------------------------------------------------------------------------------

def _wide_candidate_classes():
    from cakeops._triton.mhc_backward_finish import FinishConfig
    from cakeops._triton.mhc_backward_prepare import BackwardPrepareConfig
    from cakeops._triton.mhc_prepare import PrepareConfig

    return PrepareConfig, BackwardPrepareConfig, FinishConfig


@pytest.mark.parametrize("cls", _wide_candidate_classes(), ids=lambda c: c.__name__)
def test_tuner_candidates_at_n8_are_n8_shapes_distinct_and_resolve(monkeypatch, cls):
    """Distinct, at most 12 (the sweep's H200 minutes), none the default, n = 4's list untouched by the n argument;
    each resolves for n = 8 to what it asked for (FinishConfig: a field at n = 4's default value is kept)."""
    wide = list(cls.candidates(8))
    assert 0 < len(wide) <= 12 and len(set(wide)) == len(wide)
    assert list(cls.candidates()) == list(cls.candidates(4)) and wide != list(cls.candidates())
    if cls.__name__ == "FinishConfig":
        default = cls().resolve(8)
        assert all(cfg.resolve(8) is cfg and cfg != default for cfg in wide)
        assert any(cfg.dfn_warps == 4 for cfg in wide)  # n = 4's default value, kept at n = 8
    elif cls.__name__ == "PrepareConfig":
        from cakeops._triton import mhc_prepare  # resolved for an H200 that is not there

        monkeypatch.setattr(mhc_prepare, "persistent_programs", lambda device, work, per_sm: min(work, 132 * per_sm))
        resolved = [cfg.resolve_for(16384, 4096, torch.device("cuda"), True, n=8) for cfg in wide]
        assert all(r.slices >= 1 for r in resolved)
        # all 8 streams per loop step fit 16 columns of n = 8's fn tiles; one stream per step 32 to 128
        assert all(r.block_c == (16 if not r.stream_steps else r.block_c) and r.block_c in (16, 32, 64, 128)
                   for r in resolved)
        assert any(r.stream_steps for r in resolved) and any(not r.stream_steps for r in resolved)
        # the 64 + 16 logit accumulators and one of 128 (the default), with one stream per step; the 16-column
        # all-streams step keeps one accumulator
        assert all(r.stream_steps or not r.logit_split for r in resolved)
        assert any(r.logit_split for r in resolved) and any(r.stream_steps and not r.logit_split for r in resolved)
    else:
        launches = [cfg.resolve(4096, 2, 8) for cfg in wide]
        assert all(la.block_c in (128 * la.num_warps, 256 * la.num_warps) for la in launches)
        assert any(la.x_rows for la in launches) and any(not la.x_rows for la in launches)


def test_n8_projection_splits_logits_for_bf16_and_fills_two_programs_per_sm(monkeypatch):
    """n = 8's layer default on bf16 X: the 80 logits as 64 + 16 accumulators, twice the column slices (2 programs per
    SM, held to 128 registers each); fp16 / fp32 X keep one accumulator of 128 logit columns unless asked (TF32
    tiles: 1 program per SM, no cap); logit_split=False keeps it for bf16; n = 2 / 4 have nothing to split."""
    from cakeops._triton import mhc_prepare as P

    monkeypatch.setattr(P, "persistent_programs", lambda device, work, per_sm: min(work, 132 * per_sm))
    cuda = torch.device("cuda")
    default = P.layer_config(None, 8, True)
    got = {(T, dtype): default.resolve_for(T, 4096, cuda, True, n=8, dtype=dtype)
           for T in (8192, 16384) for dtype in (torch.bfloat16, torch.float16, torch.float32)}
    assert all(r.stream_steps for r in got.values())
    bf16 = [got[(T, torch.bfloat16)] for T in (8192, 16384)]
    assert all(r.logit_split and r.maxnreg == 128 for r in bf16) and [r.slices for r in bf16] == [4, 2]
    for dtype in (torch.float16, torch.float32):
        assert not any(got[(T, dtype)].logit_split or got[(T, dtype)].maxnreg for T in (8192, 16384))
    asked = replace(default, logit_split=True).resolve_for(8192, 4096, cuda, True, n=8, dtype=torch.float32)
    assert asked.logit_split and asked.slices == 2 and asked.maxnreg is None
    one = replace(default, logit_split=False)
    assert [one.resolve_for(T, 4096, cuda, True, n=8).slices for T in (8192, 16384)] == [2, 1]
    assert not one.resolve_for(8192, 4096, cuda, True, n=8).logit_split
    for n in (2, 4):
        assert P.logit_split_widths(n, True) == (0, 16)
        assert not P.PrepareConfig(logit_split=True).resolve_for(8192, 4096, cuda, True, n=n).logit_split
    assert P.logit_split_widths(8, False) == (0, 16)


def test_kernel_a_at_n8_keeps_its_programs_resident():
    """n = 8's kernel A default: as many programs as its registers keep resident (8 / SM at 240 on sm_90), all
    within its scratch budget at iters = 20."""
    from cakeops._triton import mhc_backward_finish as F

    cfg = F.FinishConfig().resolve(8)
    slot = (2 * 20 - 1) * cfg.dlogits_block_t * 64 * 4
    assert cfg.dlogits_per_sm * 132 * slot <= cfg.dlogits_scratch_bytes
    assert F.FinishConfig().resolve(4).dlogits_scratch_bytes == F.SCRATCH_BUDGET_BYTES


@pytest.mark.parametrize("n", STREAMS)
@pytest.mark.parametrize("T", [2048, 4096, 8192, 16384])
def test_layer_projection_gives_every_multiprocessor_a_program(monkeypatch, n, T):
    """The projection's column slices follow the token block that runs: n = 8's layer default (128-token blocks)
    at T = 8192 once got the slices of 64-token blocks, 64 programs for an H200's 132 multiprocessors."""
    from cakeops._triton import mhc_prepare

    monkeypatch.setattr(mhc_prepare, "persistent_programs", lambda device, work, per_sm=2: min(work, 132 * per_sm))
    cfg = mhc_prepare.layer_config(None, n, True).resolve_for(T, 4096, torch.device("cuda"), True, n=n)
    programs = -(-T // cfg.block_t) * cfg.slices
    assert 132 * 0.9 <= programs <= 2 * 132 and cfg.slices <= 8, (cfg.block_t, cfg.slices)
