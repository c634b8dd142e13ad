"""How Inductor runs the cakeops ops: as explicit fallback kernels, registered when Inductor is loaded.

Inductor gives a custom op that has no lowering an *implicit* fallback the first time it meets it. torch 2.11
and 2.12 then format ``log.info("Creating implicit fallback for: ...")`` eagerly, whatever the log level, and an
IR node's text embeds the text of its inputs' producers: exponential in depth for an op first met deep in a
graph. A model of 8 mHC layers did not finish compiling in 10 minutes that way (the head op first appears after
the last layer, the backward ops at the far end of the backward graph). torch 2.13 formats lazily.

The fix here is to register, for every cakeops op, the very lowering the implicit path would create -- a
fallback kernel with the layout constraint of the op's tags -- before Inductor lowers a graph, so the implicit
path (and its log line) is never taken. Compiled code is the same as with the implicit fallback, on every
supported torch, and compile time is linear in depth.

Why not ``torch.library.triton_op`` + ``wrap_triton`` (Inductor traces into the op and sees the Triton kernels):
the ops pick their implementation at run time (Triton on CUDA, the reference math on CPU, the interpreter in
tests), their launchers own host-side work that tracing would have to reproduce symbolically (launch shapes
from the GPU's SM count, device switches, workspaces), and compiled results would stop being the eager bits.
The fallback keeps one implementation per op, called the same way eagerly and compiled.

``make_fallback`` and the layout-constraint helpers are Inductor internals (the same calls the implicit path
makes). Importing Inductor costs 2-3 s, so registration waits until Inductor is loaded: the ops' fake
implementations check on each call (a dict lookup) and register once; Inductor always traces a graph through
them (AOTAutograd) before it lowers it. If the internals ever move, the ops keep working through the implicit
path, with a warning on the torch versions whose implicit path is slow at depth.
"""
import functools
import sys
import warnings
from typing import Callable, List

import torch

_OPS: List[torch._ops.OpOverload] = []
_registered = False


def register_fake(op, fake: Callable) -> None:
    """``op.register_fake(fake)``, with the fallbacks registered on the first call made while Inductor is loaded."""
    _OPS.append(getattr(torch.ops.cakeops, op._name).default)

    @functools.wraps(fake)
    def fake_registering_fallbacks(*args, **kwargs):
        if not _registered:
            register_fallbacks_if_inductor_loaded()
        return fake(*args, **kwargs)

    op.register_fake(fake_registering_fallbacks)


def register_fallbacks_if_inductor_loaded() -> bool:
    """Registers the fallback lowering of every cakeops op once Inductor's lowering module is imported."""
    global _registered
    if _registered or "torch._inductor.lowering" not in sys.modules:
        return _registered
    _registered = True
    try:
        from torch._inductor import lowering
        from torch._library.utils import get_layout_constraint_tag

        for op in _OPS:
            if op not in lowering.lowerings:
                constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
                lowering.make_fallback(op, layout_constraint=constraint, warn=False)
    except (ImportError, AttributeError, TypeError) as error:  # Inductor internals moved: implicit fallbacks
        if torch.__version__ < "2.13":
            warnings.warn(f"cakeops could not register its Inductor fallbacks ({error!r}); deep models may compile "
                          "slowly on this torch.", RuntimeWarning, stacklevel=2)
    return True


def fallbacks_registered() -> List[str]:
    """Names of the cakeops ops that Inductor lowers through the explicit fallback (for tests)."""
    if "torch._inductor.lowering" not in sys.modules:
        return []
    from torch._inductor.lowering import lowerings

    return [op.name() for op in _OPS if op in lowerings]
