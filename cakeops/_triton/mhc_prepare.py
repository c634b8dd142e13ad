"""mHC forward_prepare / forward_stats: one kernel per token block computes the stats record and the collapse U.

Pass 1 streams the block's X once for sum(x^2) and the projection fn @ x (tensor cores), then the gates
and the n x n Sinkhorn run per token in registers; pass 2 re-reads the block (from L2 when it is still
there) to write U = sum_i pre_i * X_i. Layout of the record: cakeops/meta/mhc_layout.py. FP32 inside,
IEEE division and square root, every output rounded once. Launchers do no argument validation (the
public layer does); X is [T, n, C] with unit stride along C and any token / stream strides.
"""
from typing import Optional

import torch
import triton
import triton.language as tl

from ..meta import mhc_layout as layout
from .mhc_columns import (
    PRE as _PRE, POST as _POST, COMB as _COMB, RSTD as _RSTD, MIX as _MIX, STATS_USED as _STATS_USED,
    STATS_WIDTH as _STATS_WIDTH,
)
from .._backend import interpreting
from .launch import persistent_programs
from .mhc_streams import collapse


@triton.jit
def _sigmoid(z):
    return tl.div_rn(1.0, 1.0 + tl.exp(-z))


@triton.jit
def _project(X, FN, t_off, t_ok, C, c_lo, c_hi, stride_xi, stride_fn,
             N: tl.constexpr, M: tl.constexpr, M_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
             BLOCK_C: tl.constexpr, SPLIT_BF16: tl.constexpr, INTERPRET: tl.constexpr,
             PRECISION: tl.constexpr):
    """Pass 1 over a token block, columns [c_lo, c_hi) of every stream: (fn @ x [BLOCK_T, M_PAD] and the sum
    of x^2 [BLOCK_T] over those columns), FP32.

    Walks the columns in BLOCK_C chunks, the n streams of a chunk together (no div/mod to unflatten K), so that
    the last chunks read are the first that pass 2 re-reads. fn rows past M are masked to zero.
    Tensor cores for the projection (SPEC §5 allows it): bf16 x is exact in a bf16 MMA and fn is split
    into bf16 hi + lo (~16 mantissa bits; on an H200 both faster and ~10x more accurate than TF32);
    other dtypes take fp32 x with TF32. The interpreter's bf16 dot is broken, so there the same pieces
    go through an fp32 dot.
    """
    offs_c = tl.arange(0, BLOCK_C)
    offs_m = tl.arange(0, M_PAD)
    acc = tl.zeros([BLOCK_T, M_PAD], dtype=tl.float32)
    sum_sq = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for c0 in range(c_lo, c_hi, BLOCK_C):
        c = c0 + offs_c
        c_ok = c < c_hi
        for i in tl.static_range(N):
            x = tl.load(X + t_off[:, None] + i * stride_xi + c[None, :],
                        mask=t_ok[:, None] & c_ok[None, :], other=0.0)
            w = tl.load(FN + offs_m[None, :] * stride_fn + (i * C + c)[:, None],
                        mask=(offs_m < M)[None, :] & c_ok[:, None], other=0.0)
            xf = x.to(tl.float32)
            sum_sq += xf * xf
            if SPLIT_BF16:
                w_hi = w.to(tl.bfloat16)
                w_lo = (w - w_hi.to(tl.float32)).to(tl.bfloat16)
                if INTERPRET:
                    acc = tl.dot(xf, w_hi.to(tl.float32), acc)
                    acc = tl.dot(xf, w_lo.to(tl.float32), acc)
                else:
                    acc = tl.dot(x, w_hi, acc)
                    acc = tl.dot(x, w_lo, acc)
            else:
                acc = tl.dot(xf, w, acc, input_precision=PRECISION)
    return acc, tl.sum(sum_sq, axis=1)


@triton.jit
def _sinkhorn(a, hc_eps, iters):
    """a [BLOCK_T, N, N] logits -> comb: row softmax + eps, then columns, (rows, columns) * (iters-1)."""
    e = tl.exp(a - tl.max(a, axis=2)[:, :, None])
    p = tl.div_rn(e, tl.sum(e, axis=2)[:, :, None]) + hc_eps
    p = tl.div_rn(p, tl.sum(p, axis=1)[:, None, :] + hc_eps)
    for _ in range(1, iters):
        p = tl.div_rn(p, tl.sum(p, axis=2)[:, :, None] + hc_eps)
        p = tl.div_rn(p, tl.sum(p, axis=1)[:, None, :] + hc_eps)
    return p


@triton.jit
def _prepare_block(
    X, FN, SCALE, BASE, STATS, U, block,
    T, C, stride_xt, stride_xi, stride_fn, stride_ut, rms_eps, hc_eps, iters,
    N: tl.constexpr, M_PAD: tl.constexpr, WRITE_U: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    SPLIT_BF16: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
):
    M = 2 * N + N * N
    t = block * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    acc, sum_sq = _project(X, FN, t.to(tl.int64) * stride_xt, t_ok, C, 0, C, stride_xi, stride_fn, N, M, M_PAD,
                           BLOCK_T, BLOCK_C, SPLIT_BF16, INTERPRET, PRECISION)
    _finalize_block(X, SCALE, BASE, STATS, U, acc, sum_sq, t, t_ok, C, stride_xt, stride_xi, stride_ut, rms_eps,
                    hc_eps, iters, N, M_PAD, WRITE_U, BLOCK_T, BLOCK_C)


@triton.jit
def _finalize_block(
    X, SCALE, BASE, STATS, U, acc, sum_sq, t, t_ok, C, stride_xt, stride_xi, stride_ut, rms_eps, hc_eps, iters,
    N: tl.constexpr, M_PAD: tl.constexpr, WRITE_U: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """From the whole projection and sum of squares of a token block: rstd, mix, the gates and the Sinkhorn
    (the stats rows) and, when WRITE_U, pass 2: the collapse U = sum_i pre_i * X_i."""
    M = 2 * N + N * N
    t64 = t.to(tl.int64)
    x_rows = t64 * stride_xt
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(sum_sq, (N * C) * 1.0) + rms_eps))
    mix = acc * rstd[:, None]

    # mix goes to its stats columns, then comes back in the shapes the gates and the Sinkhorn need
    # ([BLOCK_T, N], [BLOCK_T, N, N]): a cache-hot round trip of M floats per token, simpler than
    # re-laying out registers. The barrier makes the other threads' stores visible.
    s_row = STATS + t64 * _STATS_WIDTH
    offs_m = tl.arange(0, M_PAD)
    tl.store(s_row[:, None] + _MIX + offs_m[None, :], mix, mask=t_ok[:, None] & (offs_m < M)[None, :])
    tl.store(s_row + _RSTD, rstd, mask=t_ok)
    offs_w = tl.arange(0, _STATS_WIDTH)
    tl.store(s_row[:, None] + offs_w[None, :], tl.zeros([BLOCK_T, _STATS_WIDTH], dtype=tl.float32),
             mask=t_ok[:, None] & (offs_w >= _STATS_USED)[None, :])
    tl.debug_barrier()

    j = tl.arange(0, N)
    row_ok = t_ok[:, None]
    z_pre = tl.load(s_row[:, None] + _MIX + j[None, :], mask=row_ok, other=0.0)
    z_post = tl.load(s_row[:, None] + _MIX + N + j[None, :], mask=row_ok, other=0.0)
    pre = _sigmoid(z_pre * tl.load(SCALE) + tl.load(BASE + j)[None, :]) + hc_eps
    post = 2.0 * _sigmoid(z_post * tl.load(SCALE + 1) + tl.load(BASE + N + j)[None, :])
    ij = j[:, None] * N + j[None, :]
    z_res = tl.load(s_row[:, None, None] + _MIX + 2 * N + ij[None, :, :], mask=row_ok[:, :, None], other=0.0)
    comb = _sinkhorn(z_res * tl.load(SCALE + 2) + tl.load(BASE + 2 * N + ij)[None, :, :], hc_eps, iters)
    tl.store(s_row[:, None] + _PRE + j[None, :], pre, mask=row_ok)
    tl.store(s_row[:, None] + _POST + j[None, :], post, mask=row_ok)
    tl.store(s_row[:, None, None] + _COMB + ij[None, :, :], comb, mask=row_ok[:, :, None])

    if WRITE_U:
        # Pass 2 re-reads the block from L2, last chunk first: the most recently read data is the likeliest
        # to be still there when the L2 cannot hold the whole working set of all programs.
        offs_c = tl.arange(0, BLOCK_C)
        u_rows = t64 * stride_ut
        num_chunks = tl.cdiv(C, BLOCK_C)
        for k in range(num_chunks):
            c = (num_chunks - 1 - k) * BLOCK_C + offs_c
            mask = row_ok & (c < C)[None, :]
            x = tl.load(X + x_rows[:, None, None] + j[None, :, None] * stride_xi + c[None, None, :],
                        mask=mask[:, None, :], other=0.0).to(tl.float32)
            u = tl.sum(pre[:, :, None] * x, axis=1)
            tl.store(U + u_rows[:, None] + c[None, :], u.to(U.dtype.element_ty), mask=mask)


@triton.jit
def _prepare_kernel(
    X, FN, SCALE, BASE, STATS, U,
    T, C, stride_xt, stride_xi, stride_fn, stride_ut, rms_eps, hc_eps, iters,
    N: tl.constexpr, M_PAD: tl.constexpr, WRITE_U: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    SPLIT_BF16: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
):
    """Blocks of BLOCK_T tokens, grid-strided: stats rows always, U rows when WRITE_U (forward_stats skips
    the collapse only, so its stats are bitwise those of forward_prepare). A grid narrower than the
    number of blocks bounds the data in flight between pass 1 and pass 2, i.e. what the L2 must hold."""
    for block in range(tl.program_id(0), tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
        _prepare_block(X, FN, SCALE, BASE, STATS, U, block, T, C, stride_xt, stride_xi, stride_fn, stride_ut,
                       rms_eps, hc_eps, iters, N, M_PAD, WRITE_U, BLOCK_T, BLOCK_C, SPLIT_BF16, INTERPRET,
                       PRECISION)


@triton.jit
def _project_kernel(
    X, FN, PART, T, C, cols, stride_xt, stride_xi, stride_fn,
    N: tl.constexpr, M_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    SPLIT_BF16: tl.constexpr, INTERPRET: tl.constexpr, PRECISION: tl.constexpr,
):
    """Split pass 1, program (token block, column slice): the slice's projection and sum of squares into
    PART [slices, T, M_PAD]. Projection columns >= M are zero (fn rows masked), so column M carries sum(x^2)."""
    M = 2 * N + N * N
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    c_lo = tl.program_id(1) * cols
    acc, sum_sq = _project(X, FN, t.to(tl.int64) * stride_xt, t_ok, C, c_lo, tl.minimum(C, c_lo + cols), stride_xi,
                           stride_fn, N, M, M_PAD, BLOCK_T, BLOCK_C, SPLIT_BF16, INTERPRET, PRECISION)
    offs_m = tl.arange(0, M_PAD)
    row = PART + (tl.program_id(1) * T + t).to(tl.int64) * M_PAD
    tl.store(row[:, None] + offs_m[None, :], tl.where(offs_m[None, :] == M, sum_sq[:, None], acc), mask=t_ok[:, None])


@triton.jit
def _finalize_kernel(
    X, PART, SCALE, BASE, STATS, U, slices,
    T, C, stride_xt, stride_xi, stride_ut, rms_eps, hc_eps, iters,
    N: tl.constexpr, M_PAD: tl.constexpr, WRITE_U: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Split pass 2, one token block: the slices' partials summed in slice order (deterministic), then the
    stats rows and the collapse exactly as the one-kernel path."""
    M = 2 * N + N * N
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    offs_m = tl.arange(0, M_PAD)
    acc = tl.zeros([BLOCK_T, M_PAD], dtype=tl.float32)
    for s in range(slices):
        acc += tl.load(PART + (s * T + t).to(tl.int64)[:, None] * M_PAD + offs_m[None, :], mask=t_ok[:, None],
                       other=0.0)
    sum_sq = tl.sum(tl.where(offs_m[None, :] == M, acc, 0.0), axis=1)
    acc = tl.where(offs_m[None, :] < M, acc, 0.0)
    _finalize_block(X, SCALE, BASE, STATS, U, acc, sum_sq, t, t_ok, C, stride_xt, stride_xi, stride_ut, rms_eps,
                    hc_eps, iters, N, M_PAD, WRITE_U, BLOCK_T, BLOCK_C)


def _prepare_config(X: torch.Tensor, T: int, C: int):
    """Default (BLOCK_T, BLOCK_C, num_warps, num_stages) of prepare.

    On an H200 (bf16, T = 16384, C = 4096) 128 x 64 tiles, 8 warps, 3 stages were the fastest of a sweep
    over BLOCK_T 32..128, BLOCK_C 32..128, 4/8 warps, 2..4 stages: larger token blocks re-read fn (from
    L2) less often. Shorter T gets smaller blocks so that about every multiprocessor has a program
    (parallelism is T / BLOCK_T: no split over K yet). The interpreter wants small tiles.
    """
    block_c = max(16, min(64, triton.next_power_of_2(C)))
    if not X.is_cuda:
        return 16, block_c, 4, None
    sms = persistent_programs(X.device, 1 << 30, per_sm=1)  # the multiprocessor count
    block_t = 128
    while block_t > 16 and triton.cdiv(T, block_t) < sms // 2:
        block_t //= 2
    return block_t, block_c, (8 if block_t >= 128 else 4), (3 if block_t >= 128 else 2)


def prepare(X: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, rms_eps: float,
            hc_eps: float, sinkhorn_iters: int, stats: torch.Tensor, U: Optional[torch.Tensor] = None, *,
            block_t: Optional[int] = None, block_c: Optional[int] = None, num_warps: Optional[int] = None,
            num_stages: Optional[int] = None, per_sm: Optional[int] = None, slices: Optional[int] = None,
            finalize_block_t: int = 16, finalize_block_c: int = 64, finalize_warps: int = 4,
            separate_collapse: Optional[bool] = None, collapse_block_c: Optional[int] = None) -> None:
    """Writes stats [T, STATS_WIDTH] FP32 (padding zeroed) and, when U [T, C] is given, the collapse U.

    U=None is forward_stats: the same kernels with the collapse pass compiled out. Tile parameters left
    None take the defaults of ``_prepare_config``. ``per_sm``: a persistent grid of that many programs per
    multiprocessor instead of one program per token block. ``slices``: two kernels instead of one, pass 1
    split over that many column slices of every token block (partials in a [slices, T, 32] FP32 buffer),
    pass 2 (partials summed in order, gates, collapse) on blocks of ``finalize_block_t`` tokens.
    ``separate_collapse``: the stats kernel (forward_stats), then U in a one-pass stream kernel
    (mhc_streams.collapse, ``collapse_block_c`` columns per program) instead of pass 2 inside the kernel.
    """
    T, n, C = X.shape
    if T == 0:
        return
    M = 2 * n + n * n
    assert X.stride(2) == 1 and fn.shape == (M, n * C) and fn.stride(1) == 1 and fn.dtype == torch.float32
    assert stats.is_contiguous() and stats.shape == (T, layout.STATS_WIDTH) and stats.dtype == torch.float32
    assert n == layout.N_STREAMS and 1 <= sinkhorn_iters
    assert U is None or (U.shape == (T, C) and U.stride(1) == 1)
    d_t, d_c, d_w, d_s = _prepare_config(X, T, C)
    block_t, block_c, num_warps = block_t or d_t, block_c or d_c, num_warps or d_w
    num_stages = num_stages or d_s
    extra = {} if num_stages is None else {"num_stages": num_stages}
    u = U if U is not None else stats  # a placeholder pointer: never touched without WRITE_U
    m_pad = max(16, triton.next_power_of_2(M))
    precision = dict(
        SPLIT_BF16=X.dtype == torch.bfloat16, INTERPRET=interpreting(),
        # fp32 X: three-pass TF32, near-fp32 projection (SPEC §5's 1e-3 on records with one pass is tight).
        PRECISION="tf32x3" if X.dtype == torch.float32 else "tf32",
    )
    blocks = triton.cdiv(T, block_t)
    hp = (float(rms_eps), float(hc_eps), int(sinkhorn_iters))
    if separate_collapse is None:
        separate_collapse = False
    if separate_collapse and U is not None:
        prepare(X, fn, scale, base, rms_eps, hc_eps, sinkhorn_iters, stats, None, block_t=block_t, block_c=block_c,
                num_warps=num_warps, num_stages=num_stages, per_sm=per_sm, slices=slices,
                finalize_block_t=finalize_block_t, finalize_block_c=finalize_block_c, finalize_warps=finalize_warps)
        collapse(X, stats, U, block_c=collapse_block_c)
        return
    if slices is None:
        programs = blocks if per_sm is None else persistent_programs(X.device, blocks, per_sm)
        _prepare_kernel[(programs,)](
            X, fn, scale, base, stats, u, T, C, X.stride(0), X.stride(1), fn.stride(0), u.stride(0), *hp,
            N=n, M_PAD=m_pad, WRITE_U=U is not None, BLOCK_T=block_t, BLOCK_C=block_c, **precision,
            num_warps=num_warps, **extra,
        )
        return
    assert m_pad > M  # column M of a partial row carries the sum of squares
    cols = triton.cdiv(triton.cdiv(C, slices), block_c) * block_c
    part = torch.empty(triton.cdiv(C, cols), T, m_pad, dtype=torch.float32, device=X.device)
    _project_kernel[(blocks, part.shape[0])](
        X, fn, part, T, C, cols, X.stride(0), X.stride(1), fn.stride(0),
        N=n, M_PAD=m_pad, BLOCK_T=block_t, BLOCK_C=block_c, **precision, num_warps=num_warps, **extra,
    )
    _finalize_kernel[(triton.cdiv(T, finalize_block_t),)](
        X, part, scale, base, stats, u, part.shape[0], T, C, X.stride(0), X.stride(1), u.stride(0), *hp,
        N=n, M_PAD=m_pad, WRITE_U=U is not None, BLOCK_T=finalize_block_t,
        BLOCK_C=max(16, min(finalize_block_c, triton.next_power_of_2(C))), num_warps=finalize_warps,
    )
