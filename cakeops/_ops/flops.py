"""FLOP formulas of the mHC ops for torch's ``FlopCounterMode`` (what MFU accounting runs on).

Counted as torch counts its own ops: the matmul-shaped work, 2 FLOPs per multiply-add -- the projection onto the
mapping (``2 T (n C) M`` per pass; the backward has two: dfn and dX), the stream mixing ``comb^T X`` (``2 T n^2 C``)
and each weighted sum over streams or outer product with a gate (``2 T n C``). Elementwise work (RMS statistics,
sigmoids, Sinkhorn, RMSNorm itself) counts nothing, as torch's own norms count nothing.

Registered the first time a cakeops op is dispatched under a mode while ``torch.utils.flop_counter`` is loaded
(importing it loads Triton, 0.2 s, which ``import cakeops`` does not), and put into the counters then active:
``_traced.through_ops`` runs ``register_if_counter_loaded`` whenever it finds a mode (the hook set at import).
"""
import math
import sys

import torch

from .. import _traced


def _tokens(shape, dims: int) -> int:
    return math.prod(shape[:len(shape) - dims + 1])


def _streams(X):
    """(T, n, C) of a [..., n, C] shape."""
    return _tokens(X, 3), X[-2], X[-1]


def _prepare(X, fn, *args, **kwargs) -> int:
    T, n, C = _streams(X)
    return 2 * T * n * C * fn[0] + 2 * T * n * C        # projection, collapse U


def _stats(X, fn, *args, **kwargs) -> int:
    T, n, C = _streams(X)
    return 2 * T * n * C * fn[0]                        # projection


def _finish(X, *args, **kwargs) -> int:
    T, n, C = _streams(X)
    return 2 * T * n * n * C + 2 * T * n * C            # comb^T X, post (x) B


def _head_fwd(X, *args, **kwargs) -> int:
    T, n, C = _streams(X)
    return 2 * T * n * C                                # mean over the streams


def _head_bwd(dY, n, *args, **kwargs) -> int:
    return 2 * _tokens(dY, 2) * n * dY[-1]              # dY to every stream


def _backward_prepare(dY, *args, **kwargs) -> int:
    T, n, C = _streams(dY)
    return 2 * T * n * C + 2 * T * n * n * C + 2 * T * n * C   # dB, dcomb, dpost


def _backward_finish(X, dY, dU, fn, *args, **kwargs) -> int:
    T, n, C = _streams(X)
    return 4 * T * n * C * fn[0] + 2 * T * n * n * C + 4 * T * n * C   # dX and dfn of the projection, comb dY, pre


def _gated_head_fwd(X, *args, **kwargs) -> int:
    T, n, C = _streams(X)
    return 2 * T * n * C * n + 2 * T * n * C            # projection (n logits), gated sum


def _gated_head_bwd(dY, X, *args, **kwargs) -> int:
    T, n, C = _streams(X)
    return 4 * T * n * C * n + 4 * T * n * C            # dX and dfn of the projection, dX and dgates of the sum


def _rebuild(X0, Bs, *args, **kwargs) -> int:
    return len(Bs) * _finish(X0)                        # one finish per layer rebuilt through (stream recompute)


FORMULAS = {"mhc_prepare": _prepare, "mhc_prepare_rc": _prepare, "mhc_finish_rc": _finish, "mhc_rebuild": _rebuild,
            "mhc_rebuild_every": _rebuild,
            "mhc_stats": _stats, "mhc_finish": _finish, "mhc_head_fwd": _head_fwd,
            "mhc_head_bwd": _head_bwd, "mhc_backward_prepare": _backward_prepare,
            "mhc_backward_finish": _backward_finish, "mhc_gated_head_fwd": _gated_head_fwd,
            "mhc_gated_head_bwd": _gated_head_bwd}


_REGISTERED = {}  # op packet -> formula as torch's registry holds it (taking shapes)


def register_if_counter_loaded() -> None:
    """Each formula for its op and the op's unchecked twin (compiled graphs call those), once; and into every
    FlopCounterMode now active, since one copies the registry when built (before this could run)."""
    if "torch.utils.flop_counter" not in sys.modules:
        return
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    from torch.utils.flop_counter import register_flop_formula

    if not _REGISTERED:
        for name, formula in FORMULAS.items():
            targets = [getattr(torch.ops.cakeops, twin) for twin in (name, f"{name}_unchecked")
                       if hasattr(torch.ops.cakeops, twin)]
            wrapped = register_flop_formula(targets)(formula)
            _REGISTERED.update(dict.fromkeys(targets, wrapped))
    for mode in _get_current_dispatch_mode_stack():  # torch's dispatch mode holds its FlopCounterMode as .counter
        registry = getattr(getattr(mode, "counter", mode), "flop_registry", None)
        if isinstance(registry, dict):
            for packet, formula in _REGISTERED.items():
                registry.setdefault(packet, formula)


_traced.on_dispatch_mode(register_if_counter_loaded)  # FlopCounterMode may be the mode a call finds
