"""Compiled graphs call each cakeops op's unchecked twin (cakeops/_ops/inductor.py): the op's schema, tags and
fake, its body without the argument checks, no Python autograd or custom-op wrappers. What must hold: every op
has one, the twin is the op to a tracer, Inductor's code calls only twins, and the results are eager's bits."""
import re

import pytest
import torch
import torch._dynamo

import cakeops
from cakeops._ops import inductor
from cakeops.cake_mhc_train import (cake_mhc_train_finish, cake_mhc_train_gated_head, cake_mhc_train_prepare)
from cakeops.cake_rmsnorm_train import cake_rmsnorm
from conftest import DEVICE, ON_GPU

HP = dict(rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=6)


def _schema_tail(op):
    return str(op._schema).split("(", 1)[1]


def test_every_op_has_a_twin_with_its_schema_and_tags():
    twins = inductor.unchecked_twins()
    assert sorted(twins) == sorted(op.name() for op in inductor._OPS)
    for op in inductor._OPS:
        twin = getattr(torch.ops.cakeops, twins[op.name()].split("::")[1]).default
        assert twin.name() == op.name() + "_unchecked"
        assert _schema_tail(twin) == _schema_tail(op)
        assert set(twin.tags) == set(op.tags)


@pytest.mark.parametrize("residual", [False, True])
def test_twin_passes_opcheck(residual):
    """The twin's fake matches its kernel (schema, fake tensors, AOT dispatch) as the op's does."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(6, 40, generator=g).to(DEVICE, torch.bfloat16)
    w = torch.randn(40, generator=g).to(DEVICE, torch.bfloat16)
    tests = ("test_schema", "test_faketensor", "test_aot_dispatch_static")
    if residual:
        torch.library.opcheck(torch.ops.cakeops.add_rmsnorm_fwd_unchecked.default, (x, x.flip(0), w, 1e-6, True),
                              test_utils=tests)
    else:
        torch.library.opcheck(torch.ops.cakeops.rmsnorm_fwd_unchecked.default, (x, w, 1e-6, True), test_utils=tests)


def test_twin_skips_the_checks_its_op_runs():
    """What the twin saves is real work: the op rejects a bad eps, the twin does not look (compiled graphs met
    the check in the fake at trace time)."""
    x = torch.randn(4, 32, device=DEVICE)
    w = torch.ones(32, device=DEVICE)
    with pytest.raises(ValueError, match="eps"):
        torch.ops.cakeops.rmsnorm_fwd(x, w, -1.0, True)
    torch.ops.cakeops.rmsnorm_fwd_unchecked(x, w, 1e-6, True)


def _model(X, fn, scale, base, w, gfn, gscale, gbase):
    """A layer of every op family: prepare -> RMSNorm branch -> finish -> gated head."""
    U, handle = cake_mhc_train_prepare(X, fn, scale, base, **HP)
    B = cake_rmsnorm(U, w, 1e-6)
    Y = cake_mhc_train_finish(X, B, handle)
    return cake_mhc_train_gated_head(Y, gfn, gscale, gbase, rms_eps=1e-6, hc_eps=1e-6)


def _inputs(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    T, C = 24, 64
    X = torch.randn(T, n, C, generator=g).bfloat16()
    fn = torch.randn(n * n + 2 * n, n * C, generator=g) / (n * C) ** 0.5
    scale = torch.tensor([0.5, 0.7, 1.3])
    base = torch.randn(n * n + 2 * n, generator=g)
    w = 1 + 0.1 * torch.randn(C, generator=g)
    gfn = torch.randn(n, n * C, generator=g) / (n * C) ** 0.5
    gscale, gbase = torch.tensor([0.8]), torch.randn(n, generator=g)
    dY = torch.randn(T, C, generator=g).bfloat16()
    leaves = [t.to(DEVICE).requires_grad_() for t in (X, fn, scale, base, w, gfn, gscale, gbase)]
    return leaves, dY.to(DEVICE)


def _step(f, leaves, dY):
    leaves = [t.detach().clone().requires_grad_() for t in leaves]
    out = f(*leaves)
    out.backward(dY)
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_inductor_calls_only_twins_and_matches_eager(n):
    from torch._inductor.utils import run_and_get_code

    leaves, dY = _inputs(torch.seed() % 2**31, n)
    torch._dynamo.reset()
    compiled = torch.compile(_model, fullgraph=True)
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would lower nothing
        got, codes = run_and_get_code(lambda: _step(compiled, leaves, dY))
    called = set(re.findall(r"torch\.ops\.cakeops\.(\w+)\.default\(", "\n".join(codes)))
    twins = {"mhc_prepare_unchecked", "mhc_finish_unchecked", "mhc_gated_head_fwd_unchecked",
             "mhc_gated_head_bwd_unchecked", "mhc_backward_prepare_unchecked", "mhc_backward_finish_unchecked"}
    code = "\n".join(codes)
    if ON_GPU and inductor._TRACE != "none":  # the RMSNorm kernels themselves, launched by Inductor's code
        assert all(k in code for k in ("_rmsnorm_fwd_kernel", "_rmsnorm_bwd_kernel"))
    else:
        twins |= {"rmsnorm_fwd_unchecked", "rmsnorm_bwd_unchecked"}
    if ON_GPU and inductor._TRACE != "none":  # every op's kernels, no op called
        dx_kernel = "_dx_stream_kernel" if n == 8 else "_dx_kernel"  # n = 8's kernel B is the per-stream GEMM
        assert all(k in code for k in ("_project_kernel", "_collapse_kernel", dx_kernel, "_head_dgate_kernel"))
        twins = set()
    assert called == twins, called
    ref = _step(_model, leaves, dY)
    names = ["Y", "X", "fn", "scale", "base", "w", "gated fn", "gated scale", "gated base"]
    for name, a, b in zip(names, got, ref):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: compiled differs from eager"


def test_compiled_graph_still_checks_at_trace_time():
    """No check is lost: a bad argument fails while tracing, in the fake, with the op's message."""
    x = torch.randn(4, 32, device=DEVICE)
    w = torch.ones(16, device=DEVICE)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="cakeops"):
        torch.compile(lambda x, w: cakeops.cake_rmsnorm(x, w, 1e-6), fullgraph=True)(x, w)
