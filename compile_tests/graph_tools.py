"""What the compile tests share: gradients of a model, the fullgraph-equals-eager and dynamic-tokens checks, a
backend that counts compilations, the AOT graphs."""
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


def grads_after(model, x, g, dynamic_dim=None):
    """[x.grad, *param grads] after ``model(x).backward(g)`` on a fresh leaf copy of x."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    if dynamic_dim is not None:
        torch._dynamo.mark_dynamic(x, dynamic_dim)
    model(x).backward(g)
    return [x.grad] + [p.grad for p in model.parameters()]


def assert_fullgraph_equals_eager(model, x, g):
    """``model`` traces to one graph without breaks, and compiled fullgraph (aot_eager) its gradients equal
    eager's bit for bit: the same kernels run on both paths."""
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    for k, (got, ref) in enumerate(zip(grads_after(compiled, x, g), grads_after(model, x, g))):
        assert torch.equal(got, ref), f"gradient {k} (0: x, then the parameters) differs from eager"


def assert_dynamic_tokens_compile_once(model, inputs):
    """``model`` compiled fullgraph (a counting aot_eager, after a dynamo reset) with the token dim 0 of x
    dynamic: over ``inputs``, pairs (x, g) of different token counts, its gradients equal eager's bit for bit
    and it compiles once."""
    torch._dynamo.reset()
    compiles = []
    compiled = torch.compile(model, fullgraph=True, backend=counting_aot_eager(compiles))
    for x, g in inputs:
        for k, (got, ref) in enumerate(zip(grads_after(compiled, x, g, dynamic_dim=0), grads_after(model, x, g))):
            assert torch.equal(got, ref), f"T={x.shape[0]}: gradient {k} (0: x, then the parameters) differs"
    assert len(compiles) == 1, f"{len(compiles)} compilations"


def counting_aot_eager(compiles: list):
    """aot_eager that appends every graph it compiles to ``compiles``."""
    def backend(gm, example_inputs):
        compiles.append(gm)
        return torch._dynamo.backends.debugging.aot_eager(gm, example_inputs)
    return backend


def aot_graph_codes(fn, *args, backward_grads=None):
    """{"forward": code, "backward": code} of ``torch.compile(fn, fullgraph=True)`` through AOTAutograd, after a
    backward with random upstream gradients (or ``backward_grads``)."""
    torch._dynamo.reset()
    graphs = {}

    def capture(name):
        def compiler(gm, example_inputs):
            graphs[name] = gm.code.strip()
            return make_boxed_func(gm.forward)
        return compiler

    backend = aot_autograd(fw_compiler=capture("forward"), bw_compiler=capture("backward"))
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    grads = backward_grads if backward_grads is not None else [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    return graphs
