"""What the eager autograd Functions share.

Their backwards are first order: their kernels write gradients that carry no graph of their own. A backward
asked to build one (``create_graph=True``: double backward, Hessian-vector products, gradient penalties through a
cakeops layer) raises at once, as a compiled model does, where it would otherwise return a second derivative that
is silently wrong (the reference path) or fail later without saying why. torch.func transforms are refused in
cakeops' terms too (``EagerFunction``)."""
import functools

import torch


def first_order(what: str):
    """Decorates an autograd.Function's ``backward``: raises when a graph of the gradients is being built (grad
    mode on inside the backward, an incoming gradient that requires grad: torch's own test in
    ``once_differentiable``), and runs it without grad otherwise, so that no partial graph is ever returned."""
    def decorate(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            # The engine runs a backward with grad mode as create_graph asks: off in the common case, where
            # no_grad would change nothing and costs as much as the rest of this wrapper.
            if not torch.is_grad_enabled():
                return backward(ctx, *grads)
            if any(isinstance(g, torch.Tensor) and g.requires_grad for g in grads):
                raise RuntimeError(
                    f"{what}: its backward is first order; a backward with create_graph=True through it (double "
                    f"backward, a Hessian-vector product, a gradient penalty) is not supported by cakeops")
            with torch.no_grad():
                return backward(ctx, *grads)
        return checked
    return decorate


class EagerFunction(torch.autograd.Function):
    """Base of the eager autograd Functions: under a torch.func transform (grad, vmap, jvp, jacrev) ``apply``
    says in cakeops' terms that they are not supported, where torch would ask for a ``setup_context``."""
    what = "this cakeops layer"

    @classmethod
    def apply(cls, *args, **kwargs):
        if torch._C._are_functorch_transforms_active():
            raise NotImplementedError(
                f"{cls.what}: torch.func transforms (grad, vmap, jvp, jacrev, functional_call under them) are not "
                f"supported; use torch.autograd.grad / .backward() for gradients and loop instead of vmap")
        if cls.setup_context is not _NO_SETUP_CONTEXT:
            return super().apply(*args, **kwargs)
        # What torch.autograd.Function.apply does without transforms and without a setup_context, minus its
        # generic Python (two more frames and a generator per call): tensors that outlived a transform unwrapped,
        # then the C apply.
        return _C_APPLY.__get__(None, cls)(*[_unwrap_if_dead(a) if isinstance(a, torch.Tensor) else a
                                             for a in args], **kwargs)


_NO_SETUP_CONTEXT = EagerFunction.setup_context
_C_APPLY = torch._C._FunctionBase.__dict__["apply"]
_unwrap_if_dead = torch._C._functorch.unwrap_if_dead
