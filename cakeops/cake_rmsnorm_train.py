"""Fused RMSNorm training op (optional residual add), FlashInfer ``cake_rmsnorm_train``-compatible API.

Forward ``y = round((h * rstd) * w)`` with ``h = x`` or ``h = round(x + residual)`` (returned as h_new),
``rstd = 1/sqrt(mean(h^2) + eps)`` in FP32. Backward ``dx = round(rstd*g*w - h*rstd^3*mean(g*w*h) [+ g_residual])``
and ``dw = sum_t g*h*rstd`` in FP32. Beyond FlashInfer: any hidden size, x in bf16/fp16/fp32, w in x.dtype or
fp32, ``[..., H]`` inputs, CPU tensors (reference math), and every entry traceable by torch.compile.

Decisions where FlashInfer leaves room: ``rstd`` has the leading shape of x (``x.shape[:-1]``; ``[T]`` for 2-D x);
the backward accepts it in that shape or flattened. Row-strided 2-D inputs are read in place; other layouts are
copied once. ``dw``/``out`` buffers given by the caller are overwritten, never accumulated into; they may have
any layout (a slice of a wider tensor, an odd row stride, a transposed view: written through scratch, as FlashInfer
does; contiguous aligned ones in place, cakeops/_buffers.py).

FlashInfer 0.7.4: every entry point takes ``deterministic`` (default True). ``deterministic=False`` sums dw with
atomics (``cake_rmsnorm_train_backward``, the autograd backward); the forward has no cross-row sum and gives the
same bits either way. As in FlashInfer, ``deterministic=False`` while ``torch.use_deterministic_algorithms(True)``
is in effect raises RuntimeError (forward, backward, workspace helpers, ``cake_rmsnorm``), or with
``warn_only=True`` warns once per entry point and runs the deterministic path; the support query answers
regardless. FlashInfer's deterministic module is ``cakeops.cake_rmsnorm_det_train`` (its ``*_det_*`` names, also
reachable here by their previous names, as FlashInfer's are). What FlashInfer 0.7.4 accepts on the
non-deterministic path only, ``[..., H]`` inputs and FP32 weights, cakeops accepts on both.
"""
import math
import sys
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _checks, _traced
from ._buffers import out_tensor, written
from ._function import EagerFunction, first_order
from ._ops import rmsnorm as ops
from ._ops.determinism import refuse_nondeterministic
from ._ops.sharding import any_dtensor
from ._support import ARCHES, SUPPORTED_COMPUTE_CAPABILITIES  # noqa: F401
from ._support import rmsnorm_route_key as route_key  # noqa: F401
from ._ops.rmsnorm import rows as _rows
from ._ops.strides import in_shape

_DTENSOR_MODULE = "torch.distributed.tensor"

__all__ = [
    "cake_rmsnorm_train_forward", "cake_rmsnorm_train_backward", "cake_rmsnorm", "CakeRMSNormFunction",
    "is_cake_rmsnorm_train_supported", "cake_rmsnorm_train_backward_workspace_bytes",
    "cake_rmsnorm_train_backward_workspace", "cake_rmsnorm_train_workspace_numel",
    "cake_rmsnorm_train_allocate_workspace", "route_key", "ARCHES", "SUPPORTED_COMPUTE_CAPABILITIES",
]

# FlashInfer's deterministic names before its det rename: resolved here to cakeops.cake_rmsnorm_det_train's objects
# of that name on first access (not in __all__), as flashinfer.cake_rmsnorm_train does.
_PREVIOUS_DET_NAMES = frozenset((
    "CakeRMSNormDetFunction", "cake_rmsnorm_det", "cake_rmsnorm_det_train_backward",
    "cake_rmsnorm_det_train_backward_workspace", "cake_rmsnorm_det_train_backward_workspace_bytes",
    "cake_rmsnorm_det_train_forward", "is_cake_rmsnorm_det_train_supported",
))


def __getattr__(name: str):
    if name in _PREVIOUS_DET_NAMES:
        from . import cake_rmsnorm_det_train
        return getattr(cake_rmsnorm_det_train, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _check_x_w(x, w, x_name: str = "x"):
    _checks.tensor(x_name, x, dtypes=_checks.FLOAT_DTYPES, min_ndim=1)
    if x.shape[-1] == 0:
        raise ValueError(f"{x_name}: expected a hidden size (last dim) >= 1, got shape {tuple(x.shape)}")
    _checks.tensor("w", w, dtypes=_checks.FLOAT_DTYPES, ndim=1)  # any float dtype: the math is FP32
    if w.shape[0] != x.shape[-1]:
        raise ValueError(f"w: expected length {x.shape[-1]} (the hidden size of {x_name}), got {w.shape[0]}")
    _checks.same_device("w", w, x_name, x)


def _check_like(name: str, t, x: Tensor, x_name: str = "x") -> Tensor:
    _checks.tensor(name, t, dtypes=(x.dtype,))
    if t.shape != x.shape:
        raise ValueError(f"{name}: expected shape {tuple(x.shape)} (as {x_name}), got {tuple(t.shape)}")
    _checks.same_device(name, t, x_name, x)
    return t


def _check_flags(deterministic) -> None:
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic: expected a bool, got {type(deterministic).__name__}")


def cake_rmsnorm_train_forward(x: Tensor, w: Tensor, eps: float, *, residual: Optional[Tensor] = None,
                               out: Optional[Tensor] = None, rstd: Optional[Tensor] = None,
                               residual_out: Optional[Tensor] = None, deterministic: bool = True):
    """Fused RMSNorm forward (no autograd): ``(y, rstd)``, or ``(y, rstd, h_new)`` when ``residual`` is given.

    Args:
        x: ``[T, H]`` or ``[..., H]``, bf16 / fp16 / fp32, any H >= 1 (row-strided 2-D views are read in place;
            other layouts are copied once). With ``residual`` it is the residual stream h.
        w: ``[H]`` weight, x's dtype or FP32 (any float dtype; the math is FP32).
        eps: a finite float > 0 (FlashInfer's is positional and has no default; 1e-6 is common).
        residual: optional update of x's shape and dtype: ``h_new = round(x + residual)`` is normalized and
            returned (fused add).
        out, rstd, residual_out: optional buffers for y (x's shape and dtype), rstd (FP32, x's leading shape
            ``x.shape[:-1]``) and h_new, of any layout; overwritten and returned as given.
        deterministic: FlashInfer 0.7.4's keyword (default True). The forward has no cross-row sum: the same bits
            either way. A bool (TypeError otherwise); False under ``torch.use_deterministic_algorithms(True)``
            raises RuntimeError (``warn_only=True``: warns once), as FlashInfer's does.

    Returns:
        ``y = round((h * rstd) * w)`` in x's dtype, ``rstd = 1/sqrt(mean(h^2) + eps)`` FP32 ``x.shape[:-1]``,
        and h_new in residual mode.

    >>> x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.ones(64)
    >>> y, rstd = cake_rmsnorm_train_forward(x, w, 1e-6)
    >>> y.shape, y.dtype, rstd.shape, rstd.dtype
    (torch.Size([4, 64]), torch.bfloat16, torch.Size([4]), torch.float32)
    >>> y, rstd, h_new = cake_rmsnorm_train_forward(x, w, 1e-6, residual=torch.zeros_like(x))
    >>> torch.equal(h_new, x)
    True
    """
    _check_x_w(x, w)
    eps = _checks.positive_float("eps", eps)
    refuse_nondeterministic(deterministic, "cake_rmsnorm_train_forward", "the forward (it has no cross-row sum)")
    if residual is not None:
        _check_like("residual", residual, x)
    elif residual_out is not None:
        raise ValueError("residual_out: given without residual; h_new exists only in residual mode")
    out = out_tensor("out", out, shape=x.shape, dtype=x.dtype, device=x.device)
    rstd = out_tensor("rstd", rstd, shape=x.shape[:-1], dtype=torch.float32, device=x.device)
    residual_out = out_tensor("residual_out", residual_out, shape=x.shape, dtype=x.dtype, device=x.device)
    buffers = (out, rstd) if residual is None else (out, rstd, residual_out)
    rows_in = (_rows(x), w, eps, None if residual is None else _rows(residual))
    if _traced.through_ops():
        outs = _traced.rmsnorm_forward(*rows_in, buffers)
    else:
        outs = written(lambda y, r, h=None: ops.forward_impl(*rows_in, _rows_of(y), _rows_of(r, 1), _rows_of(h)),
                       *buffers)
    # the caller's own buffers where given (not views of them), the rest in x's shape
    return tuple(o if b is not None else o.view(shape)
                 for o, b, shape in zip(outs, buffers, (x.shape, x.shape[:-1], x.shape)))


def _rows_of(t: Optional[Tensor], dims: int = 2) -> Optional[Tensor]:
    """A contiguous buffer in the caller's shape (``[..., H]``; rstd's ``[...]`` with dims=1) as the op's rows
    (``[T, H]``, ``[T]``); None stays None."""
    return None if t is None else t.view(-1, *t.shape[t.dim() + 1 - dims:])


def cake_rmsnorm_train_backward(g: Tensor, x: Tensor, w: Tensor, rstd: Tensor, *, deterministic: bool = True,
                                g_residual: Optional[Tensor] = None, workspace: Optional[Tensor] = None,
                                dx: Optional[Tensor] = None, dw: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Fused RMSNorm backward: ``(dx, dw)``.

    ``dx = round(rstd*g*w - h*rstd^3*mean(g*w*h) [+ g_residual])`` (one rounding) in x's dtype and
    ``dw = sum_t g*h*rstd`` FP32.

    Args:
        g: y's gradient, x's shape and dtype. x: the tensor that was normalized (x of the plain forward, h_new
            of the residual forward; then dx is the gradient of both x and residual). w: ``[H]`` as in the
            forward. rstd: FP32 from the forward, ``x.shape[:-1]`` or flattened ``[T]``.
        deterministic: True (default) sums dw in a fixed order, bitwise reproducible for a given T and device;
            False adds with atomics: under ``torch.use_deterministic_algorithms(True)`` it raises RuntimeError
            (``warn_only=True``: warns once and runs the deterministic backward), as FlashInfer 0.7.4's.
        g_residual: optional gradient reaching h_new directly (residual mode), x's shape; added into dx.
        workspace: optional caller-owned scratch for the deterministic dw partials, from
            ``cake_rmsnorm_train_backward_workspace`` (uint8; an FP32 buffer of
            ``cake_rmsnorm_train_workspace_numel`` elements serves too). With it and dx, dw given, the call
            allocates nothing. Unused by the CPU reference.
        dx: optional buffer (x's shape and dtype); dw: optional FP32 ``[H]``; any layout, overwritten.

    >>> x, w = torch.randn(4, 64), torch.ones(64)
    >>> y, rstd = cake_rmsnorm_train_forward(x, w, 1e-6)
    >>> ws = cake_rmsnorm_train_backward_workspace(4, 64, "cpu")
    >>> dx, dw = cake_rmsnorm_train_backward(torch.randn_like(y), x, w, rstd, workspace=ws)
    >>> dx.shape, dw.shape, dw.dtype
    (torch.Size([4, 64]), torch.Size([64]), torch.float32)
    """
    _check_x_w(x, w)
    _check_like("g", g, x)
    _checks.tensor("rstd", rstd, dtypes=(torch.float32,))
    if rstd.numel() != x.numel() // x.shape[-1]:
        raise ValueError(f"rstd: expected {x.shape[:-1].numel()} values (one per row of x), got shape "
                         f"{tuple(rstd.shape)}")
    _checks.same_device("rstd", rstd, "x", x)
    if g_residual is not None:
        _check_like("g_residual", g_residual, x)
    deterministic = refuse_nondeterministic(deterministic, "cake_rmsnorm_train_backward", "the deterministic backward")
    if workspace is not None:
        workspace = _workspace_for_backward(workspace, x)
    dx = out_tensor("dx", dx, shape=x.shape, dtype=x.dtype, device=x.device)
    dw = out_tensor("dw", dw, shape=(x.shape[-1],), dtype=torch.float32, device=x.device)
    rows_in = (_rows(g), _rows(x), w, rstd.reshape(-1).contiguous(), None if g_residual is None else _rows(g_residual),
               deterministic)
    if _traced.through_ops():
        ddx, ddw = _traced.rmsnorm_backward(*rows_in, (dx, dw))
    else:
        ddx, ddw = written(lambda dx, dw: ops.backward_impl(*rows_in, workspace, _rows_of(dx), dw), dx, dw)
    return (ddx if dx is not None else ddx.view(x.shape)), ddw


def _eager_args_ok(x, w, eps, residual) -> bool:
    """Whether (x, w, eps, residual) pass every check that ``cake_rmsnorm_train_forward`` makes of them, in one
    expression: the common case costs a few attribute reads. Anything else goes through those checks, which
    raise the errors users see."""
    return (isinstance(x, Tensor) and isinstance(w, Tensor) and type(eps) is float and 0.0 < eps < math.inf
            and x.dtype in _checks.FLOAT_DTYPES and w.dtype in _checks.FLOAT_DTYPES and w.dim() == 1
            and x.dim() >= 1 and x.shape[-1] == w.shape[0] and w.shape[0] != 0 and x.device == w.device
            and (residual is None or (isinstance(residual, Tensor) and residual.dtype == x.dtype
                                      and residual.shape == x.shape and residual.device == x.device)))


class CakeRMSNormFunction(EagerFunction):
    """Eager autograd: calls the launchers directly (no dispatcher per call). Saves only (x or h_new, w, rstd).
    Its backward is the registered autograd's formula (``_ops.rmsnorm.backward_formula``). Host time matters
    here (a model calls it twice per layer): the checks are one expression in the common case, the kernels'
    entry is called without the public function's buffer handling, and no view is made that is not needed."""
    what = "cakeops RMSNorm"

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, eps: float, residual: Optional[Tensor] = None,
                deterministic: bool = True):
        if deterministic is not True:  # FlashInfer's rule: refused under torch.use_deterministic_algorithms(True)
            deterministic = refuse_nondeterministic(deterministic, "cake_rmsnorm", "the deterministic backward")
        if not _eager_args_ok(x, w, eps, residual):  # the public function's checks and errors
            _check_x_w(x, w)
            eps = _checks.positive_float("eps", eps)
            if residual is not None:
                _check_like("residual", residual, x)
        if x.dim() == 2:
            outs = ops.forward_impl(x, w, eps, residual)
        else:
            outs = ops.forward_impl(_rows(x), w, eps, None if residual is None else _rows(residual))
            outs = (outs[0].view(x.shape), outs[1].view(x.shape[:-1])) + tuple(o.view(x.shape) for o in outs[2:])
        ctx.deterministic = deterministic
        ctx.has_residual = residual is not None
        ctx.save_for_backward(outs[2] if ctx.has_residual else x, w, outs[1])
        ctx.set_materialize_grads(False)
        if ctx.has_residual:
            return outs[0], outs[2]
        return outs[0]

    @staticmethod
    @first_order(what)
    def backward(ctx, grad_y, grad_h=None):
        h, w, rstd = ctx.saved_tensors
        # The inputs were checked by the forward: straight to the kernels, dw in w's dtype from the reduction.
        dx, dw, dres = ops.backward_formula(ops.eager_backward, h, w, rstd, grad_y, grad_h, ctx.has_residual,
                                            ctx.deterministic)
        return dx, dw, None, dres, None


def cake_rmsnorm(x: Tensor, w: Tensor, eps: float = 1e-6, residual: Optional[Tensor] = None,
                 deterministic: bool = True) -> Union[Tensor, Tuple[Tensor, Tensor]]:
    """RMSNorm with autograd: ``y = x / rms(x) * w``, or with ``residual`` ``(y, h_new)`` where ``h_new = x +
    residual`` is normalized in the same pass.

    x: ``[..., H]`` bf16, fp16 or fp32 (any H >= 1); w: ``[H]`` in any float dtype; residual: like x. eps: a
    finite float > 0. deterministic: a fixed-order weight-gradient sum (True) or atomics (False). Statistics are
    FP32; y and h_new have x's dtype; w's gradient has w's dtype. Under torch.compile it becomes the cakeops
    custom ops (backward ``cakeops::rmsnorm_bwd``); eagerly, CakeRMSNormFunction.

    >>> x = torch.randn(2, 8, 64, requires_grad=True)
    >>> w = torch.ones(64, requires_grad=True)
    >>> y, h = cake_rmsnorm(x, w, 1e-6, residual=torch.zeros_like(x))
    >>> y.shape, bool(torch.equal(h, x))
    (torch.Size([2, 8, 64]), True)
    """
    if deterministic is not True:  # FlashInfer's rule: refused under torch.use_deterministic_algorithms(True)
        deterministic = refuse_nondeterministic(deterministic, "cake_rmsnorm", "the deterministic backward")
    if not _traced.through_ops():
        # DTensors exist only once torch.distributed.tensor is imported (torch.compile and FSDP import it): an
        # isinstance per argument, and any_dtensor's placement checks only for a DTensor found.
        module = sys.modules.get(_DTENSOR_MODULE)
        if not (module is not None and (isinstance(x, module.DTensor) or isinstance(w, module.DTensor)
                                        or isinstance(residual, module.DTensor))
                and any_dtensor(x=x, w=w, residual=residual)):
            return CakeRMSNormFunction.apply(x, w, eps, residual, deterministic)
    _check_x_w(x, w)
    eps = _checks.positive_float("eps", eps)
    if residual is None:
        y, _ = torch.ops.cakeops.rmsnorm_fwd(_rows(x), w, eps, deterministic)
        return in_shape(y, x.shape)
    _check_like("residual", residual, x)
    y, _, h_new = torch.ops.cakeops.add_rmsnorm_fwd(_rows(x), _rows(residual), w, eps,
                                                    deterministic)
    return in_shape(y, x.shape), in_shape(h_new, x.shape)


def is_cake_rmsnorm_train_supported(device: Union[str, torch.device], hidden: Optional[int] = None, *,
                                    deterministic: bool = True) -> bool:
    """True where the op runs on ``device`` (a torch.device or a string): CPU (reference math) and CUDA GPUs of compute capability 8.0 or newer (the mHC
    projection feeds bf16 tiles to tensor cores, which Triton offers from Ampere on; the kernels are tested on
    an H200, sm_90); ``hidden`` (optional): any hidden size >= 1; ``deterministic`` (FlashInfer 0.7.4's keyword, a
    bool): both modes run wherever the op does, and the answer does not depend on
    ``torch.use_deterministic_algorithms``, as FlashInfer's.

    >>> is_cake_rmsnorm_train_supported("cpu", 4096), is_cake_rmsnorm_train_supported("cpu", 0)
    (True, False)
    """
    _check_flags(deterministic)
    device = torch.device(device)
    if hidden is not None and (not isinstance(hidden, int) or hidden < 1):
        return False
    if device.type == "cpu":
        return True
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_capability(device) >= (8, 0)
    return False


def _workspace_for_backward(workspace, x: Tensor) -> Tensor:
    """The caller's workspace as the FP32 dw partials the kernels write (its size checked on the reference path
    too, which leaves it unused: code written on a CPU fails there as it would on the GPU)."""
    from . import _workspace

    ws = _workspace.as_bytes("workspace", workspace, x.device)
    if _traced.through_ops():
        return None  # unused: Inductor plans the scratch (cakeops/_traced.py)
    need = 4 * cake_rmsnorm_train_workspace_numel(x.numel() // x.shape[-1], x.shape[-1], x.device, x.dtype)
    _workspace.check_size("workspace", ws, need, "cake_rmsnorm_train_backward_workspace(rows, hidden, device)")
    return ws[:need].view(torch.float32)


def cake_rmsnorm_train_backward_workspace_bytes(rows: int, hidden: int, device: Union[str, torch.device], *,
                                                residual: bool = False, deterministic: bool = True) -> int:
    """Bytes of the caller-owned backward workspace serving every cake_rmsnorm_train_backward of up to ``rows``
    rows (tokens, leading dims flattened) of width ``hidden`` on ``device``, any x dtype.

    It holds the deterministic backward's FP32 dw partials ``[P, hidden]``, one row per program of the
    persistent grid (P grows with rows up to a few programs per multiprocessor), summed in a fixed order into
    dw. Written before read: no zeroing needed. ``residual`` is accepted for FlashInfer's signature and does not
    change the size; nor does ``deterministic`` (FlashInfer 0.7.4's keyword: the deterministic workspace serves
    both backwards; False under ``torch.use_deterministic_algorithms(True)`` raises, as the backward does).

    >>> cake_rmsnorm_train_backward_workspace_bytes(4096, 4096, "cpu") > 0
    True
    """
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
        raise ValueError(f"rows: expected the largest token count the buffer serves, an int >= 0, got {rows!r}")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"hidden: expected the hidden size H (x.shape[-1]), an int >= 1, got {hidden!r}")
    del residual
    refuse_nondeterministic(deterministic, "cake_rmsnorm_train_backward_workspace_bytes", "the same size")
    return 4 * max(cake_rmsnorm_train_workspace_numel(rows, hidden, device, dtype) for dtype in _checks.FLOAT_DTYPES)


def cake_rmsnorm_train_backward_workspace(rows: int, hidden: int, device: Union[str, torch.device], *,
                                          residual: bool = False, deterministic: bool = True) -> Tensor:
    """A zero-filled uint8 workspace of ``cake_rmsnorm_train_backward_workspace_bytes(rows, hidden, device)`` bytes
    on ``device`` for ``cake_rmsnorm_train_backward(..., workspace=...)``, reusable across calls of at most
    ``rows`` rows of width ``hidden``; ``residual`` and ``deterministic`` as in ..._bytes (no effect on the size).

    >>> cake_rmsnorm_train_backward_workspace(8, 64, "cpu").dtype
    torch.uint8
    """
    deterministic = refuse_nondeterministic(deterministic, "cake_rmsnorm_train_backward_workspace", "the same size")
    return torch.zeros(cake_rmsnorm_train_backward_workspace_bytes(rows, hidden, device, residual=residual,
                                                                   deterministic=deterministic),
                       dtype=torch.uint8, device=device)


def cake_rmsnorm_train_workspace_numel(num_tokens: int, hidden: int, device: Union[str, torch.device],
                                       dtype: torch.dtype = torch.bfloat16) -> int:
    """FP32 elements of the workspace the deterministic backward uses (per-program dw partials) for x of
    this dtype (cakeops' older helper; see cake_rmsnorm_train_backward_workspace_bytes): ``num_tokens`` rows of
    width ``hidden`` on ``device``, x of ``dtype`` (default bf16).

    >>> cake_rmsnorm_train_workspace_numel(8, 64, "cpu") % 64
    0
    """
    from ._triton.rmsnorm import workspace_rows

    return workspace_rows(torch.device(device), num_tokens, hidden, dtype.itemsize) * hidden


def cake_rmsnorm_train_allocate_workspace(num_tokens: int, hidden: int, device: Union[str, torch.device],
                                          dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """An FP32 workspace for ``cake_rmsnorm_train_backward(..., workspace=...)``, reusable across calls of these
    sizes (cakeops' older helper; see cake_rmsnorm_train_backward_workspace): ``num_tokens`` rows of width
    ``hidden`` on ``device``, x of ``dtype`` (default bf16).

    >>> cake_rmsnorm_train_allocate_workspace(8, 64, "cpu").dtype
    torch.float32
    """
    return torch.empty(cake_rmsnorm_train_workspace_numel(num_tokens, hidden, device, dtype), dtype=torch.float32,
                       device=device)
