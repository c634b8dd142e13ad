"""RMSNorm under torch.library.opcheck and torch.compile: schemas, fakes, no graph breaks, dynamic T, graphs."""
import pytest
import torch
import torch._dynamo
from expecttest import assert_expected_inline
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd

import cakeops
from cakeops.cake_rmsnorm_train import cake_rmsnorm
from cakeops.nn import RMSNorm
from conftest import DEVICE
from graph_tools import aot_graph_codes, assert_dynamic_tokens_compile_once, assert_fullgraph_equals_eager, grads_after

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                 "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_opcheck_forward_ops(dtype, requires_grad, with_residual):
    torch.manual_seed(0)
    x = torch.randn(6, 40, device=DEVICE, dtype=dtype, requires_grad=requires_grad)
    w = torch.randn(40, device=DEVICE, dtype=dtype, requires_grad=requires_grad)
    if with_residual:
        r = torch.randn(6, 40, device=DEVICE, dtype=dtype, requires_grad=requires_grad)
        torch.library.opcheck(torch.ops.cakeops.add_rmsnorm_fwd.default, (x, r, w, 1e-6, True), test_utils=OPCHECK_TESTS)
    else:
        torch.library.opcheck(torch.ops.cakeops.rmsnorm_fwd.default, (x, w, 1e-6, True), test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_opcheck_backward_op(dtype, with_residual):
    torch.manual_seed(1)
    x = torch.randn(6, 40, device=DEVICE, dtype=dtype)
    w = torch.randn(40, device=DEVICE, dtype=torch.float32)
    rstd = torch.rand(6, device=DEVICE) + 0.5
    g = torch.randn_like(x)
    gres = torch.randn_like(x) if with_residual else None
    torch.library.opcheck(torch.ops.cakeops.rmsnorm_bwd.default, (g, x, w, rstd, gres, True), test_utils=OPCHECK_TESTS)


class TinyBlock(torch.nn.Module):
    """Pre-norm residual block: the shape of code people compile."""

    def __init__(self, hidden):
        super().__init__()
        self.norm1 = cakeops.nn.RMSNorm(hidden)
        self.proj = torch.nn.Linear(hidden, hidden)
        self.norm2 = cakeops.nn.RMSNorm(hidden)

    def forward(self, x):
        h = self.proj(self.norm1(x))
        y, stream = self.norm2(h, x)
        return y * stream.sigmoid()




def _block(hidden=32):
    torch.manual_seed(2)
    block = TinyBlock(hidden).to(DEVICE)
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return block


def test_fullgraph_no_graph_breaks_and_eager_equal_gradients():
    block = _block()
    x = torch.randn(2, 5, 32, device=DEVICE)
    g = torch.randn(2, 5, 32, device=DEVICE)
    assert_fullgraph_equals_eager(block, x, g)


def test_inductor_fullgraph_matches_eager():
    torch._dynamo.reset()
    block = _block(24)
    x = torch.randn(3, 24, device=DEVICE)
    g = torch.randn(3, 24, device=DEVICE)
    compiled = torch.compile(block, fullgraph=True)
    for got, ref in zip(grads_after(compiled, x, g), grads_after(block, x, g)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend_name", ["aot_eager", "inductor"])
def test_no_weight_norm_compiles_fullgraph_and_matches_eager(backend_name):
    """The no-weight form's ones are made in the graph (no buffer, no cached tensor captured): same values and
    input gradient as eager, and eager's own cache is left as it was."""
    torch._dynamo.reset()
    norm = RMSNorm(24, elementwise_affine=False)
    x = torch.randn(3, 5, 24, device=DEVICE, requires_grad=True)
    g = torch.randn(3, 5, 24, device=DEVICE)
    want = torch.autograd.grad(norm(x), x, g)[0]
    cached = dict(norm._ones)
    compiled = torch.compile(norm, fullgraph=True, backend=backend_name)
    y = compiled(x)
    torch.testing.assert_close(y, norm(x), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(torch.autograd.grad(y, x, g)[0], want, rtol=1e-5, atol=1e-6)
    assert norm._ones.keys() == cached.keys() and all(norm._ones[k] is v for k, v in cached.items())


def test_dynamic_tokens_do_not_recompile():
    block = _block()
    inputs = ((torch.randn(T, 32, device=DEVICE), torch.randn(T, 32, device=DEVICE)) for T in (7, 13, 29, 64))
    assert_dynamic_tokens_compile_once(block, inputs)


def _aot_graphs(fn, *args):
    graphs = aot_graph_codes(fn, *args)
    for code in graphs.values():  # no stray copies of [T, H] tensors around the kernels
        assert "clone" not in code and "copy_" not in code and ".copy." not in code
    return graphs


def test_aot_graphs_plain(opaque_ops):
    x = torch.randn(8, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(16, device=DEVICE, requires_grad=True)
    graphs = _aot_graphs(lambda x, w: cake_rmsnorm(x, w, 1e-6), x, w)
    assert_expected_inline(graphs["forward"], """\
def forward(self, primals_1, primals_2):
    rmsnorm_fwd = torch.ops.cakeops.rmsnorm_fwd.default(primals_1, primals_2, 1e-06, True)
    getitem = rmsnorm_fwd[0]
    getitem_1 = rmsnorm_fwd[1];  rmsnorm_fwd = None
    detach = torch.ops.aten.detach.default(getitem_1);  getitem_1 = None
    _unsafe_view = torch.ops.aten._unsafe_view.default(getitem, [8, 16]);  getitem = None
    return (_unsafe_view, primals_1, primals_2, detach)""")
    assert_expected_inline(graphs["backward"], """\
def forward(self, primals_1, primals_2, detach, tangents_1):
    view = torch.ops.aten.view.default(tangents_1, [8, 16]);  tangents_1 = None
    detach_1 = torch.ops.aten.detach.default(detach);  detach = None
    rmsnorm_bwd = torch.ops.cakeops.rmsnorm_bwd.default(view, primals_1, primals_2, detach_1, None, True);  view = primals_1 = primals_2 = detach_1 = None
    getitem_2 = rmsnorm_bwd[0]
    getitem_3 = rmsnorm_bwd[1];  rmsnorm_bwd = None
    return (getitem_2, getitem_3)""")


def test_aot_graphs_residual(opaque_ops):
    x = torch.randn(8, 16, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(8, 16, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(16, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    graphs = _aot_graphs(lambda x, r, w: cake_rmsnorm(x, w, 1e-6, r), x, r, w)
    assert_expected_inline(graphs["forward"], """\
def forward(self, primals_1, primals_2, primals_3):
    add_rmsnorm_fwd = torch.ops.cakeops.add_rmsnorm_fwd.default(primals_1, primals_3, primals_2, 1e-06, True);  primals_1 = primals_3 = None
    getitem = add_rmsnorm_fwd[0]
    getitem_1 = add_rmsnorm_fwd[1]
    getitem_2 = add_rmsnorm_fwd[2];  add_rmsnorm_fwd = None
    detach = torch.ops.aten.detach.default(getitem_2)
    detach_1 = torch.ops.aten.detach.default(getitem_1);  getitem_1 = None
    _unsafe_view = torch.ops.aten._unsafe_view.default(getitem, [8, 16]);  getitem = None
    _unsafe_view_1 = torch.ops.aten._unsafe_view.default(getitem_2, [8, 16]);  getitem_2 = None
    return (_unsafe_view, _unsafe_view_1, primals_2, detach, detach_1)""")
    assert_expected_inline(graphs["backward"], """\
def forward(self, primals_2, detach, detach_1, tangents_1, tangents_2):
    view = torch.ops.aten.view.default(tangents_2, [8, 16]);  tangents_2 = None
    view_1 = torch.ops.aten.view.default(tangents_1, [8, 16]);  tangents_1 = None
    detach_2 = torch.ops.aten.detach.default(detach);  detach = None
    detach_3 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
    rmsnorm_bwd = torch.ops.cakeops.rmsnorm_bwd.default(view_1, detach_2, primals_2, detach_3, view, True);  view_1 = detach_2 = primals_2 = detach_3 = view = None
    getitem_3 = rmsnorm_bwd[0]
    getitem_4 = rmsnorm_bwd[1];  rmsnorm_bwd = None
    return (getitem_3, getitem_4, getitem_3)""")


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("shape", [(8, 16), (2, 4, 16)], ids=["2d", "3d"])
def test_outputs_are_not_views_to_regenerate(shape, with_residual):
    """y and h_new leave the compiled graph as plain outputs: none aliases an intermediate, which AOTAutograd would
    hide with an ``aten._unsafe_view`` dispatched per output at every call (host time)."""
    seen = []

    def forward_compiler(gm, example_inputs):
        seen.append([str(o.output_type) for o in torch._guards.TracingContext.get().fw_metadata.output_info])
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=forward_compiler, bw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    x = torch.randn(*shape, device=DEVICE, requires_grad=True)
    w = torch.randn(shape[-1], device=DEVICE, requires_grad=True)
    r = torch.randn(*shape, device=DEVICE, requires_grad=True) if with_residual else None
    torch._dynamo.reset()
    torch.compile(lambda x, w, r: cake_rmsnorm(x, w, 1e-6, r), fullgraph=True, backend=backend)(x, w, r)
    assert seen == [["OutputType.non_alias"] * (2 if with_residual else 1)]
