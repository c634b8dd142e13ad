"""mHC backward_finish kernels and launcher: the prepare node's backward (SPEC §2), after the branch's.

Three launches, four when deterministic:

* kernel A (mhc_backward_dlogits.py), per token block: dpre from one pass over X and dU, the gradient of
  the gates and of the exact unrolled Sinkhorn, and per token dz = rstd*dmix and the scalar s into a small
  FP32 workspace; per-program partial sums for dbase and dscale.
* ``_dx_dfn_kernel`` (B), grid (C chunks) x (token splits): each program owns the K columns
  {i*C + c : c in its chunk, every stream i} and a range of tokens. Per token block it writes
  dX = round(pre_i*dU + sum_j comb[i,j]*dY_j + (dz @ fn)_i - x_i*s), one rounding, and accumulates its
  dfn partial dz^T @ x in registers (tl.dot, TF32 on a GPU, exact FP32 under the interpreter).
* deterministic: the partials (per token split for dfn, per program for dbase / dscale) are summed in a
  fixed order by ``_sum_partials_kernel`` and ``_params_reduce_kernel``; otherwise added with atomics.

Why this split: dX needs dz, which needs the whole-C reduction dpre, so X and dU are read twice (A and B).
Fusing A into B per token block would serve the second read from L2, but then dfn (an [M, K] reduction
over tokens) has no home in registers. A costs (X + dU) bytes on top of B's minimal traffic.
"""
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..meta import mhc_layout as layout
from .mhc_columns import PRE as _PRE, COMB as _COMB
from .launch import persistent_programs
from .mhc_backward_dlogits import M_PAD, _dlogits_kernel
from .rmsnorm import _sum_partials_kernel


@triton.jit
def _dx_dfn_kernel(
    X, DY, DU, FN, STATS, DZ, DX, DFN,
    T, C, blocks_per_split,
    stride_xt, stride_xi, stride_dyt, stride_dyi, stride_ut, stride_fn, stride_st, stride_dxt, stride_dxi,
    N: tl.constexpr, M_PAD: tl.constexpr, ATOMIC: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Kernel B (see the module docstring). DFN is dfn itself (ATOMIC) or the [splits, M, K] partials."""
    M = 2 * N + N * N
    c_block = tl.program_id(0)
    split = tl.program_id(1)
    j = tl.arange(0, N)
    m = tl.arange(0, M_PAD)
    m_ok = m < M
    tt = tl.arange(0, BLOCK_T)
    c = c_block * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    # The program's K columns flattened stream-major, as tl.reshape lays out [BLOCK_T, N, BLOCK_C].
    kk = tl.arange(0, N * BLOCK_C)
    kc = c_block * BLOCK_C + kk % BLOCK_C
    k_col = (kk // BLOCK_C) * C + kc
    k_ok = kc < C
    fn_k = tl.load(FN + m[:, None] * stride_fn + k_col[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    dfn = tl.zeros([M_PAD, N * BLOCK_C], dtype=tl.float32)
    first = split * blocks_per_split
    for block in range(first, tl.minimum(first + blocks_per_split, tl.cdiv(T, BLOCK_T))):
        t = block * BLOCK_T + tt
        t_ok = t < T
        t64 = t.to(tl.int64)
        dz = tl.load(DZ + t64[:, None] * M_PAD + m[None, :], mask=t_ok[:, None] & m_ok[None, :], other=0.0)
        s = tl.load(DZ + t64 * M_PAD + M, mask=t_ok, other=0.0)
        s_row = STATS + t64 * stride_st
        mask = t_ok[:, None] & c_ok[None, :]
        x = tl.load(X + t64[:, None, None] * stride_xt + j[None, :, None] * stride_xi + c[None, None, :],
                    mask=mask[:, None, :], other=0.0).to(tl.float32)
        du = tl.load(DU + t64[:, None] * stride_ut + c[None, :], mask=mask, other=0.0).to(tl.float32)
        pre = tl.load(s_row[:, None] + _PRE + j[None, :], mask=t_ok[:, None], other=0.0)
        dx = pre[:, :, None] * du[:, None, :] - x * s[:, None, None]
        for jj in tl.static_range(N):
            dy = tl.load(DY + t64[:, None] * stride_dyt + jj * stride_dyi + c[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            comb = tl.load(s_row[:, None] + _COMB + j[None, :] * N + jj, mask=t_ok[:, None], other=0.0)
            dx += comb[:, :, None] * dy[:, None, :]
        dx += tl.reshape(tl.dot(dz, fn_k, input_precision=PRECISION), [BLOCK_T, N, BLOCK_C])
        tl.store(DX + t64[:, None, None] * stride_dxt + j[None, :, None] * stride_dxi + c[None, None, :],
                 dx.to(DX.dtype.element_ty), mask=mask[:, None, :])
        dfn = tl.dot(tl.trans(dz), tl.reshape(x, [BLOCK_T, N * BLOCK_C]), dfn, input_precision=PRECISION)
    dst = m[:, None] * (N * C) + k_col[None, :]
    dst_ok = m_ok[:, None] & k_ok[None, :]
    if ATOMIC:
        tl.atomic_add(DFN + dst, dfn, mask=dst_ok)
    else:
        tl.store(DFN + split.to(tl.int64) * (M * N * C) + dst, dfn, mask=dst_ok)


@triton.jit
def _params_reduce_kernel(PART, DBASE, DSCALE, P, N: tl.constexpr, M_PAD: tl.constexpr,
                          ACCUMULATE: tl.constexpr, BLOCK_P: tl.constexpr):
    """dbase (+)= sum_p PART[p, :M]; dscale[g] (+)= sum over logits m of group g of sum_p PART[p, M_PAD+m].
    One program, a fixed order: the deterministic reduction of kernel A's per-program partials."""
    M = 2 * N + N * N
    cols = tl.arange(0, 2 * M_PAD)
    used = (cols % M_PAD) < M  # kernel A leaves the padding columns unwritten
    acc = tl.zeros([2 * M_PAD], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + tl.arange(0, BLOCK_P)
        acc += tl.sum(tl.load(PART + p[:, None] * (2 * M_PAD) + cols[None, :], mask=(p < P)[:, None] & used[None, :],
                              other=0.0), axis=0)
    dbase = acc
    if ACCUMULATE:
        dbase += tl.load(DBASE + cols, mask=cols < M, other=0.0)
    tl.store(DBASE + cols, dbase, mask=cols < M)
    m = cols - M_PAD
    group = (m >= N).to(tl.int32) + (m >= 2 * N).to(tl.int32)
    for g in tl.static_range(3):
        dscale = tl.sum(tl.where((m >= 0) & (m < M) & (group == g), acc, 0.0), axis=0)
        if ACCUMULATE:
            dscale += tl.load(DSCALE + g)
        tl.store(DSCALE + g, dscale)


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FinishConfig:
    """Launch shape of backward_finish. Defaults are for an H200 (register counts from sm_90 builds: A ~122
    at 4 warps, B ~168 at 4 warps, i.e. 4 and 3 programs per SM); the bench tunes them."""
    dlogits_block_t: int = 8     # kernel A: tokens per block
    dlogits_block_c: int = 128   # kernel A: columns per chunk of the dpre pass
    dlogits_warps: int = 4
    dlogits_per_sm: int = 4      # kernel A: persistent programs per SM (each owns a Sinkhorn scratch slot)
    block_t: int = 16            # kernel B: tokens per block (>= 16, a tl.dot dimension)
    block_c: int = 32            # kernel B: columns per stream; a program owns n*block_c columns of K
    warps: int = 4
    stages: Optional[int] = 2
    per_sm: int = 3              # kernel B: (C chunks) x (token splits) <= per_sm programs per SM: one wave
    splits: Optional[int] = None  # kernel B: token splits; None derives them from per_sm
    input_precision: Optional[str] = None  # the projections through fn: None = "tf32x3" for fp32 X, else "tf32"


class _Plan(NamedTuple):
    dlogits_programs: int
    dlogits_block_c: int
    block_c: int
    c_blocks: int
    splits: int
    blocks_per_split: int
    # FP32 workspace, in order: dz rows [T, M_PAD] | A's partials [programs, 2*M_PAD] | Sinkhorn scratch |
    # dfn partials [splits, M, K] (deterministic only)
    sizes: tuple


def _plan(T: int, C: int, iters: int, device: torch.device, deterministic: bool, cfg: FinishConfig) -> _Plan:
    n, M = layout.N_STREAMS, layout.N_LOGITS
    a_programs = persistent_programs(device, triton.cdiv(T, cfg.dlogits_block_t), cfg.dlogits_per_sm)
    a_block_c = max(16, min(cfg.dlogits_block_c, triton.next_power_of_2(C)))
    block_c = max(16, min(cfg.block_c, triton.next_power_of_2(C)))
    c_blocks = triton.cdiv(C, block_c)
    token_blocks = triton.cdiv(T, cfg.block_t)
    splits = cfg.splits
    if splits is None:
        splits = persistent_programs(device, c_blocks * token_blocks, cfg.per_sm) // c_blocks
    blocks_per_split = triton.cdiv(token_blocks, max(1, min(splits, token_blocks)))
    splits = triton.cdiv(token_blocks, blocks_per_split)  # no split without tokens
    sizes = (T * M_PAD, a_programs * 2 * M_PAD, a_programs * (2 * iters - 1) * cfg.dlogits_block_t * n * n,
             splits * M * n * C if deterministic else 0)
    return _Plan(a_programs, a_block_c, block_c, c_blocks, splits, blocks_per_split, sizes)


def backward_finish_workspace_numel(T: int, C: int, sinkhorn_iters: int, device: torch.device,
                                    deterministic: bool = True, config: Optional[FinishConfig] = None) -> int:
    """FP32 elements of the workspace backward_finish uses for these sizes (0 when T == 0)."""
    if T == 0:
        return 0
    return sum(_plan(T, C, sinkhorn_iters, torch.device(device), deterministic, config or FinishConfig()).sizes)


def _precision(dtype: torch.dtype) -> str:
    # fp32 data: three-pass TF32 (near-fp32 products; a single TF32 pass moved dscale by 3.5e-3 on H200,
    # over SPEC's 2e-3). 16-bit data is exact in TF32 and its tolerance is 1e-2.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def backward_finish(X: torch.Tensor, dY: torch.Tensor, dU: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor,
                    base: torch.Tensor, stats: torch.Tensor, grad_stats: torch.Tensor, rms_eps: float,
                    hc_eps: float, sinkhorn_iters: int, dX: torch.Tensor, dfn: torch.Tensor, dscale: torch.Tensor,
                    dbase: torch.Tensor, deterministic: bool = True, accumulate: bool = False,
                    workspace: Optional[torch.Tensor] = None, *, config: Optional[FinishConfig] = None) -> None:
    """Writes dX [T, n, C] (X.dtype, one rounding) and FP32 dfn [M, K], dscale [3], dbase [M], or adds
    into the last three when ``accumulate``. ``rms_eps`` is not read: rstd comes from stats.

    X, dY, dX [T, n, C] and dU [T, C] need a unit stride along C only; stats and grad_stats rows may be
    strided; dfn, dscale, dbase are contiguous. ``workspace``: a flat FP32 buffer of at least
    backward_finish_workspace_numel(...) elements, else one is allocated.
    """
    del rms_eps
    T, n, C = X.shape
    if T == 0:
        if not accumulate:
            for g in (dfn, dscale, dbase):
                g.zero_()
        return
    M = 2 * n + n * n
    assert n == layout.N_STREAMS and dY.shape == X.shape and dX.shape == X.shape and dU.shape == (T, C)
    assert X.stride(2) == 1 and dY.stride(2) == 1 and dX.stride(2) == 1 and dU.stride(1) == 1
    assert stats.stride(1) == 1 and grad_stats.stride(1) == 1 and fn.shape == (M, n * C) and fn.stride(1) == 1
    assert dfn.shape == (M, n * C) and dfn.is_contiguous() and dscale.is_contiguous() and dbase.is_contiguous()
    assert all(t.dtype == torch.float32 for t in (fn, scale, base, stats, grad_stats, dfn, dscale, dbase))
    assert 1 <= sinkhorn_iters
    cfg = config or FinishConfig()
    plan = _plan(T, C, sinkhorn_iters, X.device, deterministic, cfg)
    need = sum(plan.sizes)
    if workspace is None or workspace.numel() < need:
        workspace = torch.empty(need, dtype=torch.float32, device=X.device)
    dz, part, scratch, dfn_part = torch.split(workspace[:need], plan.sizes)
    atomic = not deterministic
    if atomic and not accumulate:
        for g in (dfn, dscale, dbase):
            g.zero_()

    _dlogits_kernel[(plan.dlogits_programs,)](
        X, dU, stats, grad_stats, scale, base, dz, part, scratch, dbase, dscale,
        T, C, X.stride(0), X.stride(1), dU.stride(0), stats.stride(0), grad_stats.stride(0),
        float(hc_eps), int(sinkhorn_iters),
        N=n, M_PAD=M_PAD, ATOMIC=atomic, BLOCK_T=cfg.dlogits_block_t, BLOCK_C=plan.dlogits_block_c,
        num_warps=cfg.dlogits_warps,
    )
    extra = {} if cfg.stages is None else {"num_stages": cfg.stages}
    _dx_dfn_kernel[(plan.c_blocks, plan.splits)](
        X, dY, dU, fn, stats, dz, dX, dfn if atomic else dfn_part,
        T, C, plan.blocks_per_split,
        X.stride(0), X.stride(1), dY.stride(0), dY.stride(1), dU.stride(0), fn.stride(0), stats.stride(0),
        dX.stride(0), dX.stride(1),
        N=n, M_PAD=M_PAD, ATOMIC=atomic, PRECISION=cfg.input_precision or _precision(X.dtype),
        BLOCK_T=cfg.block_t, BLOCK_C=plan.block_c, num_warps=cfg.warps, **extra,
    )
    if atomic:
        return
    width = M * n * C
    sum_block = min(1024, triton.next_power_of_2(width))
    _sum_partials_kernel[(triton.cdiv(width, sum_block),)](
        dfn_part, dfn, plan.splits, width, width, ACCUMULATE=accumulate, BLOCK_P=8, BLOCK=sum_block, num_warps=4,
    )
    _params_reduce_kernel[(1,)](part, dbase, dscale, plan.dlogits_programs, N=n, M_PAD=M_PAD,
                                ACCUMULATE=accumulate, BLOCK_P=32, num_warps=4)
