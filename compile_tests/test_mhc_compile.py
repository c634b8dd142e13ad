"""mHC under torch.library.opcheck and torch.compile: every op opcheck-clean, a layer with an MLP branch traced
fullgraph with gradients equal to eager, dynamic T, and the AOT graphs (one dX producer, no copies)."""
import re

import pytest
import torch
import torch._dynamo
from expecttest import assert_expected_inline

from cakeops._ops import inductor
from cakeops.cake_mhc_train import cake_mhc_train_finish, cake_mhc_train_head, cake_mhc_train_prepare
from cakeops.meta import mhc as fake
from cakeops.meta.mhc_layout import GRAD_STATS_WIDTH
from cakeops.reference import mhc as reference
from conftest import DEVICE
from graph_tools import aot_graph_codes, assert_dynamic_tokens_compile_once, assert_fullgraph_equals_eager

N, M = 4, 24
OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_static",
                 "test_aot_dispatch_dynamic")
HP = (0.5, 0.05, 3)  # rms_eps, hc_eps, iters: eps large enough to matter, few iterations to keep it quick


def _inputs(T, C, dtype, requires_grad, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, N, C, generator=g).to(DEVICE, dtype).requires_grad_(requires_grad)
    fn = (torch.randn(M, N * C, generator=g) / (N * C) ** 0.5).to(DEVICE).requires_grad_(requires_grad)
    scale = torch.tensor([1.0, 1.0, 3.0], device=DEVICE).requires_grad_(requires_grad)
    base = torch.randn(M, generator=g).to(DEVICE).requires_grad_(requires_grad)
    return X, fn, scale, base


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck_forward_ops(dtype, requires_grad):
    X, fn, scale, base = _inputs(5, 8, dtype, requires_grad)
    B = torch.randn(5, 8, device=DEVICE, dtype=dtype, requires_grad=requires_grad)
    stats = reference.forward_stats(X.detach(), fn.detach(), scale.detach(), base.detach(), *HP).float()
    e_dy, e_gs = fake.edges(X.detach())
    cases = [
        (torch.ops.cakeops.mhc_prepare.default, (X, fn, scale, base, *HP, True)),
        (torch.ops.cakeops.mhc_stats.default, (X.detach(), fn.detach(), scale.detach(), base.detach(), *HP)),
        (torch.ops.cakeops.mhc_finish.default,
         (X, B, stats, e_dy.requires_grad_(requires_grad), e_gs.requires_grad_(requires_grad))),
        (torch.ops.cakeops.mhc_head_fwd.default, (X,)),
        (torch.ops.cakeops.mhc_head_bwd.default, (torch.randn(5, 8, device=DEVICE, dtype=dtype), N)),
    ]
    for op, op_args in cases:
        torch.library.opcheck(op, op_args, test_utils=OPCHECK_TESTS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_opcheck_backward_ops(dtype):
    X, fn, scale, base = (t.detach() for t in _inputs(5, 8, dtype, False, seed=1))
    stats = reference.forward_stats(X, fn, scale, base, *HP).float()
    dY = torch.randn(5, N, 8, device=DEVICE, dtype=dtype)
    B = torch.randn(5, 8, device=DEVICE, dtype=dtype)
    gs = reference.backward_prepare(dY, B, X, stats)[1]
    dU = torch.randn(5, 8, device=DEVICE, dtype=dtype)
    torch.library.opcheck(torch.ops.cakeops.mhc_backward_prepare.default, (dY, B, X, stats), test_utils=OPCHECK_TESTS)
    torch.library.opcheck(torch.ops.cakeops.mhc_backward_finish.default,
                          (X, dY, dU, fn, scale, base, stats, gs, *HP, True), test_utils=OPCHECK_TESTS)


class MHCLayer(torch.nn.Module):
    """prepare -> small MLP branch -> finish, with the mapping as parameters."""

    def __init__(self, C, seed=2):
        super().__init__()
        _, fn, scale, base = _inputs(1, C, torch.float32, False, seed)
        self.fn, self.scale, self.base = (torch.nn.Parameter(t) for t in (fn, scale, base))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(C, 2 * C), torch.nn.GELU(), torch.nn.Linear(2 * C, C))

    def forward(self, X):
        U, handle = cake_mhc_train_prepare(X, self.fn, self.scale, self.base, rms_eps=HP[0], hc_eps=HP[1],
                                           sinkhorn_iters=HP[2])
        Y = cake_mhc_train_finish(X, self.mlp(U), handle)
        return cake_mhc_train_head(Y)


def test_fullgraph_layer_no_graph_breaks_and_eager_equal_gradients():
    torch.manual_seed(3)
    layer = MHCLayer(16).to(DEVICE)
    X = torch.randn(6, N, 16, device=DEVICE)
    g = torch.randn(6, 16, device=DEVICE)
    assert_fullgraph_equals_eager(layer, X, g)


def test_dynamic_tokens_do_not_recompile():
    layer = MHCLayer(8).to(DEVICE)
    inputs = ((torch.randn(T, N, 8, device=DEVICE), torch.randn(T, 8, device=DEVICE)) for T in (5, 11, 19))
    assert_dynamic_tokens_compile_once(layer, inputs)


def test_aot_graphs_of_a_layer(opaque_ops):
    """The forward holds mhc_prepare and mhc_finish; the backward mhc_backward_prepare and mhc_backward_finish,
    which alone produces dX, and the dY tangent goes into it untouched (no copy of the edge)."""
    X, fn, scale, base = _inputs(4, 8, torch.float32, True, seed=4)

    def layer(X, fn, scale, base):
        U, handle = cake_mhc_train_prepare(X, fn, scale, base, rms_eps=HP[0], hc_eps=HP[1], sinkhorn_iters=HP[2])
        return cake_mhc_train_finish(X, torch.tanh(U), handle)

    graphs = aot_graph_codes(layer, X, fn, scale, base)
    for code in graphs.values():
        assert "clone" not in code and "copy" not in code
    assert_expected_inline(graphs["forward"], """\
def forward(self, primals_1, primals_2, primals_3, primals_4):
    mhc_prepare = torch.ops.cakeops.mhc_prepare.default(primals_1, primals_2, primals_3, primals_4, 0.5, 0.05, 3, True)
    getitem = mhc_prepare[0]
    getitem_1 = mhc_prepare[1]
    getitem_2 = mhc_prepare[2]
    getitem_3 = mhc_prepare[3];  mhc_prepare = None
    detach = torch.ops.aten.detach.default(getitem_1)
    tanh = torch.ops.aten.tanh.default(getitem);  getitem = None
    detach_1 = torch.ops.aten.detach.default(tanh)
    mhc_finish = torch.ops.cakeops.mhc_finish.default(primals_1, tanh, getitem_1, getitem_2, getitem_3);  getitem_2 = getitem_3 = None
    return (mhc_finish, primals_1, primals_2, primals_3, primals_4, getitem_1, detach, tanh, detach_1)""")
    assert_expected_inline(graphs["backward"], """\
def forward(self, primals_1, primals_2, primals_3, primals_4, getitem_1, detach, tanh, detach_1, tangents_1):
    mhc_backward_prepare = torch.ops.cakeops.mhc_backward_prepare.default(tangents_1, tanh, primals_1, getitem_1);  tanh = getitem_1 = None
    getitem_4 = mhc_backward_prepare[0]
    getitem_5 = mhc_backward_prepare[1];  mhc_backward_prepare = None
    detach_2 = torch.ops.aten.detach.default(detach_1);  detach_1 = None
    tanh_backward = torch.ops.aten.tanh_backward.default(getitem_4, detach_2);  getitem_4 = detach_2 = None
    detach_3 = torch.ops.aten.detach.default(detach);  detach = None
    mhc_backward_finish = torch.ops.cakeops.mhc_backward_finish.default(primals_1, tangents_1, tanh_backward, primals_2, primals_3, primals_4, detach_3, getitem_5, 0.5, 0.05, 3, True);  primals_1 = tangents_1 = tanh_backward = primals_2 = primals_3 = primals_4 = detach_3 = getitem_5 = None
    getitem_6 = mhc_backward_finish[0]
    getitem_7 = mhc_backward_finish[1]
    getitem_8 = mhc_backward_finish[2]
    getitem_9 = mhc_backward_finish[3];  mhc_backward_finish = None
    return (getitem_6, getitem_7, getitem_8, getitem_9)""")


@pytest.mark.parametrize("T", [0, 1, 300])
def test_edges_hold_and_write_one_element(T):
    """The edges are zero-stride views of one zeroed element, and making them writes that element only: a
    zero_() over the [T, n, C] shape would touch T*n*C positions (a 268M-element fill per layer at C = 4096)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Writes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.is_mutable:
                self.sizes.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    X = torch.randn(T, N, 64, device=DEVICE, dtype=torch.bfloat16)
    with Writes() as log:
        e_dy, e_gs = fake.edges(X)
    assert all(size <= 1 for size in log.sizes), log.sizes
    assert e_dy.shape == X.shape and e_gs.shape == (T, GRAD_STATS_WIDTH)
    for e in (e_dy, e_gs):
        assert set(e.stride()) == {0} and e.untyped_storage().nbytes() <= e.element_size()
        assert torch.count_nonzero(e) == 0


def test_edges_stay_edges_through_aot_autograd():
    """Where torch.compile traces the prepare op's body (CAKEOPS_INDUCTOR_KERNELS=1 on a GPU), its edges go through
    AOTAutograd's functionalization: they must come out as they went in, zero-stride zeros of one element (made by
    zeroing one element through an as_strided view, they came out as full contiguous tensors of garbage)."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function

    X = torch.randn(7, N, 64, device=DEVICE, dtype=torch.bfloat16)
    outs = aot_function(fake.edges, fw_compiler=lambda gm, _: make_boxed_func(gm.forward))(X)
    for e, want in zip(outs, fake.edges(X)):
        assert e.shape == want.shape and set(e.stride()) == {0}, (e.shape, e.stride())
        assert e.untyped_storage().nbytes() <= e.element_size() and torch.count_nonzero(e) == 0


def test_inductor_runs_the_four_ops_and_nothing_else():
    """What Inductor actually runs for a layer with an identity branch, forward and backward: the four cakeops
    ops in order, no kernel of its own, no copy of any input, tangent or edge (the edges cost no traffic)."""
    X, fn, scale, base = _inputs(4, 8, torch.bfloat16, True, seed=5)

    def layer(X, fn, scale, base):
        U, handle = cake_mhc_train_prepare(X, fn, scale, base, rms_eps=HP[0], hc_eps=HP[1], sinkhorn_iters=HP[2])
        return cake_mhc_train_finish(X, U, handle)

    calls = _inductor_calls(layer, X, fn, scale, base)
    if X.is_cuda and inductor._TRACE != "none":  # the ops' kernels, launched by Inductor's code: none of its own
        assert len(calls) >= 8 and all(re.fullmatch(r"_\w+_kernel_\d+\.run", c) for c in calls), calls
    else:  # each op's unchecked twin (cakeops/_ops/inductor.py): its fake checked the arguments at trace time
        assert calls == [
            "torch.ops.cakeops.mhc_prepare_unchecked.default", "torch.ops.cakeops.mhc_finish_unchecked.default",
            "torch.ops.cakeops.mhc_backward_prepare_unchecked.default",
            "torch.ops.cakeops.mhc_backward_finish_unchecked.default"]

    def with_branch(X, fn, scale, base):  # the check sees Inductor's own kernels when there are some
        U, handle = cake_mhc_train_prepare(X, fn, scale, base, rms_eps=HP[0], hc_eps=HP[1], sinkhorn_iters=HP[2])
        return cake_mhc_train_finish(X, torch.tanh(U), handle)

    assert len(_inductor_calls(with_branch, X, fn, scale, base)) > 4


# Helpers of Inductor's generated wrapper that launch nothing (allocation, its own layout and metadata asserts,
# whose names vary across torch versions, streams, devices).
_WRAPPER_HELPERS = re.compile(r"(assert_\w+|empty_strided\w*|reinterpret_tensor|"
                              r"get_raw_stream|torch\.cuda\.\w+|torch\._C\.\w+|buf\w*\.\w+|args\.clear|len)$")


def _inductor_calls(fn, *args):
    """Every call Inductor's wrappers make in fn's forward + backward, helpers that launch nothing left out."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph would lower nothing
        _, codes = run_and_get_code(lambda: compiled(*args).backward(torch.randn_like(args[0])))
    calls = []
    for code in codes:
        lines = code[code.index("def call("):].splitlines()
        indent = len(lines[0]) - len(lines[0].lstrip())
        for line in lines[1:]:
            if line.strip() and len(line) - len(line.lstrip()) <= indent:
                break  # the end of call()
            m = re.match(r"\s+(?:\w+ = )?([A-Za-z_][\w.]*)\(", line)
            if m and not _WRAPPER_HELPERS.match(m.group(1)):
                calls.append(m.group(1))
    return calls
