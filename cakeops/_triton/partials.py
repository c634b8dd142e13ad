"""The deterministic cross-program reduction that the RMSNorm and mHC backward kernels share: per-program FP32
partials [P, H] summed in a fixed order (bitwise reproducible for a given P), instead of atomics."""
from typing import Optional

import torch
import triton
import triton.language as tl

from .fast_launch import fast
from .launch import cdiv, next_power_of_2


@triton.jit
def _sum_partials_kernel(PART, OUT, P, H, stride_p, ACCUMULATE: tl.constexpr, BLOCK_P: tl.constexpr,
                         BLOCK: tl.constexpr):
    """OUT[h] (+)= sum_p PART[p, h], always in the same order: the deterministic dw reduction."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        mask = (p < P)[:, None] & (cols < H)[None, :]
        acc += tl.sum(tl.load(PART + p[:, None] * stride_p + cols[None, :], mask=mask, other=0.0), axis=0)
    if ACCUMULATE:
        acc += tl.load(OUT + cols, mask=cols < H, other=0.0)
    # An OUT narrower than FP32 gets the sum rounded once, to nearest even, as torch's .to() rounds.
    tl.store(OUT + cols, acc.to(OUT.dtype.element_ty, fp_downcast_rounding="rtne"), mask=cols < H)


_launch = fast(_sum_partials_kernel)  # all arguments positional: ACCUMULATE, BLOCK_P, BLOCK last

# Whether an OUT narrower than FP32 gets the sum rounded to nearest even: compiled, yes; Triton's interpreter (a
# Python function in place of the kernel, decided when it was decorated) truncates instead.
ROUNDS_TO_NEAREST = isinstance(_sum_partials_kernel, triton.runtime.jit.JITFunction)


def sum_partials(partials: torch.Tensor, out: torch.Tensor, accumulate: bool = False, *, max_block: int = 128,
                 block_p: int = 32, device: Optional[int] = None) -> None:
    """out [H] (+)= partials [P, H] (unit column stride) summed over P in a fixed order (in FP32; an out of another
    float dtype receives the sum rounded once, and only without accumulate). Narrow column blocks
    (max_block) make many programs, each a short walk; block_p rows are loaded per step. ``device``: the current
    CUDA device where the caller has read it (None: the launch asks)."""
    P, H = partials.shape
    block = min(max_block, next_power_of_2(H))
    _launch((cdiv(H, block),), (partials, out, P, H, partials.stride(0), accumulate, block_p, block), 4, device)
