"""mHC backward_finish, kernels A and B fused by tickets (``FinishConfig(split_k=S)``): X and dU are read
from HBM once for both.

Ticket u = b*S + s hands out slice s (C/S columns of every stream) of token block b, twice:

* pass 1 of (b, s): the partial dpre of the slice (X and dU from HBM) into a workspace row. The last pass 1
  of block b to arrive sums the S partials in slice order (deterministic, whoever is last), runs kernel A's
  per-block math (gates, exact Sinkhorn backward, dz rows) and the block's dbase / dscale partial row, then
  raises the block's flag.
* pass 2 of (b - lag, s), in the same ticket: waits for that block's flag, then dX of the slice (kernel B's
  tile), re-reading X and dU while they are still in L2.

No deadlock whatever the number of resident programs: a pass 2 waits only for pass-1 work of smaller
tickets, already taken by running programs, and a pass 1 never waits. The interpreter runs program 0
through every ticket in order. Same scheme as mhc_prepare._prepare_ticket_kernel.
"""
import triton
import triton.language as tl

from .mhc_backward_dlogits import _collapse_backward, _dlogits_block, _load_logits, _put_logits
from .mhc_backward_dx import _dx_tile


@triton.jit
def _dlogits_dx_ticket_kernel(
    X, DY, DU, FN, STATS, GS, SCALE, BASE, DZ, PART, SCR, DPRE, SYNC, DX,
    T, C, cols_per_split, lag,
    stride_xt, stride_xi, stride_dyt, stride_dyi, stride_ut, stride_fn, stride_st, stride_gt, stride_dxt, stride_dxi,
    hc_eps, iters,
    SPLITS: tl.constexpr, N: tl.constexpr, M_PAD: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_CA: tl.constexpr,
):
    """DZ [T, M_PAD] rows; PART [blocks, 2*M_PAD] (dbase | dscale partials per block); SCR the Sinkhorn
    scratch per program; DPRE [blocks*SPLITS, BLOCK_T, N]; SYNC int32 [ticket | arrivals | flags] zeroed."""
    M = 2 * N + N * N
    blocks = tl.cdiv(T, BLOCK_T)
    total = (blocks + lag) * SPLITS
    tt = tl.arange(0, BLOCK_T)
    j = tl.arange(0, N)
    ij = j[:, None] * N + j[None, :]
    STEP = BLOCK_T * N * N
    scr = SCR + tl.program_id(0).to(tl.int64) * (2 * iters - 1) * STEP + (tt[:, None, None] * (N * N) + ij[None, :, :])
    scale_pre, scale_post, scale_res = tl.load(SCALE), tl.load(SCALE + 1), tl.load(SCALE + 2)
    one = tl.zeros([1], dtype=tl.int32)
    base_pre, base_post, base_res = _load_logits(BASE + one, one == 0, N)
    # pass 2's [N, BLOCK_T, BLOCK_C] tile coordinates
    i3 = tl.arange(0, N)[:, None, None]
    t3 = tl.arange(0, BLOCK_T)[None, :, None]
    c3 = tl.arange(0, BLOCK_C)[None, None, :]
    m_row = tl.arange(0, M_PAD)[None, :, None]
    m_col = tl.arange(0, M_PAD)[None, None, :]
    u = tl.atomic_add(SYNC, 1)
    while u < total:
        b = u // SPLITS
        c_lo = (u % SPLITS) * cols_per_split
        c_hi = tl.minimum(C, c_lo + cols_per_split)
        if b < blocks:
            t = b * BLOCK_T + tt
            t_ok = t < T
            t64 = t.to(tl.int64)
            dpre = _collapse_backward(X, DU, t64, t_ok, c_lo, c_hi, stride_xt, stride_xi, stride_ut, N, BLOCK_T,
                                      BLOCK_CA)
            tl.store(DPRE + (u.to(tl.int64) * BLOCK_T + tt)[:, None] * N + j[None, :], dpre)
            tl.debug_barrier()  # every thread's partial is written before the release below publishes them
            if tl.atomic_add(SYNC + 1 + b, 1, sem="acq_rel") == SPLITS - 1:
                first = (b * SPLITS).to(tl.int64) * BLOCK_T + tt
                dpre = tl.zeros([BLOCK_T, N], dtype=tl.float32)
                for k in range(SPLITS):  # slice order, whoever arrived last
                    dpre += tl.load(DPRE + (first + k * BLOCK_T)[:, None] * N + j[None, :], cache_modifier=".cg")
                dl_pre, dl_post, dl_res, mix_pre, mix_post, mix_res = _dlogits_block(
                    dpre, t64, t_ok, C, STATS, GS, DZ, stride_st, stride_gt, scale_pre, scale_post, scale_res,
                    base_pre, base_post, base_res, hc_eps, iters, scr, N, M_PAD, STEP)
                row = PART + b * (2 * M_PAD) + one
                _put_logits(row, one == 0, tl.sum(dl_pre, axis=0, keep_dims=True),
                            tl.sum(dl_post, axis=0, keep_dims=True), tl.sum(dl_res, axis=0, keep_dims=True), N, False)
                _put_logits(row + M_PAD, one == 0, tl.sum(dl_pre * mix_pre, axis=0, keep_dims=True),
                            tl.sum(dl_post * mix_post, axis=0, keep_dims=True),
                            tl.sum(dl_res * mix_res, axis=0, keep_dims=True), N, False)
                tl.debug_barrier()  # the dz rows are written before the flag goes up
                tl.atomic_xchg(SYNC + 1 + blocks + b, 1, sem="release")
        if b >= lag:
            done = b - lag
            while tl.atomic_add(SYNC + 1 + blocks + done, 0, sem="acquire") == 0:
                pass
            t = done * BLOCK_T + t3
            t_ok = t < T
            t64 = t.to(tl.int64)
            dz = tl.load(DZ + t64 * M_PAD + m_col + i3 * 0, mask=t_ok & (m_col < M), other=0.0, cache_modifier=".cg")
            s = tl.load(DZ + t64 * M_PAD + M, mask=t_ok, other=0.0, cache_modifier=".cg")
            for c0 in range(c_lo, c_hi, BLOCK_C):
                c = c0 + c3
                c_ok = c < c_hi
                fn_i = tl.load(FN + m_row * stride_fn + i3 * C + c, mask=(m_row < M) & c_ok, other=0.0)
                _dx_tile(X, DY, DU, STATS, DX, fn_i, dz, s, t64, t_ok, c, c_ok, stride_xt, stride_xi, stride_dyt,
                         stride_dyi, stride_ut, stride_st, stride_dxt, stride_dxi, N, PRECISION)
        u = tl.atomic_add(SYNC, 1)
