"""Outputs that do not reach the loss: no zero gradient is materialized, the right gradients still arrive,
eagerly and compiled (the eager Functions and the registered autograd share one formula per node)."""
import pytest
import torch

from cakeops.cake_mhc_train import cake_mhc_train_finish, cake_mhc_train_prepare
from cakeops.cake_rmsnorm_train import cake_rmsnorm
from cakeops.reference import mhc as reference
from cakeops.testing import rel_err
from conftest import DEVICE

MODES = ["eager", "compiled"]


def _run(mode, fn):
    if mode == "compiled":
        torch._dynamo.reset()
        return torch.compile(fn, fullgraph=True, backend="aot_eager")
    return fn


@pytest.mark.parametrize("mode", MODES)
def test_rmsnorm_only_h_new_used(backend, mode):
    """y unused: h_new's gradient reaches x and residual as is; w gets none; no kernel needed."""
    x = torch.randn(6, 32, device=DEVICE, requires_grad=True)
    res = torch.randn(6, 32, device=DEVICE, requires_grad=True)
    w = torch.randn(32, device=DEVICE, requires_grad=True)
    g = torch.randn(6, 32, device=DEVICE)
    h_new = _run(mode, lambda x, res, w: cake_rmsnorm(x, w, 1e-6, residual=res)[1])(x, res, w)
    h_new.backward(g)
    assert torch.equal(x.grad, g) and torch.equal(res.grad, g)
    assert w.grad is None or torch.count_nonzero(w.grad) == 0


@pytest.mark.parametrize("mode", MODES)
def test_rmsnorm_only_y_used(backend, mode):
    """h_new unused: the backward gets no g_residual (none is read) and matches the run where h_new's
    gradient is an explicit zero tensor."""
    x = torch.randn(6, 32, device=DEVICE, requires_grad=True)
    res = torch.randn(6, 32, device=DEVICE, requires_grad=True)
    w = torch.randn(32, device=DEVICE, requires_grad=True)
    g = torch.randn(6, 32, device=DEVICE)
    y = _run(mode, lambda x, res, w: cake_rmsnorm(x, w, 1e-6, residual=res)[0])(x, res, w)
    got = torch.autograd.grad(y, [x, res, w], g)
    y2, h2 = cake_rmsnorm(x, w, 1e-6, residual=res)
    want = torch.autograd.grad([y2, h2], [x, res, w], [g, torch.zeros_like(h2)])
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def _mhc_inputs(T=7, C=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, 4, C, generator=g).to(DEVICE).requires_grad_()
    fn = (torch.randn(24, 4 * C, generator=g) * 0.2).to(DEVICE).requires_grad_()
    scale = torch.tensor([1.0, 1.0, 3.0], device=DEVICE, requires_grad=True)
    base = torch.randn(24, generator=g).to(DEVICE).requires_grad_()
    return X, fn, scale, base


@pytest.mark.parametrize("mode", MODES)
def test_mhc_only_u_used(backend, mode):
    """The finish's output unused: the prepare node's backward still gives X, fn, scale, base their
    gradients through U alone (dY and grad_stats zero), against fp64 autograd of the reference math."""
    X, fn, scale, base = _mhc_inputs()
    gU = torch.randn(X.shape[0], X.shape[2], device=DEVICE)

    def layer(X, fn, scale, base):
        U, handle = cake_mhc_train_prepare(X, fn, scale, base, sinkhorn_iters=5)
        cake_mhc_train_finish(X, torch.tanh(U), handle)  # computed, never used
        return U

    U = _run(mode, layer)(X, fn, scale, base)
    got = torch.autograd.grad(U, [X, fn, scale, base], gU)
    leaves = [t.detach().double().requires_grad_() for t in (X, fn, scale, base)]
    pre = reference.coefficients(*leaves, 1e-5, 1e-6, 5)[0]
    U64 = torch.einsum("ti,tic->tc", pre, leaves[0])
    want = torch.autograd.grad(U64, leaves, gU.double())
    for name, a, b in zip(["dX", "dfn", "dscale", "dbase"], got, want):
        assert rel_err(a, b) <= 2e-3, name


@pytest.mark.parametrize("mode", MODES)
def test_mhc_layer_output_unused_gives_no_gradient(backend, mode):
    """Neither U's consumer nor Y reaches the loss: the parameters get no gradient and nothing fails."""
    X, fn, scale, base = _mhc_inputs(seed=1)
    other = torch.randn(3, device=DEVICE, requires_grad=True)

    def step(X, fn, scale, base, other):
        U, handle = cake_mhc_train_prepare(X, fn, scale, base, sinkhorn_iters=3)
        cake_mhc_train_finish(X, U, handle)
        return (other * 2).sum() + 0 * X.sum()

    _run(mode, step)(X, fn, scale, base, other).backward()
    assert fn.grad is None or torch.count_nonzero(fn.grad) == 0
    assert torch.equal(other.grad, torch.full_like(other, 2.0))


# ---- leading dims: modules return the ops' own outputs (FSDP2 hooks a module's outputs; a view would lose it
# to an in-place op) ----

@pytest.mark.parametrize("mode", MODES)
def test_modules_on_batch_seq_streams_return_no_views_and_match_flat_tokens(backend, mode):
    import cakeops

    torch.manual_seed(3)
    block = cakeops.nn.MHC(torch.nn.Linear(16, 16, device=DEVICE), hidden_size=16, hc_eps=0.05, device=DEVICE)
    head = cakeops.nn.MHCHead()
    X = torch.randn(2, 3, 4, 16, device=DEVICE, requires_grad=True)
    X3 = X.detach().reshape(6, 4, 16).clone().requires_grad_()
    run = _run(mode, lambda X: (lambda Y: (Y, head(Y)))(block(X)))
    Y, out = run(X)
    assert Y.shape == X.shape and out.shape == (2, 3, 16)
    assert Y._base is None and out._base is None
    g = torch.randn_like(out)
    out.backward(g)
    grads = [X.grad] + [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    Y3 = block(X3)
    head(Y3).backward(g.reshape(6, 16))
    assert torch.equal(Y.detach().reshape(6, 4, 16), Y3.detach())
    for a, b in zip(grads, [X3.grad.reshape(X.shape)] + [p.grad for p in block.parameters()]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_prepare_on_batch_seq_streams_returns_u_as_no_view(backend, mode):
    """U of a [batch, seq, n, C] input: no view (a function returning it hands it back as a tensor of its own, as
    the modules' outputs above), the flat-token run's values, and the same gradients through it."""
    X, fn, scale, base = _mhc_inputs(T=8, seed=4)
    X4 = X.detach().reshape(2, X.shape[0] // 2, *X.shape[1:]).clone().requires_grad_()
    gU = torch.randn(X.shape[0], X.shape[2], device=DEVICE)
    U = _run(mode, lambda X: cake_mhc_train_prepare(X, fn, scale, base, sinkhorn_iters=4)[0])(X4)
    assert U.shape == (*X4.shape[:2], X4.shape[-1]) and U._base is None
    got = torch.autograd.grad(U, [X4, fn, scale, base], gU.reshape(U.shape))
    U3 = cake_mhc_train_prepare(X, fn, scale, base, sinkhorn_iters=4)[0]
    want = torch.autograd.grad(U3, [X, fn, scale, base], gU)
    assert torch.equal(U.detach().reshape(U3.shape), U3.detach())
    for name, a, b in zip(["dX", "dfn", "dscale", "dbase"], got, want):
        assert torch.equal(a.reshape(b.shape), b), name


@pytest.mark.parametrize("impl", ["finish", "head", "gated_head"])
def test_op_bodies_traced_in_the_ops_place_return_no_views(impl):
    """On a GPU torch.compile traces an op's body in the op's place (``inductor.register_visible_kernels``): an
    output the kernels wrote through a flattened view of it became a view of an intermediate, which AOTAutograd
    hands back as a view (seen on the H200: the test above failed compiled). Here the bodies are traced on CPU
    tensors through the reference math, whose copy into the output buffers stands for the kernels' write (on a GPU
    the test above runs the kernels so; Dynamo cannot trace the bodies' kernel launchers directly)."""
    from cakeops import _backend
    from cakeops._ops import mhc as ops
    from cakeops._ops import mhc_gated_head as gated

    X, B = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 16)
    fn, scale, base = torch.randn(4, 64) * 0.1, torch.ones(1), torch.zeros(4)
    with _backend.cpu_kernels("reference"):
        stats = ops.prepare_impl(X.reshape(6, 4, 16), torch.randn(24, 64) * 0.1, torch.ones(3), torch.randn(24),
                                 1e-6, 0.0, 3)[1]
        body = {"finish": lambda X, B: ops.finish_impl(X, B, stats),
                "head": lambda X, B: ops.head_forward_impl(X),
                "gated_head": lambda X, B: gated.forward_impl(X, fn, scale, base, 1e-6, 0.0)[0]}[impl]
        torch._dynamo.reset()
        got = torch.compile(body, fullgraph=True, backend="aot_eager")(X, B)
        want = body(X, B)
    assert got._base is None
    assert torch.equal(got, want)
