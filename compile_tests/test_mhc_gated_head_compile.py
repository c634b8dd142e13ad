"""The gated head under torch.library.opcheck and torch.compile: both ops opcheck-clean, a model ending with
``MHCHead(gated=True)`` traced fullgraph with gradients equal to eager, dynamic T, the AOT graphs, Inductor."""
import pytest
import torch
import torch._dynamo

import cakeops
from cakeops.cake_mhc_train import cake_mhc_train_gated_head
from cakeops.reference import mhc_gated_head as reference
from conftest import DEVICE
from graph_tools import aot_graph_codes, assert_dynamic_tokens_compile_once, assert_fullgraph_equals_eager, grads_after

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                 "test_aot_dispatch_dynamic")
HP = (0.5, 0.05)  # rms_eps, hc_eps: large enough to matter


def _inputs(shape, dtype, requires_grad, param_dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n, C = shape[-2:]
    X = torch.randn(*shape, generator=g).to(DEVICE, dtype).requires_grad_(requires_grad)
    fn = (torch.randn(n, n * C, generator=g) / (n * C) ** 0.5).to(DEVICE, param_dtype).requires_grad_(requires_grad)
    scale = torch.tensor([3.0]).to(DEVICE, param_dtype).requires_grad_(requires_grad)
    base = torch.randn(n, generator=g).to(DEVICE, param_dtype).requires_grad_(requires_grad)
    return X, fn, scale, base


@pytest.mark.parametrize("shape", [(5, 4, 8), (2, 3, 2, 8), (3, 8, 4)], ids=["T5-n4", "lead-n2", "T3-n8"])
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_forward(shape, dtype, param_dtype, requires_grad):
    args = _inputs(shape, dtype, requires_grad, param_dtype)
    torch.library.opcheck(torch.ops.cakeops.mhc_gated_head_fwd.default, (*args, *HP, True), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_opcheck_backward(n, dtype):
    X, fn, scale, base = _inputs((5, n, 8), dtype, False)
    stats = reference.forward_stats(X, fn, scale, base, *HP).float()
    dY = torch.randn(5, 8, device=DEVICE, dtype=dtype)
    torch.library.opcheck(torch.ops.cakeops.mhc_gated_head_bwd.default, (dY, X, fn, scale, base, stats, *HP, True),
                          test_utils=OPCHECK_TESTS)


class TinyModel(torch.nn.Module):
    """Embedding-like input -> n streams -> one mHC layer (an MLP branch) -> the gated head -> a linear."""

    def __init__(self, C, n=4):
        super().__init__()
        self.expand = cakeops.nn.StreamExpand(n)
        mlp = torch.nn.Sequential(torch.nn.Linear(C, 2 * C), torch.nn.GELU(), torch.nn.Linear(2 * C, C))
        self.layer = cakeops.nn.MHC(mlp, C, n, sinkhorn_iters=3, rms_eps=HP[0], hc_eps=HP[1])
        self.head = cakeops.nn.MHCHead(gated=True, hidden_size=C, n_streams=n, rms_eps=HP[0], hc_eps=HP[1])
        with torch.no_grad():
            self.head.scale.fill_(3.0)  # gates far from their initial 1/n
        self.out = torch.nn.Linear(C, C)

    def forward(self, h):
        return self.out(self.head(self.layer(self.expand(h))))


def test_fullgraph_model_ending_with_the_gated_head_has_eager_gradients():
    torch.manual_seed(3)
    model = TinyModel(16).to(DEVICE)
    h = torch.randn(2, 6, 16, device=DEVICE)
    g = torch.randn(2, 6, 16, device=DEVICE)
    assert_fullgraph_equals_eager(model, h, g)


def test_gated_head_alone_n2_dynamic_tokens_do_not_recompile():
    head = cakeops.nn.MHCHead(gated=True, hidden_size=8, n_streams=2).to(DEVICE)
    inputs = ((torch.randn(T, 2, 8, device=DEVICE), torch.randn(T, 8, device=DEVICE)) for T in (5, 11, 19))
    assert_dynamic_tokens_compile_once(head, inputs)


def test_aot_graphs_hold_the_two_ops(opaque_ops):
    """The forward graph runs mhc_gated_head_fwd; the backward graph mhc_gated_head_bwd on the saved record, and
    nothing copies X or the tangent."""
    X, fn, scale, base = _inputs((4, 4, 8), torch.float32, True, seed=4)

    def head(X, fn, scale, base):
        return cake_mhc_train_gated_head(X, fn, scale, base, rms_eps=HP[0], hc_eps=HP[1])

    graphs = aot_graph_codes(head, X, fn, scale, base)
    assert "torch.ops.cakeops.mhc_gated_head_fwd.default(primals_1, primals_2, primals_3, primals_4, 0.5, 0.05, True)" \
        in graphs["forward"]
    assert graphs["backward"].count("torch.ops.cakeops.mhc_gated_head_bwd.default(tangents_1, primals_1") == 1
    for code in graphs.values():
        assert "clone" not in code and "copy" not in code


def test_inductor_compiles_the_model_with_eager_gradients():
    """Inductor (one test: ~30 s of C++ codegen on a CPU) lowers the head ops through the explicit fallbacks."""
    from cakeops._ops import inductor

    torch._dynamo.reset()
    torch.manual_seed(5)
    model = TinyModel(8).to(DEVICE)
    h = torch.randn(3, 8, device=DEVICE)
    g = torch.randn(3, 8, device=DEVICE)
    compiled = torch.compile(model, fullgraph=True)
    for got, ref in zip(grads_after(compiled, h, g), grads_after(model, h, g)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    assert {"cakeops::mhc_gated_head_fwd", "cakeops::mhc_gated_head_bwd"} <= set(inductor.fallbacks_registered())
