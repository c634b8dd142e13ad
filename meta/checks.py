"""What every cakeops custom op requires of its arguments: shapes, dtypes, devices, ranges.

The ops' real implementations and their fakes both call these, so ``torch.ops.cakeops.*`` reached directly
(no public function in front) rejects what would make a kernel read or write out of bounds, in eager mode
and while tracing. The public functions check the same things first, with messages in their own terms.
Pure torch; a failed check raises ValueError (TypeError for a non-tensor), naming the op's argument.
"""
import math

import torch

from . import mhc_layout as layout

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def tensor(op: str, name: str, t, *, ndim=None, shape=None, dtypes=None, device=None):
    """``t`` is a tensor of ``ndim`` dims / this ``shape`` / one of ``dtypes`` / on ``device``."""
    where = f"{op}: {name}"
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where}: expected a tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{where}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if shape is not None and (t.dim() != len(shape) or any(a != b for a, b in zip(t.shape, shape))):
        raise ValueError(f"{where}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{where}: expected dtype in ({', '.join(_name(d) for d in dtypes)}), got {_name(t.dtype)}")
    if device is not None and t.device != device:
        raise ValueError(f"{where}: expected a tensor on {device}, got one on {t.device}")
    return t


def positive(op: str, name: str, v) -> None:
    if not (isinstance(v, (int, float)) and 0 < v < math.inf):  # comparisons: v may be symbolic (dynamic=True)
        raise ValueError(f"{op}: {name}: expected a finite value > 0, got {v!r}")


# ---- RMSNorm ----

def rmsnorm_fwd(op: str, x, w, eps, residual=None) -> None:
    tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    T, H = x.shape
    tensor(op, "w", w, shape=(H,), dtypes=FLOAT_DTYPES, device=x.device)
    if residual is not None:
        tensor(op, "residual", residual, shape=(T, H), dtypes=(x.dtype,), device=x.device)
    positive(op, "eps", eps)


def rmsnorm_bwd(op: str, g, x, w, rstd, g_residual) -> None:
    tensor(op, "x", x, ndim=2, dtypes=FLOAT_DTYPES)
    T, H = x.shape
    tensor(op, "g", g, shape=(T, H), dtypes=(x.dtype,), device=x.device)
    tensor(op, "w", w, shape=(H,), dtypes=FLOAT_DTYPES, device=x.device)
    tensor(op, "rstd", rstd, shape=(T,), dtypes=(torch.float32,), device=x.device)
    if g_residual is not None:
        tensor(op, "g_residual", g_residual, shape=(T, H), dtypes=(x.dtype,), device=x.device)


# ---- mHC ----

def _streams_tensor(op: str, name: str, X, leading_dims: bool) -> None:
    """A float tensor [T, n, C], or [..., n, C] with leading_dims; n is the caller's to check."""
    tensor(op, name, X, dtypes=FLOAT_DTYPES)
    if X.dim() != 3 and not (leading_dims and X.dim() > 3):
        raise ValueError(f"{op}: {name}: expected a {'[..., n, C]' if leading_dims else '3-D [T, n, C]'} tensor, "
                         f"got shape {tuple(X.shape)}")


def streams(op: str, name: str, X, leading_dims: bool = False) -> None:
    """[T, n, C], or [..., n, C] where the op takes leading dims (finish, head)."""
    _streams_tensor(op, name, X, leading_dims)
    if X.shape[-2] not in layout.SUPPORTED_STREAMS:
        raise NotImplementedError(f"{op}: {name}: {layout.unsupported_streams_message(X.shape[-2])} "
                                  f"(X is [T, n, C]), got shape {tuple(X.shape)}")


def n_streams(X) -> int:
    """X's stream count as a plain int (a traced size is specialized: each n is its own kernel)."""
    return int(X.shape[-2])


def mapping(op: str, X, fn, scale, base) -> None:
    """Parameters in any float dtype (mixed precision casts them); the ops compute in FP32 whatever it is."""
    T, n, C = X.shape
    M = layout.n_logits(n_streams(X))
    tensor(op, "fn", fn, shape=(M, n * C), dtypes=FLOAT_DTYPES, device=X.device)
    tensor(op, "scale", scale, shape=(3,), dtypes=FLOAT_DTYPES, device=X.device)
    tensor(op, "base", base, shape=(M,), dtypes=FLOAT_DTYPES, device=X.device)


def hparams(op: str, rms_eps, hc_eps, sinkhorn_iters) -> None:
    positive(op, "rms_eps", rms_eps)
    positive(op, "hc_eps", hc_eps)
    if not 1 <= sinkhorn_iters <= layout.MAX_SINKHORN_ITERS:
        raise ValueError(f"{op}: sinkhorn_iters: expected 1..{layout.MAX_SINKHORN_ITERS}, got {sinkhorn_iters}")


def branch(op: str, name: str, B, X, same_dtype: bool = False) -> None:
    """B [..., C] with X's leading dims."""
    tensor(op, name, B, shape=tuple(X.shape[:-2]) + (X.shape[-1],), dtypes=(X.dtype,) if same_dtype else FLOAT_DTYPES,
           device=X.device)


def record(op: str, name: str, t, X, width: int) -> None:
    """A per-token FP32 record: one row per token of X (its leading dims flattened)."""
    tokens = X.shape[0] if X.dim() == 3 else X.numel() // (X.shape[-2] * X.shape[-1]) if X.shape[-1] else 0
    tensor(op, name, t, shape=(tokens, width), dtypes=(torch.float32,), device=X.device)


def mhc_prepare(op: str, X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters) -> None:
    streams(op, "X", X)
    mapping(op, X, fn, scale, base)
    hparams(op, rms_eps, hc_eps, sinkhorn_iters)


def mhc_finish(op: str, X, B, stats, leading_dims: bool = True) -> None:
    streams(op, "X", X, leading_dims)
    branch(op, "B", B, X)
    record(op, "stats", stats, X, layout.stats_width(n_streams(X)))


def stream_expand(op: str, h, n) -> None:
    tensor(op, "h", h, dtypes=FLOAT_DTYPES)
    if h.dim() < 1:
        raise ValueError(f"{op}: h: expected a hidden state [..., C] (at least 1 dim), got shape {tuple(h.shape)}")
    if n not in layout.SUPPORTED_STREAMS:
        raise NotImplementedError(f"{op}: n: {layout.unsupported_streams_message(n)}")


def group_size(op: str, size) -> None:
    if type(size) is not int or size < 2:
        raise ValueError(f"{op}: group_size: expected an int >= 2 (a stream-recompute group), got {size!r}")


def mhc_rebuild(op: str, X0, Bs, records) -> None:
    """X0 [T, n, C] and, per layer to finish through (none: X0 itself, materialized), B [T, C] and its record
    [T, STATS_WIDTH(n)]."""
    streams(op, "X0", X0)
    if len(Bs) != len(records):
        raise ValueError(f"{op}: expected one record per branch output, got {len(Bs)} branch outputs and "
                         f"{len(records)} records")
    for k, (B, stats) in enumerate(zip(Bs, records)):
        mhc_finish(op, X0, B, stats, leading_dims=False)


def mhc_head_bwd(op: str, dY, n) -> None:
    tensor(op, "dY", dY, ndim=2, dtypes=FLOAT_DTYPES)
    if n not in layout.SUPPORTED_STREAMS:
        raise NotImplementedError(f"{op}: n: {layout.unsupported_streams_message(n)}")


def mhc_backward_prepare(op: str, dY, B, X, stats) -> None:
    mhc_finish(op, X, B, stats, leading_dims=False)
    tensor(op, "dY", dY, shape=tuple(X.shape), dtypes=(X.dtype,), device=X.device)


def mhc_backward_finish(op: str, X, dY, dU, fn, scale, base, stats, grad_stats, rms_eps, hc_eps,
                        sinkhorn_iters) -> None:
    mhc_prepare(op, X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters)
    tensor(op, "dY", dY, shape=tuple(X.shape), dtypes=(X.dtype,), device=X.device)
    branch(op, "dU", dU, X, same_dtype=True)
    record(op, "stats", stats, X, layout.stats_width(n_streams(X)))
    record(op, "grad_stats", grad_stats, X, layout.grad_stats_width(n_streams(X)))


# ---- the gated head (meta/mhc_head_layout.py) ----

def gated_streams(op: str, name: str, X, leading_dims: bool = False) -> None:
    """[T, n, C] ([..., n, C] with leading_dims), n in mhc_head_layout.SUPPORTED_N."""
    from . import mhc_head_layout as head

    _streams_tensor(op, name, X, leading_dims)
    if X.shape[-2] not in head.SUPPORTED_N:
        raise ValueError(f"{op}: {name}: expected n in {head.SUPPORTED_N} streams, got shape {tuple(X.shape)}")


def mhc_gated_head_fwd(op: str, X, fn, scale, base, rms_eps, hc_eps, leading_dims: bool = True) -> None:
    gated_streams(op, "X", X, leading_dims)
    n, C = X.shape[-2], X.shape[-1]
    tensor(op, "fn", fn, shape=(n, n * C), dtypes=FLOAT_DTYPES, device=X.device)
    tensor(op, "scale", scale, shape=(1,), dtypes=FLOAT_DTYPES, device=X.device)
    tensor(op, "base", base, shape=(n,), dtypes=FLOAT_DTYPES, device=X.device)
    positive(op, "rms_eps", rms_eps)
    positive(op, "hc_eps", hc_eps)


def mhc_gated_head_bwd(op: str, dY, X, fn, scale, base, stats, rms_eps, hc_eps) -> None:
    from . import mhc_head_layout as head

    mhc_gated_head_fwd(op, X, fn, scale, base, rms_eps, hc_eps, leading_dims=False)
    tensor(op, "dY", dY, shape=(X.shape[0], X.shape[2]), dtypes=(X.dtype,), device=X.device)
    record(op, "stats", stats, X, head.HEAD_STATS_WIDTH)
