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
* ``_head_dx_kernel``, grid (C chunks) x (token splits): dX = round(g_i*dY - x_i*s + (dz @ fn)_i) through
  backward_finish's ``_dx_tile`` (its residual-mixing term switched off), and dfn += dz^T @ x on the same x
  tile, per token split: backward_finish reads X a third time for dfn (its kernel C); here dz has n columns
  only, and reusing the tile saves that pass (3.5 X-sized transfers instead of 4.5 at n = 4).
  Deterministic: the [splits, n, n*C] dfn partials are summed in a fixed order; otherwise atomics.

Record layout: meta/mhc_head_layout.py. FP32 inside, IEEE division and square root, every output rounded
once. Any n in meta/mhc_head_layout.SUPPORTED_N (N constexpr). Launchers do no argument validation (the public
layer does); X is [T, n, C] with unit stride along C and any token / stream strides.
"""
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..meta import mhc_head_layout as layout
from ..meta import mhc_layout
from .._backend import interpreting
from .launch import cdiv, next_power_of_2, persistent_programs
from .mhc_backward_dx import _dx_tile
from .mhc_backward_finish import _precision, _split, _stages
from .mhc_math import sigmoid
from .mhc_prepare import PrepareConfig, _project, _split_fn_kernel
from .mhc_streams import StreamConfig, collapse
from .partials import sum_partials

_GATE = tl.constexpr(layout.GATE)
_MIX = tl.constexpr(layout.MIX)
_RSTD = tl.constexpr(layout.RSTD)
_WIDTH = tl.constexpr(layout.HEAD_STATS_WIDTH)
M_PAD = 16  # n logits padded to a tl.dot dimension (>= 16); column n of a partial / dz row carries a scalar
assert layout.MAX_N < M_PAD and layout.GATE == mhc_layout.PRE  # collapse and _dx_tile read the gates at PRE


# ------------------------------------------------------------------------------------------------
# Forward
# ------------------------------------------------------------------------------------------------

@triton.jit
def _head_project_kernel(X, FN, PART, T, C, cols, stride_xt, stride_xi, stride_fn,
                         N: tl.constexpr, M_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                         SPLIT_BF16: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
                         PRESPLIT: tl.constexpr):
    """Program (token block, column slice): fn @ x over the slice into PART [slices, T, M_PAD], the sum of
    x^2 in column N (fn rows >= N are masked to zero by _project)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    c_lo = tl.program_id(1) * cols
    acc, sum_sq = _project(X, FN, t.to(tl.int64) * stride_xt, t_ok, C, c_lo, tl.minimum(C, c_lo + cols), stride_xi,
                           stride_fn, N, N, M_PAD, BLOCK_T, BLOCK_C, SPLIT_BF16, INTERPRET, PRECISION, PRESPLIT)
    m = tl.arange(0, M_PAD)
    row = PART + (tl.program_id(1) * T + t).to(tl.int64) * M_PAD
    tl.store(row[:, None] + m[None, :], tl.where(m[None, :] == N, sum_sq[:, None], acc), mask=t_ok[:, None])


@triton.jit
def _head_gates_kernel(PART, SCALE, BASE, STATS, slices, T, C, rms_eps, hc_eps,
                       N: tl.constexpr, M_PAD: tl.constexpr, BLOCK_T: tl.constexpr):
    """One token block: the slices summed in slice order (deterministic), rstd, mix and the gates into the
    record; every other column of the row is zeroed (the stores are disjoint: no barrier)."""
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
    gate = sigmoid(mix * tl.load(SCALE) + base[None, :]) + hc_eps
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
    """Launch shape of the gated head, forward and backward. Not tuned on a GPU yet: the forward projection
    takes forward_prepare's measured launch shape (``projection``, resolved per call by PrepareConfig: 128-token
    blocks, column slices when T has fewer blocks than the GPU has multiprocessors), the dX kernel
    backward_finish's kernel B shape (16-token blocks, ~4 programs per SM), scaled by n so that the
    [n, tokens, columns] tiles keep the register footprint of n = 4."""
    projection: PrepareConfig = PrepareConfig()
    gates_block_t: int = 64          # forward gates and backward dlogits: tokens per program
    gates_warps: int = 2
    collapse_block_c: Optional[int] = None  # the collapse Y (mhc_streams.StreamConfig)
    dgate_elems: int = 128           # dgate pass: n * tokens per program (32 tokens at n = 4, like dpre)
    dgate_block_c: int = 128
    dgate_warps: int = 4
    dgate_slices: Optional[int] = None  # column slices; None: enough programs to fill the GPU
    dx_block_t: int = 16             # dX + dfn kernel: tokens per block (a tl.dot dimension, >= 16)
    dx_elems: int = 256              # dX kernel: n * columns per program (64 columns at n = 4)
    dx_warps: int = 4
    dx_stages: Optional[int] = 2
    dx_per_sm: int = 3               # backward_finish's B runs 4 per SM at 128 registers; this kernel also holds
    #                                  the dfn accumulator (~+32 registers at 64 columns), so 3 fit in one wave
    dx_splits: Optional[int] = None
    x_per_stream: bool = True        # _dx_tile's X layout (mhc_backward_finish.FinishConfig.x_per_stream)

    @staticmethod
    def candidates():
        """Variants for a tuner (python -m cakeops.bench.tune does not sweep them yet)."""
        for per_sm, elems in ((4, 256), (2, 256), (6, 128), (2, 512)):
            yield GatedHeadConfig(dx_per_sm=per_sm, dx_elems=elems)
        yield GatedHeadConfig(dgate_elems=64)


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
    proj = cfg.projection.resolve(X)
    cols = cdiv(cdiv(C, proj.slices), proj.block_c) * proj.block_c
    part = torch.empty(cdiv(C, cols), T, M_PAD, dtype=torch.float32, device=X.device)
    presplit = proj.presplit and X.dtype == torch.bfloat16
    w = fn
    if presplit:
        w = torch.empty(2, n, n * C, dtype=torch.bfloat16, device=X.device)
        _split_fn_kernel[(n, cdiv(n * C, 1024))](fn, w, n, n * C, fn.stride(0), BLOCK=1024, num_warps=4)
    _head_project_kernel[(cdiv(T, proj.block_t), part.shape[0])](
        X, w, part, T, C, cols, X.stride(0), X.stride(1), w.stride(-2),
        N=n, M_PAD=M_PAD, BLOCK_T=proj.block_t, BLOCK_C=proj.block_c, SPLIT_BF16=X.dtype == torch.bfloat16,
        INTERPRET=interpreting(), PRESPLIT=presplit, PRECISION="tf32x3" if X.dtype == torch.float32 else "tf32",
        num_warps=proj.num_warps, **_stages(proj.num_stages),
    )
    _head_gates_kernel[(cdiv(T, cfg.gates_block_t),)](
        part, scale, base, stats, part.shape[0], T, C, float(rms_eps), float(hc_eps),
        N=n, M_PAD=M_PAD, BLOCK_T=cfg.gates_block_t, num_warps=cfg.gates_warps,
    )
    if Y is not None:
        collapse(X, stats, Y, config=StreamConfig(block_c=cfg.collapse_block_c))


# ------------------------------------------------------------------------------------------------
# Backward
# ------------------------------------------------------------------------------------------------

@triton.jit
def _head_dgate_kernel(X, DY, DG, T, C, cols, stride_xt, stride_xi, stride_dyt,
                       N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (token block, column slice): dg_i = sum_c dY[t, c] * X[t, i, c] over the slice into DG
    [slices, T, N]. [N, BLOCK_T, BLOCK_C] tiles, the stream axis first, X loaded per stream in dY's layout
    (as _dx_tile does), reduced once after the chunk loop. Both inputs are streamed once: evict first."""
    i = tl.arange(0, N)[:, None, None]
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[None, :, None]
    t_ok = t < T
    t64 = t.to(tl.int64)
    c_lo = tl.program_id(1) * cols
    c_hi = tl.minimum(C, c_lo + cols)
    x_row = X + t64 * stride_xt
    acc = tl.zeros([N, BLOCK_T, BLOCK_C], dtype=tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)[None, None, :]
        mask = t_ok & (c < c_hi)
        dy = tl.load(DY + t64 * stride_dyt + c, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        x = tl.where(i == 0, tl.load(x_row + c, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32),
                     0.0)
        for k in tl.static_range(1, N):
            x = tl.where(i == k, tl.load(x_row + k * stride_xi + c, mask=mask, other=0.0,
                                         eviction_policy="evict_first").to(tl.float32), x)
        acc += dy * x
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
    sg = sigmoid(mix * scale + tl.load(BASE + j)[None, :])
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
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, X_PER_STREAM: tl.constexpr):
    """dX over (C chunk) x (a range of token blocks), and that range's dfn columns of the chunk.

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
                     _WIDTH, stride_dxt, stride_dxi, N, PRECISION, X_PER_STREAM, False)
        t_col = block * BLOCK_T + tt_col
        dz_t = tl.load(DZ + t_col.to(tl.int64) * M_PAD + m_row, mask=(t_col < T) & (m_row < N), other=0.0)
        dfn = tl.dot(tl.broadcast_to(dz_t, (N, M_PAD, BLOCK_T)), x, dfn, input_precision=PRECISION)
    dst = m_row * (N * C) + i * C + c
    ok = (m_row < N) & c_ok & (i < N)  # at the full shape: the interpreter's atomics do not broadcast masks
    if ATOMIC:
        tl.atomic_add(DFN + dst, dfn, mask=ok)
    else:
        tl.store(DFN + tl.program_id(1).to(tl.int64) * (N * N * C) + dst, dfn, mask=ok)


class _Plan(NamedTuple):
    dgate_block_t: int
    dgate_block_c: int
    dgate_cols: int
    dx: tuple             # mhc_backward_finish._Split
    # FP32 workspace, in order: dg partials [slices, T, n] | dz rows [T, M_PAD] | dbase/dscale partials
    # [programs, n + 1] | dfn partials [splits, n, n*C] (deterministic only)
    sizes: tuple


def _plan(T: int, n: int, C: int, device, deterministic: bool, cfg: GatedHeadConfig) -> _Plan:
    block_t = max(1, cfg.dgate_elems // n)
    block_c = max(16, min(cfg.dgate_block_c, next_power_of_2(C)))
    slices = cfg.dgate_slices
    if slices is None:  # few token blocks (small T): split the columns too, so every SM has a program
        blocks = cdiv(T, block_t)
        slices = max(1, min(8, persistent_programs(device, 1 << 30, per_sm=1) // blocks, cdiv(C, block_c)))
    cols = cdiv(cdiv(C, slices), block_c) * block_c
    dx = _split(device, T, C, cfg.dx_block_t, max(16, cfg.dx_elems // n), cfg.dx_per_sm, cfg.dx_splits)
    sizes = (cdiv(C, cols) * T * n, T * M_PAD, cdiv(T, cfg.gates_block_t) * (n + 1),
             dx.splits * n * n * C if deterministic else 0)
    return _Plan(block_t, block_c, cols, dx, sizes)


def backward_workspace_numel(T: int, n: int, C: int, device, deterministic: bool = True,
                             config: Optional[GatedHeadConfig] = None) -> int:
    """FP32 elements of the workspace the gated head backward uses for these sizes (0 when T == 0)."""
    if T == 0:
        return 0
    return sum(_plan(T, n, C, torch.device(device), deterministic, config or GatedHeadConfig()).sizes)


def backward(dY: torch.Tensor, X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor,
             stats: torch.Tensor, dX: torch.Tensor, dfn: torch.Tensor, dscale: torch.Tensor, dbase: torch.Tensor,
             deterministic: bool = True, accumulate: bool = False, workspace: Optional[torch.Tensor] = None, *,
             config: Optional[GatedHeadConfig] = None) -> None:
    """Writes dX [T, n, C] (X.dtype, one rounding) and FP32 dfn [n, n*C], dscale [1], dbase [n], or adds into
    the last three when ``accumulate``. dY [T, C] and X need a unit stride along C only; stats is contiguous."""
    T, n, C = X.shape
    if T == 0:
        if not accumulate:
            for g in (dfn, dscale, dbase):
                g.zero_()
        return
    assert n in layout.SUPPORTED_N and dY.shape == (T, C) and dX.shape == X.shape
    assert X.stride(2) == 1 and dY.stride(1) == 1 and dX.stride(2) == 1
    assert stats.is_contiguous() and stats.shape == (T, layout.HEAD_STATS_WIDTH)
    assert fn.shape == (n, n * C) and fn.stride(1) == 1 and dfn.shape == fn.shape and dfn.is_contiguous()
    assert dscale.is_contiguous() and dbase.is_contiguous() and base.is_contiguous()
    assert all(t.dtype == torch.float32 for t in (fn, scale, base, stats, dfn, dscale, dbase))
    cfg = config or GatedHeadConfig()
    plan = _plan(T, n, C, X.device, deterministic, cfg)
    need = sum(plan.sizes)
    if workspace is None or workspace.numel() < need:
        workspace = torch.empty(need, dtype=torch.float32, device=X.device)
    dg, dz, part, dfn_part = torch.split(workspace[:need], plan.sizes)
    atomic = not deterministic
    if atomic and not accumulate:
        for g in (dfn, dscale, dbase):
            g.zero_()
    slices = cdiv(C, plan.dgate_cols)
    _head_dgate_kernel[(cdiv(T, plan.dgate_block_t), slices)](
        X, dY, dg, T, C, plan.dgate_cols, X.stride(0), X.stride(1), dY.stride(0),
        N=n, BLOCK_T=plan.dgate_block_t, BLOCK_C=plan.dgate_block_c, num_warps=cfg.dgate_warps,
    )
    programs = cdiv(T, cfg.gates_block_t)
    _head_dlogits_kernel[(programs,)](
        dg, stats, scale, base, dz, part, dbase, dscale, T, C, slices,
        N=n, M_PAD=M_PAD, ATOMIC=atomic, BLOCK_T=cfg.gates_block_t, num_warps=cfg.gates_warps,
    )
    if not atomic:  # fixed order, while the partials are in L2
        part = part.view(programs, n + 1)
        sum_partials(part[:, :n], dbase, accumulate)
        sum_partials(part[:, n:], dscale, accumulate)
    precision = _precision(X.dtype)
    _head_dx_kernel[(plan.dx.columns, plan.dx.splits)](
        X, dY, fn, stats, dz, dX, dfn if atomic else dfn_part, T, C, plan.dx.blocks_per_split,
        X.stride(0), X.stride(1), dY.stride(0), fn.stride(0), dX.stride(0), dX.stride(1),
        N=n, M_PAD=M_PAD, ATOMIC=atomic, PRECISION=precision, BLOCK_T=cfg.dx_block_t, BLOCK_C=plan.dx.block_c,
        X_PER_STREAM=cfg.x_per_stream, num_warps=cfg.dx_warps, **_stages(cfg.dx_stages),
    )
    if not atomic:
        width = n * n * C
        sum_partials(dfn_part.view(plan.dx.splits, width), dfn.view(width), accumulate, max_block=1024, block_p=8)
