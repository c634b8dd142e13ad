"""The FlashInfer-style functions (no autograd, caller-given buffers) under torch.compile (and dispatch modes).

Their eager bodies launch the kernels through cakeops' own launcher, which Dynamo cannot trace: a graph break, an
error under ``fullgraph=True``. While compiling (and under a dispatch mode: ``through_ops``), each function calls
its custom op's functional form instead -- the same kernels, launched (or, on a GPU, traced) by Inductor:
_ops/inductor.py -- and writes the results into the buffers the caller gave, as the eager call does. A caller
workspace is unused there: Inductor plans the scratch. Gradients stay out of it as in eager (``no_grad``): these
functions are the autograd-free layer.
"""
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from cakeops.meta import mhc as mhc_meta

from ._buffers import into

ops = torch.ops.cakeops

_dispatch_mode_hooks: List[Callable[[], None]] = []


def on_dispatch_mode(hook: Callable[[], None]) -> None:
    """``hook()`` runs whenever a call finds a dispatch mode active (``through_ops``), before it dispatches the
    ops: how the op layer above hears of modes (``_ops/flops.py`` puts its formulas into a FlopCounterMode)
    without this module importing it."""
    if hook not in _dispatch_mode_hooks:
        _dispatch_mode_hooks.append(hook)


def through_ops() -> bool:
    """True where a call must dispatch the custom ops (``torch.ops.cakeops.*``) rather than launch its kernels
    itself: under torch.compile (Dynamo cannot trace cakeops' launcher), and under any TorchDispatchMode --
    FakeTensorMode (shapes and memory without data), selective activation checkpointing's policy, FlopCounterMode,
    dispatch loggers -- since those see dispatched ops only (a direct launch would run on fake tensors, or be
    invisible to the policy)."""
    if torch.compiler.is_compiling():  # first: Dynamo need not trace the C call below
        return True
    if torch._C._len_torch_dispatch_stack() == 0:
        return False
    for hook in _dispatch_mode_hooks:
        hook()
    return True


def mhc_prepare(X, fn, scale, base, hp, U: Optional[Tensor], stats: Optional[Tensor]) -> Tuple[Tensor, Tensor]:
    with torch.no_grad():
        values = ops.mhc_prepare(X, fn, scale, base, *hp, True)[:2]
    return into(values, (U, stats))


def mhc_stats(X, fn, scale, base, hp, stats: Optional[Tensor]) -> Tensor:
    with torch.no_grad():
        return into((ops.mhc_stats(X, fn, scale, base, *hp),), (stats,))[0]


def mhc_finish(X, B, stats, Y: Optional[Tensor]) -> Tensor:
    with torch.no_grad():
        return into((ops.mhc_finish(X, B, stats, *mhc_meta.edges(X)),), (Y,))[0]


def mhc_head_forward(X, Y: Optional[Tensor]) -> Tensor:
    with torch.no_grad():
        return into((ops.mhc_head_fwd(X),), (Y,))[0]


def mhc_head_backward(dY, n: int, dX: Optional[Tensor], accumulate: bool) -> Tensor:
    with torch.no_grad():
        if not accumulate:
            return into((ops.mhc_head_bwd(dY, n),), (dX,))[0]
        # the kernel's sum, rounded once (dY / n is exact for n = 2, 4, 8)
        return dX.copy_((dX.float() + dY.float()[:, None, :] / n).to(dX.dtype))


def mhc_backward_prepare(dY, B, X, stats, dB: Optional[Tensor], grad_stats: Optional[Tensor]):
    with torch.no_grad():
        return into(ops.mhc_backward_prepare(dY, B, X, stats), (dB, grad_stats))


def mhc_backward_finish(X, dY, dU, fn, scale, base, stats, grad_stats, hp, deterministic: bool, accumulate: bool,
                        buffers):
    """``buffers``: the caller's (dX, dfn, dscale, dbase), each or None; the parameter gradients FP32."""
    with torch.no_grad():
        grads = ops.mhc_backward_finish(X, dY, dU, fn, scale, base, stats, grad_stats, *hp, deterministic)
    return into(grads, buffers, (False,) + (accumulate,) * 3)


def gated_head_forward(X, fn, scale, base, hp, Y: Optional[Tensor], stats: Optional[Tensor]):
    with torch.no_grad():
        return into(ops.mhc_gated_head_fwd(X, fn, scale, base, *hp, True), (Y, stats))


def gated_head_backward(dY, X, fn, scale, base, stats, hp, deterministic: bool, accumulate: bool, buffers):
    """``buffers``: the caller's (dX, dfn, dscale, dbase), each or None; the parameter gradients FP32."""
    with torch.no_grad():
        grads = ops.mhc_gated_head_bwd(dY, X, fn, scale, base, stats, *hp, deterministic)
    return into(grads, buffers, (False,) + (accumulate,) * 3)


def rmsnorm_forward(x2, w, eps: float, residual2: Optional[Tensor], buffers):
    """x2 / residual2 as rows [T, H]; ``buffers``: the caller's (y, rstd[, h_new]) viewed as the ops' outputs."""
    with torch.no_grad():
        if residual2 is None:
            values = ops.rmsnorm_fwd(x2, w, eps, True)
        else:
            values = ops.add_rmsnorm_fwd(x2, residual2, w, eps, True)
    return into(values, buffers)


def rmsnorm_backward(g2, x2, w, rstd1, g_residual2, deterministic: bool, buffers):
    """Rows as in rmsnorm_forward; dw FP32 as the eager function returns it (w's values widened exactly, so dx
    is the same)."""
    with torch.no_grad():
        values = ops.rmsnorm_bwd(g2, x2, w.float(), rstd1, g_residual2, deterministic)
    return into(values, buffers)
