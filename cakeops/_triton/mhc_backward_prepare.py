"""mHC backward_prepare kernel and launcher: the finish node's backward, before the branch's.

One program per token walks C in chunks and, from one read of dY, B and X, writes
dB = round(sum_j post_j * dY_j) and the token's grad_stats row (dpost | dcomb | zeros, layout in
cakeops/meta/mhc_layout.py). The products are accumulated elementwise over the chunks and reduced once
at the end, so the chunk loop is pure loads and FMAs. No cross-token reduction: bitwise deterministic.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..meta import mhc_layout as layout

# Kernels may only read module globals that are constexpr.
_POST = tl.constexpr(layout.POST)
_STATS_WIDTH = tl.constexpr(layout.STATS_WIDTH)
_DPOST = tl.constexpr(layout.DPOST)
_DCOMB = tl.constexpr(layout.DCOMB)
_GRAD_STATS_USED = tl.constexpr(layout.GRAD_STATS_USED)
_GRAD_STATS_WIDTH = tl.constexpr(layout.GRAD_STATS_WIDTH)


@triton.jit
def _backward_prepare_kernel(
    DY, B, X, STATS, DB, GS, C,
    stride_dyt, stride_dyi, stride_bt, stride_xt, stride_xi, stride_st, stride_dbt, stride_gt,
    N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # Only 2-D [n, BLOCK_C] tiles: a [n, n, BLOCK_C] broadcast made the compiler shuffle layouts through
    # shared memory every chunk (452 GB/s on H200). dcomb is kept as one [n, BLOCK_C] accumulator per
    # stream i of X, written out for n = 4.
    tl.static_assert(N == 4)
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, N)
    offs_c = tl.arange(0, BLOCK_C)
    post = tl.load(STATS + t * stride_st + _POST + j)
    dy_rows = DY + t * stride_dyt + j[:, None] * stride_dyi
    x_row = X + t * stride_xt
    acc_post = tl.zeros([N, BLOCK_C], dtype=tl.float32)
    acc0 = tl.zeros([N, BLOCK_C], dtype=tl.float32)
    acc1 = tl.zeros([N, BLOCK_C], dtype=tl.float32)
    acc2 = tl.zeros([N, BLOCK_C], dtype=tl.float32)
    acc3 = tl.zeros([N, BLOCK_C], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        c = c0 + offs_c
        c_ok = c < C
        dy = tl.load(dy_rows + c[None, :], mask=c_ok[None, :], other=0.0).to(tl.float32)
        b = tl.load(B + t * stride_bt + c, mask=c_ok, other=0.0).to(tl.float32)
        tl.store(DB + t * stride_dbt + c, tl.sum(post[:, None] * dy, axis=0).to(DB.dtype.element_ty), mask=c_ok)
        acc_post += dy * b[None, :]
        acc0 += tl.load(x_row + c, mask=c_ok, other=0.0).to(tl.float32)[None, :] * dy
        acc1 += tl.load(x_row + stride_xi + c, mask=c_ok, other=0.0).to(tl.float32)[None, :] * dy
        acc2 += tl.load(x_row + 2 * stride_xi + c, mask=c_ok, other=0.0).to(tl.float32)[None, :] * dy
        acc3 += tl.load(x_row + 3 * stride_xi + c, mask=c_ok, other=0.0).to(tl.float32)[None, :] * dy
    g_row = GS + t * stride_gt
    tl.store(g_row + _DPOST + j, tl.sum(acc_post, axis=1))
    tl.store(g_row + _DCOMB + j, tl.sum(acc0, axis=1))
    tl.store(g_row + _DCOMB + N + j, tl.sum(acc1, axis=1))
    tl.store(g_row + _DCOMB + 2 * N + j, tl.sum(acc2, axis=1))
    tl.store(g_row + _DCOMB + 3 * N + j, tl.sum(acc3, axis=1))
    w = tl.arange(0, _GRAD_STATS_WIDTH)
    tl.store(g_row + w, tl.zeros([_GRAD_STATS_WIDTH], dtype=tl.float32), mask=w >= _GRAD_STATS_USED)


def backward_prepare(dY: torch.Tensor, B: torch.Tensor, X: torch.Tensor, stats: torch.Tensor, dB: torch.Tensor,
                     grad_stats: torch.Tensor, *, block_c: Optional[int] = None,
                     num_warps: Optional[int] = None) -> None:
    """dB [T, C] = round(sum_j post_j * dY[:, j]); grad_stats [T, 32] FP32 = dpost | dcomb | zeros.

    dY, X [T, n, C] and B, dB [T, C] need a unit stride along C only; stats and grad_stats rows may be
    strided too. Default tile: 512 columns x (n + n*n) accumulators over 8 warps, 8 fp32 per thread each.
    """
    T, n, C = X.shape
    if T == 0:
        return
    assert n == layout.N_STREAMS and dY.shape == (T, n, C) and B.shape == (T, C) and dB.shape == (T, C)
    assert dY.stride(2) == 1 and X.stride(2) == 1 and B.stride(1) == 1 and dB.stride(1) == 1
    assert stats.stride(1) == 1 and grad_stats.stride(1) == 1 and grad_stats.dtype == torch.float32
    assert grad_stats.shape == (T, layout.GRAD_STATS_WIDTH) and stats.shape == (T, layout.STATS_WIDTH)
    if block_c is None:
        block_c = max(16, min(512, triton.next_power_of_2(C)))
    if num_warps is None:
        num_warps = max(1, min(8, block_c // 64))
    _backward_prepare_kernel[(T,)](
        dY, B, X, stats, dB, grad_stats, C,
        dY.stride(0), dY.stride(1), B.stride(0), X.stride(0), X.stride(1), stats.stride(0), dB.stride(0),
        grad_stats.stride(0),
        N=n, BLOCK_C=block_c, num_warps=num_warps,
    )
