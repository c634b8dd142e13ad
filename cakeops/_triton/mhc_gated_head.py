"""The gated head (DeepSeek-V4's hc_head), forward and backward kernels and launchers.

    g_i = sigmoid(rstd * (fn_i . x) * scale + base_i) + hc_eps,   Y[t, c] = round(sum_i g_i * X[t, i, c])

It is forward_prepare's ``pre`` gate with M = n logits and nothing else, so it runs on forward_prepare's pieces
(mhc_prepare.py) and backward_finish's (mhc_backward_*.py), parameterized rather than copied:

Forward, two passes over X (a row reduction before any output element: DESIGN.md "two passes"):
* ``_split_fn_kernel`` (bf16 X, mhc_prepare.py): fn into bf16 hi / lo once per call.
* ``_head_project_kernel``, per block of tokens (x column slices): fn @ x on tensor cores and the sum of x^2
  through prepare's ``_project`` with M = n logits (fn re-read per token block from L2: big blocks, the launch
  shape of PrepareConfig).
* ``_head_gates_kernel``, many small token blocks: slices summed in order, rstd, mix, the gates, the record.
* the weighted collapse Y = sum_i g_i X_i: ``mhc_streams.collapse`` reading the record's GATE column.

Backward, two passes over X and dY, X's gradient written once:
* ``_head_dgate_kernel``: dg_i = sum_c dY * X_i, one streaming pass, partials per column slice.
* ``_head_dlogits_kernel``, many small token blocks: dlogit = dg * s'(z), dz = rstd*dlogit*scale and
  s = rstd^2/K * sum_i dmix_i*mix_i into a small FP32 row per token; per-program partial sums of dbase and
  dscale (fixed-order reduction after, by ``partials.sum_partials``), or atomics.
* ``_head_dx_columns_kernel`` (the default, ``GatedHeadConfig.dfn="columns"``): dX and dfn from one read of X as
  FMAs, each program a column block of every stream over a range of tokens with fn's slice and dfn's
  accumulators in registers: no third pass over X, no tensor-core padding of the n logits to 16 rows. H200
  (T=16384 C=4096 bf16, 2026-12-02): backward 0.365 / 0.639 / 1.329 ms at n = 2 / 4 / 8 against 0.415 / 0.662 /
  1.536 with the separate dfn kernel; at n = 4 with the next step's loads issued before this step's FMAs (Triton
  pipelines only loads that feed tl.dot) 0.599 ms. Deterministic: [splits, n, n*C] dfn partials summed in a fixed
  order.
* ``_head_dx_kernel`` (``dfn="separate"`` or ``"fused"``), grid (C chunks) x (token splits):
  dX = round(g_i*dY - x_i*s + (dz @ fn)_i) through backward_finish's ``_dx_tile`` (its residual-mixing term
  switched off), and (``GatedHeadConfig.dfn="fused"``)
  dfn += dz^T @ x on the same x tile, per token split: backward_finish reads X a third time for dfn (its kernel
  C, which ``dfn="separate"`` runs here with M = n logits); reusing the tile saves that pass but costs the dX
  kernel registers (sm_90 build at n = 4: 168 fused, 80 without), as it cost backward_finish's B (docs/perf.md).
  Deterministic: the [splits, n, n*C] dfn partials are summed in a fixed order; otherwise atomics.
  Launch shapes and their alternatives: GatedHeadConfig; ``python -m cakeops.bench.tune --ops gated_head`` times
  them, ``python -m cakeops.bench.build_check`` compiles them for sm_90 without a GPU (shared memory, registers).

Record layout: meta/mhc_head_layout.py. FP32 inside, IEEE division and square root, every output rounded
once. Any n in meta/mhc_head_layout.SUPPORTED_N (N constexpr). Launchers do no argument validation (the public
layer does); X is [T, n, C] with unit stride along C and any token / stream strides.
"""
import functools
from dataclasses import dataclass, replace
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from .fast_launch import fast, tracing
from ..meta import mhc_head_layout as layout
from ..meta import mhc_layout
from .._workspace import fp32_scratch, fp32_scratch_numel
from . import arch
from .launch import cdiv, next_power_of_2, persistent_programs, pipeline_stages, register_cap
from .mhc_backward_dx import _dfn_kernel, _dx_tile
from .mhc_backward_finish import _precision, _split, _zero_unless_accumulate
from .mhc_math import logit, sigmoid
from .mhc_prepare import (PrepareConfig, _project, _split_fn_kernel, projection_args, projection_options,
                          unset_fields)
from .mhc_streams import StreamConfig, collapse
from .partials import sum_partials

_GATE = tl.constexpr(layout.GATE)
_MIX = tl.constexpr(layout.MIX)
_RSTD = tl.constexpr(layout.RSTD)
_WIDTH = tl.constexpr(layout.HEAD_STATS_WIDTH)
M_PAD = 16  # n logits padded to a tl.dot dimension (>= 16); column n of a partial / dz row carries a scalar
assert layout.MAX_N < M_PAD  # collapse and _dx_tile are told the gates' column (GATE)


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------

@triton.jit
def _head_project_kernel(X, FN, PART, T, C, cols, stride_xt, stride_xi, stride_fn,
                         N: tl.constexpr, M_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                         SPLIT_BF16: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
                         PRESPLIT: tl.constexpr, STREAM_STEPS: tl.constexpr = False):
    """Program (token block, column slice): fn @ x over the slice into PART [slices, T, M_PAD], the sum of
    x^2 in column N (fn rows >= N are masked to zero by _project)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    c_lo = tl.program_id(1) * cols
    acc, _, sum_sq = _project(X, FN, t.to(tl.int64) * stride_xt, t_ok, C, c_lo, tl.minimum(C, c_lo + cols),
                              stride_xi, stride_fn, N, N, M_PAD, BLOCK_T, BLOCK_C, SPLIT_BF16, INTERPRET, PRECISION,
                              PRESPLIT, STREAM_STEPS)
    m = tl.arange(0, M_PAD)
    row = PART + (tl.program_id(1) * T + t).to(tl.int64) * M_PAD
    tl.store(row[:, None] + m[None, :], tl.where(m[None, :] == N, sum_sq[:, None], acc), mask=t_ok[:, None])


@triton.jit
def _head_gates_kernel(PART, SCALE, BASE, STATS, slices, T, C, rms_eps, hc_eps,
                       N: tl.constexpr, M_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """One token block: the slices summed in slice order (deterministic), rstd, mix and the gates into the
    record; every other column of the row is zeroed (the stores are disjoint: no barrier)."""
    rms_eps, hc_eps = tl.cast(rms_eps, tl.float32), tl.cast(hc_eps, tl.float32)  # FP64 from Inductor's launcher
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    m = tl.arange(0, M_PAD)
    acc = tl.zeros([BLOCK_T, M_PAD], dtype=tl.float32)
    for s in range(slices):
        acc += tl.load(PART + (s * T + t64)[:, None] * M_PAD + m[None, :], mask=t_ok[:, None], other=0.0)
    sum_sq = tl.sum(tl.where(m[None, :] == N, acc, 0.0), axis=1)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sum_sq, (N * C) * 1.0) + rms_eps))
    mix = acc * rstd[:, None]
    base = tl.load(BASE + m, mask=m < N, other=0.0)
    gate = sigmoid(logit(mix, tl.load(SCALE), base[None, :])) + hc_eps
    row = STATS + t64 * _WIDTH
    ok = t_ok[:, None] & (m < N)[None, :]
    tl.store(row[:, None] + _GATE + m[None, :], gate, mask=ok)
    tl.store(row[:, None] + _MIX + m[None, :], mix, mask=ok)
    tl.store(row + _RSTD, rstd, mask=t_ok)
    w = tl.arange(0, _WIDTH)
    unused = ~((w - _GATE < N) & (w >= _GATE)) & ~((w - _MIX < N) & (w >= _MIX)) & (w != _RSTD)
    tl.store(row[:, None] + w[None, :], tl.zeros([BLOCK_T, _WIDTH], dtype=tl.float32),
             mask=t_ok[:, None] & unused[None, :])


@dataclass(frozen=True)
class GatedHeadConfig:
    """Launch shape of the gated head, forward and backward; ``candidates`` is what ``python -m cakeops.bench.tune
    --ops gated_head`` sweeps. Not tuned on a GPU yet (H200, 2026-12-01: forward 0.305 ms, backward 1.336 ms with
    the first defaults at n = 4; the tuner's sweep the same day moved the defaults to the separate dfn kernel and
    the per-chunk dgate reduction: 0.665 ms at n = 4, 0.438 at n = 2, 1.613 at n = 8, docs/perf.md).

    Forward: the projection takes forward_prepare's measured launch shape (``projection``, resolved per call by
    PrepareConfig: 128-token blocks, 8 warps, 3 stages, column slices when T has fewer blocks than the GPU has
    multiprocessors) with ``project_cols // n`` columns per stream and chunk when ``projection.block_c`` is None:
    a chunk loads all n streams, so the pipeline's shared memory is (stages - 1) * n * block_c * (2 block_t +
    4 M_PAD) bytes plus 16 KiB: 180224 at every n on sm_90 (the 232448 limit) and 163840 on sm_80 (166912);
    n = 8 at 64 columns asked for 360448 (python -m cakeops.bench.build_check). bf16 X at n = 8 on a GPU: one
    stream per loop step on 128 x 128 tiles instead (WIDE_BF16_PROJECTION, 27 % faster on an H200).

    Backward: the dgate pass, then per-token dlogits, then dX and dfn in one FMA pass (``dfn="columns"``,
    ``columns_*``: n * ``columns_elems`` columns per program, ``columns_shape(n)`` its steps), or dX through
    backward_finish's kernel B tile (16-token blocks, ``dx_elems // n`` columns) with dfn either accumulated on the
    same x tile (``dfn="fused"``) or by
    backward_finish's kernel C, a skinny GEMM that reads X once more (``dfn="separate"``: perf.md measured the
    fused form costing kernel B ~0.3 ms in backward_finish; here the fused dX kernel took 1150 of 1353 us at n = 4,
    the separate pair 338 + 131). ``dx_per_sm``: programs per SM the token splits are sized for; None takes 6
    (the fastest measured with the separate dfn kernel at n = 2, 4 and 8; the fused form's 168-255 registers
    held it to 2-3)."""
    projection: PrepareConfig = PrepareConfig()
    project_cols: int = 256          # forward projection: n * columns per chunk when projection.block_c is None
    gates_block_t: int = 64          # forward gates and backward dlogits: tokens per program
    gates_warps: int = 2
    collapse_block_c: Optional[int] = None  # the collapse Y (mhc_streams.StreamConfig)
    dgate_elems: int = 128           # dgate pass: n * tokens per program (32 tokens at n = 4, like dpre)
    dgate_block_c: int = 128
    dgate_warps: int = 4
    dgate_slices: Optional[int] = None  # column slices; None: enough programs to fill the GPU
    dgate_x_per_stream: bool = True  # dgate pass: X as n tiles in dY's layout (False: one [n, tokens, cols] tile)
    dgate_reduce_per_chunk: bool = True  # dgate pass: reduce over columns every chunk (128 registers, not 255)
    dx_block_t: int = 16             # dX kernel: tokens per block (a tl.dot dimension, >= 16)
    dx_elems: Optional[int] = None   # dX kernel: n * columns per program (None: 64 columns at every n)
    dx_warps: Optional[int] = None   # dX kernel: warps per program (None: 4; 2 at n = 2)
    dx_stages: Optional[int] = 2
    dx_per_sm: Optional[int] = None  # dX kernel: programs per SM (None: 6, 8 at n = 2, 3 at n = 4 / 2 with "fused")
    dx_splits: Optional[int] = None
    dx_maxnreg: Optional[int] = None  # dX kernel: register cap per thread
    x_per_stream: bool = True        # _dx_tile's X layout (mhc_backward_finish.FinishConfig.x_per_stream)
    dfn: str = "columns"             # one FMA pass for dX and dfn; backward_finish's kernel C ("separate"), or
    #                                  "fused" into the tensor-core dX kernel
    columns_block_t: Optional[int] = None  # dfn="columns": tokens per step (in registers); None: columns_shape(n)
    columns_elems: int = 1024        # dfn="columns": n * columns per program (8 per thread at 4 warps)
    columns_warps: int = 4
    columns_per_sm: Optional[int] = None   # None: columns_shape(n)
    columns_stages: Optional[int] = None
    columns_splits: Optional[int] = None
    columns_prefetch: Optional[bool] = None  # the next block's loads issued by hand before its FMAs (None: off)
    columns_loop_stages: Optional[int] = None  # the token loop's software pipeline (tl.range's num_stages; None: 4)
    dfn_block_t: int = 64            # separate dfn kernel: tokens per step of the GEMM's K loop
    dfn_block_c: int = 256           # separate dfn kernel: columns of one stream per program
    dfn_warps: int = 4
    dfn_stages: Optional[int] = 3
    dfn_per_sm: int = 2
    dfn_splits: Optional[int] = None

    # n = 2's dX kernel: 64 columns of 2 warps, 8 per SM took 215 us in the backward against 239 at n = 4's shape
    # (128 columns, 4 warps, 6 per SM); the backward 0.415 against 0.438 ms (H200, 2026-12-01, docs/perf.md)
    def dx_programs_per_sm(self, n: int) -> int:
        if self.dx_per_sm is not None:
            return self.dx_per_sm
        if self.dfn != "separate":
            return 3 if n == 4 else 2
        return 8 if n == 2 else 6

    def dx_elements(self, n: int) -> int:
        # 64 columns at every n. n = 8 had 32: the dX kernel alone took 989.5 us at 64 against 1063 in the backward
        # at 32 (H200, 2026-12-01, .devrun/proto_head_rows.py "cur"; the whole backward at 64 not yet timed)
        return self.dx_elems if self.dx_elems is not None else 64 * n

    # n = 4: 2 tokens per step, 3 programs per SM (168 registers); n = 2 and 8: 4 tokens at 2 per SM. The token loop
    # pipelined over 4 stages (Triton copies the next blocks' x and dY tiles to shared memory asynchronously; sm_90:
    # 28-54 KB of shared memory, n = 4 140 registers (168 before), n = 8 255 with 36 bytes spilled, bf16) instead of
    # the next block's loads issued by hand (n = 4's default until 2026-12-03: 0.599 ms against 0.640 without; n = 2
    # and 8 were slower with it): the backward at n = 4, T = 16384 0.599 -> 0.518 ms, n = 8, T = 8192 0.684 ->
    # 0.623, n = 2, T = 32768 0.682 -> 0.569 (H200, 2026-12-03, sixth session).
    def columns_shape(self, n: int) -> tuple:
        """(tokens per step, programs per SM, prefetch, loop stages) of the one-pass kernel at n streams."""
        block_t, per_sm = (2, 3) if n == 4 else (4, 2)
        return (self.columns_block_t or block_t, self.columns_per_sm or per_sm,
                bool(self.columns_prefetch), self.columns_loop_stages or 4)

    def dx_num_warps(self, n: int) -> int:
        return self.dx_warps if self.dx_warps is not None else (2 if n == 2 else 4)

    @staticmethod
    def candidates():
        """The tuner's variants of the backward besides the default: dX programs per SM and tile widths, the separate
        dfn kernel (backward_finish's C shapes), register caps, the dgate pass's forms. Registers from the sm_90
        builds (python -m cakeops.bench.build_check --n 4 --all-candidates)."""
        G = GatedHeadConfig
        # the one-pass FMA form (default; columns_shape). H200 2026-12-02, n = 4 backward without the prefetch:
        # 4 tokens at 2 per SM 0.639 ms (208 registers), one stage the same; 2 tokens at 3 per SM 0.712; 8 tokens at
        # 1 per SM 0.776; 512 elements at 3 per SM 2.770 (128 columns: Triton splits the tokens across warps, so
        # dfn's token sum goes through shared memory every step; docs/perf.md). With it: 4 tokens at 2 per SM 0.613
        # (241 registers), 2 tokens at 2 per SM 0.697, the default 0.599 (168 registers)
        yield G(columns_block_t=4, columns_per_sm=2, columns_prefetch=False)
        yield G(columns_block_t=4, columns_per_sm=2, columns_prefetch=True)
        yield G(columns_block_t=1, columns_per_sm=5, columns_prefetch=True)  # 96 registers
        yield G(columns_block_t=1, columns_per_sm=4, columns_prefetch=True)
        yield G(columns_elems=512, columns_block_t=2, columns_per_sm=4, columns_prefetch=True)  # 128 registers
        yield G(columns_elems=512, columns_block_t=4, columns_per_sm=3, columns_prefetch=True)  # 168 registers
        yield G(columns_block_t=2, columns_per_sm=3, columns_prefetch=False)
        yield G(columns_block_t=8, columns_elems=512, columns_per_sm=2, columns_prefetch=False)  # 207 registers
        yield G(columns_stages=1)
        # the token loop unpipelined (each n's form until 2026-12-03: n = 4 with the next block's loads issued by hand),
        # at 2 / 3 / 5 stages, and pipelined with the hand prefetch (H200, 2026-12-03: n = 8 at T = 8192 0.684 /
        # 0.746 / 0.641 ms against 4 stages' 0.623, with the prefetch at 3 stages 1.253, 255 registers and spills)
        yield G(columns_loop_stages=1, columns_prefetch=False)
        yield G(columns_loop_stages=1, columns_prefetch=True)
        for stages in (2, 3, 5):
            yield G(columns_loop_stages=stages)
        # (a thread's columns in runs of 4 at 128 columns of 8 warps, one stream per warp at n = 8 as at n = 4, 1-2
        # tokens a step at 3-8 loop stages, capped at 128 registers or not, and 512 elements of 4 warps: n = 8
        # T = 8192 0.720-0.883 ms against the default's 0.625, n = 4 T = 16384 0.598-0.703 against 0.521, H200
        # 2026-12-04, docs/perf.md; removed)
        # (n = 8 at 64 columns with a thread's columns in runs of 4, not 16 bytes (a tl.max_contiguous hint: the
        # tokens stay in registers, 96-168 registers, 3-5 per SM): 0.695-0.862 ms against the default's 0.678 at
        # T = 8192, H200 2026-12-03 (fifth session, docs/perf.md); removed)
        # the tensor-core dX kernel with backward_finish's dfn kernel (the default until 2026-12-02: 0.662 ms at n = 4)
        yield G(dfn="separate")
        # (dfn="fused_2d", one 2-D dot in the dX kernel: 0.703 ms against 0.661 at n = 4, H200 2026-12-01, removed)
        # first what the sm_90 builds point at (a short sweep may stop early): the separate dfn kernel (dX kernel
        # 80 registers instead of 168) with the dgate pass reduced per chunk (128 registers instead of 255)
        yield G(dfn="separate", dx_per_sm=4, dgate_reduce_per_chunk=True)
        yield G(dfn="separate", dx_per_sm=6, dx_elems=128, dgate_reduce_per_chunk=True)
        yield G(dfn="separate", dx_per_sm=6, dgate_reduce_per_chunk=True)
        for per_sm, elems, stages in ((None, 256, 2), (4, 256, 2), (5, 256, 3), (6, 128, 2)):
            yield G(dfn="separate", dx_per_sm=per_sm, dx_elems=elems, dx_stages=stages)
        yield G(dfn="separate", dx_per_sm=4, dfn_block_c=512, dfn_per_sm=1)
        yield G(dfn="separate", dx_per_sm=4, dx_maxnreg=128)
        # the dgate pass (X as one tile, dgate_x_per_stream=False, spills 604 bytes on sm_90: not swept)
        yield G(dgate_elems=64)
        yield G(dgate_elems=256, dgate_reduce_per_chunk=True, dgate_warps=8)
        # the tensor-core dX kernel and the separate dfn kernel: programs per SM, tile widths, stages, a register cap
        for per_sm, elems in ((2, 256), (4, 256), (4, 128), (6, 128)):
            yield G(dfn="separate", dx_per_sm=per_sm, dx_elems=elems)
        yield G(dfn="separate", dx_stages=3)
        yield G(dfn="separate", dx_maxnreg=128, dx_per_sm=4)


# bf16 X at n = 8: one stream per projection loop step on 128 x 128 tiles of 8 warps (H200, 2026-12-03: the forward
# 0.393 -> 0.290 ms at T = 8192, 0.732 -> 0.556 at 16384; 4 stages 0.285 / -), where a step of all 8 streams fits
# only 32 columns. fp16 / fp32 X and n = 2 / 4 keep all n streams a step (their tiles: FP32 in registers).
WIDE_BF16_PROJECTION = dict(block_t=128, num_warps=8, block_c=128, stream_steps=True)


@functools.lru_cache(maxsize=64)  # per forward call, on the host path; the configs are frozen (hashable)
def projection_config(cfg: GatedHeadConfig, n: int, C: int, dtype: torch.dtype, cuda: bool) -> PrepareConfig:
    """The projection's launch shape before ``resolve``: the fields ``cfg.projection`` leaves None from
    WIDE_BF16_PROJECTION (bf16 X on a GPU, n > 4; the interpreter wants small tiles) or else ``project_cols // n``
    columns per chunk, all n streams a loop step; n logits, so one accumulator (logit_split has nothing to split).
    (build_check compiles for a GPU from meta tensors: it calls this with cuda=True.)"""
    proj = replace(cfg.projection, logit_split=False)
    if n > 4 and cuda and dtype == torch.bfloat16 and proj.stream_steps is not False:
        proj = replace(proj, **{k: v for k, v in WIDE_BF16_PROJECTION.items() if getattr(proj, k) is None})
    if proj.block_c is None:
        proj = replace(proj, block_c=max(16, min(cfg.project_cols // n, next_power_of_2(C))))
    if proj.stream_steps is None:
        proj = replace(proj, stream_steps=False)
    return proj


def _project_build(proj: PrepareConfig, n: int, dtype: torch.dtype):
    """The projection's launch at ``proj`` (what ``arch.first_fit`` builds)."""
    return _head_project_kernel, projection_args(proj, dtype), projection_options(proj, n, dtype, M_PAD)


def _projection(cfg: GatedHeadConfig, X: torch.Tensor) -> PrepareConfig:
    """The projection's resolved launch shape for X: on a GPU, falling back where its build does not fit the
    device (PrepareConfig.fallbacks) in the fields ``cfg.projection`` leaves None."""
    _, n, C = X.shape
    return projection_config(cfg, n, C, X.dtype, X.is_cuda).resolve(X, build=_project_build,
                                                                   free=unset_fields(cfg.projection))


def forward(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
            hc_eps: float, stats: torch.Tensor, Y: Optional[torch.Tensor], *,
            config: Optional[GatedHeadConfig] = None) -> None:
    """Writes the record stats [T, HEAD_STATS_WIDTH] FP32 and, when given, Y [T, C] (X.dtype, one rounding)."""
    T, n, C = X.shape
    if T == 0:
        return
    assert n in layout.SUPPORTED_N and X.stride(2) == 1
    assert fn.shape == (n, n * C) and fn.stride(1) == 1 and fn.dtype == torch.float32
    assert scale.dtype == torch.float32 and base.dtype == torch.float32 and base.is_contiguous()
    assert stats.is_contiguous() and stats.shape == (T, layout.HEAD_STATS_WIDTH) and stats.dtype == torch.float32
    assert Y is None or (Y.shape == (T, C) and Y.stride(1) == 1)
    cfg = config or GatedHeadConfig()
    proj = _projection(cfg, X)
    cols = cdiv(cdiv(C, proj.slices), proj.block_c) * proj.block_c
    part = torch.empty(cdiv(C, cols), T, M_PAD, dtype=torch.float32, device=X.device)
    presplit = proj.presplit and X.dtype == torch.bfloat16
    w = fn
    if presplit:
        w = torch.empty(2, n, n * C, dtype=torch.bfloat16, device=X.device)
        fast(_split_fn_kernel)[(n, cdiv(n * C, 1024))](fn, w, n, n * C, fn.stride(0), BLOCK=1024, num_warps=4)
    fast(_head_project_kernel)[(cdiv(T, proj.block_t), part.shape[0])](
        X, w, part, T, C, cols, X.stride(0), X.stride(1), w.stride(-2),
        **projection_options(proj, n, X.dtype, M_PAD),
    )
    fast(_head_gates_kernel)[(cdiv(T, cfg.gates_block_t),)](
        part, scale, base, stats, part.shape[0], T, C, float(rms_eps), float(hc_eps),
        N=n, M_PAD=M_PAD, BLOCK_T=cfg.gates_block_t, num_warps=cfg.gates_warps,
    )
    if Y is not None:
        collapse(X, stats, Y, layout.GATE, config=StreamConfig(block_c=cfg.collapse_block_c))


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------

@triton.jit
def _head_dgate_kernel(X, DY, DG, T, C, cols, stride_xt, stride_xi, stride_dyt,
                       N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                       X_PER_STREAM: tl.constexpr = True, REDUCE_PER_CHUNK: tl.constexpr = False):
    """Program (token block, column slice): dg_i = sum_c dY[t, c] * X[t, i, c] over the slice into DG
    [slices, T, N]. [N, BLOCK_T, BLOCK_C] tiles, the stream axis first; X loaded per stream in dY's layout
    (as _dx_tile does) or as one [N, BLOCK_T, BLOCK_C] tile (X_PER_STREAM=False); the products reduced once
    after the chunk loop ([N, BLOCK_T, BLOCK_C] FP32 accumulator: 128 registers per thread at the defaults) or
    per chunk into [N, BLOCK_T] (REDUCE_PER_CHUNK: fewer registers, a reduction per chunk; another summation
    order, so dg differs in the last bits). Both inputs are streamed once: evict first."""
    i = tl.arange(0, N)[:, None, None]
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[None, :, None]
    t_ok = t < T
    t64 = t.to(tl.int64)
    c_lo = tl.program_id(1) * cols
    c_hi = tl.minimum(C, c_lo + cols)
    x_row = X + t64 * stride_xt
    if REDUCE_PER_CHUNK:
        acc = tl.zeros([N, BLOCK_T], dtype=tl.float32)
    else:
        acc = tl.zeros([N, BLOCK_T, BLOCK_C], dtype=tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)[None, None, :]
        mask = t_ok & (c < c_hi)
        dy = tl.load(DY + t64 * stride_dyt + c, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        if X_PER_STREAM:
            x = tl.where(i == 0, tl.load(x_row + c, mask=mask, other=0.0,
                                         eviction_policy="evict_first").to(tl.float32), 0.0)
            for k in tl.static_range(1, N):
                x = tl.where(i == k, tl.load(x_row + k * stride_xi + c, mask=mask, other=0.0,
                                             eviction_policy="evict_first").to(tl.float32), x)
        else:
            x = tl.load(x_row + i * stride_xi + c, mask=mask & (i < N), other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
        if REDUCE_PER_CHUNK:
            acc += tl.sum(dy * x, axis=2)
        else:
            acc += dy * x
    if REDUCE_PER_CHUNK:
        dg = acc
    else:
        dg = tl.sum(acc, axis=2)  # [N, BLOCK_T]
    j = tl.arange(0, N)[:, None]
    tt = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[None, :]
    tl.store(DG + (tl.program_id(1) * T + tt).to(tl.int64) * N + j, dg, mask=(tt < T) & (j < N))


@triton.jit
def _head_dlogits_kernel(DG, STATS, SCALE, BASE, DZ, PART, DBASE, DSCALE, T, C, slices,
                         N: tl.constexpr, M_PAD: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_T: tl.constexpr):
    """One token block: dg (slices summed in order) back through g = sigmoid(z) + eps, z = mix*scale + base,
    to dz = rstd*dlogit*scale (DZ row columns 0..N-1) and s = rstd^2/K * sum_i dmix_i*mix_i (column N); the
    block's sums of dlogit (-> dbase) and dlogit*mix (-> dscale) into its PART row [N + 1], or atomics.
    The sigmoid comes from the logits, not from the stored gate: g - hc_eps loses small values."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    t64 = t.to(tl.int64)
    j = tl.arange(0, N)
    ok = t_ok[:, None] & (j < N)[None, :]
    dg = tl.zeros([BLOCK_T, N], dtype=tl.float32)
    for s in range(slices):
        dg += tl.load(DG + (s * T + t64)[:, None] * N + j[None, :], mask=ok, other=0.0)
    row = STATS + t64 * _WIDTH
    mix = tl.load(row[:, None] + _MIX + j[None, :], mask=ok, other=0.0)
    rstd = tl.load(row + _RSTD, mask=t_ok, other=0.0)
    scale = tl.load(SCALE)
    sg = sigmoid(logit(mix, scale, tl.load(BASE + j)[None, :]))
    dlogit = dg * sg * (1.0 - sg)  # tokens past T: dg = 0
    dmix = dlogit * scale
    dz_row = DZ + t64 * M_PAD
    tl.store(dz_row[:, None] + j[None, :], rstd[:, None] * dmix, mask=ok)
    tl.store(dz_row + N, tl.div_rn(rstd * rstd, (N * C) * 1.0) * tl.sum(dmix * mix, axis=1), mask=t_ok)
    dbase = tl.sum(dlogit, axis=0)
    dscale = tl.sum(tl.sum(dlogit * mix, axis=1), axis=0)
    if ATOMIC:
        tl.atomic_add(DBASE + j, dbase, mask=j < N)
        tl.atomic_add(DSCALE, dscale)
    else:
        p_row = PART + tl.program_id(0) * (N + 1)
        tl.store(p_row + j, dbase)
        tl.store(p_row + N, dscale)


@triton.jit
def _head_dx_kernel(X, DY, FN, STATS, DZ, DX, DFN, T, C, blocks_per_split,
                    stride_xt, stride_xi, stride_dyt, stride_fn, stride_dxt, stride_dxi,
                    N: tl.constexpr, M_PAD: tl.constexpr, ATOMIC: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, X_PER_STREAM: tl.constexpr,
                    FUSED_DFN: tl.constexpr = True):
    """dX over (C chunk) x (a range of token blocks), and (FUSED_DFN) that range's dfn columns of the chunk;
    without FUSED_DFN it is backward_finish's kernel B without the mixing term and DFN is unused.

    Per token block, backward_finish's _dx_tile with the gates as its ``pre`` and no mixing term:
    dX = round(g_i*dY - x_i*s + (dz @ fn)_i); then dfn[:, i*C + c] += dz^T @ x_i on the x tile it loaded.
    fn's columns of the chunk ([N, M_PAD, BLOCK_C], rows >= N zero) stay in registers for the whole range.
    DFN: dfn itself (ATOMIC) or the [splits, N, N*C] partials."""
    i = tl.arange(0, N)[:, None, None]
    tt = tl.arange(0, BLOCK_T)[None, :, None]
    tt_col = tl.arange(0, BLOCK_T)[None, None, :]
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[None, None, :]
    c_ok = c < C
    m_row = tl.arange(0, M_PAD)[None, :, None]
    m_col = tl.arange(0, M_PAD)[None, None, :]
    fn_i = tl.load(FN + m_row * stride_fn + i * C + c, mask=(m_row < N) & c_ok, other=0.0)  # [N, M_PAD, BLOCK_C]
    dfn = tl.zeros([N, M_PAD, BLOCK_C], dtype=tl.float32)
    first = tl.program_id(1) * blocks_per_split
    for block in range(first, tl.minimum(first + blocks_per_split, tl.cdiv(T, BLOCK_T))):
        t = block * BLOCK_T + tt
        t_ok = t < T
        t64 = t.to(tl.int64)
        dz = tl.broadcast_to(tl.load(DZ + t64 * M_PAD + m_col, mask=t_ok & (m_col < N), other=0.0),
                             (N, BLOCK_T, M_PAD))
        s = tl.load(DZ + t64 * M_PAD + N, mask=t_ok, other=0.0)
        x = _dx_tile(X, DY, DY, STATS, DX, fn_i, dz, s, t64, t_ok, c, c_ok, stride_xt, stride_xi, 0, 0, stride_dyt,
                     _WIDTH, stride_dxt, stride_dxi, N, PRECISION, X_PER_STREAM, _GATE, False)
        if FUSED_DFN:
            t_col = block * BLOCK_T + tt_col
            dz_t = tl.load(DZ + t_col.to(tl.int64) * M_PAD + m_row, mask=(t_col < T) & (m_row < N), other=0.0)
            dfn = tl.dot(tl.broadcast_to(dz_t, (N, M_PAD, BLOCK_T)), x, dfn, input_precision=PRECISION)
    if FUSED_DFN:
        dst = m_row * (N * C) + i * C + c
        ok = (m_row < N) & c_ok & (i < N)  # at the full shape: the interpreter's atomics do not broadcast masks
        if ATOMIC:
            tl.atomic_add(DFN + dst, dfn, mask=ok)
        else:
            tl.store(DFN + tl.program_id(1).to(tl.int64) * (N * N * C) + dst, dfn, mask=ok)


@triton.jit
def _columns_tiles(X, DY, block, T, i3, c3, c_ok, stride_xt, stride_xi, stride_dyt, BLOCK_T: tl.constexpr):
    """x [N, BLOCK_T, BLOCK_C] and dY (its row repeated for every stream's warp, which L1 serves: the tile keeps
    x's layout, no exchange) of one token block, as stored; tokens from T on read as zeros."""
    t3 = block * BLOCK_T + tl.arange(0, BLOCK_T)[None, :, None]
    t64 = t3.to(tl.int64)
    mask = (t3 < T) & c_ok
    x = tl.load(X + t64 * stride_xt + i3 * stride_xi + c3, mask=mask, other=0.0, eviction_policy="evict_first")
    dy = tl.load(DY + t64 * stride_dyt + c3 + i3 * 0, mask=mask, other=0.0)
    return x, dy


@triton.jit
def _head_dx_columns_kernel(X, DY, FN, STATS, DZ, DX, DFN, T, C, blocks_per_split,
                            stride_xt, stride_xi, stride_dyt, stride_fn, stride_dxt, stride_dxi,
                            N: tl.constexpr, M_PAD: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_T: tl.constexpr,
                            BLOCK_C: tl.constexpr, PREFETCH: tl.constexpr, LOOP_STAGES: tl.constexpr = 1):
    """dX and dfn in one pass over X (``GatedHeadConfig.dfn="columns"``): one column block of every stream over a
    range of token blocks, as FMAs (the projection has only n terms per element). [N, BLOCK_T, BLOCK_C] tiles:
    threads own columns, warps own streams and the token axis stays in registers (sm_90 build, triton 3.6: no
    shuffle in the loop and one layout for every tile), so dfn's sum over tokens is in-thread. fn's n rows and the
    n dfn accumulators are tuples of [N, 1, BLOCK_C] tiles held for the whole range: per element n FMAs for
    dz @ fn and n for dfn, against the tensor-core forms' 16-row padding and the third read of X by a separate
    dfn kernel. DFN: dfn itself (ATOMIC) or the [splits, N, N*C] partials. LOOP_STAGES: the token loop's software
    pipeline (from 2 on, Triton copies the next blocks' tiles to shared memory asynchronously; without a loop-level
    num_stages it pipelines only loads that feed a ``tl.dot``): at 2 or 3 programs per SM one block's bytes do not
    cover DRAM's latency. PREFETCH: the next block's x and dY loaded by hand (as stored, 16-bit) before this block's
    FMAs (n = 4's form until 2026-12-03)."""
    i3 = tl.arange(0, N)[:, None, None]
    c3 = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[None, None, :]
    c_ok = c3 < C
    fns = ()
    dfns = ()
    for m in tl.static_range(N):
        fns = fns + (tl.load(FN + m * stride_fn + i3 * C + c3, mask=c_ok, other=0.0),)
        dfns = dfns + (tl.zeros([N, 1, BLOCK_C], dtype=tl.float32),)
    first = tl.program_id(1) * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(T, BLOCK_T))
    if PREFETCH:
        x_next, dy_next = _columns_tiles(X, DY, first, T, i3, c3, c_ok, stride_xt, stride_xi, stride_dyt, BLOCK_T)
    for block in tl.range(first, last, num_stages=LOOP_STAGES):
        t3 = block * BLOCK_T + tl.arange(0, BLOCK_T)[None, :, None]
        t_ok = t3 < T
        t64 = t3.to(tl.int64)
        mask = t_ok & c_ok
        if PREFETCH:
            x, dy = x_next, dy_next
            x_next, dy_next = _columns_tiles(X, DY, block + 1, tl.minimum(T, last * BLOCK_T), i3, c3, c_ok,
                                             stride_xt, stride_xi, stride_dyt, BLOCK_T)
        else:
            x, dy = _columns_tiles(X, DY, block, T, i3, c3, c_ok, stride_xt, stride_xi, stride_dyt, BLOCK_T)
        x = x.to(tl.float32)
        dy = dy.to(tl.float32)
        g = tl.load(STATS + t64 * _WIDTH + _GATE + i3, mask=t_ok, other=0.0)
        dz_row = DZ + t64 * M_PAD
        dx = g * dy - x * tl.load(dz_row + N, mask=t_ok, other=0.0)
        summed = ()
        for m in tl.static_range(N):
            dz_m = tl.load(dz_row + m, mask=t_ok, other=0.0)
            dx += dz_m * fns[m]
            summed = summed + (dfns[m] + tl.sum(dz_m * x, axis=1, keep_dims=True),)
        dfns = summed
        tl.store(DX + t64 * stride_dxt + i3 * stride_dxi + c3, dx.to(DX.dtype.element_ty), mask=mask)
    ok = c_ok & (i3 < N)  # at the full shape: the interpreter's atomics do not broadcast masks
    for m in tl.static_range(N):
        if ATOMIC:
            tl.atomic_add(DFN + m * (N * C) + i3 * C + c3, dfns[m], mask=ok)
        else:
            tl.store(DFN + tl.program_id(1).to(tl.int64) * (N * N * C) + m * (N * C) + i3 * C + c3, dfns[m],
                     mask=ok)


class _Plan(NamedTuple):
    dgate_block_t: int
    dgate_block_c: int
    dgate_cols: int
    dx: tuple             # mhc_backward_finish._Split
    dfn: tuple            # the separate dfn kernel's _Split (dfn="separate"), else dx
    # FP32 workspace, in order: dg partials [slices, T, n] | dz rows [T, M_PAD] | dbase/dscale partials
    # [programs, n + 1] | dfn partials [splits, n, n*C] (deterministic only; splits of the kernel computing dfn)
    sizes: tuple


def _plan(T: int, n: int, C: int, device, deterministic: bool, cfg: GatedHeadConfig) -> _Plan:
    block_t = max(1, cfg.dgate_elems // n)
    block_c = max(16, min(cfg.dgate_block_c, next_power_of_2(C)))
    slices = cfg.dgate_slices
    if slices is None:  # few token blocks (small T): split the columns too, so every SM has a program
        blocks = cdiv(T, block_t)
        slices = max(1, min(8, persistent_programs(device, 1 << 30, per_sm=1) // blocks, cdiv(C, block_c)))
    cols = cdiv(cdiv(C, slices), block_c) * block_c
    if cfg.dfn == "columns":
        step_t, per_sm, _, _ = cfg.columns_shape(n)
        dx = _split(device, T, C, step_t, max(16, cfg.columns_elems // n), per_sm, cfg.columns_splits)
    else:
        dx = _split(device, T, C, cfg.dx_block_t, max(16, cfg.dx_elements(n) // n), cfg.dx_programs_per_sm(n),
                    cfg.dx_splits)
    dfn = dx
    if cfg.dfn == "separate":
        dfn = _split(device, T, C, cfg.dfn_block_t, cfg.dfn_block_c, cfg.dfn_per_sm, cfg.dfn_splits, streams=n)
    else:
        assert cfg.dfn in ("fused", "columns"), \
            f"GatedHeadConfig.dfn: 'separate', 'fused' or 'columns', not {cfg.dfn!r}"
    sizes = (cdiv(C, cols) * T * n, T * M_PAD, cdiv(T, cfg.gates_block_t) * (n + 1),
             dfn.splits * n * n * C if deterministic else 0)
    return _Plan(block_t, block_c, cols, dx, dfn, sizes)


def backward_workspace_numel(T: int, n: int, C: int, device, deterministic: bool = True,
                             config: Optional[GatedHeadConfig] = None) -> int:
    """FP32 elements of the workspace the gated head backward uses for these sizes (0 when T == 0)."""
    if T == 0:
        return 0
    return fp32_scratch_numel(_plan(T, n, C, torch.device(device), deterministic, config or GatedHeadConfig()).sizes)


def _columns_options(cfg: GatedHeadConfig, n: int, atomic: bool, block_c: int, loop_stages: int) -> dict:
    """The one-pass dX / dfn kernel's constexprs and launch options."""
    block_t, _, prefetch, _ = cfg.columns_shape(n)
    return dict(N=n, M_PAD=M_PAD, ATOMIC=atomic, BLOCK_T=block_t, BLOCK_C=block_c, PREFETCH=prefetch,
                LOOP_STAGES=loop_stages, num_warps=cfg.columns_warps, **pipeline_stages(cfg.columns_stages))


@functools.lru_cache(maxsize=256)  # per backward call, on the host path
def _columns_fit(cfg: GatedHeadConfig, target, n: int, dtype: torch.dtype, atomic: bool, block_c: int) -> int:
    """The one-pass kernel's token-loop stages: its default, or fewer where the build does not fit ``target``.
    What ``arch.first_fit`` builds: X, dY, fn, the record, the dz rows, dX, dfn; T, C, blocks per split and six
    strides (16-divisible stand-ins)."""
    f32 = torch.float32
    args = (dtype, dtype, f32, f32, f32, dtype, f32) + (4096,) * 9
    return arch.first_fit(target, arch.fewer_stages(cfg.columns_shape(n)[3]), lambda stages: (
        _head_dx_columns_kernel, args, _columns_options(cfg, n, atomic, block_c, stages)))


def backward(dY: torch.Tensor, X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             stats: torch.Tensor, dX: torch.Tensor, dfn: torch.Tensor, dscale: torch.Tensor, dbase: torch.Tensor,
             deterministic: bool = True, accumulate: bool = False, workspace: Optional[torch.Tensor] = None, *,
             config: Optional[GatedHeadConfig] = None) -> None:
    """Writes dX [T, n, C] (X.dtype, one rounding) and FP32 dfn [n, n*C], dscale [1], dbase [n], or adds into
    the last three when ``accumulate``. dY [T, C] and X need a unit stride along C only; stats is contiguous."""
    T, n, C = X.shape
    if T == 0:  # no launch: the gradients of no tokens
        _zero_unless_accumulate((dfn, dscale, dbase), accumulate)
        return
    assert n in layout.SUPPORTED_N and dY.shape == (T, C) and dX.shape == X.shape
    assert X.stride(2) == 1 and dY.stride(1) == 1 and dX.stride(2) == 1
    assert stats.is_contiguous() and stats.shape == (T, layout.HEAD_STATS_WIDTH)
    assert fn.shape == (n, n * C) and fn.stride(1) == 1 and dfn.shape == fn.shape and dfn.is_contiguous()
    assert dscale.is_contiguous() and dbase.is_contiguous() and base.is_contiguous()
    assert all(t.dtype == torch.float32 for t in (fn, scale, base, stats, dfn, dscale, dbase))
    cfg = config or GatedHeadConfig()
    plan = _plan(T, n, C, X.device, deterministic, cfg)
    dg, dz, part, dfn_part = fp32_scratch(plan.sizes, workspace, X.device, separate=tracing())
    atomic = not deterministic
    if atomic:  # the kernels add into the gradients
        _zero_unless_accumulate((dfn, dscale, dbase), accumulate)
    slices = cdiv(C, plan.dgate_cols)
    fast(_head_dgate_kernel)[(cdiv(T, plan.dgate_block_t), slices)](
        X, dY, dg, T, C, plan.dgate_cols, X.stride(0), X.stride(1), dY.stride(0),
        N=n, BLOCK_T=plan.dgate_block_t, BLOCK_C=plan.dgate_block_c, X_PER_STREAM=cfg.dgate_x_per_stream,
        REDUCE_PER_CHUNK=cfg.dgate_reduce_per_chunk, num_warps=cfg.dgate_warps,
    )
    programs = cdiv(T, cfg.gates_block_t)
    fast(_head_dlogits_kernel)[(programs,)](
        dg, stats, scale, base, dz, part, dbase, dscale, T, C, slices,
        N=n, M_PAD=M_PAD, ATOMIC=atomic, BLOCK_T=cfg.gates_block_t, num_warps=cfg.gates_warps,
    )
    if not atomic:  # fixed order, while the partials are in L2
        part = part.view(programs, n + 1)
        sum_partials(part[:, :n], dbase, accumulate)
        sum_partials(part[:, n:], dscale, accumulate)
    precision = _precision(X.dtype)
    fused = cfg.dfn == "fused"
    if cfg.dfn == "columns":
        loop_stages = cfg.columns_shape(n)[3]
        if cfg.columns_loop_stages is None:  # as deep as the GPU's shared memory holds (sm_120, fp32, n = 8: 3)
            loop_stages = _columns_fit(cfg, arch.target_of(X.device), n, X.dtype, atomic, plan.dx.block_c)
        fast(_head_dx_columns_kernel)[(plan.dx.columns, plan.dx.splits)](
            X, dY, fn, stats, dz, dX, dfn if atomic else dfn_part, T, C, plan.dx.blocks_per_split,
            X.stride(0), X.stride(1), dY.stride(0), fn.stride(0), dX.stride(0), dX.stride(1),
            **_columns_options(cfg, n, atomic, plan.dx.block_c, loop_stages),
        )
    else:
        fast(_head_dx_kernel)[(plan.dx.columns, plan.dx.splits)](
            X, dY, fn, stats, dz, dX, dfn if atomic else dfn_part, T, C, plan.dx.blocks_per_split,
            X.stride(0), X.stride(1), dY.stride(0), fn.stride(0), dX.stride(0), dX.stride(1),
            N=n, M_PAD=M_PAD, ATOMIC=atomic, PRECISION=precision, BLOCK_T=cfg.dx_block_t, BLOCK_C=plan.dx.block_c,
            X_PER_STREAM=cfg.x_per_stream, FUSED_DFN=fused, num_warps=cfg.dx_num_warps(n),
            **pipeline_stages(cfg.dx_stages),
            **register_cap(cfg.dx_maxnreg),
        )
    if cfg.dfn == "separate":
        fast(_dfn_kernel)[(plan.dfn.columns, plan.dfn.splits)](
            X, dz, dz, dfn if atomic else dfn_part, T, C, plan.dfn.blocks_per_split, X.stride(0), X.stride(1),
            N=n, M_PAD=M_PAD, ATOMIC=atomic, PRECISION=precision, BLOCK_T=cfg.dfn_block_t,
            BLOCK_C=plan.dfn.block_c, LOGITS=n, num_warps=cfg.dfn_warps, **pipeline_stages(cfg.dfn_stages),
        )
    if not atomic:
        width = n * n * C
        sum_partials(dfn_part.view(plan.dfn.splits, width), dfn.view(width), accumulate, max_block=1024, block_p=8)
