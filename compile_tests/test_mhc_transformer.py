"""A 2-layer mHC transformer (attention and MLP branches, cakeops RMSNorm pre-norms) under torch.compile:
no graph breaks, loss and gradients equal to eager, dynamic sequence length, the cakeops op sequence of the
forward and backward graphs, CUDA graphs (GPU) and torch.export."""
import re

import pytest
import torch
import torch._dynamo
from expecttest import assert_expected_inline

from cakeops.tiny_lm import TinyLM
from conftest import DEVICE, ON_GPU
from graph_tools import aot_graph_codes, counting_aot_eager

VOCAB, DIM = 48, 32


def _model(seed=0, layers=2, **kw):
    torch.manual_seed(seed)
    return TinyLM(VOCAB, DIM, layers=layers, heads=4, **kw).to(DEVICE)


def _tokens(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=g).to(DEVICE)


def _loss_and_grads(loss_fn, model, tokens):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(tokens)
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


def _assert_same(a, b, exact):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    pairs = [(loss_a, loss_b)] + list(zip(grads_a, grads_b))
    for x, y in pairs:
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)


def test_no_graph_breaks():
    model = _model()
    explanation = torch._dynamo.explain(model.loss)(_tokens(2, 9, 1))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1


def test_compiled_training_step_equals_eager():
    model = _model()
    tokens = _tokens(3, 17, 2)
    compiled = torch.compile(model.loss, fullgraph=True, backend="aot_eager")
    _assert_same(_loss_and_grads(compiled, model, tokens), _loss_and_grads(model.loss, model, tokens), exact=True)


def test_dynamic_sequence_length_does_not_recompile():
    torch._dynamo.reset()
    compiles = []
    model = _model()
    compiled = torch.compile(model.loss, fullgraph=True, backend=counting_aot_eager(compiles))
    for i, length in enumerate((9, 13, 21)):
        tokens = _tokens(2, length, 10 + i)
        torch._dynamo.mark_dynamic(tokens, 1)
        _assert_same(_loss_and_grads(compiled, model, tokens), _loss_and_grads(model.loss, model, tokens), exact=True)
    assert len(compiles) == 1


def _cakeops_ops(code: str):
    return re.findall(r"torch\.ops\.cakeops\.(\w+)\.default", code)


def test_op_sequence_of_the_graphs(opaque_ops):
    model = _model()
    graphs = aot_graph_codes(model.loss, _tokens(2, 9, 3))
    assert_expected_inline(" ".join(_cakeops_ops(graphs["forward"])), """mhc_prepare rmsnorm_fwd mhc_finish mhc_prepare rmsnorm_fwd mhc_finish mhc_prepare rmsnorm_fwd mhc_finish mhc_prepare rmsnorm_fwd mhc_finish mhc_head_fwd rmsnorm_fwd""")
    assert_expected_inline(" ".join(_cakeops_ops(graphs["backward"])), """rmsnorm_bwd mhc_head_bwd mhc_backward_prepare rmsnorm_bwd mhc_backward_finish mhc_backward_prepare rmsnorm_bwd mhc_backward_finish mhc_backward_prepare rmsnorm_bwd mhc_backward_finish mhc_backward_prepare rmsnorm_bwd mhc_backward_finish""")
    # one dX producer per mHC layer: every X gradient comes out of mhc_backward_finish
    assert _cakeops_ops(graphs["backward"]).count("mhc_backward_finish") == 4


def test_plain_residual_twin_compiles_too():
    model = _model(hyper_connections=False)
    tokens = _tokens(2, 11, 4)
    compiled = torch.compile(model.loss, fullgraph=True, backend="aot_eager")
    _assert_same(_loss_and_grads(compiled, model, tokens), _loss_and_grads(model.loss, model, tokens), exact=True)


def test_export_forward():
    model = _model().eval()
    tokens = _tokens(2, 9, 5)
    exported = torch.export.export(model, (tokens,))
    text = str(exported.graph)
    assert "cakeops.mhc_prepare" in text and "cakeops.mhc_finish" in text and "cakeops.mhc_head_fwd" in text
    with torch.no_grad():
        assert torch.equal(exported.module()(tokens), model(tokens))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_reduce_overhead_cuda_graphs_four_steps():
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    model = _model(seed=6)
    twin = _model(seed=6)
    compiled = torch.compile(model.loss, fullgraph=True, mode="reduce-overhead")
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(twin.parameters(), lr=0.1)
    for step in range(4):
        tokens = _tokens(4, 33, 100 + step)
        a = _loss_and_grads(compiled, model, tokens)
        b = _loss_and_grads(twin.loss, twin, tokens)
        _assert_same(a, b, exact=False)  # Inductor fuses the non-cakeops ops differently
        opt_a.step()
        opt_b.step()
    from torch._dynamo.utils import counters
    assert counters["inductor"]["cudagraph_skips"] == 0


def test_inductor_training_step_close_to_eager():
    """Inductor around the custom ops (the zero-stride edges included): one compile, ~15 s on a CPU."""
    torch._dynamo.reset()
    model = _model(seed=7)
    tokens = _tokens(4, 33 if ON_GPU else 9, 7)
    compiled = torch.compile(model.loss, fullgraph=True)
    _assert_same(_loss_and_grads(compiled, model, tokens), _loss_and_grads(model.loss, model, tokens), exact=False)


@pytest.mark.parametrize("forward", ["compiled", "compiled_before", "eager"])
def test_compiled_autograd_gives_eager_gradients(forward):
    """The backward traced by compiled autograd.
    - "compiled": forward compiled inside compiled autograd's context; the backward is one graph of the cakeops
      backward ops (they stay ops there even where torch.compile traces their kernels: cakeops/_ops/inductor.py).
    - "compiled_before": forward compiled before compiled autograd is switched on; same gradients. On a GPU its
      backward graph holds the traced kernels, which compiled autograd's Dynamo cannot trace (graph breaks,
      results right), so one graph is asserted only where the backward ops are ops.
    - "eager": the autograd.Function path; it still runs and gives the same gradients."""
    from torch._dynamo import compiled_autograd

    from cakeops._ops import inductor

    torch._dynamo.reset()
    # one block (two mHC layers and the head): compiled autograd's Dynamo traces the eager path's backward node by
    # node with symbolic sizes, ~3x as long at two blocks
    model = _model(seed=8, layers=1)
    tokens = _tokens(2, 9, 8)
    reference = _loss_and_grads(model.loss, model, tokens)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward

    loss_fn = model.loss if forward == "eager" else torch.compile(model.loss, fullgraph=True, backend="aot_eager")
    model.zero_grad(set_to_none=True)
    if forward == "compiled_before":
        loss = loss_fn(tokens)
    with compiled_autograd._enable(torch.compile(backend=backend)):
        if forward != "compiled_before":
            loss = loss_fn(tokens)
        loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads, reference[1]))
    traced_backward = ON_GPU and inductor._TRACE != "none"
    if forward == "compiled" or (forward == "compiled_before" and not traced_backward):
        assert len(graphs) == 1 and _cakeops_ops(graphs[0]).count("mhc_backward_finish") == 2
