"""mHC argument checking: every bad input raises ValueError/TypeError (NotImplementedError for unsupported
ranges) naming the argument; T == 0 and NaN inputs go through without crashing."""
import pytest
import torch

from cakeops.cake_mhc_train import (
    cake_mhc_train_backward_finish, cake_mhc_train_backward_prepare, cake_mhc_train_forward_finish,
    cake_mhc_train_forward_prepare, cake_mhc_train_forward_stats, cake_mhc_train_head_backward,
    cake_mhc_train_head_forward, cake_mhc_train_prepare,
)
from conftest import DEVICE

T, N, C, M = 5, 4, 8, 24


def _good():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(T, N, C, generator=g).to(DEVICE, torch.bfloat16)
    fn = (torch.randn(M, N * C, generator=g) * 0.1).to(DEVICE)
    scale = torch.ones(3, device=DEVICE)
    base = torch.zeros(M, device=DEVICE)
    return X, fn, scale, base


def _prepare(X=None, fn=None, scale=None, base=None, **kw):
    gX, gfn, gscale, gbase = _good()
    return cake_mhc_train_forward_prepare(gX if X is None else X, gfn if fn is None else fn,
                                          gscale if scale is None else scale, gbase if base is None else base, **kw)


BAD_PREPARE = [
    ("X", TypeError, lambda X, fn, s, b: _prepare(X=X.tolist())),
    ("X", ValueError, lambda X, fn, s, b: _prepare(X=X.to(torch.int32))),
    ("X", ValueError, lambda X, fn, s, b: _prepare(X=X.reshape(T, N * C))),
    ("X", NotImplementedError, lambda X, fn, s, b: _prepare(X=X[:, :3])),  # n = 3 streams
    ("fn", ValueError, lambda X, fn, s, b: _prepare(fn=fn[:, :-1])),
    ("fn", ValueError, lambda X, fn, s, b: _prepare(fn=fn.to(torch.float64))),
    ("fn", ValueError, lambda X, fn, s, b: _prepare(fn=fn.to("meta"))),
    ("scale", ValueError, lambda X, fn, s, b: _prepare(scale=s[:2])),
    ("base", ValueError, lambda X, fn, s, b: _prepare(base=b.double())),
    ("rms_eps", ValueError, lambda X, fn, s, b: _prepare(rms_eps=0.0)),
    ("hc_eps", ValueError, lambda X, fn, s, b: _prepare(hc_eps=float("inf"))),
    ("hc_eps", TypeError, lambda X, fn, s, b: _prepare(hc_eps=None)),
    ("sinkhorn_iters", ValueError, lambda X, fn, s, b: _prepare(sinkhorn_iters=0)),
    ("sinkhorn_iters", TypeError, lambda X, fn, s, b: _prepare(sinkhorn_iters=2.0)),
    ("sinkhorn_iters", NotImplementedError, lambda X, fn, s, b: _prepare(sinkhorn_iters=65)),
    ("out", ValueError, lambda X, fn, s, b: _prepare(out=torch.empty(T, C + 1, device=DEVICE, dtype=X.dtype))),
    ("stats_out", ValueError, lambda X, fn, s, b: _prepare(stats_out=torch.empty(T, 64, device=DEVICE,
                                                                                dtype=torch.float64))),
]


@pytest.mark.parametrize("name,exc,call", BAD_PREPARE, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_PREPARE)])
def test_bad_prepare_arguments_name_the_argument(name, exc, call):
    with pytest.raises(exc, match=rf"^{name}:"):
        call(*_good())


def _records():
    X, fn, scale, base = _good()
    U, stats = cake_mhc_train_forward_prepare(X, fn, scale, base)
    dY = torch.randn(T, N, C, device=DEVICE, dtype=X.dtype)
    B = torch.randn(T, C, device=DEVICE, dtype=X.dtype)
    dB, gs = cake_mhc_train_backward_prepare(dY, B, X, stats)
    return X, fn, scale, base, stats, dY, B, gs


BAD_OTHERS = [
    ("B", ValueError, lambda r: cake_mhc_train_forward_finish(r[0], r[6][:3], r[4])),  # T mismatch
    ("stats", ValueError, lambda r: cake_mhc_train_forward_finish(r[0], r[6], r[4][:, :32])),
    ("stats", ValueError, lambda r: cake_mhc_train_forward_finish(r[0], r[6], r[4][1:])),
    ("dY", ValueError, lambda r: cake_mhc_train_backward_prepare(r[5].float(), r[6], r[0], r[4])),
    ("dY", ValueError, lambda r: cake_mhc_train_backward_prepare(r[5][:, :, 1:], r[6], r[0], r[4])),
    ("grad_stats", ValueError, lambda r: cake_mhc_train_backward_finish(
        r[0], r[5], r[6], None, r[1], r[2], r[3], r[4], r[7][:, :20])),
    ("dU", ValueError, lambda r: cake_mhc_train_backward_finish(
        r[0], r[5], r[6][:4], None, r[1], r[2], r[3], r[4], r[7])),
    ("deterministic", TypeError, lambda r: cake_mhc_train_backward_finish(
        r[0], r[5], r[6], None, r[1], r[2], r[3], r[4], r[7], deterministic=1)),
    ("dfn", ValueError, lambda r: cake_mhc_train_backward_finish(
        r[0], r[5], r[6], None, r[1], r[2], r[3], r[4], r[7], accumulate=True)),
    ("dY", ValueError, lambda r: cake_mhc_train_head_backward(r[6].reshape(1, T, C))),
    ("dX", ValueError, lambda r: cake_mhc_train_head_backward(r[6], accumulate=True)),
    ("X", NotImplementedError, lambda r: cake_mhc_train_head_forward(r[0][:, :3])),
    ("save_stats", TypeError, lambda r: cake_mhc_train_prepare(r[0], r[1], r[2], r[3], save_stats="no")),
]


@pytest.mark.parametrize("name,exc,call", BAD_OTHERS, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_OTHERS)])
def test_bad_arguments_of_the_other_entries_name_the_argument(name, exc, call):
    with pytest.raises(exc, match=rf"^{name}:"):
        call(_records())


def test_empty_tokens_through_the_functions(backend):
    X, fn, scale, base = (t[:0] if i == 0 else t for i, t in enumerate(_good()))
    U, stats = cake_mhc_train_forward_prepare(X, fn, scale, base)
    assert U.shape == (0, C) and stats.shape == (0, 64)
    assert cake_mhc_train_forward_stats(X, fn, scale, base).shape == (0, 64)
    B = torch.empty(0, C, device=DEVICE, dtype=X.dtype)
    assert cake_mhc_train_forward_finish(X, B, stats).shape == (0, N, C)
    assert cake_mhc_train_head_forward(X).shape == (0, C)
    dB, gs = cake_mhc_train_backward_prepare(X, B, X, stats)
    dX, dfn, dscale, dbase = cake_mhc_train_backward_finish(X, X, B, B, fn, scale, base, stats, gs)
    assert dX.shape == X.shape and torch.equal(dfn, torch.zeros_like(fn)) and torch.equal(dbase, torch.zeros_like(base))
    assert torch.equal(dscale, torch.zeros_like(scale))


def test_nan_in_one_token_stays_in_that_token(backend):
    X, fn, scale, base = _good()
    X = X.float()
    X[2, 1, 3] = float("nan")
    U, stats = cake_mhc_train_forward_prepare(X, fn, scale, base)
    assert torch.isnan(U[2]).all() and torch.isfinite(U[[0, 1, 3, 4]]).all()
    assert torch.isnan(stats[2, :25]).any() and torch.isfinite(stats[[0, 1, 3, 4]]).all()
    Y = cake_mhc_train_forward_finish(X, torch.ones(T, C, device=DEVICE), stats)
    assert torch.isnan(Y[2]).all() and torch.isfinite(Y[[0, 1, 3, 4]]).all()


def test_module_errors_speak_the_users_terms():
    """What a user of nn.MHC / the functions sees for the usual mistakes: their own shapes and names."""
    import cakeops

    X, fn, scale, base = _good()
    with pytest.raises(ValueError, match=r"scale: expected shape \(3,\), got \(4,\)"):
        _prepare(scale=torch.ones(4, device=DEVICE))
    with pytest.raises(ValueError, match=r"base: expected shape \(24,\), got \(20,\)"):
        _prepare(base=torch.zeros(20, device=DEVICE))
    block = cakeops.nn.MHC(torch.nn.Linear(C, C // 2, device=DEVICE), hidden_size=C, device=DEVICE)
    with pytest.raises(ValueError, match=r"the branch must map \[\.\.\., 8\] to \[\.\.\., 8\]: given \(2, 3, 8\), "
                                         r"it returned \(2, 3, 4\)"):
        block(torch.randn(2, 3, N, C, device=DEVICE))
    with pytest.raises(ValueError, match=r"MHC: expected the residual streams \[\.\.\., 4, 8\].*got \(6, 8\).*"
                                         r"StreamExpand"):
        block(torch.randn(6, C, device=DEVICE))
    wide = cakeops.nn.MHC(torch.nn.Identity(), hidden_size=16, device=DEVICE)
    with pytest.raises(ValueError, match=r"\[\.\.\., 4, 16\] \(n_streams, hidden_size\), got \(5, 4, 8\)"):
        wide(torch.randn(T, N, C, device=DEVICE))


@pytest.mark.parametrize("kwargs, exc, name", [
    (dict(hidden_size=True), ValueError, "hidden_size"),
    (dict(hidden_size=0), ValueError, "hidden_size"),
    (dict(sinkhorn_iters=0), ValueError, "sinkhorn_iters"),
    (dict(sinkhorn_iters=2.5), TypeError, "sinkhorn_iters"),
    (dict(sinkhorn_iters=65), NotImplementedError, "sinkhorn_iters"),
    (dict(rms_eps=-1.0), ValueError, "rms_eps"),
    (dict(hc_eps=float("nan")), ValueError, "hc_eps"),
    (dict(deterministic="yes"), TypeError, "deterministic"),
    (dict(save_stats=1), TypeError, "save_stats"),
    (dict(keep_fp32_mapping=None), TypeError, "keep_fp32_mapping"),
    (dict(branch=3), TypeError, "branch"),
])
def test_mhc_module_validates_its_arguments_at_construction(kwargs, exc, name):
    import cakeops

    kwargs = {"branch": torch.nn.Identity(), "hidden_size": C, **kwargs}
    with pytest.raises(exc, match=rf"^{name}:"):
        cakeops.nn.MHC(**kwargs)


def test_mhc_module_dtype_gives_the_mapping_that_dtype():
    import cakeops

    block = cakeops.nn.MHC(torch.nn.Identity(), hidden_size=C, dtype=torch.bfloat16)
    assert {p.dtype for p in block.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in cakeops.nn.MHC(torch.nn.Identity(), hidden_size=C).parameters()} == {torch.float32}


def test_mhc_module_errors_name_the_streams_and_the_branch_dtype(backend):
    """Another stream count than the module's says so (not "widen the stream"); an un-widened hidden state is told
    to widen; a branch returning another dtype is told in the module's terms (the user never named a B)."""
    import cakeops

    block = cakeops.nn.MHC(torch.nn.Identity(), hidden_size=C, device=DEVICE)
    with pytest.raises(ValueError, match=r"got \(5, 8, 8\); if its dim -2 holds 8 residual streams, this MHC was "
                                         r"built for n_streams=4 \(build it with n_streams=8\)"):
        block(torch.randn(5, 8, C, device=DEVICE))
    with pytest.raises(ValueError, match=r"got \(6, 8\); widen the stream first with cakeops.nn.StreamExpand\(4\)"):
        block(torch.randn(6, C, device=DEVICE))
    to_double = cakeops.nn.MHC(lambda U: U.double(), hidden_size=C, device=DEVICE)
    with pytest.raises(ValueError, match=r"^MHC: the branch must return bfloat16, float16 or float32: given "
                                         r"float32, it returned float64"):
        to_double(torch.randn(T, N, C, device=DEVICE))


def test_stream_expand_needs_a_hidden_dim():
    """A 0-dim tensor (or no tensor) has no hidden size to widen: said in the module's terms, not an IndexError."""
    import cakeops

    expand = cakeops.nn.StreamExpand()
    with pytest.raises(ValueError, match=r"^StreamExpand: expected a hidden state \[\.\.\., C\] \(at least 1 dim\) "
                                         r"to copy into the 4 residual streams, got shape \(\)$"):
        expand(torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"^StreamExpand: expected a hidden state .*, got list$"):
        expand([1.0, 2.0])
    assert expand(torch.ones(C)).shape == (4, C)


def test_gated_head_shape_error_says_which_argument_differs():
    import cakeops

    head = cakeops.nn.MHCHead(gated=True, hidden_size=C, n_streams=4)
    with pytest.raises(ValueError, match=r"built with n_streams=4 \(the input has 8\) and hidden_size=8 \(the input "
                                         r"has 16\)"):
        head(torch.randn(3, 8, 16))


def test_float64_inputs_are_told_to_cast_and_integer_inputs_get_the_dtype_error():
    import cakeops

    with pytest.raises(ValueError, match=r"^X: expected dtype in .*got float64; float64 is not supported .*\.float\(\)"):
        _prepare(X=_good()[0].double())
    with pytest.raises(ValueError, match=r"^x: expected dtype in \(bfloat16, float16, float32\), got int32$"):
        cakeops.nn.RMSNorm(16)(torch.ones(2, 16, dtype=torch.int32))


def test_cpu_kernels_without_the_interpreter_say_what_to_set():
    """A user's ``CAKEOPS_CPU_KERNELS=triton`` without ``TRITON_INTERPRET=1``: cakeops' message, not Triton's
    "0 active drivers" (a fresh process: both are read at import)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CAKEOPS_CPU_KERNELS"] = "triton"
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
    script = "import torch, cakeops; cakeops.cake_rmsnorm(torch.ones(2, 8), torch.ones(8), 1e-6)"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "RuntimeError: CAKEOPS_CPU_KERNELS=triton runs the Triton kernels on CPU tensors" in done.stderr, done.stderr
    assert "TRITON_INTERPRET=1" in done.stderr.splitlines()[-1]


@pytest.mark.parametrize("name", ["rmsnorm", "mhc", "head", "gated head"])
def test_double_backward_raises_instead_of_wrong_numbers(backend, name):
    """The gradients are first order: a backward with create_graph=True (for a Hessian-vector product) raises on
    every path, naming the layer. The reference path returned a differentiable first gradient whose second
    derivative was wrong (RMSNorm: 1.5 against torch's 1e-5 on one case), the interpreter an error that did not
    say why."""
    import cakeops

    torch.manual_seed(3)
    C = 16
    models = {"rmsnorm": (cakeops.nn.RMSNorm(C), (3, C)),
              "mhc": (cakeops.nn.MHC(torch.nn.Linear(C, C), hidden_size=C), (3, 4, C)),
              "head": (cakeops.nn.MHCHead(), (3, 4, C)),
              "gated head": (cakeops.nn.MHCHead(gated=True, n_streams=4, hidden_size=C), (3, 4, C))}
    model, shape = models[name]
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"backward is first order; a backward with create_graph=True"):
        torch.autograd.grad(model.to(DEVICE)(x).pow(2).sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(model(x).pow(2).sum(), x)  # first order as before
    assert g.shape == x.shape and not g.requires_grad


@pytest.mark.parametrize("name", ["rmsnorm", "mhc", "gated head"])
def test_torch_func_transforms_say_they_are_not_supported(backend, name):
    """torch.func.grad / vmap over a cakeops layer: a NotImplementedError naming the layer and what to use, where
    torch asked the user for a ``setup_context`` they cannot add."""
    import cakeops

    C = 16
    models = {"rmsnorm": (cakeops.nn.RMSNorm(C), (3, C)),
              "mhc": (cakeops.nn.MHC(torch.nn.Linear(C, C), hidden_size=C), (3, 4, C)),
              "gated head": (cakeops.nn.MHCHead(gated=True, n_streams=4, hidden_size=C), (3, 4, C))}
    model, shape = models[name]
    model = model.to(DEVICE)
    x = torch.randn(shape, device=DEVICE)
    for transform in (lambda: torch.func.grad(lambda t: model(t).sum())(x),
                      lambda: torch.func.vmap(model)(x[None])):
        with pytest.raises(NotImplementedError, match=r"^cakeops .*: torch.func transforms .* are not supported"):
            transform()
