"""RMSNorm training op: numerics vs fp64 math, kernels (GPU or interpreter), determinism, buffers, errors."""
import warnings

import pytest
import torch

import cakeops
from cakeops.cake_rmsnorm_train import (
    CakeRMSNormFunction, cake_rmsnorm, cake_rmsnorm_train_allocate_workspace, cake_rmsnorm_train_backward,
    cake_rmsnorm_train_forward, is_cake_rmsnorm_train_supported,
)
from cakeops.testing import rel_err
from conftest import DEVICE, ON_GPU

FWD_TOL = {torch.bfloat16: 4e-3, torch.float16: 1e-3, torch.float32: 1e-5}
GRAD_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def fwd_tol(dtype, backend):
    # The Triton interpreter truncates fp32 -> bf16 (a GPU rounds to nearest even): up to two bf16 ulps there.
    if dtype == torch.bfloat16 and backend == "triton" and not ON_GPU:
        return 2.0 ** -7
    return FWD_TOL[dtype]


def _oracle(x, w, eps, residual, gy, gh, h_new=None):
    """fp64 autograd through the math of design.md §1. h_new is rounded to x.dtype on the way forward and passes the
    gradient straight through; given the op's own h_new, the oracle normalizes exactly that tensor (the
    Triton interpreter rounds by truncation, so its h_new can sit one ulp from round-to-nearest)."""
    x64 = x.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    inputs = [x64, w64]
    h = x64
    if residual is not None:
        r64 = residual.detach().double().requires_grad_()
        inputs.append(r64)
        s = x64 + r64
        rounded = s.detach().to(x.dtype).double() if h_new is None else h_new.detach().double()
        h = s + (rounded - s.detach())
    rstd = 1.0 / torch.sqrt(h.square().mean(-1, keepdim=True) + eps)
    y = h * rstd * w64
    outs, grads = [y], [gy.double()]
    if residual is not None:
        outs.append(h)
        grads.append(gh.double())
    if x.numel() == 0:
        return y, h, [torch.zeros_like(i) for i in inputs]
    return y, h, torch.autograd.grad(outs, inputs, grads)


@pytest.mark.parametrize("H", [1, 7, 1000, 4095, 5120])
@pytest.mark.parametrize("T", [0, 1, 33])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_autograd_matches_fp64(backend, H, T, dtype, with_residual):
    # seeded by conftest from the test id: the same inputs in every run, different ones per parametrization
    w_dtype = torch.float32 if (H + T) % 2 else dtype  # both weight dtypes across the grid
    eps = 1e-6 if H > 1 else 0.5  # H = 1: dx is a pure cancellation term, meaningful only with eps large
    x = torch.randn(T, H, device=DEVICE, dtype=dtype, requires_grad=True)
    w = (1 + 0.5 * torch.randn(H, device=DEVICE)).to(w_dtype).requires_grad_()
    r = torch.randn(T, H, device=DEVICE, dtype=dtype, requires_grad=True) if with_residual else None
    gy = torch.randn(T, H, device=DEVICE, dtype=dtype)
    gh = torch.randn(T, H, device=DEVICE, dtype=dtype) if with_residual else None

    outs = cake_rmsnorm(x, w, eps, r)
    y = outs[0] if with_residual else outs
    ref_y, ref_h, ref_grads = _oracle(x, w, eps, r, gy, gh, outs[1] if with_residual else None)
    assert y.shape == x.shape and y.dtype == dtype
    assert rel_err(y, ref_y) <= fwd_tol(dtype, backend)
    if with_residual:
        exact_sum = x.detach().double() + r.detach().double()
        if dtype == torch.bfloat16 and backend == "triton" and not ON_GPU:
            assert rel_err(outs[1], exact_sum) <= fwd_tol(dtype, backend)
        else:  # h_new = round(x + residual): exact
            assert torch.equal(outs[1], exact_sum.to(dtype))
        torch.autograd.backward(outs, [gy, gh])
    else:
        y.backward(gy)
    assert x.grad.dtype == dtype and w.grad.dtype == w_dtype
    assert rel_err(x.grad, ref_grads[0]) <= GRAD_TOL[dtype]
    assert rel_err(w.grad, ref_grads[1]) <= GRAD_TOL[dtype]
    if with_residual:
        assert torch.equal(x.grad, r.grad)  # one gradient tensor for both residual inputs
        assert rel_err(r.grad, ref_grads[2]) <= GRAD_TOL[dtype]


def test_function_api_shapes_and_records(backend):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 96, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(96, device=DEVICE)
    y, rstd = cake_rmsnorm_train_forward(x, w, 1e-5)
    assert y.shape == x.shape and rstd.shape == (2, 3) and rstd.dtype == torch.float32
    ref = 1.0 / torch.sqrt(x.double().square().mean(-1) + 1e-5)
    assert rel_err(rstd, ref) <= 1e-5
    g = torch.randn_like(x)
    dx, dw = cake_rmsnorm_train_backward(g, x, w, rstd)
    assert dx.shape == x.shape and dx.dtype == x.dtype and dw.dtype == torch.float32 and dw.shape == (96,)
    # rstd flattened is accepted as well
    dx2, dw2 = cake_rmsnorm_train_backward(g, x, w, rstd.reshape(-1))
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)


@pytest.mark.parametrize("with_residual", [False, True])
def test_caller_buffers_are_written(backend, with_residual):
    torch.manual_seed(2)
    T, H = 9, 200
    x = torch.randn(T, H, device=DEVICE, dtype=torch.float16)
    r = torch.randn_like(x) if with_residual else None
    w = torch.randn(H, device=DEVICE, dtype=torch.float16)
    out = torch.full_like(x, float("nan"))
    rstd = torch.full((T,), float("nan"), device=DEVICE)
    h_out = torch.full_like(x, float("nan")) if with_residual else None
    res = cake_rmsnorm_train_forward(x, w, 1e-6, residual=r, out=out, rstd=rstd, residual_out=h_out)
    assert res[0] is out and res[1].data_ptr() == rstd.data_ptr()
    fresh = cake_rmsnorm_train_forward(x, w, 1e-6, residual=r)
    assert torch.equal(out, fresh[0]) and torch.equal(rstd, fresh[1])
    if with_residual:
        assert torch.equal(h_out, fresh[2])
    h = fresh[2] if with_residual else x
    g = torch.randn_like(x)
    dx = torch.full_like(x, float("nan"))
    dw = torch.full((H,), float("nan"), device=DEVICE)
    ws = cake_rmsnorm_train_allocate_workspace(T, H, DEVICE, x.dtype)
    got = cake_rmsnorm_train_backward(g, h, w, rstd, g_residual=r, workspace=ws, dx=dx, dw=dw)
    assert got[0] is dx and got[1] is dw
    ref = cake_rmsnorm_train_backward(g, h, w, rstd, g_residual=r)
    assert torch.equal(dx, ref[0]) and torch.equal(dw, ref[1])


def test_row_strided_input_read_in_place(backend):
    torch.manual_seed(3)
    wide = torch.randn(17, 300, device=DEVICE, dtype=torch.bfloat16)
    x = wide[:, 20:276]  # row stride 300, unit column stride
    w = torch.randn(256, device=DEVICE, dtype=torch.bfloat16)
    assert cakeops.cake_rmsnorm_train._rows(x).data_ptr() == x.data_ptr()  # no copy
    y, rstd = cake_rmsnorm_train_forward(x, w, 1e-6)
    y2, rstd2 = cake_rmsnorm_train_forward(x.contiguous(), w, 1e-6)
    assert torch.equal(y, y2) and torch.equal(rstd, rstd2)
    g = torch.randn(17, 256, device=DEVICE, dtype=torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(cake_rmsnorm_train_backward(g, x, w, rstd),
                                                cake_rmsnorm_train_backward(g, x.contiguous(), w, rstd)))
    # a layout that is not row-strided (column slice of a transpose) is copied once and still right
    xt = torch.randn(256, 17, device=DEVICE, dtype=torch.bfloat16).t()
    assert torch.equal(cake_rmsnorm_train_forward(xt, w, 1e-6)[0], cake_rmsnorm_train_forward(xt.contiguous(), w, 1e-6)[0])


@pytest.mark.parametrize("H, residual", [(20000, True), (3000, False), (5000, False), (20000, False)])
def test_wide_rows_are_walked_in_chunks(triton_kernels, H, residual):
    """Rows wider than one register tile take the two-pass chunked kernels: past 2048 elements the plain
    forward, past 16384 the residual forward and the backward; a partial last chunk is masked."""
    from cakeops._triton.rmsnorm import RMSNormConfig

    assert RMSNormConfig().forward_tile(H, 2, residual)[2] > 1
    torch.manual_seed(4)
    T = 3
    x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn_like(x, requires_grad=True) if residual else None
    w = torch.randn(H, device=DEVICE, requires_grad=True)
    gy = torch.randn_like(x)
    if residual:
        y, h = cake_rmsnorm(x, w, 1e-6, r)
        gh = torch.randn_like(x)
        torch.autograd.backward([y, h], [gy, gh])
        leaves = [x, w, r]
    else:
        y, h, gh = cake_rmsnorm(x, w, 1e-6), None, None
        y.backward(gy)
        leaves = [x, w]
    ref_y, _, ref_grads = _oracle(x, w, 1e-6, r, gy, gh, h)
    assert rel_err(y, ref_y) <= fwd_tol(torch.bfloat16, "triton")
    assert len(ref_grads) == len(leaves)
    for got, ref in zip([t.grad for t in leaves], ref_grads):
        assert rel_err(got, ref) <= GRAD_TOL[torch.bfloat16]


@pytest.mark.parametrize("H", [96, 20000])
def test_deterministic_dw_is_bitwise_reproducible(backend, H):
    torch.manual_seed(5)
    T = 67 if H < 1000 else 5
    x = torch.randn(T, H, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(H, device=DEVICE, dtype=torch.bfloat16)
    g = torch.randn_like(x)
    _, rstd = cake_rmsnorm_train_forward(x, w, 1e-6)
    runs = [cake_rmsnorm_train_backward(g, x, w, rstd, deterministic=True) for _ in range(3)]
    for dx, dw in runs[1:]:
        assert torch.equal(dx, runs[0][0]) and torch.equal(dw, runs[0][1])


def test_fast_dw_is_accurate_and_respects_deterministic_mode(backend):
    torch.manual_seed(6)
    x = torch.randn(40, 128, device=DEVICE, dtype=torch.float32)
    w = torch.randn(128, device=DEVICE)
    g = torch.randn_like(x)
    _, rstd = cake_rmsnorm_train_forward(x, w, 1e-6)
    dx_d, dw_d = cake_rmsnorm_train_backward(g, x, w, rstd, deterministic=True)
    dx_f, dw_f = cake_rmsnorm_train_backward(g, x, w, rstd, deterministic=False)
    assert torch.equal(dx_d, dx_f)
    assert rel_err(dw_f, dw_d) <= 1e-6
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="deterministic"):
            cake_rmsnorm_train_backward(g, x, w, rstd, deterministic=False)
        cake_rmsnorm_train_backward(g, x, w, rstd, deterministic=True)  # the fixed-order path stays allowed
        torch.use_deterministic_algorithms(True, warn_only=True)
        cakeops._ops.determinism._warned.clear()  # warns once per process; this test needs the one
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            cake_rmsnorm_train_backward(g, x, w, rstd, deterministic=False)
        assert any("deterministic" in str(c.message) for c in caught)
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


def test_empty_input(backend):
    x = torch.randn(0, 64, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(64, device=DEVICE, requires_grad=True)
    y = cake_rmsnorm(x, w)
    assert y.shape == (0, 64)
    y.backward(torch.randn_like(y))
    assert x.grad.shape == (0, 64) and torch.equal(w.grad, torch.zeros_like(w))
    dx, dw = cake_rmsnorm_train_backward(torch.randn(0, 64, device=DEVICE, dtype=torch.bfloat16), x.detach(), w.detach(),
                                         torch.empty(0, device=DEVICE))
    assert dx.shape == (0, 64) and torch.equal(dw, torch.zeros(64, device=DEVICE))


def test_nn_rmsnorm_is_a_drop_in(backend):
    torch.manual_seed(7)
    ours = cakeops.nn.RMSNorm(48, eps=1e-5, device=DEVICE)
    theirs = torch.nn.RMSNorm(48, eps=1e-5, device=DEVICE)
    with torch.no_grad():
        ours.weight.copy_(torch.randn(48))
        theirs.weight.copy_(ours.weight)
    x = torch.randn(4, 6, 48, device=DEVICE, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(4, 6, 48, device=DEVICE)
    ours(x).backward(g)
    theirs(x2).backward(g)
    assert rel_err(x.grad, x2.grad) <= 1e-5 and rel_err(ours.weight.grad, theirs.weight.grad) <= 1e-5
    r = torch.randn_like(x)
    y, h = ours(x.detach(), r)
    assert torch.equal(h, x.detach() + r) and rel_err(y, theirs(h)) <= 1e-5


def test_function_class_returns_h_new_and_saves_three_tensors(backend):
    x = torch.randn(5, 32, device=DEVICE, requires_grad=True)
    r = torch.randn(5, 32, device=DEVICE, requires_grad=True)
    w = torch.randn(32, device=DEVICE, requires_grad=True)
    y, h = CakeRMSNormFunction.apply(x, w, 1e-6, r, True)
    assert len(y.grad_fn.saved_tensors) == 3
    y.backward(torch.randn_like(y))  # h unused: its gradient arrives as None
    assert torch.equal(x.grad, r.grad)


def test_supported():
    assert is_cake_rmsnorm_train_supported("cpu") and is_cake_rmsnorm_train_supported("cpu", 5)
    assert not is_cake_rmsnorm_train_supported("cpu", 0)
    if ON_GPU:
        assert is_cake_rmsnorm_train_supported("cuda", 5120)


@pytest.mark.parametrize("capability, supported", [((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_supported_claims_ampere_and_newer(monkeypatch, capability, supported):
    """The claim is sm_80+ (bf16 tensor-core dots); the GPU tests run on sm_90."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert is_cake_rmsnorm_train_supported("cuda:0", 4096) is supported


def _good():
    x = torch.randn(4, 16, device=DEVICE, dtype=torch.bfloat16)
    return x, torch.randn(16, device=DEVICE, dtype=torch.bfloat16)


BAD_FORWARD = [
    ("x", TypeError, lambda x, w: cake_rmsnorm_train_forward(x.tolist(), w, 1e-6)),
    ("x", ValueError, lambda x, w: cake_rmsnorm_train_forward(x.to(torch.int32), w, 1e-6)),
    ("x", ValueError, lambda x, w: cake_rmsnorm_train_forward(x[:, :0], w[:0], 1e-6)),
    ("w", ValueError, lambda x, w: cake_rmsnorm_train_forward(x, w[:15], 1e-6)),
    ("w", ValueError, lambda x, w: cake_rmsnorm_train_forward(x, w.to(torch.float64), 1e-6)),
    ("w", ValueError, lambda x, w: cake_rmsnorm_train_forward(x, w.reshape(4, 4), 1e-6)),
    ("w", ValueError, lambda x, w: cake_rmsnorm_train_forward(x, w.to("meta"), 1e-6)),
    ("eps", ValueError, lambda x, w: cake_rmsnorm_train_forward(x, w, 0.0)),
    ("eps", ValueError, lambda x, w: cake_rmsnorm_train_forward(x, w, float("nan"))),
    ("eps", TypeError, lambda x, w: cake_rmsnorm_train_forward(x, w, "1e-6")),
    ("residual", ValueError, lambda x, w: cake_rmsnorm_train_forward(x, w, 1e-6, residual=x[:3])),
    ("residual", ValueError, lambda x, w: cake_rmsnorm_train_forward(x, w, 1e-6, residual=x.float())),
    ("out", ValueError, lambda x, w: cake_rmsnorm_train_forward(x, w, 1e-6, out=torch.empty_like(x).float())),
    ("rstd", ValueError, lambda x, w: cake_rmsnorm_train_forward(x, w, 1e-6, rstd=torch.empty(5, device=DEVICE))),
    ("residual_out", ValueError, lambda x, w: cake_rmsnorm_train_forward(x, w, 1e-6, residual_out=torch.empty_like(x))),
]

BAD_BACKWARD = [
    ("g", ValueError, lambda x, w, r: cake_rmsnorm_train_backward(x[:2], x, w, r)),
    ("g", TypeError, lambda x, w, r: cake_rmsnorm_train_backward(None, x, w, r)),
    ("rstd", ValueError, lambda x, w, r: cake_rmsnorm_train_backward(x, x, w, r[:2])),
    ("rstd", ValueError, lambda x, w, r: cake_rmsnorm_train_backward(x, x, w, r.double())),
    ("g_residual", ValueError, lambda x, w, r: cake_rmsnorm_train_backward(x, x, w, r, g_residual=x.t())),
    ("deterministic", TypeError, lambda x, w, r: cake_rmsnorm_train_backward(x, x, w, r, deterministic="yes")),
    ("dw", ValueError, lambda x, w, r: cake_rmsnorm_train_backward(x, x, w, r, dw=torch.empty(16, device=DEVICE,
                                                                                               dtype=torch.bfloat16))),
    ("workspace", ValueError, lambda x, w, r: cake_rmsnorm_train_backward(x, x, w, r, workspace=torch.empty(8, device=DEVICE,
                                                                                                          dtype=torch.int64))),
]


@pytest.mark.parametrize("name,exc,call", BAD_FORWARD, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_FORWARD)])
def test_bad_forward_arguments_name_the_argument(name, exc, call):
    x, w = _good()
    with pytest.raises(exc, match=rf"^{name}:"):
        call(x, w)


@pytest.mark.parametrize("name,exc,call", BAD_BACKWARD, ids=[f"{c[0]}-{i}" for i, c in enumerate(BAD_BACKWARD)])
def test_bad_backward_arguments_name_the_argument(name, exc, call):
    x, w = _good()
    rstd = torch.rand(4, device=DEVICE)
    with pytest.raises(exc, match=rf"^{name}:"):
        call(x, w, rstd)


def test_nan_propagates(backend):
    x = torch.randn(3, 64, device=DEVICE)
    x[1, 5] = float("nan")
    y, rstd = cake_rmsnorm_train_forward(x, torch.ones(64, device=DEVICE), 1e-6)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all() and torch.isnan(rstd[1])


def test_custom_ops_take_any_layout(backend):
    """torch.ops entries can be handed any strides (opcheck and AOT pass such tangents): same results."""
    torch.manual_seed(8)
    x = torch.randn(40, 24, device=DEVICE).t()  # [24, 40], column stride != 1
    w = torch.randn(80, device=DEVICE)[::2]
    g = torch.randn(40, 24, device=DEVICE).t()
    y, rstd = torch.ops.cakeops.rmsnorm_fwd(x, w, 1e-6, True)
    y2, rstd2 = torch.ops.cakeops.rmsnorm_fwd(x.contiguous(), w.contiguous(), 1e-6, True)
    assert torch.equal(y, y2) and torch.equal(rstd, rstd2)
    gz = torch.randn(1, 40, device=DEVICE).expand(24, 40)  # zero row stride
    for grad in (g, gz):
        got = torch.ops.cakeops.rmsnorm_bwd(grad, x, w, rstd, grad, True)
        ref = torch.ops.cakeops.rmsnorm_bwd(grad.contiguous(), x.contiguous(), w.contiguous(), rstd,
                                            grad.contiguous(), True)
        # Bitwise under the interpreter; on a GPU a stride-0 row changes the load vectorization and so the
        # order of the row sums: the same values up to FP32 rounding.
        assert all(rel_err(a, b) <= (0 if not ON_GPU else 1e-6) for a, b in zip(got, ref))


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "no-weight"])
@pytest.mark.parametrize("shape_arg", [48, (48,)], ids=["int", "tuple"])
def test_nn_rmsnorm_matches_torch_with_torch_defaults(backend, affine, shape_arg):
    """Same constructor arguments and defaults as torch.nn.RMSNorm (eps=None: finfo(x.dtype).eps), same output,
    gradients and state dict, loaded both ways."""
    torch.manual_seed(8)
    theirs = torch.nn.RMSNorm(shape_arg, elementwise_affine=affine, device=DEVICE)
    ours = cakeops.nn.RMSNorm(shape_arg, elementwise_affine=affine, device=DEVICE)
    if affine:
        with torch.no_grad():
            theirs.weight.copy_(torch.randn(48))
        ours.load_state_dict(theirs.state_dict())
        theirs.load_state_dict(ours.state_dict())
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    x = (torch.randn(3, 5, 48, device=DEVICE) * 1e-3).requires_grad_()  # small: eps matters
    x2 = x.detach().clone().requires_grad_()
    g = torch.randn(3, 5, 48, device=DEVICE)
    y, y2 = ours(x), theirs(x2)
    assert rel_err(y, y2) <= 1e-5
    y.backward(g)
    y2.backward(g)
    assert rel_err(x.grad, x2.grad) <= 1e-4
    if affine:
        assert rel_err(ours.weight.grad, theirs.weight.grad) <= 1e-4
    else:
        assert ours.weight is None and list(ours.parameters()) == []


@pytest.mark.parametrize("args, exc, match", [
    (((48, 2),), NotImplementedError, "normalized_shape"),
    ((0,), ValueError, "normalized_shape"),
    (("48",), ValueError, "normalized_shape"),
    ((48, -1e-6), ValueError, "eps"),
])
def test_nn_rmsnorm_checks_its_arguments_at_construction(args, exc, match):
    with pytest.raises(exc, match=match):
        cakeops.nn.RMSNorm(*args)


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_autograd_dw_is_the_fp32_sum_rounded_once(backend, w_dtype):
    # The eager backward has the fixed-order reduction write dw in w's dtype (no separate cast launch): the bits
    # must be those of the function API's FP32 dw cast by torch. The interpreter truncates where a GPU rounds to
    # nearest even, so on CPU this holds bitwise for the reference math only.
    x = torch.randn(37, 300, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = (1 + 0.5 * torch.randn(300, device=DEVICE)).to(w_dtype).requires_grad_()
    gy = torch.randn_like(x)
    cake_rmsnorm(x, w, 1e-6).backward(gy)
    _, rstd = cake_rmsnorm_train_forward(x.detach(), w.detach(), 1e-6)
    _, dw32 = cake_rmsnorm_train_backward(gy, x.detach(), w.detach(), rstd)
    if backend == "triton" and not ON_GPU and w_dtype != torch.float32:
        assert rel_err(w.grad, dw32) <= 2.0 ** -7
    else:
        assert torch.equal(w.grad, dw32.to(w_dtype))
