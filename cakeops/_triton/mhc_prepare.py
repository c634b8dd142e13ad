"""mHC forward_prepare / forward_stats: the stats record (rstd, mix, pre, post, comb) and the collapse U.

Four launches, each with the parallelism its work needs (H200, bf16, T=16384, C=4096; docs/perf.md):

* ``_split_fn_kernel`` (bf16 X): fn into bf16 hi / lo halves, once per call (2 us).
* ``_project_kernel``, per block of 128 tokens (x column slices): the projection fn @ x on tensor cores and
  the sum of x^2, one pass over X (140-146 us: fn is re-read per token block, so big blocks).
* ``_gates_kernel``, per block of 8 tokens: the slices summed in order, rstd, mix, the gates and the n x n
  Sinkhorn, written to the record (11 us: latency-bound, so many small programs).
* the collapse U = sum_i pre_i * X_i, a one-pass stream kernel (mhc_streams.collapse, 150 us).

One kernel doing all of it per token block measured 0.39 ms against 0.34: its Sinkhorn ran as a tail after
the projection on every multiprocessor at once, and its second pass over the block missed the L2 anyway.
One launch with column slices (tickets: the last slice of a block runs its gates, the collapse of block b - D
waits for them and re-reads X from L2) measured 0.44 ms at best against 0.32, and 0.57 even when nobody waits
(2026-11-29, docs/perf.md): one kernel gives both phases one register budget (182: one program per SM), and the
collapse phase then has too few bytes in flight; with short deferrals the gates also outlast X's stay in L2.
forward_stats is all but the collapse, so its record is bitwise forward_prepare's. Record layout:
cakeops/meta/mhc_layout.py. FP32 inside, IEEE division and square root, every output rounded once. Launchers
do no argument validation (the public layer does); X is [T, n, C] with unit stride along C and any token /
stream strides.
"""
import functools
import math
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .fast_launch import fast
from ..meta import mhc_layout as layout
from .mhc_columns import PRE, POST, COMB, RSTD, MIX, STATS_USED, STATS_WIDTH, logits_pad
from .._backend import interpreting
from . import arch
from .launch import cdiv, kept_per_shape, next_power_of_2, persistent_programs, pipeline_stages, register_cap
from .mhc_math import SINKHORN_TILE, bf16_pieces, dot_bf16, logit, sigmoid, sinkhorn
from .mhc_streams import StreamConfig, collapse


@triton.jit
def _fn_rows(FN, C, i, c, c_ok, stride_fn, offs_m, M: tl.constexpr):
    """fn[offs_m, i*C + c]^T [len(c), len(offs_m)] (the hi piece when presplit), rows past M masked to zero."""
    w_mask = (offs_m < M)[None, :] & c_ok[:, None]
    return tl.load(FN + offs_m[None, :] * stride_fn + (i * C + c)[:, None], mask=w_mask, other=0.0), w_mask


@triton.jit
def _fn_dot(x, xf, w, w_mask, FN, C, i, c, stride_fn, offs_m, acc, M: tl.constexpr, SPLIT_BF16: tl.constexpr,
            INTERPRET: tl.constexpr, PRECISION: tl.constexpr, PRESPLIT: tl.constexpr):
    """acc + x @ w, w = _fn_rows' tile: bf16 x against fn's hi and lo pieces, else FP32 x in TF32."""
    if SPLIT_BF16:
        if PRESPLIT:
            w_hi = w
            w_lo = tl.load(FN + (M + offs_m[None, :]) * stride_fn + (i * C + c)[:, None], mask=w_mask, other=0.0)
        else:
            w_hi, w_lo = bf16_pieces(w)
        acc = dot_bf16(x, w_hi, acc, INTERPRET)
        acc = dot_bf16(x, w_lo, acc, INTERPRET)
    else:
        acc = tl.dot(xf, w, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _project_chunk(X, FN, t_off, t_ok, C, i, c, c_ok, stride_xi, stride_fn, acc, acc_lo, sum_sq,
                   M: tl.constexpr, M_PAD: tl.constexpr, SPLIT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
                   PRECISION: tl.constexpr, PRESPLIT: tl.constexpr, M_HI: tl.constexpr, M_LO: tl.constexpr):
    """One stream's columns c of a token block added to (acc, acc_lo, sum_sq): logits [0, M_PAD) into acc, or,
    with M_HI > 0, [0, M_HI) into acc and [M_HI, M_HI + M_LO) into acc_lo (that one first: acc's MMA is the
    last, the one _await_mma waits for)."""
    # (x, fn's tile, then x^2: the order n = 2 / 4's build has had since 2026-11-29)
    offs_m = tl.arange(0, M_PAD if M_HI == 0 else M_HI)
    x = tl.load(X + t_off[:, None] + i * stride_xi + c[None, :], mask=t_ok[:, None] & c_ok[None, :], other=0.0)
    w, w_mask = _fn_rows(FN, C, i, c, c_ok, stride_fn, offs_m, M)
    xf = x.to(tl.float32)
    sum_sq += xf * xf
    if M_HI > 0:
        offs_lo = M_HI + tl.arange(0, M_LO)
        w_lo, w_lo_mask = _fn_rows(FN, C, i, c, c_ok, stride_fn, offs_lo, M)
        acc_lo = _fn_dot(x, xf, w_lo, w_lo_mask, FN, C, i, c, stride_fn, offs_lo, acc_lo, M, SPLIT_BF16, INTERPRET,
                         PRECISION, PRESPLIT)
    acc = _fn_dot(x, xf, w, w_mask, FN, C, i, c, stride_fn, offs_m, acc, M, SPLIT_BF16, INTERPRET, PRECISION,
                  PRESPLIT)
    return acc, acc_lo, sum_sq


@triton.jit
def _await_mma(acc, SPLIT_BF16: tl.constexpr):
    """acc read in registers at the end of a loop step, so that Triton waits for the step's last MMA inside it.

    bf16 x goes to the tensor cores from the shared-memory buffer its copy filled, and x^2 reads that buffer in
    registers too, so triton 3.6 gives x one buffer fewer than the stages (fn's tiles, read by the MMA alone, get
    one per stage) yet leaves the step's last MMA in flight across the loop edge, while the copy of a later x
    tile refills the buffer it reads: a race (sm_90 builds of every bf16 projection, 2026-12-03; on the H200 the
    64 + 16 logit split gave records a few roundings apart from run to run). With the wait, nothing reads a
    buffer when it is refilled (tests/test_build_races.py checks the builds). + 0.0 changes no value but -0's
    sign, which no sum sees. fp16 / fp32 x reach the MMA through registers (FP32, TF32): nothing to wait for."""
    if SPLIT_BF16:
        acc = acc + 0.0
    return acc


@triton.jit
def _project(X, FN, t_off, t_ok, C, c_lo, c_hi, stride_xi, stride_fn,
             N: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
             BLOCK_C: tl.constexpr, SPLIT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
             PRECISION: tl.constexpr, PRESPLIT: tl.constexpr, STREAM_STEPS: tl.constexpr = False,
             M_HI: tl.constexpr = 0, M_LO: tl.constexpr = 16):
    """A token block, columns [c_lo, c_hi) of every stream: (fn @ x [BLOCK_T, M_PAD], [BLOCK_T, M_LO] and the
    sum of x^2 [BLOCK_T] over those columns), FP32.

    Walks the columns in BLOCK_C chunks, the n streams of a chunk together in one loop step (no div/mod to
    unflatten K); STREAM_STEPS: one stream's chunk per step instead (the loop runs n times as many steps, each
    1/n of the shared memory), so that n = 8's 128 logit columns fit chunks of 64 columns rather than 16.
    Tensor cores for the projection (design.md §3 allows it): bf16 x is exact in a bf16 MMA and fn is split
    into bf16 hi + lo (~16 mantissa bits; on an H200 both faster and ~10x more accurate than TF32);
    other dtypes take fp32 x with TF32. The interpreter's bf16 dot is broken, so there the same pieces
    go through an fp32 dot. PRESPLIT: FN is [2, M, K] bf16 (hi, lo), split once per call by _split_fn_kernel,
    so the tiles go to the tensor cores as loaded instead of through registers for the split.
    M_HI > 0 (n = 8's 80 logits): the logits as two accumulators, [0, M_HI) and [M_HI, M_HI + M_LO) (64 + 16),
    instead of one padded to M_PAD = 128: 37.5 % fewer MMA operations; the first is then only M_HI wide and the
    second holds the rest (otherwise an unused [BLOCK_T, M_LO] of zeros).
    """
    offs_c = tl.arange(0, BLOCK_C)
    acc = tl.zeros([BLOCK_T, M_PAD if M_HI == 0 else M_HI], dtype=tl.float32)
    acc_lo = tl.zeros([BLOCK_T, M_LO], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if STREAM_STEPS:
        chunks = tl.cdiv(c_hi - c_lo, BLOCK_C)
        for step in range(0, N * chunks):
            i = step // chunks
            c = c_lo + (step - i * chunks) * BLOCK_C + offs_c
            acc, acc_lo, sum_sq = _project_chunk(X, FN, t_off, t_ok, C, i, c, c < c_hi, stride_xi, stride_fn, acc,
                                                 acc_lo, sum_sq, M, M_PAD, SPLIT_BF16, INTERPRET, PRECISION,
                                                 PRESPLIT, M_HI, M_LO)
            acc = _await_mma(acc, SPLIT_BF16)
    else:
        for c0 in range(c_lo, c_hi, BLOCK_C):
            c = c0 + offs_c
            for i in tl.static_range(N):
                acc, acc_lo, sum_sq = _project_chunk(X, FN, t_off, t_ok, C, i, c, c < c_hi, stride_xi, stride_fn,
                                                     acc, acc_lo, sum_sq, M, M_PAD, SPLIT_BF16, INTERPRET,
                                                     PRECISION, PRESPLIT, M_HI, M_LO)
            acc = _await_mma(acc, SPLIT_BF16)
    return acc, acc_lo, tl.sum(sum_sq, axis=1)


@triton.jit
def _split_fn_kernel(FN, OUT, M, K, stride_fn, BLOCK: tl.constexpr):
    """OUT [2, M, K] bf16 = (round(fn), round(fn - round(fn))): the split _project does per tile, once."""
    row = tl.program_id(0)
    k = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = k < K
    hi, lo = bf16_pieces(tl.load(FN + row * stride_fn + k, mask=ok, other=0.0))
    tl.store(OUT + row * K + k, hi, mask=ok)
    tl.store(OUT + (M + row) * K + k, lo, mask=ok)


@triton.jit
def _project_kernel(
    X, FN, PART, T, C, cols, stride_xt, stride_xi, stride_fn,
    N: tl.constexpr, M_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    SPLIT_BF16: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr, PRESPLIT: tl.constexpr,
    STREAM_STEPS: tl.constexpr = False, M_HI: tl.constexpr = 0, M_LO: tl.constexpr = 16,
):
    """Program (token block, column slice): the slice's projection and sum of squares into PART [slices, T,
    M_PAD]. Projection columns >= M are zero (fn rows masked), so column M carries sum(x^2)."""
    M = 2 * N + N * N
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    c_lo = tl.program_id(1) * cols
    acc, acc_lo, sum_sq = _project(X, FN, t.to(tl.int64) * stride_xt, t_ok, C, c_lo, tl.minimum(C, c_lo + cols),
                                   stride_xi, stride_fn, N, M, M_PAD, BLOCK_T, BLOCK_C, SPLIT_BF16, INTERPRET,
                                   PRECISION, PRESPLIT, STREAM_STEPS, M_HI, M_LO)
    row = PART + (tl.program_id(1) * T + t).to(tl.int64) * M_PAD
    if M_HI == 0:
        offs_m = tl.arange(0, M_PAD)
        tl.store(row[:, None] + offs_m[None, :], tl.where(offs_m[None, :] == M, sum_sq[:, None], acc),
                 mask=t_ok[:, None])
    else:  # the two accumulators, then the row's tail past the logits: sum(x^2) at M, zeros after it
        tl.store(row[:, None] + tl.arange(0, M_HI)[None, :], acc, mask=t_ok[:, None])
        offs_lo = M_HI + tl.arange(0, M_LO)[None, :]
        tl.store(row[:, None] + offs_lo, acc_lo, mask=t_ok[:, None] & (offs_lo < M))
        offs_tail = M_HI + tl.arange(0, M_PAD - M_HI)[None, :]
        tl.store(row[:, None] + offs_tail, tl.where(offs_tail == M, sum_sq[:, None], 0.0),
                 mask=t_ok[:, None] & (offs_tail >= M))


@triton.jit
def _gates_kernel(PART, SCALE, BASE, STATS, slices, T, C, rms_eps, hc_eps, iters,
                  N: tl.constexpr, M_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """One token block: the slices' partials summed in slice order (deterministic), then rstd, mix, the
    gates and the Sinkhorn into the stats rows (padding zeroed)."""
    # float arguments arrive as FP32 from Triton's launcher, as FP64 from Inductor's (a traced launch)
    rms_eps, hc_eps = tl.cast(rms_eps, tl.float32), tl.cast(hc_eps, tl.float32)
    M = 2 * N + N * N
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    offs_m = tl.arange(0, M_PAD)
    acc = tl.zeros([BLOCK_T, M_PAD], dtype=tl.float32)
    for s in range(slices):
        acc += tl.load(PART + (s * T + t64)[:, None] * M_PAD + offs_m[None, :], mask=t_ok[:, None], other=0.0)
    sum_sq = tl.sum(tl.where(offs_m[None, :] == M, acc, 0.0), axis=1)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sum_sq, (N * C) * 1.0) + rms_eps))
    mix = acc * rstd[:, None]

    # mix goes to its stats columns, then comes back in the shapes the gates and the Sinkhorn need
    # ([BLOCK_T, N], [BLOCK_T, N, N]): a cache-hot round trip of M floats per token, simpler than
    # re-laying out registers. The barrier makes the other threads' stores visible.
    s_row = STATS + t64 * STATS_WIDTH(N)
    tl.store(s_row[:, None] + MIX(N) + offs_m[None, :], mix, mask=t_ok[:, None] & (offs_m < M)[None, :])
    tl.store(s_row + RSTD(N), rstd, mask=t_ok)
    offs_w = tl.arange(0, STATS_WIDTH(N))
    tl.store(s_row[:, None] + offs_w[None, :], tl.zeros([BLOCK_T, STATS_WIDTH(N)], dtype=tl.float32),
             mask=t_ok[:, None] & (offs_w >= STATS_USED(N))[None, :])
    tl.debug_barrier()

    j = tl.arange(0, N)
    row_ok = t_ok[:, None]
    z_pre = tl.load(s_row[:, None] + MIX(N) + j[None, :], mask=row_ok, other=0.0)
    z_post = tl.load(s_row[:, None] + MIX(N) + N + j[None, :], mask=row_ok, other=0.0)
    pre = sigmoid(logit(z_pre, tl.load(SCALE), tl.load(BASE + j)[None, :])) + hc_eps
    post = 2.0 * sigmoid(logit(z_post, tl.load(SCALE + 1), tl.load(BASE + N + j)[None, :]))
    ij = j[:, None] * N + j[None, :]
    z_res = tl.load(s_row[:, None, None] + MIX(N) + 2 * N + ij[None, :, :], mask=row_ok[:, :, None], other=0.0)
    comb, _ = sinkhorn(z_res, tl.load(SCALE + 2), tl.load(BASE + 2 * N + ij)[None, :, :], hc_eps, iters,
                       STATS, 0, False)  # no scratch: nothing recorded
    tl.store(s_row[:, None] + PRE(N) + j[None, :], pre, mask=row_ok)
    tl.store(s_row[:, None] + POST(N) + j[None, :], post, mask=row_ok)
    # comb reaches its columns through the block's first partials rows (read above, dead now; 16-byte aligned, and
    # M_PAD >= n*n). Stored straight to COMB, 4 bytes past a 16-byte boundary in FlashInfer's order, the Sinkhorn
    # tile took another register layout on sm_90 ([8, 1, 4] threads, not kernel A's [8, 4, 1] with rows in one
    # thread: triton 3.6's TTGIR), its n-element sums another order, and the backward's replay missed the forward's
    # bits at n = 4, 8 (H100). Stored where kernel A stores its iterates (aligned rows), the tile is kernel A's.
    stage = PART + t64[:, None, None] * M_PAD + ij[None, :, :]
    tl.store(stage, comb, mask=row_ok[:, :, None])
    tl.debug_barrier()
    comb = tl.load(stage, mask=row_ok[:, :, None], other=0.0)
    tl.store(s_row[:, None, None] + COMB(N) + ij[None, :, :], comb, mask=row_ok[:, :, None])


def logit_split_widths(n: int, split: bool):
    """(M_HI, M_LO) of _project for n streams: the M = 2n + n^2 logits as [0, M_HI) and [M_HI, M_HI + M_LO) when
    ``split`` and that is narrower than one accumulator of logits_pad(n) (n = 8: 64 + 16 against 128; at n = 2
    and 4 a tl.dot's 16-column minimum leaves nothing to save); (0, 16) otherwise: one accumulator."""
    M = 2 * n + n * n
    hi = 1 << (M.bit_length() - 1)
    lo = max(16, next_power_of_2(M - hi)) if M > hi else 0
    if not split or hi < 16 or lo == 0 or hi + lo >= logits_pad(n):
        return 0, 16
    return hi, lo


@dataclass(frozen=True)
class PrepareConfig:
    """Launch shape of forward_prepare / forward_stats. Fields left None are chosen for the call by ``resolve``;
    ``candidates`` is the search space ``python -m cakeops.bench.tune --ops prepare`` sweeps.

    Projection: on an H200 (bf16, T = 16384, C = 4096) 128 x 64 tiles, 8 warps, 3 stages were the fastest
    (sweeps over BLOCK_T 32..256, BLOCK_C 32..128, 4/8 warps, 2..5 stages, 1..8 column slices): fn (1.5 MiB)
    is re-read from L2 by every token block, so large blocks; 256 does not fit the shared memory. When T has
    fewer 128-token blocks than there are multiprocessors, the columns are split into slices so that every one
    has a program (T = 8192: 2 slices, projection 124 -> 78 us at C = 4096, 217 -> 128 at C = 7168; halving the
    blocks instead gave 90 and 150); only past 8 slices do the blocks shrink. The interpreter wants small tiles.
    ``presplit`` (bf16 X): fn split into bf16 hi / lo once per call (a 2 us kernel) instead of per tile (146 us
    against 166). The gates kernel runs the Sinkhorn on SINKHORN_TILE (mhc_math.py). Measured on sm_90 only;
    other GPUs take the same rules, then fewer stages or smaller tiles where the build does not fit their shared
    memory (``arch.first_fit``; sm_90 keeps the measured shape).
    """
    block_t: Optional[int] = None      # projection: tokens per block
    block_c: Optional[int] = None      # projection: columns per chunk
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    slices: Optional[int] = None       # projection: column slices per token block (partials summed in order)
    gates_block_t: int = SINKHORN_TILE[0]
    gates_warps: int = SINKHORN_TILE[1]
    collapse_block_c: Optional[int] = None  # the collapse U: columns per program (mhc_streams.StreamConfig)
    presplit: bool = True
    stream_steps: Optional[bool] = None  # projection: one stream's chunk per loop step (_project); None: n > 4
    # projection: n = 8's 80 logits as 64 + 16 accumulators, not one padded to 128 (logit_split_widths); None: for
    # bf16 X (H200, 2026-12-03: forward_prepare 0.458 -> 0.404 ms at T = 8192, 0.867 -> 0.766 at 16384; bitwise
    # the same record run after run since _await_mma; fp16 / fp32 X not measured with it: one accumulator)
    logit_split: Optional[bool] = None
    maxnreg: Optional[int] = None      # projection: registers per thread (None: 128 for bf16 x with the split)

    def resolve(self, X: torch.Tensor, build=None, free: Optional[frozenset] = None) -> "PrepareConfig":
        """This config with every None replaced by the default for X's shape and device (``resolve_for``)."""
        T, n, C = X.shape
        return self.resolve_for(T, C, X.device, X.is_cuda, n=n, dtype=X.dtype, build=build, free=free)

    def resolve_for(self, T: int, C: int, device: torch.device, cuda: Optional[bool] = None,
                    n: int = 4, dtype: torch.dtype = torch.bfloat16, build=None,
                    free: Optional[frozenset] = None) -> "PrepareConfig":
        """``resolve`` from the sizes alone (the workspace size helpers have no X). On a GPU the shape is the one
        measured on sm_90, or the first of ``fallbacks`` whose build fits the device (``arch.first_fit``):
        ``build(config, n, dtype)`` gives the projection's launch (default: forward_prepare's ``_project_kernel``);
        ``free`` names the fields it may change (default: those this config leaves None)."""
        # n = 8: M_PAD = 128 logit columns (32 for n = 4) make fn's tiles 4x wider: a loop step of all 8 streams
        # fits 16 columns per chunk (n = 4's 64 would need 1 MB of shared memory), one stream per step 64.
        wide = n > 4
        stream_steps = wide if self.stream_steps is None else self.stream_steps
        # (fp32 X at 64 columns: 255 registers and spills on sm_90, so 32)
        widest = 64 if not (wide and stream_steps and dtype == torch.float32) else 32
        block_c = max(16, min(16 if wide and not stream_steps else widest, next_power_of_2(C)))
        asked = dtype == torch.bfloat16 if self.logit_split is None else self.logit_split
        split = asked and logit_split_widths(n, True)[0] > 0
        gpu = device.type == "cuda" if cuda is None else cuda
        if not gpu:
            chosen = dict(block_t=16, block_c=block_c, num_warps=4, num_stages=None, slices=1)
        else:
            sms = persistent_programs(device, 1 << 30, per_sm=1)  # the multiprocessor count
            # the slices follow the block size that runs: a given one (n = 8's layer default is 128) or the rule's;
            # n = 8's split logits on bf16 X leave room for 2 programs per SM (sm_90: 128 registers, 92 KB of
            # shared memory at 128 x 64 of 8 warps), so twice the slices (T = 8192: 4, 196 us against 2's 244)
            per_sm = 2 if split and dtype == torch.bfloat16 else 1
            block_t = self.block_t or (64 if wide else 128)
            slices = max(1, min(8, per_sm * sms // cdiv(T, block_t), cdiv(C, block_c)))
            while self.block_t is None and block_t > 16 and cdiv(T, block_t) * slices < sms // 2:
                block_t //= 2
            # fp32 / fp16 X: fn's tiles stay FP32 (no bf16 pieces), twice the bytes a stage: 3 stages need
            # 336 KB (n = 4) / 280 KB (n = 8) of shared memory, sm_90 has 227 KB; 2 fit. A GPU with less shared
            # memory (or whose builds take more, sm_100) falls back from there (fallbacks)
            deep = dtype == torch.bfloat16 and (block_t >= 128 or wide)
            # the split's 2 programs per SM at 8 warps need <= 128 registers: its build takes 126 capped, 152
            # without (sm_90, triton 3.6: _await_mma's wait keeps acc live across the step's last MMA), no spills
            chosen = dict(block_t=block_t, block_c=block_c, num_warps=8 if block_t >= 128 else 4,
                          num_stages=3 if deep else 2, slices=slices, maxnreg=128 if per_sm == 2 else None)
        chosen["stream_steps"] = stream_steps
        # logit_split as it runs: asked for at n = 2 / 4 it has nothing to split
        cfg = replace(self, **{k: v for k, v in chosen.items() if getattr(self, k) is None}, logit_split=split)
        if not gpu or cfg.num_stages is None:  # the interpreter: nothing is built
            return cfg
        free = unset_fields(self) if free is None else free
        return _fit(cfg, free, arch.target_of(device), build or _project_build, n, dtype)

    def fallbacks(self, free: frozenset):
        """This resolved config, then the same with fewer stages (down to 2), then with smaller tiles: columns per
        chunk halved down to 16, then tokens per block (4 warps below 128), each from this config's stages
        down again; only the fields named in ``free`` change. What ``arch.first_fit`` tries on a GPU whose shared
        memory the build exceeds."""
        def halvings(field, least):
            value = getattr(self, field)
            return [value >> k for k in range(value.bit_length()) if value >> k >= least] if field in free else [value]

        stages = arch.fewer_stages(self.num_stages, 2) if "num_stages" in free else (self.num_stages,)
        for block_t in halvings("block_t", 16):
            warps = self.num_warps if "num_warps" not in free or block_t == self.block_t else \
                (8 if block_t >= 128 else 4)
            for block_c in halvings("block_c", 16):
                for s in stages:
                    yield replace(self, block_t=block_t, block_c=block_c, num_warps=warps, num_stages=s)

    @staticmethod
    def candidates(n: int = 4):
        """The tuner's variants besides the default, for n streams (n = 8 has its own, every other n n = 4's)."""
        if n > 4:
            yield from _wide_candidates()
            return
        yield PrepareConfig(presplit=False)  # fn split per tile inside the projection
        # 128 programs of 128 tokens leave SMs idle: shorter blocks / column slices / deeper pipelines
        for block_t, warps, stages, block_c, slices in ((128, 8, 3, 64, 1), (128, 8, 3, 64, 2), (64, 4, 3, 64, 1),
                                                        (64, 4, 2, 64, 2), (64, 8, 3, 64, 1), (128, 8, 4, 32, 1)):
            yield PrepareConfig(block_t=block_t, num_warps=warps, num_stages=stages, block_c=block_c, slices=slices)
        # one stream per loop step (n = 8's form), H200 2026-12-02: 0.316 ms against the default's 0.323 (equal
        # within noise; n = 4 keeps its form), 64 columns 0.330-0.356
        yield PrepareConfig(block_t=128, num_warps=8, num_stages=3, block_c=128, stream_steps=True)


def _wide_candidates():
    """n = 8's projection shapes (triton 3.6 sm_90 builds at T = 16384, C = 4096; none spills). fn's bf16 hi / lo
    tiles are 80 (M_PAD 128) rows wide, so every token block re-reads 2.5x its own X bytes of fn from L2 at 64
    tokens: 128- and 256-token blocks halve / quarter that; presplit=False stages fp32 fn through registers,
    column slices give the SMs programs to share. stream_steps: one stream's 32 / 64 columns per loop step (48 KB
    of shared memory a stage at 128 x 64, bf16)."""
    # the 80 logits as 64 + 16 accumulators (logit_split, the default for bf16 X: 128 x 64 / 8 warps / 3 stages, the
    # rule's 4 / 2 slices) at other depths, slices and tiles. H200 2026-12-03, forward_prepare ms at T = 8192 /
    # 16384 (the default 0.386 / 0.716-0.734 before _await_mma, 0.404 / 0.766 with it; 2 / 1 slices: 0.400 / -;
    # the stages measured at 2 / 1 slices, before _await_mma; 64 x 64 / 4 warps / 4 stages with it: 0.402 / -)
    for block_t, warps, stages, slices in ((128, 8, 4, None),   # 0.411 / -, 128 KB of shared memory
                                           (128, 8, 5, None),   # 0.409 / 0.779
                                           (128, 8, 3, 4),
                                           (128, 8, 3, 2),
                                           (64, 4, 4, None)):   # 0.461 / 0.743, 146 registers
        yield PrepareConfig(block_t=block_t, block_c=64, num_warps=warps, num_stages=stages, slices=slices,
                            stream_steps=True, logit_split=True)
    # (split at 128 columns per step, 128 x 128 of 8 warps / 64 x 128 of 4, one program per SM: 0.405 / 0.443 ms at
    # T = 8192, 0.758 / 0.840 at 16384, H200 2026-12-03; dropped)
    # one accumulator of 128 logit columns (M_PAD; 162 registers, 128 KB, 1 / SM): the default until 2026-12-03
    # (128 x 64 / 8 warps / 3 stages: 0.450 / 0.855 ms at T = 8192 / 16384, 0.458 / 0.867 with _await_mma), and at
    # other shapes
    yield PrepareConfig(block_t=128, num_warps=8, logit_split=False)
    for block_t, warps, stages, block_c in ((128, 8, 4, 64),    # 0.448 / 0.851, 180 KB of shared memory
                                            (64, 4, 3, 64),     # 0.519 / 0.820, 115 KB, 2 / SM
                                            (128, 4, 3, 64)):   # 0.490 / 0.934
        yield PrepareConfig(block_t=block_t, block_c=block_c, num_warps=warps, num_stages=stages, stream_steps=True,
                            logit_split=False)
    # (256 x 64 of 8 warps, 2 stages: 0.537 / 0.976; 128 x 32 of 8, 3 stages: 0.555 / 1.055; 128 x 64 of 8, 2
    # stages: 0.644 / 1.377; dropped from the sweep on 2026-12-03)
    # all 8 streams per loop step (the default until 2026-12-02: 128 x 16, 8 warps, 2 stages, 2 slices: 0.661 at
    # T = 8192; the others 0.717-1.480; 128 x 16 / 3 stages / fn split per tile, 2026-12-03: 0.720)
    yield PrepareConfig(block_t=128, block_c=16, num_warps=8, num_stages=2, slices=2, stream_steps=False,
                        logit_split=False)
    # (the 80 logits as 64 + 16 at all 8 streams per step, 16 columns: 1.705 / 2.604 ms against 1.256, H200
    # 2026-12-01; one stream per step, 64 columns, they are the default since 2026-12-03)


# The layer's projection at n = 8 where it differs from resolve's rules (which the gated head's projection, with
# n logits instead of 2n + n^2, keeps): 128-token blocks of 8 warps, one stream's 64 columns per loop step
# (stream_steps, resolve's choice at n > 4), 3 stages. H200, bf16, C = 4096 (python -m cakeops.bench.tune --ops
# prepare --n 8, 2026-12-02): forward_prepare at T = 8192 0.642 -> 0.450 ms (the projection 456 -> 263 us; all 8
# streams per step at 16 columns before), at T = 16384 1.310 -> 0.855 (64-token blocks of 4 warps 0.820, 3 %
# apart; the 128-token blocks win by 13 % at T = 8192, the equal-bytes row). 2 stages: 0.644 / 1.377. With the
# logits split 64 + 16 (resolve's choice for bf16 X) 0.404 / 0.766 ms (2026-12-03).
LAYER_DEFAULTS = {8: dict(block_t=128, num_warps=8)}  # the stages: resolve's (3 for bf16 on sm_90)


TILE_FIELDS = ("block_t", "block_c", "num_warps", "num_stages")


@functools.lru_cache(maxsize=256)
def unset_fields(config: Optional[PrepareConfig]) -> frozenset:
    """The tile fields ``config`` leaves None (every one without a config): those ``resolve`` may fall back on when
    the build does not fit the GPU. Defaults filled in before ``resolve`` (LAYER_DEFAULTS, the gated head's) stay
    free."""
    return frozenset(f for f in TILE_FIELDS if config is None or getattr(config, f) is None)


def projection_options(cfg: PrepareConfig, n: int, dtype: torch.dtype, m_pad: int) -> dict:
    """The projection kernels' constexprs and launch options at a resolved config (forward_prepare's
    ``_project_kernel`` adds its logit split, ``_project_options``; the gated head's runs them as they are)."""
    bf16 = dtype == torch.bfloat16
    return dict(N=n, M_PAD=m_pad, BLOCK_T=cfg.block_t, BLOCK_C=cfg.block_c, SPLIT_BF16=bf16, INTERPRET=interpreting(),
                PRESPLIT=cfg.presplit and bf16, STREAM_STEPS=cfg.stream_steps,
                # fp32 X: three-pass TF32, near-fp32 projection (design.md §3's 1e-3 on records with one pass is tight)
                PRECISION="tf32x3" if dtype == torch.float32 else "tf32",
                num_warps=cfg.num_warps, **pipeline_stages(cfg.num_stages), **register_cap(cfg.maxnreg))


def projection_args(cfg: PrepareConfig, dtype: torch.dtype) -> tuple:
    """A projection launch's arguments as ``arch.built_shared_memory`` takes them: X, fn (its bf16 pieces when
    presplit), the partials; then T, C, columns per slice and the three strides (16-divisible stand-ins)."""
    return (dtype, torch.bfloat16 if cfg.presplit and dtype == torch.bfloat16 else torch.float32,
            torch.float32) + (4096,) * 6


def _project_options(cfg: PrepareConfig, n: int, dtype: torch.dtype) -> dict:
    return dict(projection_options(cfg, n, dtype, logits_pad(n)),
                **dict(zip(("M_HI", "M_LO"), logit_split_widths(n, cfg.logit_split))))


def _project_build(cfg: PrepareConfig, n: int, dtype: torch.dtype):
    """forward_prepare's projection launch at ``cfg`` (what ``arch.first_fit`` builds)."""
    return _project_kernel, projection_args(cfg, dtype), _project_options(cfg, n, dtype)


@functools.lru_cache(maxsize=1024)  # resolve runs per call, on the host path
def _fit(cfg: PrepareConfig, free: frozenset, target, build, n: int, dtype: torch.dtype) -> PrepareConfig:
    return arch.first_fit(target, cfg.fallbacks(free), functools.partial(build, n=n, dtype=dtype))


def layer_config(config: Optional[PrepareConfig], n: int, cuda: bool) -> PrepareConfig:
    """The config forward_prepare / forward_stats run for n streams: the caller's, or n's layer default on a GPU
    (the interpreter keeps resolve's small tiles)."""
    if config is not None:
        return config
    return PrepareConfig(**LAYER_DEFAULTS.get(n, {})) if cuda else PrepareConfig()


def workspace_regions(T: int, n: int, C: int, dtype: torch.dtype, cfg: PrepareConfig):
    """The scratch of one call, as (shape, dtype) regions in workspace order (``cfg`` resolved):
    the bf16 hi / lo pieces of fn [2, M, n*C] (bf16 X with ``presplit`` only), then the projection partials
    FP32 [slices, T, M_PAD] (column M of a row carries the sum of squares)."""
    M = 2 * n + n * n
    m_pad = logits_pad(n)
    cols = cdiv(cdiv(C, cfg.slices), cfg.block_c) * cfg.block_c
    regions = [((2, M, n * C), torch.bfloat16)] if cfg.presplit and dtype == torch.bfloat16 else []
    return regions + [((cdiv(C, cols), T, m_pad), torch.float32)]


def workspace_bytes(X: torch.Tensor, config: Optional[PrepareConfig] = None) -> int:
    """Bytes of workspace ``prepare`` carves for this X (0 when T == 0: nothing is launched)."""
    from .._workspace import layout_bytes

    T, n, C = X.shape
    if T == 0:
        return 0
    cfg = layer_config(config, n, X.is_cuda).resolve(X, free=unset_fields(config))
    return layout_bytes(workspace_regions(T, n, C, X.dtype, cfg))


def workspace_bytes_max(T: int, n: int, C: int, device: torch.device, config: Optional[PrepareConfig] = None) -> int:
    """Bytes of a workspace that serves every call of up to T tokens of [*, n, C] on ``device``, any dtype:
    fn's pieces (always reserved) and the largest partials over T' <= T (column slices shrink as T grows,
    so slices * T' is not monotone; it changes only at whole token blocks: 128 tokens, 64 for n = 8)."""
    from .._workspace import layout_bytes

    if T == 0:
        return 0
    base, free = layer_config(config, n, device.type == "cuda"), unset_fields(config)
    block = 64 if n > 4 else 128
    candidates = {T} | {block * k for k in range(1, min(cdiv(T, block), 257))}
    # the dtypes resolve to different columns per chunk and (n = 8) programs per SM, so to different slices
    parts = max((workspace_regions(t, n, C, torch.float32, base.resolve_for(t, C, device, n=n, dtype=dtype,
                                                                            free=free))[0][0]
                 for t in candidates if t <= T for dtype in (torch.bfloat16, torch.float16, torch.float32)),
                key=math.prod)  # by elements: shapes compare lexicographically
    M = 2 * n + n * n
    return layout_bytes([((2, M, n * C), torch.bfloat16), (parts, torch.float32)])


class _Launch(NamedTuple):
    """What a forward_prepare / forward_stats call launches with, from X's sizes alone (``_launch``)."""
    cfg: PrepareConfig    # resolved
    cols: int             # projection: columns per slice
    presplit: bool        # fn split into bf16 pieces first
    regions: tuple        # workspace_regions: fn's pieces (presplit), the partials
    project_options: dict  # the projection's constexprs and launch options
    collapse: StreamConfig
    pre: int              # the record's column of the first pre gate (PRE(n), a constexpr function: slow on the host)


@kept_per_shape
def _launch(X: torch.Tensor, config: Optional[PrepareConfig]) -> _Launch:
    T, n, C = X.shape
    cfg = layer_config(config, n, X.is_cuda).resolve(X, free=unset_fields(config))
    cols = cdiv(cdiv(C, cfg.slices), cfg.block_c) * cfg.block_c
    regions = tuple(workspace_regions(T, n, C, X.dtype, cfg))
    return _Launch(cfg, cols, cfg.presplit and X.dtype == torch.bfloat16, regions, _project_options(cfg, n, X.dtype),
                   StreamConfig(block_c=cfg.collapse_block_c), PRE(n))


def prepare(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
            hc_eps: float, sinkhorn_iters: int, stats: torch.Tensor, U: Optional[torch.Tensor] = None, *,
            config: Optional[PrepareConfig] = None, workspace: Optional[torch.Tensor] = None) -> None:
    """Writes stats [T, STATS_WIDTH] FP32 (padding zeroed) and, when U [T, C] is given, the collapse U.

    U=None is forward_stats. ``config``: the launch shape (PrepareConfig; the defaults when None).
    ``workspace``: a flat uint8 buffer of at least ``layout_bytes(workspace_regions(...))`` bytes (checked by
    the public layer) from which the scratch is carved; None allocates it.
    """
    T, n, C = X.shape
    if T == 0:
        return
    M = 2 * n + n * n
    assert X.stride(2) == 1 and fn.shape == (M, n * C) and fn.stride(1) == 1 and fn.dtype == torch.float32
    assert stats.is_contiguous() and stats.shape == (T, layout.stats_width(n)) and stats.dtype == torch.float32
    assert U is None or (U.shape == (T, C) and U.stride(1) == 1)
    cfg, cols, presplit, regions, project_options, collapse_config, pre = _launch(X, config)
    assert n in layout.SUPPORTED_STREAMS and 1 <= sinkhorn_iters and cfg.slices >= 1
    m_pad = logits_pad(n)  # > M: column M of a partial row carries the sum of squares
    if workspace is None:  # the autograd path: allocated per call, as workspace_regions lays them out
        part = torch.empty(regions[-1][0], dtype=torch.float32, device=X.device)
        pieces = torch.empty(regions[0][0], dtype=torch.bfloat16, device=X.device) if presplit else None
    else:
        from .._workspace import carve
        *pieces, part = carve(workspace, regions)
        pieces = pieces[0] if presplit else None
    w = fn
    if presplit:
        w = pieces
        fast(_split_fn_kernel)[(M, cdiv(n * C, 1024))](fn, w, M, n * C, fn.stride(0), BLOCK=1024, num_warps=4)
    fast(_project_kernel)[(cdiv(T, cfg.block_t), part.shape[0])](
        X, w, part, T, C, cols, X.stride(0), X.stride(1), w.stride(-2), **project_options,
    )
    fast(_gates_kernel)[(cdiv(T, cfg.gates_block_t),)](
        part, scale, base, stats, part.shape[0], T, C, float(rms_eps), float(hc_eps), int(sinkhorn_iters),
        N=n, M_PAD=m_pad, BLOCK_T=cfg.gates_block_t, num_warps=cfg.gates_warps,
    )
    if U is not None:
        collapse(X, stats, U, pre, config=collapse_config)
