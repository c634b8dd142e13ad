"""What the compile tests share: gradients of a model, a backend that counts compilations, the AOT graphs."""
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
