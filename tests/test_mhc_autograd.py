"""mHC autograd: the prepare/finish pair and the head against fp64 autograd through the reference math;
single-cast dX, save_stats, checkpoint, handles, determinism, accumulate, T == 0."""
import warnings

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from cakeops.cake_mhc_train import (
    CakeMHCTrainHeadFunction, cake_mhc_train_backward_finish, cake_mhc_train_backward_prepare, cake_mhc_train_finish,
    cake_mhc_train_forward_prepare, cake_mhc_train_head, cake_mhc_train_prepare,
)
from cakeops.reference import mhc as reference
from cakeops.testing import rel_err
from conftest import DEVICE

N, M = 4, 24
# design.md §3: gradients with bf16 data <= 1e-2; fp32 data through a TF32 projection <= 2e-3.
GRAD_TOL = {torch.bfloat16: 1e-2, torch.float32: 2e-3}
FWD_TOL = {torch.bfloat16: 8e-3, torch.float32: 1e-3}  # bf16: two ulps, the interpreter truncates


def _params(C, seed, logit_scale=(1.0, 1.0, 3.0)):
    g = torch.Generator().manual_seed(seed)
    K = N * C
    fn = (torch.randn(M, K, generator=g) / K ** 0.5).to(DEVICE).requires_grad_()
    scale = torch.tensor(logit_scale).to(DEVICE).requires_grad_()
    base = torch.randn(M, generator=g).to(DEVICE).requires_grad_()
    return fn, scale, base


class Branch(torch.nn.Module):
    """A small MLP branch B = W2 tanh(W1 U), in fp32 math whatever the data dtype."""

    def __init__(self, C, seed):
        super().__init__()
        g = torch.Generator().manual_seed(seed + 1)
        self.w1 = (torch.randn(C, C, generator=g) / C ** 0.5).to(DEVICE)
        self.w2 = (torch.randn(C, C, generator=g) / C ** 0.5).to(DEVICE)

    def forward(self, U):
        w1, w2 = self.w1.to(U.dtype), self.w2.to(U.dtype)
        return torch.tanh(U @ w1) @ w2


def _reference_grads(X, fn, scale, base, branch, gY, hp):
    leaves = [t.detach().double().requires_grad_() for t in (X, fn, scale, base)]
    Y = reference.layer(*leaves, branch, *hp)
    return Y, torch.autograd.grad(Y, leaves, gY.double())


def _layer(X, fn, scale, base, branch, hp, **kw):
    U, handle = cake_mhc_train_prepare(X, fn, scale, base, rms_eps=hp[0], hc_eps=hp[1], sinkhorn_iters=hp[2], **kw)
    return cake_mhc_train_finish(X, branch(U), handle)


def _grads(Y, gY, leaves):
    return torch.autograd.grad(Y, leaves, gY)


@pytest.mark.parametrize("iters", [1, 3, 20])
@pytest.mark.parametrize("eps", [(0.5, 0.05), (1e-5, 1e-6)], ids=["large-eps", "default-eps"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_gradients_match_fp64_autograd(backend, iters, eps, dtype):
    T, C = 9, 24
    seed = 100 * iters + int(eps[1] * 100) + (dtype == torch.bfloat16)
    torch.manual_seed(seed)
    X = torch.randn(T, N, C, device=DEVICE).to(dtype).requires_grad_()
    fn, scale, base = _params(C, seed)
    branch = Branch(C, seed)
    gY = torch.randn(T, N, C, device=DEVICE).to(dtype)
    hp = (eps[0], eps[1], iters)
    Y = _layer(X, fn, scale, base, branch, hp)
    ref_Y, ref = _reference_grads(X, fn, scale, base, branch, gY, hp)
    assert Y.dtype == dtype and rel_err(Y, ref_Y) <= FWD_TOL[dtype]
    got = _grads(Y, gY, [X, fn, scale, base])
    assert got[0].dtype == dtype and got[1].dtype == torch.float32
    names = ["dX", "dfn", "dscale", "dbase"]
    # bf16 end to end: dscale is three cross-token sums with cancellation, moved by the bf16 rounding of
    # U, B, dB, dU between the ops (not by the ops): it is checked op by op in the kernel tests instead.
    checked = names if dtype == torch.float32 else ["dX", "dfn", "dbase"]
    for name, g_, r in zip(names, got, ref):
        if name in checked:
            assert rel_err(g_, r) <= GRAD_TOL[dtype], name


def test_x_gets_one_gradient_written_once(backend):
    """The finish node gives X no gradient; the prepare node's is the whole one (single cast)."""
    torch.manual_seed(3)
    T, C = 5, 16
    X = torch.randn(T, N, C, device=DEVICE, requires_grad=True)
    fn, scale, base = _params(C, 3)
    U, handle = cake_mhc_train_prepare(X, fn, scale, base)
    Y = cake_mhc_train_finish(X, U * 2, handle)
    gY = torch.randn_like(Y)
    # The finish node's own backward: nothing for X, dY itself for the dY edge.
    from_finish = Y.grad_fn.apply(gY)
    assert from_finish[0] is None and from_finish[3] is gY
    dX = torch.autograd.grad(Y, X, gY)[0]
    ref = _reference_grads(X, fn, scale, base, lambda u: u * 2, gY, (1e-5, 1e-6, 20))[1][0]
    assert rel_err(dX, ref) <= GRAD_TOL[torch.float32]


@pytest.mark.parametrize("save_stats", [True, False])
def test_save_stats_false_gives_the_same_bits(backend, save_stats):
    torch.manual_seed(4)
    T, C = 7, 12
    X = torch.randn(T, N, C, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    fn, scale, base = _params(C, 4)
    branch = Branch(C, 4)
    gY = torch.randn(T, N, C, device=DEVICE, dtype=torch.bfloat16)
    hp = (0.5, 0.05, 5)
    kept = _grads(_layer(X, fn, scale, base, branch, hp, save_stats=True), gY, [X, fn, scale, base])
    Y = _layer(X, fn, scale, base, branch, hp, save_stats=save_stats)
    redo = _grads(Y, gY, [X, fn, scale, base])
    for a, b in zip(kept, redo):
        assert torch.equal(a, b)


def test_save_stats_false_keeps_no_stats_record(backend):
    X = torch.randn(6, N, 8, device=DEVICE, requires_grad=True)
    fn, scale, base = _params(8, 5)
    U, handle = cake_mhc_train_prepare(X, fn, scale, base, save_stats=False)
    Y = cake_mhc_train_finish(X, U, handle)
    assert handle.state.stats is None  # dropped after the forward
    shapes = [tuple(t.shape) for t in Y.grad_fn.saved_tensors] + [tuple(t.shape) for t in U.grad_fn.saved_tensors]
    assert (6, 64) not in shapes
    Y.backward(torch.randn_like(Y))
    assert X.grad is not None and torch.isfinite(X.grad).all()


def test_checkpoint_around_the_layer_gives_equal_gradients(backend):
    torch.manual_seed(6)
    T, C = 6, 16
    X = torch.randn(T, N, C, device=DEVICE, requires_grad=True)
    fn, scale, base = _params(C, 6)
    branch = Branch(C, 6)
    gY = torch.randn(T, N, C, device=DEVICE)
    hp = (1e-5, 0.05, 4)
    plain = _grads(_layer(X, fn, scale, base, branch, hp), gY, [X, fn, scale, base])
    Y = checkpoint(lambda x: _layer(x, fn, scale, base, branch, hp), X, use_reentrant=False)
    ckpt = _grads(Y, gY, [X, fn, scale, base])
    for a, b in zip(plain, ckpt):
        assert torch.equal(a, b)


def test_handle_is_used_once_and_only_with_its_own_x():
    X = torch.randn(3, N, 8, device=DEVICE, requires_grad=True)
    X2 = torch.randn(3, N, 8, device=DEVICE, requires_grad=True)
    fn, scale, base = _params(8, 7)
    U, handle = cake_mhc_train_prepare(X, fn, scale, base)
    with pytest.raises(ValueError, match="another X"):
        cake_mhc_train_finish(X2, U, handle)
    cake_mhc_train_finish(X, U, handle)
    with pytest.raises(RuntimeError, match="already used"):
        cake_mhc_train_finish(X, U, handle)
    with pytest.raises(TypeError, match="handle"):
        cake_mhc_train_finish(X, U, object())


def test_deterministic_backward_is_bitwise_reproducible(backend):
    torch.manual_seed(8)
    T, C = 21, 16
    X = torch.randn(T, N, C, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    fn, scale, base = _params(C, 8)
    gY = torch.randn(T, N, C, device=DEVICE, dtype=torch.bfloat16)
    runs = [_grads(_layer(X, fn, scale, base, Branch(C, 8), (1e-5, 1e-6, 20)), gY, [X, fn, scale, base])
            for _ in range(3)]
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a, b)


def test_fast_backward_is_close_and_refused_in_deterministic_mode(backend):
    torch.manual_seed(9)
    T, C = 11, 8
    X = torch.randn(T, N, C, device=DEVICE, requires_grad=True)
    fn, scale, base = _params(C, 9)
    gY = torch.randn(T, N, C, device=DEVICE)
    hp = (1e-5, 1e-6, 20)
    det = _grads(_layer(X, fn, scale, base, Branch(C, 9), hp), gY, [X, fn, scale, base])
    fast = _grads(_layer(X, fn, scale, base, Branch(C, 9), hp, deterministic=False), gY, [X, fn, scale, base])
    for a, b in zip(det, fast):
        assert rel_err(b, a) <= 1e-5
    saved = torch.are_deterministic_algorithms_enabled()
    Y = _layer(X, fn, scale, base, Branch(C, 9), hp, deterministic=False)  # prepared before: non-deterministic
    try:
        torch.use_deterministic_algorithms(True)
        with pytest.raises(RuntimeError, match="deterministic"):
            Y.backward(gY)
        # prepared while they are on: FlashInfer 0.7.4's fallback, a deterministic layer (it warns once per
        # process: tests/test_flashinfer_074.py)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again = _grads(_layer(X, fn, scale, base, Branch(C, 9), hp, deterministic=False), gY,
                           [X, fn, scale, base])
        for a, b in zip(det, again):
            assert torch.equal(a, b)
    finally:
        torch.use_deterministic_algorithms(saved)


def test_backward_finish_accumulates_parameter_gradients(backend):
    torch.manual_seed(10)
    T, C = 8, 12
    X = torch.randn(T, N, C, device=DEVICE)
    fn, scale, base = (p.detach() for p in _params(C, 10))
    dY = torch.randn(T, N, C, device=DEVICE)
    U, stats = cake_mhc_train_forward_prepare(X, fn, scale, base)
    B = torch.tanh(U)
    dB, gs = cake_mhc_train_backward_prepare(dY, B, X, stats)
    dU = torch.randn(T, C, device=DEVICE)
    first = cake_mhc_train_backward_finish(X, dY, dU, B, fn, scale, base, stats, gs)
    acc = [torch.randn_like(t) for t in first[1:]]
    start = [a.clone() for a in acc]
    out = cake_mhc_train_backward_finish(X, dY, dU, None, fn, scale, base, stats, gs, accumulate=True,
                                         dfn=acc[0], dscale=acc[1], dbase=acc[2])
    assert torch.equal(out[0], first[0])
    for got, s, once in zip(out[1:], start, first[1:]):
        assert rel_err(got, s + once) <= 1e-6


def test_empty_tokens(backend):
    X = torch.randn(0, N, 8, device=DEVICE, requires_grad=True)
    fn, scale, base = _params(8, 11)
    U, handle = cake_mhc_train_prepare(X, fn, scale, base)
    Y = cake_mhc_train_finish(X, U, handle)
    assert U.shape == (0, 8) and Y.shape == (0, N, 8)
    dX, dfn, dscale, dbase = torch.autograd.grad(Y, [X, fn, scale, base], torch.randn_like(Y))
    assert dX.shape == X.shape
    for g in (dfn, dscale, dbase):
        assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_head_autograd(backend, dtype):
    torch.manual_seed(12)
    X = torch.randn(9, N, 40, device=DEVICE).to(dtype).requires_grad_()
    Y = cake_mhc_train_head(X)
    ref = X.detach().double().mean(1)
    assert rel_err(Y, ref) <= FWD_TOL[dtype]
    assert len(Y.grad_fn.saved_tensors) == 0
    gY = torch.randn(9, 40, device=DEVICE).to(dtype)
    Y.backward(gY)
    assert rel_err(X.grad, (gY.double() / N)[:, None, :].expand(9, N, 40)) <= 1e-6
    assert isinstance(Y.grad_fn, CakeMHCTrainHeadFunction._backward_cls)


@pytest.mark.parametrize("save_stats", [True, False])
def test_layer_keeps_no_activation_beyond_x_and_stats(backend, save_stats):
    """Identity branch: everything autograd keeps for the backward is X, B (= U, the branch's output that
    any residual block keeps) and, with save_stats, the [T, 64] FP32 stats -- plus the parameters."""
    T, C = 12, 16
    X = torch.randn(T, N, C, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    fn, scale, base = _params(C, 13)
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        U, handle = cake_mhc_train_prepare(X, fn, scale, base, save_stats=save_stats)
        Y = cake_mhc_train_finish(X, U, handle)
    storages = {t.untyped_storage().data_ptr(): t for t in kept}
    params = {p.untyped_storage().data_ptr() for p in (fn, scale, base)}
    activations = {tuple(t.shape) for ptr, t in storages.items() if ptr not in params}
    expected = {(T, N, C), (T, C)} | ({(T, 64)} if save_stats else set())
    assert activations == expected
    assert X.untyped_storage().data_ptr() in storages and U.untyped_storage().data_ptr() in storages
    Y.backward(torch.randn_like(Y))
