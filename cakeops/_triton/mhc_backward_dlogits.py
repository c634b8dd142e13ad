"""mHC backward_finish, the dpre pass and kernel A: per token, the gradient of the mapping logits (dlogit [M])
and what kernel B (mhc_backward_dx.py) needs from it.

``_dpre_kernel``: dpre_i = sum_c dU*X_i, one pass over X and dU, partials per column slice. Kernel A,
persistent over blocks of BLOCK_T tokens: from dpre, on [BLOCK_T, n] / [BLOCK_T, n, n] tiles, back through
pre = sigmoid + eps, post = 2*sigmoid and the exact unrolled Sinkhorn to dlogit. Writes dz = rstd*dmix and
s = rstd^2/K * sum_m dmix_m*mix_m to a small FP32 workspace row per token ([T, M_PAD]: dz at 0..M-1, s at M),
and sums dlogit and dlogit*mix over its tokens, per logit: one partial row per program (-> dbase, dscale after
a fixed-order reduction), or atomics.

Sinkhorn backward: the backward of normalization step s needs that step's input. The kernel replays the
forward once from the logits (a = mix*scale[2] + base, mix from stats) through the forward's own function
(mhc_math.sinkhorn), storing each of the 2*iters - 1 normalization inputs in a per-program FP32 scratch
[2*iters-1, BLOCK_T, n, n], then walks the steps in reverse: exact, and linear in iters (a replay from the
logits for every reverse step would be quadratic: ~20x the forward's work at iters=20). Persistent programs
reuse their slot, so the scratch is programs*(2*iters-1)*BLOCK_T*64 bytes (~40 MB at iters=20 with the
defaults on an H200, where 16 programs per SM of 8 tokens each beat fewer, larger ones: the replay and
the reverse walk are chains of dependent steps, so the kernel runs as fast as it has chains in flight).
"""
import triton
import triton.language as tl

from .mhc_columns import RSTD, MIX, DPOST, DCOMB
from .mhc_math import logit, sigmoid, sinkhorn


@triton.jit
def _load_logits(row, row_ok, N: tl.constexpr):
    """The pre [R, N], post [R, N] and res [R, N, N] pieces of the M logit-indexed values at row[r] + m."""
    j = tl.arange(0, N)
    ij = j[:, None] * N + j[None, :]
    pre = tl.load(row[:, None] + j[None, :], mask=row_ok[:, None], other=0.0)
    post = tl.load(row[:, None] + N + j[None, :], mask=row_ok[:, None], other=0.0)
    res = tl.load(row[:, None, None] + 2 * N + ij[None, :, :], mask=row_ok[:, None, None], other=0.0)
    return pre, post, res


@triton.jit
def _put_logits(row, row_ok, pre, post, res, N: tl.constexpr, ATOMIC: tl.constexpr):
    """Stores (or atomically adds) the three pieces back at row[r] + m, the inverse of _load_logits."""
    j = tl.arange(0, N)
    ij = j[:, None] * N + j[None, :]
    if ATOMIC:
        # Masks spelled out at the pointers' full shape: the Triton interpreter's atomics do not broadcast a
        # mask (a [R, 1] mask adds only column 0 there); compiled, both spellings are the same code.
        vec_ok = row_ok[:, None] & (j[None, :] < N)
        tl.atomic_add(row[:, None] + j[None, :], pre, mask=vec_ok)
        tl.atomic_add(row[:, None] + N + j[None, :], post, mask=vec_ok)
        tl.atomic_add(row[:, None, None] + 2 * N + ij[None, :, :], res,
                      mask=row_ok[:, None, None] & (ij[None, :, :] < N * N))
    else:
        tl.store(row[:, None] + j[None, :], pre, mask=row_ok[:, None])
        tl.store(row[:, None] + N + j[None, :], post, mask=row_ok[:, None])
        tl.store(row[:, None, None] + 2 * N + ij[None, :, :], res, mask=row_ok[:, None, None])


@triton.jit
def _normalize_backward(dq, p, AXIS: tl.constexpr, hc_eps):
    """q = p / d, d = sum_AXIS p + eps: dp = (dq - sum_AXIS(dq * q)) / d."""
    d = tl.expand_dims(tl.sum(p, axis=AXIS), AXIS) + hc_eps
    q = tl.div_rn(p, d)
    return tl.div_rn(dq - tl.expand_dims(tl.sum(dq * q, axis=AXIS), AXIS), d)


@triton.jit
def _sinkhorn_backward(mix_res, scale_res, base_res, dcomb, hc_eps, iters, scr, STEP: tl.constexpr):
    """da [BLOCK_T, N, N] from dcomb: the exact unrolled Sinkhorn backward, every eps and iteration.

    Replays the forward (mhc_math.sinkhorn, recording the input of normalization step s at scr + s*STEP),
    then walks the steps in reverse.
    """
    tl.debug_barrier()  # every thread is done reading the previous block's iterates
    _, s = sinkhorn(mix_res, scale_res, base_res, hc_eps, iters, scr, STEP, True)
    tl.debug_barrier()  # the iterates are visible to every thread
    # Each reverse step loads its two iterates one step ahead: the loads do not depend on dp, so their
    # latency hides behind the previous step's arithmetic instead of stalling every step.
    dp = dcomb
    p_col = tl.load(scr + 2 * (iters - 1) * STEP)
    p_row = tl.load(scr + tl.maximum(2 * iters - 3, 0) * STEP)
    for r in range(1, iters):
        k = iters - r - 1
        col, row = p_col, p_row
        p_col = tl.load(scr + 2 * k * STEP)
        p_row = tl.load(scr + tl.maximum(2 * k - 1, 0) * STEP)
        dp = _normalize_backward(dp, col, 1, hc_eps)
        dp = _normalize_backward(dp, row, 2, hc_eps)
    dp = _normalize_backward(dp, p_col, 1, hc_eps)  # p_col is the first iterate here (scr + 0)
    # P0 = softmax(a) + eps: the eps has gradient one, then the row softmax.
    return s * (dp - tl.sum(dp * s, axis=2)[:, :, None])


@triton.jit
def _collapse_backward(X, DU, t64, t_ok, c_lo, c_hi, stride_xt, stride_xi, stride_ut,
                       N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """dpre [BLOCK_T, N] = sum_c dU[t, c] * X[t, i, c] over c in [c_lo, c_hi), FP32, reduced once after the
    chunk loop.

    2-D [BLOCK_T, BLOCK_C] tiles, one accumulator per stream (a tuple of N tiles, unrolled at compile time): a
    [BLOCK_T, n, BLOCK_C] tile compiled for sm_90 to scalar loads and barriers; these tiles load 16 bytes per
    thread per access."""
    offs_c = tl.arange(0, BLOCK_C)
    x_row = X + t64[:, None] * stride_xt
    u_row = DU + t64[:, None] * stride_ut
    acc = ()
    for i in tl.static_range(N):
        acc = acc + (tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32),)
    for c0 in range(c_lo, c_hi, BLOCK_C):
        c = (c0 + offs_c)[None, :]
        mask = t_ok[:, None] & (c < c_hi)
        du = tl.load(u_row + c, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
        summed = ()
        for i in tl.static_range(N):
            summed = summed + (acc[i] + du * _stream(x_row, i, stride_xi, c, mask),)
        acc = summed
    j = tl.arange(0, N)[None, :]
    dpre = tl.where(j == 0, tl.sum(acc[0], axis=1)[:, None], 0.0)
    for i in tl.static_range(1, N):
        dpre = dpre + tl.where(j == i, tl.sum(acc[i], axis=1)[:, None], 0.0)
    return dpre


@triton.jit
def _stream(x_row, i: tl.constexpr, stride_xi, c, mask):
    """Stream i of X on a [BLOCK_T, BLOCK_C] tile, FP32 (streamed once: evict first)."""
    return tl.load(x_row + i * stride_xi + c, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)


@triton.jit
def _dlogits_block(dpre, t64, t_ok, C, STATS, GS, DZ, stride_st, stride_gt, scale_pre, scale_post, scale_res,
                   base_pre, base_post, base_res, hc_eps, iters, scr, N: tl.constexpr, M_PAD: tl.constexpr,
                   STEP: tl.constexpr):
    """One token block from dpre [BLOCK_T, N]: back through the gates and the Sinkhorn to dlogit, writes the
    block's dz rows (dz = rstd*dmix at 0..M-1, s at M). Returns dlogit and mix as (pre, post, res) pieces."""
    M = 2 * N + N * N
    j = tl.arange(0, N)
    ij = j[:, None] * N + j[None, :]
    s_row = STATS + t64 * stride_st
    g_row = GS + t64 * stride_gt
    mix_pre, mix_post, mix_res = _load_logits(s_row + MIX(N), t_ok, N)
    rstd = tl.load(s_row + RSTD(N), mask=t_ok, other=0.0)
    dpost = tl.load(g_row[:, None] + DPOST(N) + j[None, :], mask=t_ok[:, None], other=0.0)
    dcomb = tl.load(g_row[:, None, None] + DCOMB(N) + ij[None, :, :], mask=t_ok[:, None, None], other=0.0)
    # The sigmoids come from the logits, not from the stored gates: pre - eps loses small values.
    sg_pre = sigmoid(logit(mix_pre, scale_pre, base_pre))
    sg_post = sigmoid(logit(mix_post, scale_post, base_post))
    dl_pre = dpre * sg_pre * (1.0 - sg_pre)
    dl_post = dpost * 2.0 * sg_post * (1.0 - sg_post)
    dl_res = _sinkhorn_backward(mix_res, scale_res, base_res, dcomb, hc_eps, iters, scr, STEP)

    dm_pre, dm_post, dm_res = dl_pre * scale_pre, dl_post * scale_post, dl_res * scale_res
    dmix_mix = (tl.sum(dm_pre * mix_pre, axis=1) + tl.sum(dm_post * mix_post, axis=1)
                + tl.sum(tl.sum(dm_res * mix_res, axis=2), axis=1))
    dz_row = DZ + t64 * M_PAD
    _put_logits(dz_row, t_ok, rstd[:, None] * dm_pre, rstd[:, None] * dm_post, rstd[:, None, None] * dm_res,
                N, False)
    tl.store(dz_row + M, tl.div_rn(rstd * rstd, (N * C) * 1.0) * dmix_mix, mask=t_ok)
    return dl_pre, dl_post, dl_res, mix_pre, mix_post, mix_res


@triton.jit
def _dpre_kernel(X, DU, DPRE, T, C, cols, stride_xt, stride_xi, stride_ut,
                 N: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """The dpre pass on its own, program (token block, column slice): partial dpre into DPRE [slices, T, N].
    Kernel A then only sums the slices, so its Sinkhorn work no longer sits between two streaming phases."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < T
    c_lo = tl.program_id(1) * cols
    dpre = _collapse_backward(X, DU, t.to(tl.int64), t_ok, c_lo, tl.minimum(C, c_lo + cols), stride_xt, stride_xi,
                              stride_ut, N, BLOCK_T, BLOCK_C)
    j = tl.arange(0, N)
    tl.store(DPRE + (tl.program_id(1) * T + t).to(tl.int64)[:, None] * N + j[None, :], dpre, mask=t_ok[:, None])


@triton.jit
def _dlogits_kernel(
    DPRE, STATS, GS, SCALE, BASE, DZ, PART, SCR, DBASE, DSCALE,
    T, C, dpre_slices, stride_st, stride_gt, hc_eps, iters,
    N: tl.constexpr, M_PAD: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Kernel A (see the module docstring); dpre comes from _dpre_kernel's [dpre_slices, T, N] partials, summed
    in slice order. Padded tokens have zero upstream gradients, hence zero dlogits."""
    hc_eps = tl.cast(hc_eps, tl.float32)  # FP64 from Inductor's launcher (a traced launch), FP32 from Triton's
    pid = tl.program_id(0)
    tt = tl.arange(0, BLOCK_T)
    j = tl.arange(0, N)
    ij = j[:, None] * N + j[None, :]
    STEP = BLOCK_T * N * N
    scr = SCR + pid.to(tl.int64) * (2 * iters - 1) * STEP + (tt[:, None, None] * (N * N) + ij[None, :, :])
    scale_pre, scale_post, scale_res = tl.load(SCALE), tl.load(SCALE + 1), tl.load(SCALE + 2)
    one = tl.zeros([1], dtype=tl.int32)  # the logit-indexed vectors below are one "row" of _load_logits
    base_pre, base_post, base_res = _load_logits(BASE + one, one == 0, N)
    # Sums over this program's tokens, per logit: dlogit (-> dbase) and dlogit*mix (-> dscale).
    db_pre = tl.zeros([1, N], dtype=tl.float32)
    db_post = tl.zeros([1, N], dtype=tl.float32)
    db_res = tl.zeros([1, N, N], dtype=tl.float32)
    ds_pre, ds_post, ds_res = db_pre, db_post, db_res
    for block in range(pid, tl.cdiv(T, BLOCK_T), tl.num_programs(0)):
        t = block * BLOCK_T + tt
        t_ok = t < T
        t64 = t.to(tl.int64)
        dpre = tl.zeros([BLOCK_T, N], dtype=tl.float32)
        for s in range(dpre_slices):
            dpre += tl.load(DPRE + (s * T + t64)[:, None] * N + j[None, :], mask=t_ok[:, None], other=0.0)
        dl_pre, dl_post, dl_res, mix_pre, mix_post, mix_res = _dlogits_block(
            dpre, t64, t_ok, C, STATS, GS, DZ, stride_st, stride_gt, scale_pre, scale_post, scale_res,
            base_pre, base_post, base_res, hc_eps, iters, scr, N, M_PAD, STEP)
        db_pre += tl.sum(dl_pre, axis=0, keep_dims=True)
        db_post += tl.sum(dl_post, axis=0, keep_dims=True)
        db_res += tl.sum(dl_res, axis=0, keep_dims=True)
        ds_pre += tl.sum(dl_pre * mix_pre, axis=0, keep_dims=True)
        ds_post += tl.sum(dl_post * mix_post, axis=0, keep_dims=True)
        ds_res += tl.sum(dl_res * mix_res, axis=0, keep_dims=True)
    if ATOMIC:
        _put_logits(DBASE + one, one == 0, db_pre, db_post, db_res, N, True)
        tl.atomic_add(DSCALE, tl.sum(ds_pre))
        tl.atomic_add(DSCALE + 1, tl.sum(ds_post))
        tl.atomic_add(DSCALE + 2, tl.sum(ds_res))
    else:
        row = PART + pid * (2 * M_PAD) + one
        _put_logits(row, one == 0, db_pre, db_post, db_res, N, False)
        _put_logits(row + M_PAD, one == 0, ds_pre, ds_post, ds_res, N, False)
