"""mHC backward_prepare kernel and launcher: the finish node's backward, before the branch's.

One program per token walks C in chunks and, from one read of dY, B and X, writes
dB = round(sum_j post_j * dY_j) and the token's grad_stats row (dpost | dcomb | zeros, layout in
cakeops/meta/mhc_layout.py). The products are accumulated elementwise over the chunks and reduced once
at the end, so the chunk loop is pure loads and FMAs. No cross-token reduction: bitwise deterministic.
"""
import itertools
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .fast_launch import fast
from ..meta import mhc_layout as layout
from .launch import next_power_of_2
from .mhc_columns import POST, DPOST, DCOMB, GRAD_STATS_USED, GRAD_STATS_WIDTH


@triton.jit
def _backward_prepare_kernel(
    DY, B, X, STATS, DB, GS, C,
    stride_dyt, stride_dyi, stride_bt, stride_xt, stride_xi, stride_st, stride_dbt, stride_gt,
    N: tl.constexpr, BLOCK_C: tl.constexpr, VEC: tl.constexpr, X_ROWS: tl.constexpr, STAGES: tl.constexpr,
):
    # Tiles are [BLOCK_C, N]: C, the contiguous axis, first. The compiler then spreads columns over threads
    # and keeps a column's N streams inside one thread, so every per-chunk reduction over streams (dB) is
    # thread-local -- with [N, BLOCK_C] tiles the streams landed on different warps and each chunk paid
    # shared-memory round trips and barriers (462 GB/s on H200).
    # dcomb[i, j] = sum_c X_i * dY_j is gathered on the diagonals of a "rolled" dY: accumulator s holds
    # X_i * dY_{(i+s) mod N}; the rolled tiles re-read dY lines already in L1. The N accumulators are a tuple
    # unrolled at compile time (N separate [BLOCK_C // VEC, N] tiles, as if written out one by one).
    # X_ROWS (n = 8): X read stream by stream instead, accumulator s holding X_s * dY (row s of dcomb): no
    # re-loads of dY and no N-wide X tile, about half the instructions per chunk; with the chunk loop pipelined
    # (STAGES, cp.async) it runs at copy speed where the rolled form is instruction bound (H200, bf16, n = 8,
    # T = 8192, C = 4096, 2026-12-02: 457 -> 301 us; sm_90: 166 registers against 232).
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, N)
    offs_c = tl.arange(0, BLOCK_C)
    post = tl.load(STATS + t * stride_st + POST(N) + i)
    dy_base = DY + t * stride_dyt
    x_cols = X + t * stride_xt + i[None, :] * stride_xi
    acc_post = tl.zeros([BLOCK_C // VEC, N], dtype=tl.float32)
    acc = ()
    for shift in tl.static_range(N):
        acc = acc + (tl.zeros([BLOCK_C // VEC, N], dtype=tl.float32),)
    for c0 in tl.range(0, C, BLOCK_C, num_stages=STAGES):
        c = (c0 + offs_c)[:, None]
        m = c < C
        dy = tl.load(dy_base + i[None, :] * stride_dyi + c, mask=m, other=0.0).to(tl.float32)
        if not X_ROWS:
            x = tl.load(x_cols + c, mask=m, other=0.0).to(tl.float32)
        b = tl.load(B + t * stride_bt + c, mask=m, other=0.0).to(tl.float32)
        tl.store(DB + t * stride_dbt + (c0 + offs_c), tl.sum(dy * post[None, :], axis=1).to(DB.dtype.element_ty),
                 mask=(c0 + offs_c) < C)
        acc_post += _fold(dy * b, BLOCK_C, VEC, N)
        if X_ROWS:
            products = ()
            for s in tl.static_range(N):
                x_s = tl.load(X + t * stride_xt + s * stride_xi + c, mask=m, other=0.0).to(tl.float32)
                products = products + (acc[s] + _fold(x_s * dy, BLOCK_C, VEC, N),)
        else:
            products = (acc[0] + _fold(x * dy, BLOCK_C, VEC, N),)
            for shift in tl.static_range(1, N):
                products = products + (acc[shift] + _fold(x * _rolled(dy_base, i, shift, stride_dyi, c, m, N),
                                                          BLOCK_C, VEC, N),)
        acc = products
    g_row = GS + t * stride_gt
    tl.store(g_row + DPOST(N) + i, tl.sum(acc_post, axis=0))
    if X_ROWS:  # accumulator s: row s of dcomb
        for s in tl.static_range(N):
            tl.store(g_row + DCOMB(N) + s * N + i, tl.sum(acc[s], axis=0))
    else:       # accumulator s: the diagonal (i, i + s mod N)
        tl.store(g_row + DCOMB(N) + i * N + i, tl.sum(acc[0], axis=0))
        for shift in tl.static_range(1, N):
            tl.store(g_row + DCOMB(N) + i * N + (i + shift) % N, tl.sum(acc[shift], axis=0))
    w = tl.arange(0, GRAD_STATS_WIDTH(N))
    tl.store(g_row + w, tl.zeros([GRAD_STATS_WIDTH(N)], dtype=tl.float32), mask=w >= GRAD_STATS_USED(N))


@triton.jit
def _fold(p, BLOCK_C: tl.constexpr, VEC: tl.constexpr, N: tl.constexpr):
    """[BLOCK_C, N] -> [BLOCK_C // VEC, N]: sums each thread's VEC adjacent columns (its own registers), so the
    accumulators stay small."""
    return tl.sum(tl.reshape(p, [BLOCK_C // VEC, VEC, N]), axis=1)


@triton.jit
def _rolled(dy_base, i, shift: tl.constexpr, stride_dyi, c, m, N: tl.constexpr):
    """dY with its streams rotated by ``shift``: column i holds dY_{(i+shift) mod N}, in FP32."""
    return tl.load(dy_base + ((i + shift) % N)[None, :] * stride_dyi + c, mask=m, other=0.0).to(tl.float32)


@dataclass(frozen=True)
class BackwardPrepareConfig:
    """Launch shape of backward_prepare (one program per token). Default: 256 columns per warp (each thread one
    16-byte vector of every stream), 4 warps from C = 1024 on, else 1; for sm_90 that compiles to 128
    registers, 128-bit loads and no barrier inside the column loop. None: chosen by ``resolve``.
    ``x_rows``: dcomb from X stream by stream (the kernel's comment); ``stages``: the chunk loop's pipeline depth
    (None: not pipelined)."""
    block_c: Optional[int] = None
    num_warps: Optional[int] = None
    x_rows: Optional[bool] = None
    stages: Optional[int] = None

    def resolve(self, C: int, elem_bytes: int, n: int = 4) -> "BackwardPrepareLaunch":
        """The launch for rows of C elements of elem_bytes, n streams. n = 8 with 2-byte elements: one warp
        (H200, bf16, T = 16384, C = 4096, 2026-12-01: 1.013 -> 0.876 ms against 4 warps), X by rows and 3 stages
        (T = 8192: 457 -> 301 us, 2026-12-02). fp32 at n = 8 keeps 4 warps, rolled (one warp: 120 bytes of spills)."""
        vec = 16 // elem_bytes  # elements of one 16-byte load: the columns a thread folds in registers
        wide_half = n > 4 and elem_bytes == 2
        one_warp = C < 1024 or wide_half
        num_warps = self.num_warps if self.num_warps is not None else (1 if one_warp else 4)
        block_c = self.block_c if self.block_c is not None else max(vec, min(32 * vec * num_warps,
                                                                             next_power_of_2(C)))
        x_rows = self.x_rows if self.x_rows is not None else wide_half
        stages = self.stages if self.stages is not None else (3 if wide_half else None)
        return BackwardPrepareLaunch(block_c, num_warps, min(vec, block_c), x_rows, stages)

    @staticmethod
    def candidates(n: int = 4):
        """The tuner's variants. n = 8: only a thread's own 16-byte vector of each stream (256 columns per warp)
        or half of it (128: 168-178 registers against 232, sm_90); wider blocks spill (2.5-117 KB); and the
        rolled dcomb unpipelined (the default until 2026-12-03) or pipelined, X by rows unpipelined. n <= 4: 256 or
        512 columns per warp; at 1024 a thread's tiles spill (sm_90: 1 KB at 1024 columns of 1 warp or 2048 of 2,
        16 KB at 2048 of 1, whose test never finished on the H200 in two runs of the suite, > 150 s)."""
        for block_c, warps in itertools.product((256, 512, 1024, 2048), (1, 2, 4, 8)):
            if n <= 4 and 256 * warps <= block_c <= 512 * warps:
                yield BackwardPrepareConfig(block_c=block_c, num_warps=warps)
            elif n > 4 and block_c in (128 * warps, 256 * warps) and (block_c, warps) != (256, 1):  # not n's default
                yield BackwardPrepareConfig(block_c=block_c, num_warps=warps)
        if n > 4:
            yield BackwardPrepareConfig(x_rows=False, stages=0)
            yield BackwardPrepareConfig(x_rows=False, stages=3)
            yield BackwardPrepareConfig(x_rows=True, stages=0)
            yield BackwardPrepareConfig(x_rows=True, stages=2)
        else:
            yield BackwardPrepareConfig(x_rows=True, stages=3)


class BackwardPrepareLaunch(NamedTuple):
    block_c: int
    num_warps: int
    vec: int          # columns a thread folds in registers
    x_rows: bool
    stages: Optional[int]  # 0 or None: the chunk loop not pipelined


def backward_prepare(dY: torch.Tensor, B: torch.Tensor, X: torch.Tensor, stats: torch.Tensor, dB: torch.Tensor,
                     grad_stats: torch.Tensor, *, config: Optional[BackwardPrepareConfig] = None) -> None:
    """dB [T, C] = round(sum_j post_j * dY[:, j]); grad_stats [T, GRAD_STATS_WIDTH] FP32 = dpost | dcomb | zeros.

    dY, X [T, n, C] and B, dB [T, C] need a unit stride along C only; stats and grad_stats rows may be
    strided too. ``config``: the launch shape (BackwardPrepareConfig; the defaults when None).
    """
    T, n, C = X.shape
    if T == 0:
        return
    assert n in layout.SUPPORTED_STREAMS and dY.shape == (T, n, C) and B.shape == (T, C) and dB.shape == (T, C)
    s_dy, s_b, s_x, s_stats, s_db, s_gs = (t.stride() for t in (dY, B, X, stats, dB, grad_stats))
    assert s_dy[2] == 1 and s_x[2] == 1 and s_b[1] == 1 and s_db[1] == 1
    assert s_stats[1] == 1 and s_gs[1] == 1 and grad_stats.dtype == torch.float32
    assert grad_stats.shape == (T, layout.grad_stats_width(n)) and stats.shape == (T, layout.stats_width(n))
    launch = (config or BackwardPrepareConfig()).resolve(C, X.element_size(), n)
    pipelined = {"num_stages": launch.stages} if launch.stages else {}
    fast(_backward_prepare_kernel)[(T,)](
        dY, B, X, stats, dB, grad_stats, C,
        s_dy[0], s_dy[1], s_b[0], s_x[0], s_x[1], s_stats[0], s_db[0], s_gs[0],
        N=n, BLOCK_C=launch.block_c, VEC=launch.vec, X_ROWS=launch.x_rows, STAGES=launch.stages or None,
        num_warps=launch.num_warps, **pipelined,
    )
