"""Caller-given output buffers of the FlashInfer-style functions (``out=``, ``rstd=``, ``dX=``, ``dfn=`` ...): their
check, and how a call writes them.

A buffer may have any layout FlashInfer accepts: a column slice of a wider tensor, an odd row stride, a transposed
view, an offset that breaks 16-byte alignment. The kernels write contiguous, 16-byte-aligned outputs. So:

- eager (``written``): a buffer the kernels can write (contiguous and aligned: the usual one) is written in place
  -- no scratch, no copy, nothing allocated; any other is replaced by aligned scratch for the call (holding the
  buffer's values where the call adds into it, ``accumulate=True``), which is then copied into the caller's view.
  The result is the bits the call gives a contiguous buffer; nothing of the buffer's storage outside the view is
  touched.
- under torch.compile and dispatch modes (``into``, from ``_traced``): the ops' functional results are copied (or
  added) into the buffers, which takes any layout as it is.

Either way the call returns the caller's buffers themselves where given.
"""
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ._checks import tensor


def out_tensor(name: str, t, *, shape, dtype, device) -> Optional[Tensor]:
    """A caller-given output buffer: exact shape, dtype and device, any layout whose elements are each their own
    memory (an ``expand()``-ed view is refused: every element written would land on the same address)."""
    if t is None:
        return None
    tensor(name, t, dtypes=(dtype,), shape=shape, device=device)
    if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)):
        raise ValueError(f"{name}: expected a buffer whose elements do not share memory, got strides {t.stride()} "
                         f"for shape {tuple(t.shape)} (an expand()-ed view?); pass a tensor of its own")
    return t


def direct(t: Tensor) -> bool:
    """Whether the kernels write ``t`` in place: contiguous, its data 16-byte aligned (Triton's vector stores)."""
    return t.is_contiguous() and t.data_ptr() % 16 == 0


def _scratch(t: Tensor, added: bool) -> Tensor:
    if added:  # the values the call adds to; a fresh, contiguous copy even of a contiguous but unaligned t
        return t.clone(memory_format=torch.contiguous_format)
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def written(run: Callable, *buffers: Optional[Tensor], added: Sequence[bool] = ()):
    """``run(*buffers)`` -- an eager call writing its outputs into the buffers it is given, allocating those given
    None, and returning them (one tensor, or a tuple in the buffers' order) -- with each buffer the kernels
    cannot write (``direct``) replaced by scratch and copied back after. ``added``: per buffer, whether the call
    adds into it (the scratch then starts as a copy of it). Returns run's results with the caller's buffers in
    place of what was written for them."""
    if all(b is None or direct(b) for b in buffers):
        results = run(*buffers)
    else:
        added = tuple(added) + (False,) * (len(buffers) - len(added))
        staged = tuple(b if b is None or direct(b) else _scratch(b, add) for b, add in zip(buffers, added))
        results = run(*staged)
        for b, s in zip(buffers, staged):
            if s is not b:
                b.copy_(s)
    if isinstance(results, Tensor):
        return results if buffers[0] is None else buffers[0]
    return tuple(r if b is None else b for r, b in zip(results, buffers))


def into(values: Sequence[Tensor], buffers: Sequence[Optional[Tensor]],
         added: Sequence[bool] = ()) -> Tuple[Tensor, ...]:
    """Each value written into the caller's buffer where one was given (added to it where ``added``), viewed in
    the buffer's shape (an op's rows ``[T, H]`` into an ``[..., H]`` buffer), else returned as it is."""
    added = tuple(added) + (False,) * (len(values) - len(added))
    return tuple(v if b is None else (b.add_(v.view(b.shape)) if add else b.copy_(v.view(b.shape)))
                 for v, b, add in zip(values, buffers, added))
