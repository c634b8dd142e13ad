"""mHC backward_finish kernels and launcher: the prepare node's backward (design.md §2), after the branch's.

Four launches, six when deterministic:

* ``_dpre_kernel`` (mhc_backward_dlogits.py): dpre_i = sum_c dU * X_i, one streaming pass over X and dU.
* kernel A (``_dlogits_kernel``), per token block: from dpre, the gradient of the gates and of the exact
  unrolled Sinkhorn, and per token dz = rstd*dmix and the scalar s into a small FP32 workspace; per-program
  partial sums for dbase and dscale.
* ``_dx_kernel`` (B), grid (C chunks) x (token splits): per token block
  dX = round(pre_i*dU + sum_j comb[i,j]*dY_j + (dz @ fn)_i - x_i*s), one rounding, fn's columns of the chunk
  held for the whole token range. n = 8 runs ``_dx_stream_kernel`` instead (``dx_by_stream``): the same value as
  one GEMM per output stream, its 80 logits unpadded.
* ``_dfn_kernel`` (C): dfn = dz^T @ X, a skinny GEMM over the tokens (per token split when deterministic).
* deterministic: the partials (per token split for dfn, per program for dbase / dscale) are summed in a
  fixed order by ``partials.sum_partials`` and ``_params_reduce_kernel``; otherwise added with atomics.

Why this split: dX needs dz, which needs dpre, a reduction over the whole row of C, so X and dU are read
once for dpre and again by B (two passes: the floor for a row reduction without cross-CTA exchange). dpre has
its own streaming kernel because A's Sinkhorn backward is latency-bound and stalls a streaming kernel that
carries it; dfn is a separate skinny GEMM (C) because accumulating it in B costs B the registers and layout
changes that keep its loads in flight. The measurements behind each choice, and the designs measured and
rejected (A fused into B, B through the tensor cores, other tile shapes), are in docs/perf.md.
Kernel B loads X as n per-stream tiles in the dY tiles' layout, so all of a tile's loads issue in one round;
``FinishConfig(x_per_stream=False)`` keeps X as one [n, BLOCK_T, BLOCK_C] tile, whose layout change through
shared memory made the other loads wait for it (6 % slower on an H200, docs/perf.md).
"""
import functools
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .fast_launch import fast, tracing
from ..meta import mhc_layout as layout
from .._workspace import fp32_scratch, fp32_scratch_numel
from .._backend import interpreting
from . import arch
from .launch import cdiv, kept_per_shape, next_power_of_2, persistent_programs, pipeline_stages, register_cap
from .mhc_backward_dlogits import _dlogits_kernel, _dpre_kernel
from .mhc_backward_dx import _dfn_kernel, _dx_kernel, _dx_stream_kernel, _transpose_kernel
from .mhc_columns import logits_pad
from .mhc_math import SINKHORN_TILE
from .mhc_prepare import _split_fn_kernel
from .partials import sum_partials


@triton.jit
def _params_reduce_kernel(PART, DBASE, DSCALE, P, N: tl.constexpr, M_PAD: tl.constexpr,
                          ACCUMULATE: tl.constexpr, BLOCK_P: tl.constexpr):
    """The deterministic reduction of kernel A's per-program partials, one program per output: program m < M
    writes dbase[m] (+)= sum_p PART[p, m]; program M + g writes dscale[g] (+)= sum_p of PART[p, M_PAD + m] over
    the logits m of group g (pre, post, comb). Each output is summed in a fixed order by one program."""
    M: tl.constexpr = 2 * N + N * N
    GROUP_MAX: tl.constexpr = N * N
    out = tl.program_id(0)
    g = out - M
    # the columns this program sums: one dbase column, or the dscale columns of group g
    first = tl.where(g < 0, out, M_PAD + tl.where(g == 0, 0, tl.where(g == 1, N, 2 * N)))
    width = tl.where(g < 0, 1, tl.where(g == 2, N * N, N))
    k = tl.arange(0, GROUP_MAX)
    acc = tl.zeros([GROUP_MAX], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        acc += tl.sum(tl.load(PART + p[:, None] * (2 * M_PAD) + first + k[None, :],
                              mask=(p < P)[:, None] & (k < width)[None, :], other=0.0), axis=0)
    total = tl.sum(acc, axis=0)
    dst = tl.where(g < 0, DBASE + out, DSCALE + g)
    if ACCUMULATE:
        total += tl.load(dst)
    tl.store(dst, total)


def reduce_params(part: torch.Tensor, dbase: torch.Tensor, dscale: torch.Tensor, P: int, accumulate: bool,
                  n: int = layout.N_STREAMS) -> None:
    """dbase [M], dscale [3] (+)= the fixed-order sums of kernel A's P partial rows ``part`` [P, 2 * M_PAD]
    (M_PAD = mhc_columns.logits_pad(n)) for n streams."""
    fast(_params_reduce_kernel)[(layout.n_logits(n) + 3,)](
        part, dbase, dscale, P, N=n, M_PAD=logits_pad(n), ACCUMULATE=accumulate,
        BLOCK_P=min(256, next_power_of_2(P)), num_warps=4,
    )


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------

# Kernel A's Sinkhorn scratch grows with its programs and with sinkhorn_iters (40 MB at the defaults on an
# H200 at iters=20); above this, fewer programs each walk more token blocks (iters=64: ~8 instead of 16 per SM).
# The default of FinishConfig.dlogits_scratch_bytes (n = 8's: STREAM_DEFAULTS).
SCRATCH_BUDGET_BYTES = 64 << 20


@dataclass(frozen=True)
class FinishConfig:
    """Launch shape of backward_finish. Defaults: the fastest of a sweep on an H200 (bf16, T=16384, C=4096,
    2026-11-29 and 2026-12-01; docs/perf.md), measured on sm_90 only; token splits and program counts follow the
    GPU's multiprocessor count (``_plan``). ``candidates`` is what ``python -m cakeops.bench.tune --ops
    backward_finish`` sweeps."""
    dpre_slices: Optional[int] = None  # dpre kernel: column slices per token block; None: 1, or more when T has
    #                                    fewer token blocks than 2 programs per SM (at most 8; not yet timed)
    dpre_block_t: int = 32       # dpre kernel: tokens per program
    dpre_block_c: int = 128      # dpre kernel: columns per chunk
    dpre_warps: int = 4
    dlogits_block_t: int = SINKHORN_TILE[0]  # kernel A: tokens per block, warps (the forward's Sinkhorn
    dlogits_warps: int = SINKHORN_TILE[1]    # tile: its replay is then bitwise the forward's)
    dlogits_per_sm: int = 16     # kernel A: persistent programs per SM (each owns a Sinkhorn scratch slot)
    dlogits_scratch_bytes: int = SCRATCH_BUDGET_BYTES  # kernel A: cap on its Sinkhorn scratch, all programs
    block_t: int = 16            # kernel B (dX): tokens per block (>= 16, a tl.dot dimension)
    block_c: int = 64            # kernel B: columns per stream and program
    warps: int = 4
    stages: Optional[int] = 2
    per_sm: int = 4              # kernel B: (C chunks) x (token splits) ~ per_sm programs per SM
    splits: Optional[int] = None  # kernel B: token splits; None derives them from per_sm
    maxnreg: Optional[int] = None  # kernel B: register cap per thread (more resident programs, maybe spills)
    dfn_block_t: int = 64        # kernel C (dfn): tokens per step of the GEMM's K loop
    dfn_block_c: int = 256       # kernel C: columns of one stream per program
    dfn_warps: int = 4
    dfn_stages: Optional[int] = 3
    dfn_split_bf16: bool = False  # kernel C with bf16 X: dz split into bf16 hi / lo, bf16 MMAs (mhc_backward_dx.py)
    dfn_per_sm: int = 2          # kernel C: (n x C chunks) x (token splits) ~ dfn_per_sm programs per SM
    dfn_presplit: bool = False   # kernel C with dfn_split_bf16: dz split once per call (a workspace region)
    dfn_splits: Optional[int] = None
    x_per_stream: bool = True    # kernel B: X as n per-stream tiles in the dY tiles' layout (H200: 0.885 ms
    #                              backward_finish against 0.945 with X as one [n, BLOCK_T, BLOCK_C] tile)
    dx_by_stream: bool = False   # kernel B as a GEMM per output stream (_dx_stream_kernel; n = 8's default)
    stream_block_t: int = 64     # _dx_stream_kernel: tokens (the MMA's rows; >= 64 for sm_90's wgmma) and
    stream_block_c: int = 64     # columns of one stream per program, warps
    stream_warps: int = 4
    stream_block_k: int = 16     # _dx_stream_kernel: logits per MMA step
    stream_group_t: int = 1      # _dx_stream_kernel: token blocks walked before the next column block
    stream_fn_k_major: bool = False  # _dx_stream_kernel: fn read from its transpose (FN_K_MAJOR; a workspace region)
    stream_maxnreg: Optional[int] = None  # _dx_stream_kernel: register cap per thread
    stream_k_stages: int = 1     # _dx_stream_kernel: pipeline stages of its logit steps (K_STAGES; 1: none)
    input_precision: Optional[str] = None  # the projections through fn: None = "tf32x3" for fp32 X, else "tf32"
    streams: Optional[int] = None  # set by for_streams(n): every field already holds n's value, resolve(n) keeps it

    def resolve(self, n: int) -> "FinishConfig":
        """This config for n streams: the defaults above are n = 4's; for another n, every field still at its
        n = 4 default takes that n's value from STREAM_DEFAULTS (tiles that hold n streams, or M_PAD = 16 / 128
        logit columns, sized to keep a thread's registers near n = 4's). n = 4, or a config built by
        for_streams(n): the config itself."""
        if n == layout.N_STREAMS or self.streams == n:
            return self
        default = FinishConfig()
        return replace(self, **{k: v for k, v in STREAM_DEFAULTS.get(n, {}).items()
                                if getattr(self, k) == getattr(default, k)})

    @staticmethod
    def for_streams(n: int, **fields) -> "FinishConfig":
        """n's defaults with ``fields`` changed, kept as given by resolve(n): a field set to n = 4's default
        value (say 4 warps at n = 8) would otherwise be taken for "unset" and get n's default."""
        return replace(FinishConfig().resolve(n), streams=n, **fields)

    @staticmethod
    def candidates(n: int = layout.N_STREAMS):
        """The tuner's variants besides the default for n streams: n = 8 has its own (_wide_candidates), every
        other n n = 4's list (kernel A keeps SINKHORN_TILE: see mhc_math.py)."""
        if n > layout.N_STREAMS:
            yield from _wide_candidates(n)
            return
        # kernel B: programs per SM; taller token blocks and wider columns (all slower on the H200, 2026-11-29:
        # 16 x 64 tiles at 4 programs / SM hold fn's columns in registers for the whole token range)
        for block_t, block_c, warps, per_sm in ((16, 64, 4, 3), (16, 64, 4, 6), (32, 64, 4, 2), (16, 128, 8, 2)):
            yield FinishConfig(block_t=block_t, block_c=block_c, warps=warps, per_sm=per_sm)
        # kernel B with its registers capped so that more programs are resident
        for maxnreg, per_sm in ((128, 4), (128, 3), (96, 5), (80, 6)):
            yield FinishConfig(maxnreg=maxnreg, per_sm=per_sm)
        # kernel B with 3 pipeline stages (triton 3.6's sm_90 build: 96 registers, so 5 programs / SM)
        for per_sm in (4, 5):
            yield FinishConfig(stages=3, per_sm=per_sm)
        # kernel B with X as one [n, BLOCK_T, BLOCK_C] tile (the default until 2026-12-01)
        yield FinishConfig(x_per_stream=False)
        # kernel B with X as per-stream tiles at other shapes (triton 3.6 sm_90 builds: 127 registers; 96 with
        # 3 stages; 72 at 32 columns)
        for block_c, warps, per_sm, stages in ((64, 4, 3, 2), (64, 4, 4, 3), (64, 4, 5, 3), (32, 4, 6, 2),
                                               (32, 4, 8, 2), (128, 8, 2, 2)):
            yield FinishConfig(block_c=block_c, warps=warps, per_sm=per_sm, stages=stages)
        # the dpre pass on one column slice at any T (the default until the fourth session of 2026-12-01)
        # (256-column chunks: 1.042 ms at 32 tokens, 0.879 at 16, against the default's 0.880; the dpre kernel
        # already reads at 4.36 TB/s, 154 us. H200 2026-12-02, removed)
        yield FinishConfig(dpre_slices=1)
        # kernel A: programs per SM; kernel C (dfn): column width
        yield FinishConfig(dlogits_per_sm=8)
        yield FinishConfig(dfn_block_c=512, dfn_per_sm=1)
        # (kernel C folded into B, one 2-D dot per token block: 1.055 ms against 0.881, H200 2026-12-01, removed)


def _wide_candidates(n: int):
    """n = 8's variants, one cause each (triton 3.6 sm_90 builds at T = 16384, C = 4096: registers, programs per
    SM; none spills). Kernel A at other tiles replays the Sinkhorn on a layout the forward's gates kernel does not
    use unless the forward runs on the same tile (mhc_math.SINKHORN_TILE): the tuner computes its stats so."""
    F = functools.partial(FinishConfig.for_streams, n)
    # kernel B: the batched streams-first tile (n = 8's default until 2026-12-02: 3.85 ms at T = 16384, C = 4096,
    # against 2.62 for the GEMM per stream) and the per-stream GEMM at other tiles
    # (the batched form itself, dx_by_stream=False, a candidate until 2026-12-03)
    yield F(stream_fn_k_major=False)  # the default until 2026-12-03
    # kernel B unpipelined at 64 x 64 of 4 warps, capped at 96 registers (5 programs per SM; the default until the
    # sixth session of 2026-12-03: 1142 against 1013 us at T = 8192); without the cap it was 1229 us, at 80 1.705 ms
    # of backward_finish against 1.593 (H200 2026-12-03)
    yield F(stream_block_c=64, stream_warps=4, stream_maxnreg=96, stream_k_stages=1)
    # the pipelined steps at 4 stages uncapped (111 registers; 1079 us against the default's 1025-1028 at T = 8192,
    # 2203 against 2062 at 16384), 2 stages (1081), 3 stages at 80 registers (3 per SM, 152 bytes spilled: 1158);
    # (4 stages capped at 128: 1034, 3 stages at 112 registers: 1010 / 2074, even with the default; 5 / 6 stages
    # 1131 / 1167, 128 x 128 or 64 x 256 of 8 warps 2240 / 1452, 16 warps 1475-1806: H200, 2026-12-03, dropped)
    yield F(stream_k_stages=4, stream_maxnreg=None)
    yield F(stream_k_stages=2)
    yield F(stream_maxnreg=80)
    # (several streams per program one after another: the compiler hoists the dY and dz tiles out of the stream
    # loop, 255 registers and 2 programs per SM at 2 or 8 streams, sm_90 build 2026-12-03; not timed)
    # (64 x 32 of 4 warps, 64 x 64 of 8 and 128 x 32 of 8: 3214-3245 / 3279-3459 / 3076-3337 us against 2581 at
    # T = 16384, H200 2026-12-02; dropped from the sweep on 2026-12-03)
    yield F(stream_group_t=8)
    # (fn's tiles loaded once per program into shared memory and reused over 2-16 token blocks: kernel B 1668-2232 us
    # against 1152 at T = 8192, dX bitwise the same; H200 2026-12-03, fifth session; the token loop serializes a
    # program's work as the streams loop did; not kept)
    yield F(dlogits_per_sm=16, dlogits_scratch_bytes=SCRATCH_BUDGET_BYTES)  # A as before: 840 programs (scratch cap)
    yield F(dlogits_block_t=4, dlogits_per_sm=14)  # A: 146 registers, 14 programs / SM (half the tokens each)
    # (A at 2 tokens, 18 programs per SM, 110 registers: a candidate until 2026-12-03)
    yield F(dlogits_warps=2, dlogits_per_sm=6)     # A: 166 registers, 6 / SM of 2 warps
    # (B at 16 columns per stream, fn's [8, 128, 16] chunk, 2-3 programs of 4 warps per SM: all slower on the H200,
    # 2026-12-01, 10.5-12.6 ms against 7.9; gone)
    # dpre: half the columns per chunk (128 registers, 4 / SM against 251 and 2); dfn: 128 columns
    yield F(dpre_block_c=64)
    # (kernel B on bf16 hi / lo pieces of dz and fn, three bf16 MMAs: 5.85 ms against 5.01, H200 2026-12-01; gone)
    # kernel C: the default until 2026-12-01 (TF32 on x converted to FP32, 64 columns, 4 warps, 2 stages), and
    # the split MMAs at the tile of 2026-12-01 .. 12-03 (TF32 at that tile was a candidate until 2026-12-03)
    yield F(dfn_block_c=64, dfn_warps=4, dfn_stages=2, dfn_split_bf16=False)
    yield F(dfn_presplit=False)  # kernel C: dz split per tile (the default until 2026-12-03; at 128 columns and
    #                              2 programs per SM until 2026-12-03 too: 329 against 257 us at T = 8192, gone)
    # (kernel C folded into B, one 2-D dot per token block: 7.403 ms against 4.996, H200 2026-12-01, removed)
    # (B's and C's 80 logits as 64 + 16, not padded to 128: 5.318 ms against 4.998, H200 2026-12-01, removed)


# Launch shapes of n = 2 and n = 8 where they differ from n = 4's (FinishConfig.resolve), chosen from sm_90 builds
# (triton 3.6) to keep n = 4's rows in flight without spills; not yet measured on a GPU. dpre: n * dpre_block_t
# = 128 stream rows per program (n = 8 at 32 tokens: 1.1 KB of spills; at 16: 251 registers, none). n = 8, kernel
# B: a GEMM per output stream (dx_by_stream; sm_90 at 64 x 64 tiles of 4 warps: 128 registers bf16, 4 programs
# per SM; 158 fp32 at 32 columns; no spills; timed in docs/perf.md); the batched form's fn columns [8, 128,
# BLOCK_C] stay in registers, so 32 columns and 8 warps (128 registers, 152 KB shared: one program per SM; 64
# columns spill). The per-stream GEMM reads fn from fn^T (stream_fn_k_major: a transposed copy in the workspace,
# 10.5 MB at C = 4096, written once per call) since 2026-12-03 (docs/perf.md). Its logit steps pipelined over 3
# stages on 64 x 128 tiles of 8 warps since 2026-12-03 (sixth session; sm_90: 128 registers at the cap, 36 KB shared,
# 2 programs per SM, no spills; H200, T = 8192: 1142 -> 1025 us against 64 x 64 of 4 warps unpipelined and capped at
# 96 registers, 5 per SM; 4 stages uncapped 1079; fp32 X halves the columns, see finish()).
# n = 8, kernel C: M_PAD = 128 makes its GEMM 4x n = 4's work per byte, so bf16 MMAs on dz's hi / lo pieces, 128
# columns, 8 warps, 3 stages (H200, bf16, T = 16384, C = 4096, 2026-12-01: the kernel 3611 -> 648 us,
# backward_finish 7.89 -> 4.95 ms; sm_90 builds: 134 registers bf16, 227 fp32 (TF32 there), no spills). Then 256
# columns at one program per SM (bf16, T = 8192: 329 -> 257 us, H200 2026-12-03; sm_90: 219 registers, 160 KB
# shared; fp16 and fp32 keep 128 columns, see finish()).
# n = 8, kernel A: 240 registers allow 8 programs of one warp per SM, and the scratch budget holds them all
# (8 x 132 slots of 78 KB at iters = 20: 84 MB): 64 MB held it to 840 programs, 6.4 per SM, so at T = 16384
# (2048 blocks of 8 tokens) the slowest programs walked 3 blocks, now 2 (T = 8192: 2, now 1).
STREAM_DEFAULTS = {
    2: {"dpre_block_t": 64},
    8: {"dpre_block_t": 16, "block_c": 32, "warps": 8, "per_sm": 1, "dx_by_stream": True, "stream_fn_k_major": True,
        "stream_block_c": 128, "stream_warps": 8, "stream_k_stages": 3, "stream_maxnreg": 128,
        "dfn_block_c": 256, "dfn_per_sm": 1, "dfn_presplit": True, "dfn_warps": 8, "dfn_stages": 3,
        "dfn_split_bf16": True,
        "dlogits_per_sm": 8, "dlogits_scratch_bytes": 96 << 20},
}


class _Split(NamedTuple):
    """A (column tiles) x (token splits) grid over token blocks."""
    block_c: int
    columns: int          # program_id(0) extent
    splits: int           # program_id(1) extent
    blocks_per_split: int


def _split(device, T: int, C: int, block_t: int, block_c: int, per_sm: int, splits: Optional[int],
           streams: int = 1) -> _Split:
    block_c = max(16, min(block_c, next_power_of_2(C)))
    columns = streams * cdiv(C, block_c)
    token_blocks = cdiv(T, block_t)
    if splits is None:
        splits = max(1, persistent_programs(device, columns * token_blocks, per_sm) // columns)
    blocks_per_split = cdiv(token_blocks, max(1, min(splits, token_blocks)))
    return _Split(block_c, columns, cdiv(token_blocks, blocks_per_split), blocks_per_split)


def _dpre_slices(T: int, C: int, device, cfg: "FinishConfig") -> int:
    """The dpre pass's column slices: the config's, or (None) enough for 2 programs per SM when T has few token
    blocks (small T), as the projection splits its columns; at most 8 and one chunk each."""
    if cfg.dpre_slices is not None:
        return max(1, cfg.dpre_slices)
    fill = persistent_programs(device, 1 << 30, per_sm=2) // cdiv(T, cfg.dpre_block_t)
    return max(1, min(8, fill, cdiv(C, _dpre_block_c(C, cfg))))


def _dpre_block_c(C: int, cfg: "FinishConfig") -> int:
    return max(16, min(cfg.dpre_block_c, next_power_of_2(C)))


def _dpre_rows_max(T: int, C: int, device, cfg: "FinishConfig") -> int:
    """The largest slices * T' over T' <= T (the dpre partials' rows): slices shrink as T' grows, so not at T
    itself when T has few token blocks; they change only at whole token blocks."""
    block = cfg.dpre_block_t
    many = persistent_programs(device, 1 << 30, per_sm=2)  # from this many token blocks on: one slice
    sizes = {T} | {block * k for k in range(1, min(cdiv(T, block), many) + 1)}
    return max(_dpre_slices(t, C, device, cfg) * t for t in sizes if t <= T)


def _dfn_split(device, T: int, C: int, cfg: "FinishConfig", n: int) -> _Split:
    """Kernel C's grid: (n x C chunks) x (token splits)."""
    return _split(device, T, C, cfg.dfn_block_t, cfg.dfn_block_c, cfg.dfn_per_sm, cfg.dfn_splits, streams=n)


class _Plan(NamedTuple):
    dlogits_programs: int
    dx: _Split
    dfn: _Split           # kernel C's grid
    dpre_block_c: int
    dpre_cols: int        # columns per slice of the dpre kernel
    # FP32 workspace, in order: dz rows [T, M_PAD] | A's partials [programs, 2*M_PAD] | Sinkhorn scratch |
    # dfn partials [splits, M, K] (deterministic only) | dpre partials [slices, T, n] | fn^T [K, M] (kernel B per
    # stream, stream_fn_k_major only) | dz's bf16 hi / lo pieces [2, T, M_PAD] (dfn_presplit only)
    sizes: tuple


def _plan(T: int, C: int, iters: int, device: torch.device, deterministic: bool, cfg: FinishConfig,
          n: int = layout.N_STREAMS) -> _Plan:
    M, m_pad = layout.n_logits(n), logits_pad(n)
    cfg = cfg.resolve(n)
    slot = (2 * iters - 1) * cfg.dlogits_block_t * n * n * 4  # bytes of one program's Sinkhorn scratch
    a_programs = max(1, min(persistent_programs(device, cdiv(T, cfg.dlogits_block_t), cfg.dlogits_per_sm),
                            cfg.dlogits_scratch_bytes // slot))
    dx = _split(device, T, C, cfg.block_t, cfg.block_c, cfg.per_sm, cfg.splits)
    dfn = _dfn_split(device, T, C, cfg, n)
    dpre_block_c = _dpre_block_c(C, cfg)
    dpre_cols = cdiv(cdiv(C, _dpre_slices(T, C, device, cfg)), dpre_block_c) * dpre_block_c
    sizes = (T * m_pad, a_programs * 2 * m_pad, a_programs * (2 * iters - 1) * cfg.dlogits_block_t * n * n,
             dfn.splits * M * n * C if deterministic else 0, cdiv(C, dpre_cols) * T * n, _fn_t_numel(cfg, n, C),
             _dz_pieces_numel(cfg, T, n))
    return _Plan(a_programs, dx, dfn, dpre_block_c, dpre_cols, sizes)


def _fn_t_numel(cfg: FinishConfig, n: int, C: int) -> int:
    return layout.n_logits(n) * n * C if cfg.dx_by_stream and cfg.stream_fn_k_major else 0


def _dz_pieces_numel(cfg: FinishConfig, T: int, n: int) -> int:
    """FP32 elements holding dz's two bf16 pieces (allocated for any X dtype: the workspace sizes know none)."""
    return T * logits_pad(n) if cfg.dfn_presplit and cfg.dfn_split_bf16 else 0


def backward_finish_workspace_numel(T: int, C: int, sinkhorn_iters: int, device: torch.device,
                                    deterministic: bool = True, config: Optional[FinishConfig] = None,
                                    n: int = layout.N_STREAMS) -> int:
    """FP32 elements of the workspace backward_finish uses for these sizes and n streams (0 when T == 0)."""
    if T == 0:
        return 0
    return fp32_scratch_numel(
        _plan(T, C, sinkhorn_iters, torch.device(device), deterministic, config or FinishConfig(), n).sizes)


def backward_finish_workspace_bytes_max(T: int, C: int, device: torch.device, deterministic: bool = True,
                                        sinkhorn_iters: Optional[int] = None,
                                        config: Optional[FinishConfig] = None, n: int = layout.N_STREAMS) -> int:
    """Bytes of a workspace that serves every backward_finish of up to T tokens at hidden size C, n streams, on
    ``device`` (and every sinkhorn_iters in 1..MAX when None). Every region of ``_plan`` but the dfn and dpre partials grows
    with T; the dfn partials' effective split count is at most min(requested splits, token blocks), both monotone;
    the dpre partials' largest size over T' <= T is ``_dpre_rows_max``'s."""
    if T == 0:
        return 0
    device = torch.device(device)
    cfg = (config or FinishConfig()).resolve(n)
    M = layout.n_logits(n)
    iters_range = range(1, layout.MAX_SINKHORN_ITERS + 1) if sinkhorn_iters is None else (sinkhorn_iters,)
    worst = max((_plan(T, C, it, device, False, cfg, n) for it in iters_range), key=lambda p: sum(p.sizes))
    dfn_partials = 0
    if deterministic:
        dfn = _dfn_split(device, T, C, cfg, n)
        token_blocks = cdiv(T, cfg.dfn_block_t)
        requested = cfg.dfn_splits or max(1, persistent_programs(device, dfn.columns * token_blocks,
                                                                   cfg.dfn_per_sm) // dfn.columns)
        dfn_partials = min(requested, token_blocks) * M * n * C
    return 4 * fp32_scratch_numel(worst.sizes[:3] + (dfn_partials, _dpre_rows_max(T, C, device, cfg) * n,
                                                     _fn_t_numel(cfg, n, C), _dz_pieces_numel(cfg, T, n)))


def _zero_unless_accumulate(grads, accumulate: bool) -> None:
    """Zeroes the parameter gradients ``grads`` unless ``accumulate`` (then what they hold is added to)."""
    if not accumulate:
        for g in grads:
            g.zero_()


def _precision(dtype: torch.dtype) -> str:
    # fp32 data: three-pass TF32 (near-fp32 products; a single TF32 pass moved dscale by 3.5e-3 on H200,
    # over design.md §3's 2e-3). 16-bit data is exact in TF32 and its tolerance is 1e-2.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _dfn_split_bf16(cfg: FinishConfig, dtype: torch.dtype) -> bool:
    return cfg.dfn_split_bf16 and dtype == torch.bfloat16


def _dfn_options(cfg: FinishConfig, n: int, C: int, dtype: torch.dtype, atomic: bool) -> dict:
    """Kernel C's constexprs and launch options (``cfg`` resolved for n streams)."""
    split_bf16 = _dfn_split_bf16(cfg, dtype)
    return dict(N=n, M_PAD=logits_pad(n), ATOMIC=atomic, PRECISION=cfg.input_precision or _precision(dtype),
                BLOCK_T=cfg.dfn_block_t, BLOCK_C=max(16, min(cfg.dfn_block_c, next_power_of_2(C))),
                SPLIT_BF16=split_bf16, INTERPRET=interpreting(), PRESPLIT=split_bf16 and cfg.dfn_presplit,
                num_warps=cfg.dfn_warps, **pipeline_stages(cfg.dfn_stages))


@functools.lru_cache(maxsize=256)  # per backward call, on the host path
def _dfn_fit(cfg: FinishConfig, target, n: int, C: int, dtype: torch.dtype, atomic: bool) -> FinishConfig:
    """``cfg`` with kernel C's stages as deep as ``target``'s shared memory holds. What ``arch.first_fit`` builds:
    X, dz (its bf16 pieces when presplit), the partials; T, C, blocks per split and X's strides (16-divisible
    stand-ins)."""
    dz = torch.bfloat16 if _dfn_split_bf16(cfg, dtype) and cfg.dfn_presplit else torch.float32
    args = (dtype, dz, dz, torch.float32) + (4096,) * 5
    return arch.first_fit(target, (replace(cfg, dfn_stages=s) for s in arch.fewer_stages(cfg.dfn_stages)),
                          lambda c: (_dfn_kernel, args, _dfn_options(c, n, C, dtype, atomic)))


def launch_dx(X: torch.Tensor, dY: torch.Tensor, dU: torch.Tensor, fn: torch.Tensor, stats: torch.Tensor,
              dz: torch.Tensor, dX: torch.Tensor, fn_t: torch.Tensor, cfg: FinishConfig, split: _Split,
              precision: str) -> None:
    """Kernel B: dX from kernel A's dz rows ``dz`` (FP32 [T * M_PAD]): _dx_kernel over ``split``'s grid, or
    _dx_stream_kernel (``cfg.dx_by_stream``, reading fn^T from ``fn_t`` when ``cfg.stream_fn_k_major``). ``cfg``:
    resolved for X's n; ``precision``: the projection's input precision."""
    T, n, C = X.shape
    M, m_pad = 2 * n + n * n, logits_pad(n)
    # (whole stride tuples: one call each, where stride(d) is one per dim)
    strides = X.stride()[:2] + dY.stride()[:2] + (dU.stride()[0], fn.stride()[0], stats.stride()[0]) + dX.stride()[:2]
    if cfg.dx_by_stream:
        block_c = max(16, min(cfg.stream_block_c, next_power_of_2(C)))
        fn_b = fn
        if cfg.stream_fn_k_major:
            fn_b = fn_t.view(n * C, M)
            fast(_transpose_kernel)[(cdiv(n * C, 64),)](fn, fn_b, M, n * C, fn.stride(0), M,
                                                         BLOCK_R=next_power_of_2(M), BLOCK_K=64, num_warps=4)
            strides = strides[:5] + (fn_b.stride(0),) + strides[6:]
        fast(_dx_stream_kernel)[(n * cdiv(T, cfg.stream_block_t) * cdiv(C, block_c),)](
            X, dY, dU, fn_b, stats, dz, dX, T, C, *strides,
            N=n, M_PAD=m_pad, PRECISION=precision, BLOCK_T=cfg.stream_block_t, BLOCK_C=block_c,
            BLOCK_K=cfg.stream_block_k, GROUP_T=cfg.stream_group_t, FN_K_MAJOR=cfg.stream_fn_k_major,
            K_STAGES=cfg.stream_k_stages, num_warps=cfg.stream_warps, num_stages=1,
            **register_cap(cfg.stream_maxnreg),
        )
    else:
        fast(_dx_kernel)[(split.columns, split.splits)](
            X, dY, dU, fn, stats, dz, dX, T, C, split.blocks_per_split, *strides,
            N=n, M_PAD=m_pad, PRECISION=precision, BLOCK_T=cfg.block_t, BLOCK_C=split.block_c,
            X_PER_STREAM=cfg.x_per_stream, num_warps=cfg.warps, **pipeline_stages(cfg.stages),
            **register_cap(cfg.maxnreg),
        )


class _Launch(NamedTuple):
    """What a backward_finish call launches with, from its sizes alone (``_launch``)."""
    cfg: FinishConfig     # resolved for n streams, X's dtype and the GPU
    plan: _Plan
    precision: str        # the projections' input precision
    dfn_options: dict     # kernel C's constexprs and launch options


@kept_per_shape
def _launch(X: torch.Tensor, iters: int, deterministic: bool, config: Optional[FinishConfig]) -> _Launch:
    T, n, C = X.shape
    dtype = X.dtype
    cfg = (config or FinishConfig()).resolve(n)
    if config is None and n > 4 and dtype.itemsize == 4:
        # fp32 X at n = 8: kernel B's tiles are twice bf16's bytes. Batched: 32 columns need 280 KB of shared
        # memory (sm_90 has 227 KB), 16 fit; per stream: half bf16's columns (64 of 8 warps, three-pass TF32: 128
        # registers, no spill on sm_90), never capped
        cfg = replace(cfg, block_c=cfg.block_c // 2, stream_block_c=cfg.stream_block_c // 2, stream_maxnreg=None)
    if config is None and n > 4 and dtype != torch.bfloat16:
        # kernel C's 256 columns were measured on bf16's split MMAs; TF32 tiles at 256 columns need 320 KB of
        # shared memory for fp32 X (224 KB fp16), so 128 at 2 programs per SM (bf16's tile until 2026-12-03)
        cfg = replace(cfg, dfn_block_c=cfg.dfn_block_c // 2, dfn_per_sm=2 * cfg.dfn_per_sm)
    if config is None and cfg.dfn_stages:
        # kernel C's pipeline as deep as the GPU's shared memory holds (sm_120 at n = 8: 2 stages); only its
        # stages: its tile sizes the workspace
        cfg = _dfn_fit(cfg, arch.target_of(X.device), n, C, dtype, not deterministic)
    return _Launch(cfg, _plan(T, C, iters, X.device, deterministic, cfg, n), cfg.input_precision or _precision(dtype),
                   _dfn_options(cfg, n, C, dtype, not deterministic))


def backward_finish(X: torch.Tensor, dY: torch.Tensor, dU: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                    base: torch.Tensor, stats: torch.Tensor, grad_stats: torch.Tensor, rms_eps: float,
                    hc_eps: float, sinkhorn_iters: int, dX: torch.Tensor, dfn: torch.Tensor, dscale: torch.Tensor,
                    dbase: torch.Tensor, deterministic: bool = True, accumulate: bool = False,
                    workspace: Optional[torch.Tensor] = None, *, config: Optional[FinishConfig] = None) -> None:
    """Writes dX [T, n, C] (X.dtype, one rounding) and FP32 dfn [M, K], dscale [3], dbase [M], or adds
    into the last three when ``accumulate``. ``rms_eps`` is not read: rstd comes from stats.

    X, dY, dX [T, n, C] and dU [T, C] need a unit stride along C only; stats and grad_stats rows may be
    strided; dfn, dscale, dbase are contiguous. ``workspace``: a flat FP32 buffer of at least
    backward_finish_workspace_numel(...) elements, else one is allocated; or a flat uint8 buffer of at least 4x
    that many bytes (the public layer's workspaces, checked there), whose bytes are read as FP32.
    """
    del rms_eps
    T, n, C = X.shape
    if T == 0:  # no launch: the gradients of no tokens
        _zero_unless_accumulate((dfn, dscale, dbase), accumulate)
        return
    M, m_pad = 2 * n + n * n, logits_pad(n)
    assert n in layout.SUPPORTED_STREAMS and dY.shape == X.shape and dX.shape == X.shape and dU.shape == (T, C)
    sx, s_stats, s_gs = X.stride(), stats.stride(), grad_stats.stride()
    assert sx[2] == 1 and dY.stride(2) == 1 and dX.stride(2) == 1 and dU.stride(1) == 1
    assert s_stats[1] == 1 and s_gs[1] == 1 and fn.shape == (M, n * C) and fn.stride(1) == 1
    assert dfn.shape == (M, n * C) and dfn.is_contiguous() and dscale.is_contiguous() and dbase.is_contiguous()
    assert all(t.dtype == torch.float32 for t in (fn, scale, base, stats, grad_stats, dfn, dscale, dbase))
    assert 1 <= sinkhorn_iters
    cfg, plan, precision, dfn_options = _launch(X, sinkhorn_iters, deterministic, config)
    dz, part, scratch, dfn_part, dpre, fn_t, dz_pieces = fp32_scratch(plan.sizes, workspace, X.device,
                                                                      separate=tracing())
    atomic = not deterministic
    if atomic:  # the kernels add into the gradients
        _zero_unless_accumulate((dfn, dscale, dbase), accumulate)
    dpre_slices = cdiv(C, plan.dpre_cols)
    fast(_dpre_kernel)[(cdiv(T, cfg.dpre_block_t), dpre_slices)](
        X, dU, dpre, T, C, plan.dpre_cols, sx[0], sx[1], dU.stride(0),
        N=n, BLOCK_T=cfg.dpre_block_t, BLOCK_C=plan.dpre_block_c, num_warps=cfg.dpre_warps,
    )
    fast(_dlogits_kernel)[(plan.dlogits_programs,)](
        dpre, stats, grad_stats, scale, base, dz, part, scratch, dbase, dscale,
        T, C, dpre_slices, s_stats[0], s_gs[0], float(hc_eps), int(sinkhorn_iters),
        N=n, M_PAD=m_pad, ATOMIC=atomic, BLOCK_T=cfg.dlogits_block_t, num_warps=cfg.dlogits_warps,
    )
    if not atomic:  # right away, while A's partials are in L2
        reduce_params(part, dbase, dscale, plan.dlogits_programs, accumulate, n)
    launch_dx(X, dY, dU, fn, stats, dz, dX, fn_t, cfg, plan.dx, precision)
    split_bf16 = _dfn_split_bf16(cfg, X.dtype)
    dz_c, dz_lo = dz, dz
    if split_bf16 and cfg.dfn_presplit:
        # the kernel is given the whole [2, T * M_PAD] buffer it writes (hi row, lo row): under torch.compile a
        # launch's written arguments are what Inductor keeps, so a write past a row's view would be lost
        pieces = dz_pieces.view(torch.bfloat16).view(2, T * m_pad)
        fast(_split_fn_kernel)[(1, cdiv(T * m_pad, 1024))](dz, pieces, 1, T * m_pad, T * m_pad, BLOCK=1024,
                                                            num_warps=4)
        dz_c, dz_lo = pieces
    fast(_dfn_kernel)[(plan.dfn.columns, plan.dfn.splits)](
        X, dz_c, dz_lo, dfn if atomic else dfn_part, T, C, plan.dfn.blocks_per_split, sx[0], sx[1],
        **dfn_options,
    )
    if not atomic:
        width = M * n * C
        sum_partials(dfn_part.reshape(plan.dfn.splits, width), dfn.view(width), accumulate, max_block=1024,
                     block_p=8)
