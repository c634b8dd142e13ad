"""Argument checks of the mHC API: every error names the argument and what was expected."""
import torch
from torch import Tensor

from . import _checks
from .meta import mhc_layout as layout

N = layout.N_STREAMS  # the default stream count (n = 4)
M = layout.N_LOGITS


def n_streams(name: str, n) -> int:
    """A stream count given as an argument (a module's ``n_streams``, the head backward's ``n``)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"{name}: expected an int (the number of residual streams), got {type(n).__name__}")
    if n not in layout.SUPPORTED_STREAMS:
        raise NotImplementedError(f"{name}: {layout.unsupported_streams_message(n)}")
    return n


def streams(name: str, X, leading_dims: bool = False) -> Tensor:
    """X-like [T, n, C] tensor ([..., n, C] with ``leading_dims``): n in {2, 4, 8} streams, C >= 1, float dtype."""
    _checks.tensor(name, X, dtypes=_checks.FLOAT_DTYPES, **({"min_ndim": 3} if leading_dims else {"ndim": 3}))
    if X.shape[-2] not in layout.SUPPORTED_STREAMS:
        raise NotImplementedError(
            f"{name}: {layout.unsupported_streams_message(X.shape[-2])} (shape [{'...' if leading_dims else 'T'}, n, "
            f"C]), got shape {tuple(X.shape)}")
    if X.shape[-1] < 1:
        raise ValueError(f"{name}: expected a hidden size C >= 1, got shape {tuple(X.shape)}")
    return X


def like(name: str, t, X: Tensor, shape, dtypes=None, x_name: str = "X", per_token: bool = True,
         hint: str = "") -> Tensor:
    """A tensor that must sit beside X: its device, the given shape, and X's dtype unless dtypes is given.
    ``per_token``: its first dim is X's tokens (a parameter's is not), so a mismatch there is said in tokens.
    ``hint``: appended to a shape mismatch's message (what the shape means, what to do)."""
    _checks.tensor(name, t, dtypes=dtypes if dtypes is not None else (X.dtype,))
    if tuple(t.shape) != tuple(shape):
        if per_token and t.dim() >= 1 and t.shape[0] != shape[0] and tuple(t.shape[1:]) == tuple(shape[1:]):
            raise ValueError(f"{name}: expected {shape[0]} tokens (as {x_name}), got {t.shape[0]}{hint}")
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}{hint}")
    _checks.same_device(name, t, x_name, X)
    return t


def mapping(X: Tensor, fn, scale, base) -> None:
    """fn, scale, base in any float dtype: FP32 as initialised, bf16/fp16 after ``model.to(dtype)`` or under an
    FSDP2 mixed-precision policy. The math is FP32 either way; gradients come back in each parameter's dtype."""
    T, n, C = X.shape
    m = layout.n_logits(n)  # 2n + n*n
    logits = f"{m} = 2n + n*n mapping logits for n = {n} streams"
    like("fn", fn, X, (m, n * C), dtypes=_checks.FLOAT_DTYPES, per_token=False,
         hint=f": one row per logit ({logits}) and one column per element of a token's streams (n*C = {n}*{C}, "
              f"C = X.shape[-1]); was the mapping made for another hidden size?")
    like("scale", scale, X, (3,), dtypes=_checks.FLOAT_DTYPES, per_token=False,
         hint=": one scale per group of logits (pre, post, res)")
    like("base", base, X, (m,), dtypes=_checks.FLOAT_DTYPES, per_token=False,
         hint=f": one offset per logit ({logits})")


def hparams(rms_eps, hc_eps, sinkhorn_iters) -> tuple:
    rms_eps = _checks.positive_float("rms_eps", rms_eps)
    hc_eps = _checks.positive_float("hc_eps", hc_eps)
    if isinstance(sinkhorn_iters, bool) or not isinstance(sinkhorn_iters, int):
        raise TypeError(f"sinkhorn_iters: expected an int, got {type(sinkhorn_iters).__name__}")
    if sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters: expected >= 1, got {sinkhorn_iters}")
    if sinkhorn_iters > layout.MAX_SINKHORN_ITERS:
        raise NotImplementedError(
            f"sinkhorn_iters: at most {layout.MAX_SINKHORN_ITERS} iterations are supported, got {sinkhorn_iters}")
    return rms_eps, hc_eps, sinkhorn_iters


def stats(name: str, t, X: Tensor, width: int) -> Tensor:
    return like(name, t, X, (X.shape[0], width), dtypes=(torch.float32,))


def flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return value
