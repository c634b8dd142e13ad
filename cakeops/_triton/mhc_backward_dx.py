"""mHC backward_finish, kernel B (dX) in two forms and kernel C (dfn); the launcher and the reasons for the split are in
mhc_backward_finish.py."""
import triton
import triton.language as tl

from .mhc_columns import PRE, COMB
from .mhc_math import bf16_pieces, dot_bf16


@triton.jit
def _dx_kernel(
    X, DY, DU, FN, STATS, DZ, DX,
    T, C, blocks_per_split,
    stride_xt, stride_xi, stride_dyt, stride_dyi, stride_ut, stride_fn, stride_st, stride_dxt, stride_dxi,
    N: tl.constexpr, M_PAD: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    X_PER_STREAM: tl.constexpr,
):
    """Kernel B (see mhc_backward_finish.py): dX over (C chunk) x (a range of token blocks).

    Tiles are [N, BLOCK_T, BLOCK_C], the stream axis first: the compiler puts one warp on each stream, so the
    per-stream coefficients (pre_i, comb[i, j]) are [N, BLOCK_T, 1] broadcasts and the dY_j tiles are loaded
    once per warp; the projection is one batched dot [N, BLOCK_T, M_PAD] @ [N, M_PAD, BLOCK_C] that takes the
    elementwise terms as its accumulator (H200, triton 3.6: 128 registers, no spill; 4 programs of 4 warps per SM).
    """
    M = 2 * N + N * N
    i = tl.arange(0, N)[:, None, None]
    tt = tl.arange(0, BLOCK_T)[None, :, None]
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)[None, None, :]
    c_ok = c < C
    m_row = tl.arange(0, M_PAD)[None, :, None]
    m_col = tl.arange(0, M_PAD)[None, None, :]
    fn_i = tl.load(FN + m_row * stride_fn + i * C + c, mask=(m_row < M) & c_ok, other=0.0)  # [N, M_PAD, BLOCK_C]
    first = tl.program_id(1) * blocks_per_split
    for block in range(first, tl.minimum(first + blocks_per_split, tl.cdiv(T, BLOCK_T))):
        t = block * BLOCK_T + tt
        t_ok = t < T
        t64 = t.to(tl.int64)
        # dz once per token block, broadcast over the streams (a load per stream cost B 2-3%, H200)
        dz = tl.broadcast_to(tl.load(DZ + t64 * M_PAD + m_col, mask=t_ok & (m_col < M), other=0.0),
                             (N, BLOCK_T, M_PAD))
        s = tl.load(DZ + t64 * M_PAD + M, mask=t_ok, other=0.0)
        _dx_tile(X, DY, DU, STATS, DX, fn_i, dz, s, t64, t_ok, c, c_ok, stride_xt, stride_xi, stride_dyt, stride_dyi,
                 stride_ut, stride_st, stride_dxt, stride_dxi, N, PRECISION, X_PER_STREAM, PRE(N))


@triton.jit
def _dx_tile(X, DY, DU, STATS, DX, fn_i, dz, s, t64, t_ok, c, c_ok, stride_xt, stride_xi, stride_dyt, stride_dyi,
             stride_ut, stride_st, stride_dxt, stride_dxi, N: tl.constexpr, PRECISION: tl.constexpr,
             X_PER_STREAM: tl.constexpr, GATES: tl.constexpr, MIX_STREAMS: tl.constexpr = True):
    """dX = round(pre_i*dU + sum_j comb[i,j]*dY_j - x_i*s + (dz @ fn)_i) on one [N, BLOCK_T, BLOCK_C] tile;
    t64 / t_ok are [1, BLOCK_T, 1], c / c_ok [1, 1, BLOCK_C], fn_i [N, M_PAD, BLOCK_C], dz [N, BLOCK_T, M_PAD].
    pre_i is read at column GATES + i of a record row (PRE(N) of the mHC stats, GATE of the gated head's record).
    MIX_STREAMS=False drops the residual-mixing term (DY unread): the gated head's dX.
    Returns the FP32 x tile (the gated head reuses it for dfn)."""
    i = tl.arange(0, N)[:, None, None]
    s_row = STATS + t64 * stride_st
    mask = t_ok & c_ok
    if X_PER_STREAM:  # one [1, BLOCK_T, BLOCK_C] load per stream in the layout of the dY_j tiles, picked per stream
        x_rows = X + t64 * stride_xt + c
        x = tl.where(i == 0, tl.load(x_rows, mask=mask, other=0.0).to(tl.float32), 0.0)
        for k in tl.static_range(1, N):
            x = tl.where(i == k, tl.load(x_rows + k * stride_xi, mask=mask, other=0.0).to(tl.float32), x)
    else:
        x = tl.load(X + t64 * stride_xt + i * stride_xi + c, mask=mask, other=0.0).to(tl.float32)
    du = tl.load(DU + t64 * stride_ut + c, mask=mask, other=0.0).to(tl.float32)
    dx = tl.load(s_row + GATES + i, mask=t_ok, other=0.0) * du - x * s
    if MIX_STREAMS:
        for j in tl.static_range(N):
            dy = tl.load(DY + t64 * stride_dyt + j * stride_dyi + c, mask=mask, other=0.0).to(tl.float32)
            dx += tl.load(s_row + COMB(N) + i * N + j, mask=t_ok, other=0.0) * dy
    dx = tl.dot(dz, fn_i, dx, input_precision=PRECISION)
    tl.store(DX + t64 * stride_dxt + i * stride_dxi + c, dx.to(DX.dtype.element_ty), mask=mask & (i < N))
    return x


@triton.jit
def _dx_stream_kernel(
    X, DY, DU, FN, STATS, DZ, DX, T, C,
    stride_xt, stride_xi, stride_dyt, stride_dyi, stride_ut, stride_fn, stride_st, stride_dxt, stride_dxi,
    N: tl.constexpr, M_PAD: tl.constexpr, PRECISION: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_T: tl.constexpr, FN_K_MAJOR: tl.constexpr = False, K_STAGES: tl.constexpr = 1,
):
    """Kernel B as a GEMM per output stream (``FinishConfig(dx_by_stream=True)``, n = 8's default): a program
    writes dX[t, i, c] for one stream i over [BLOCK_T, BLOCK_C], the same value as _dx_tile's
    round(pre_i*dU + sum_j comb[i,j]*dY_j - x_i*s + (dz @ fn)_i), with the elementwise terms as the accumulator of
    dz[:, k:k+BLOCK_K] @ fn[k:k+BLOCK_K, i*C + c] over k < M: n = 8's 80 logits in 5 steps of 16 instead of a dot
    padded to 128, the tokens as the MMA's rows (wgmma on sm_90), no tile holding every stream. i is the grid's
    fastest axis, so the n programs of a block re-read dY, dU and dz from L2; GROUP_T token blocks are walked
    before the next column block, so fn's columns are re-read from L2 too. (Every stream of a block in one
    program, dY / dU / dz read once, lost on the H200: n = 2 backward_finish 1.23-1.57 ms against 1.006 with
    _dx_kernel, n = 4 and 8 slower still; 2026-12-03/04, docs/perf.md.)
    FN_K_MAJOR: FN is fn^T [n*C, M] (stride_fn its row stride), written by _transpose_kernel: the MMA's fn operand
    then goes to shared memory as it is loaded, where fn [M, n*C] is transposed by scalar stores with 8-way bank
    conflicts (60 % of the kernel's shared-memory wavefronts; H200, n = 8, T = 8192: 1302 -> 1198 us, dX bitwise
    equal, 2026-12-03).
    K_STAGES: the logit steps' software pipeline (tl.range's num_stages): from 2 on, dz's and fn's tiles of the
    next steps are copied to shared memory asynchronously (cp.async) while a step's wgmma runs, where a step of the
    unrolled loop waited on its own global loads and then on its MMA (H200, n = 8, T = 8192, 3 stages at 64 x 128
    of 8 warps: 1142 -> 1025 us, dX bitwise equal, 2026-12-03)."""
    M: tl.constexpr = 2 * N + N * N
    c_blocks = tl.cdiv(C, BLOCK_C)
    pid = tl.program_id(0)
    blk = pid // N
    t_blocks = tl.cdiv(T, BLOCK_T)
    per_group = GROUP_T * c_blocks
    g = blk // per_group
    first_t = g * GROUP_T
    rows = tl.minimum(t_blocks - first_t, GROUP_T)
    tb = first_t + (blk % per_group) % rows
    cb = (blk % per_group) // rows
    t = tb * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    c = cb * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    t_ok = t < T
    c_ok = c < C
    mask = t_ok & c_ok
    t64 = t.to(tl.int64)
    s_row = STATS + t64 * stride_st
    s = tl.load(DZ + t64 * M_PAD + M, mask=t_ok, other=0.0)
    kk = tl.arange(0, BLOCK_K)
    # One stream per program, as a loop of one iteration: the H200 runs this form 25 % faster than the same body
    # without the loop (triton 3.6, 64 x 64 tiles: 2.62 against 3.46 ms; the launcher's num_stages=1 keeps the
    # loop unpipelined, 2 stages took 4.66), the instruction mix being the same.
    i_first = pid % N
    for i in range(i_first, i_first + 1):
        x = tl.load(X + t64 * stride_xt + i * stride_xi + c, mask=mask, other=0.0).to(tl.float32)
        du = tl.load(DU + t64 * stride_ut + c, mask=mask, other=0.0).to(tl.float32)
        dx = tl.load(s_row + PRE(N) + i, mask=t_ok, other=0.0) * du - x * s
        for j in tl.static_range(N):
            dy = tl.load(DY + t64 * stride_dyt + j * stride_dyi + c, mask=mask, other=0.0).to(tl.float32)
            dx += tl.load(s_row + COMB(N) + i * N + j, mask=t_ok, other=0.0) * dy
        for k0 in tl.range(0, M, BLOCK_K, num_stages=K_STAGES):
            k = k0 + kk
            dz = tl.load(DZ + t64 * M_PAD + k[None, :], mask=t_ok & (k < M)[None, :], other=0.0)
            if FN_K_MAJOR:
                c_rows = cb * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]
                fn = tl.trans(tl.load(FN + (i * C + c_rows).to(tl.int64) * stride_fn + k[None, :],
                                      mask=(c_rows < C) & (k < M)[None, :], other=0.0))
            else:
                fn = tl.load(FN + k[:, None] * stride_fn + i * C + c, mask=(k < M)[:, None] & c_ok, other=0.0)
            dx = tl.dot(dz, fn, dx, input_precision=PRECISION)
        tl.store(DX + t64 * stride_dxt + i * stride_dxi + c, dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _transpose_kernel(SRC, DST, R, K, stride_src, stride_dst, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """DST [K, R] = SRC [R, K]^T over one block of BLOCK_K columns (all R <= BLOCK_R rows): fn^T for kernel B."""
    r = tl.arange(0, BLOCK_R)[:, None]
    k = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
    ok = (r < R) & (k < K)
    tile = tl.load(SRC + r * stride_src + k, mask=ok, other=0.0)
    tl.store(DST + tl.trans(k).to(tl.int64) * stride_dst + tl.trans(r), tl.trans(tile), mask=tl.trans(ok))


@triton.jit
def _dfn_kernel(X, DZ, DZ_LO, DFN, T, C, blocks_per_split, stride_xt, stride_xi,
                N: tl.constexpr, M_PAD: tl.constexpr, ATOMIC: tl.constexpr, PRECISION: tl.constexpr,
                BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, LOGITS: tl.constexpr = 0,
                SPLIT_BF16: tl.constexpr = False, INTERPRET: tl.constexpr = False, PRESPLIT: tl.constexpr = False):
    """Kernel C: dfn[:, i*C + c] = dz^T @ X_i over a range of token blocks, a skinny GEMM (M_PAD x BLOCK_C
    tiles, K = tokens) that the compiler pipelines (asynchronous copies of both operands). Grid: (stream x
    C chunk, token splits). DFN is dfn itself (ATOMIC) or the [splits, M, K] partials. M = LOGITS when given
    (the gated head's n), else the mHC layer's 2n + n^2.
    SPLIT_BF16 (bf16 X): dz as bf16 hi + lo against x as loaded, two bf16 MMAs (the forward projection's split)
    instead of x converted to FP32 for a TF32 MMA: at n = 8 (M_PAD = 128) the GEMM has 4x n = 4's work per byte
    of X. PRESPLIT (with SPLIT_BF16): DZ and DZ_LO are dz's bf16 hi / lo pieces [T, M_PAD], split once per call
    (_split_fn_kernel), not per tile (H200, n = 8, T = 8192: 257 -> 204 us, 2026-12-02)."""
    M = 2 * N + N * N if LOGITS == 0 else LOGITS
    c_blocks = tl.cdiv(C, BLOCK_C)
    i = tl.program_id(0) // c_blocks
    c = (tl.program_id(0) % c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = tl.arange(0, M_PAD)
    tt = tl.arange(0, BLOCK_T)
    acc = tl.zeros([M_PAD, BLOCK_C], dtype=tl.float32)
    first = tl.program_id(1) * blocks_per_split
    for block in range(first, tl.minimum(first + blocks_per_split, tl.cdiv(T, BLOCK_T))):
        t = block * BLOCK_T + tt
        t_ok = t < T
        t64 = t.to(tl.int64)
        dz_at = t64[None, :] * M_PAD + m[:, None]
        dz_ok = t_ok[None, :] & (m < M)[:, None]
        dz_t = tl.load(DZ + dz_at, mask=dz_ok, other=0.0)
        x = tl.load(X + t64[:, None] * stride_xt + i * stride_xi + c[None, :], mask=t_ok[:, None] & (c < C)[None, :],
                    other=0.0)
        if SPLIT_BF16:
            if not PRESPLIT:  # DZ_LO unread (a pointer always, not None: launchers drop None arguments)
                dz_hi, dz_lo = bf16_pieces(dz_t)
            else:
                dz_hi, dz_lo = dz_t, tl.load(DZ_LO + dz_at, mask=dz_ok, other=0.0)
            acc = dot_bf16(dz_hi, x, acc, INTERPRET)
            acc = dot_bf16(dz_lo, x, acc, INTERPRET)
        else:
            acc = tl.dot(dz_t, x.to(tl.float32), acc, input_precision=PRECISION)
    dst = m[:, None] * (N * C) + i * C + c[None, :]
    ok = (m < M)[:, None] & (c < C)[None, :]
    if ATOMIC:
        tl.atomic_add(DFN + dst, acc, mask=ok)
    else:
        tl.store(DFN + tl.program_id(1).to(tl.int64) * (M * N * C) + dst, acc, mask=ok)
