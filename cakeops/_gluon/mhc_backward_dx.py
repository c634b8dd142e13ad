"""backward_finish's kernel B (dX) in Gluon for sm_90: a drop-in for the one launch of ``_dx_kernel`` (n = 2, 4) or
``_dx_stream_kernel`` (n = 8) in mhc_backward_finish.py, with the same arithmetic.

Per token t, stream i and column c (``_dx_tile``):
    dX = round(pre_i*dU - x_i*s + sum_j comb[i,j]*dY_j + (dz @ fn)_i)
the elementwise terms summed in that order in FP32, then the projection through the tensor cores with the
elementwise sum as its accumulator, dz's logits in steps of 8 in order: TF32 ``mma.sync`` m16n8k8 for n = 2, 4
(what Triton builds ``_dx_kernel``'s batched dot into on sm_90) and TF32 ``wgmma`` for n = 8 (what it builds
``_dx_stream_kernel``'s into), so dX is meant to equal the Triton kernel's bit for bit (tests/test_gluon_kernels.py
checks it on the GPU). The launcher ``dx`` is at the end.

What Gluon gives beyond Triton, and why each:
* One layout for every [BLOCK_T, BLOCK_C] stream tile: the MMA's accumulator layout. X, dY, dU come from shared
  memory straight into it (ldmatrix), the per-token coefficients as [BLOCK_T, 1] columns of it, and dX leaves it for
  shared memory (stmatrix): no layout conversion anywhere.
* Warp specialization: one warp issues every TMA load, one every TMA store, the other warps (the default partition)
  only compute. Loads sit in shared memory one block of tokens ahead: every tile has its own slot, refilled with the
  next block's tile as soon as the compute warps have read it (dY / dU / pre / s / dz at the top of a block, X_i and
  comb[i, :] after output stream i); mbarriers carry "ready" and "empty" between the warps. (TMA issued by the
  compute warps themselves was tried first: Triton's shared-memory barrier analysis put a CTA barrier beside every
  TMA and mbarrier operation, some 60 per block at n = 8, each one stalling all compute warps.)
* fn's columns for the program's chunk stay in shared memory for its whole token range (loaded once, FP32,
  K-major: the wgmma's TF32 operands must be, mma.sync reads its B fragments so by ldmatrix): per block only the
  data tiles and the per-token records move.
* Persistent programs: a column chunk x a contiguous range of token blocks each, like _dx_kernel's grid.

dY_j and dz (the MMA's A operand) stay in registers for the whole block: each output stream reads them from there,
not from shared memory n times. A stream tile is BLOCK_T * BLOCK_C / (32 * num_warps) elements per thread; the
default shapes (``DxConfig``) keep it at 16 (n = 2, 4) or 8 (n = 8) so n such tiles fit beside the accumulator
(sm_90 builds: the compute warps use up to 118 / 164 / 177 of their 240 registers at n = 2 / 4 / 8, no spills).
With the wgmma, a stream's projection runs while the next stream's elementwise terms are computed.

There is no interpreter for Gluon: this kernel runs on sm_90 only (``cakeops._gluon.available``); the Triton
kernels stay the path everywhere else and its numerical twin. tests/test_gluon_builds.py compiles every variant the
launcher can pick for sm_90 on CPU.
"""
import functools
from dataclasses import dataclass
from typing import Optional

import torch

from .._triton.launch import cdiv, persistent_programs
from .._triton.mhc_columns import logits_pad
from .compat import (TensorDescriptor, cta_barrier, fence_async_shared, gl, gluon, mbarrier, mma_v2, tma,
                     warpgroup_mma, warpgroup_mma_wait)

# Module constants the kernels read are gl.constexpr (Triton accepts no other globals); host code reads .value.
K_STEP = gl.constexpr(16)  # logits per dz box and per MMA call (two k-steps of 8 for TF32)
TOKENS = 64                # tokens per block: 4 warps along the tokens, 16 rows each (mma.sync's rows; one wgmma)
COEF_MIN = 4               # FP32 columns of a per-token record box at least: a TMA box is >= 16 bytes wide
WORKER_REGS = gl.constexpr(24)  # registers of the load and the store warp (the least setmaxnreg gives)


@gluon.constexpr_function
def acc_layout(wgmma, warps_c, block_c):
    """The accumulator layout of the projection's MMA over a [TOKENS, block_c] tile, 4 warps along the tokens and
    ``warps_c`` along the columns: every stream tile of the kernel lives in it."""
    if wgmma:
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, warps_c],
                                         instr_shape=[16, block_c // warps_c, 8])
    return gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[4, warps_c], instr_shape=[16, 8])


@gluon.constexpr_function
def flat_layout(layout):
    """The rank-2 shared layout of a [BLOCK_T, 1, BLOCK_C] TMA box's layout: the same bytes (the unit dimension
    adds nothing to the swizzle's row index), so a 2-D slot takes a 3-D box as it is."""
    return gl.NVMMASharedLayout(swizzle_byte_width=layout.swizzle_byte_width,
                                element_bitwidth=layout.element_bitwidth, rank=2)


@gluon.constexpr_function
def fn_layout(block_c):
    """fn's shared tile for one stream and K_STEP logits, [block_c, K_STEP] K-major: the wgmma's TF32 operands must
    be K-major, and mma.sync's B fragments (4 logits x 8 columns a warp) read it without bank conflicts (a
    row-major [K_STEP, block_c] tile has two-way conflicts)."""
    return gl.NVMMASharedLayout.get_default_for([block_c, K_STEP.value], gl.float32)


@gluon.constexpr_function
def fn_load_layout(num_warps, block_c):
    """A [K_STEP, block_c] FP32 chunk of fn over the CTA's threads without replication (num_warps = 8: exactly one
    tile), vectors along the columns."""
    return gl.BlockedLayout([1, max(1, block_c // 16)], [2, 16], [num_warps, 1], [1, 0])


@gluon.jit
def _barriers(count: gl.constexpr):
    """``count`` mbarriers of one arrival each, in one allocation."""
    group = gl.allocate_shared_memory(gl.int64, [count, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(count):
        mbarrier.init(group.index(b), count=1)
    return group


@gluon.jit
def _invalidate(group):
    """Every mbarrier of ``group`` invalidated: before its shared memory could be reused (triton #10106)."""
    count: gl.constexpr = group.shape[0]
    for b in gl.static_range(count):
        mbarrier.invalidate(group.index(b))


@gluon.jit
def _as_box(slot, desc):
    """A [BLOCK_T, BLOCK_C] slot as the [BLOCK_T, 1, BLOCK_C] box of the rank-3 (token, stream, column) ``desc``."""
    return slot._reinterpret(desc.dtype, desc.block_type.shape, desc.layout)


@gluon.jit
def _column(buf, k: gl.constexpr, layout: gl.constexpr):
    """Column k of a [BLOCK_T, width] per-token FP32 box as [BLOCK_T, 1] in the tiles' layout (a broadcast)."""
    return buf.slice(k, 1, dim=1).load(layout)


# ------------------------------------------------------------------------------------------------
# The load warp: every TMA load, one block ahead of the compute warps
# ------------------------------------------------------------------------------------------------

@gluon.jit
def _dx_load(descs, bufs, bars, c0, first, blocks, N: gl.constexpr):
    """For each block: what the compute warps read at its top (dU, dY_0..n-1, pre, s, dz), then X_i and comb[i, :]
    per output stream, each group once the compute warps have emptied its slots (the empty barriers start out
    "emptied": an mbarrier's phase before its first completion reads as complete, so the first waits, on parity 1,
    pass)."""
    x_desc, dy_desc, du_desc, dx_desc, dz_desc, s_desc, st_desc = descs
    x_bufs, dy_bufs, du_buf, st_bufs, s_buf, dz_bufs, out_bufs, fn_bufs = bufs
    head_ready, head_empty, x_ready, x_empty, out_ready, out_empty = bars
    M: gl.constexpr = 2 * N + N * N
    PRE_COL: gl.constexpr = 1 + M             # the stats columns of pre and comb: _triton/mhc_columns.py's PRE(N),
    COMB_COL: gl.constexpr = PRE_COL + 2 * N  # COMB(N) (checked against them below, _COLUMNS_AGREE)
    KC: gl.constexpr = dz_bufs.shape[0]
    BLOCK_T: gl.constexpr = x_desc.block_type.shape[0]
    for it in range(blocks):
        t0 = (first + it) * BLOCK_T
        phase = it & 1

        mbarrier.wait(head_empty.index(0), phase ^ 1)
        bar = head_ready.index(0)
        mbarrier.expect(bar, (N + 1) * dy_desc.block_type.nbytes + st_desc.block_type.nbytes
                        + s_desc.block_type.nbytes + KC * dz_desc.block_type.nbytes)  # positional (renamed in 3.7)
        tma.async_copy_global_to_shared(du_desc, [t0, c0], bar, du_buf)
        for j in gl.static_range(N):
            tma.async_copy_global_to_shared(dy_desc, [t0, j, c0], bar, _as_box(dy_bufs.index(j), dy_desc))
        tma.async_copy_global_to_shared(st_desc, [t0, PRE_COL], bar, st_bufs.index(0))  # pre_0..: from column PRE(N)
        tma.async_copy_global_to_shared(s_desc, [t0, M], bar, s_buf)              # s: dz's column M
        # dz_desc's shape ends at column M, so columns past M (s, padding) arrive as zeros, as _dx_kernel masks them
        for kc in gl.static_range(KC):
            tma.async_copy_global_to_shared(dz_desc, [t0, kc * K_STEP], bar, dz_bufs.index(kc))

        for i in gl.static_range(N):
            mbarrier.wait(x_empty.index(i), phase ^ 1)
            bar = x_ready.index(i)
            mbarrier.expect(bar, x_desc.block_type.nbytes + st_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [t0, i, c0], bar, _as_box(x_bufs.index(i), x_desc))
            tma.async_copy_global_to_shared(st_desc, [t0, COMB_COL + N * i], bar, st_bufs.index(1 + i))  # comb[i, :]


# ------------------------------------------------------------------------------------------------
# The store warp: every TMA store of dX
# ------------------------------------------------------------------------------------------------

@gluon.jit
def _dx_store(descs, bufs, bars, c0, first, blocks, N: gl.constexpr):
    """dX_i of each block from staging tile i % 2 once the compute warps have filled it; the tile is handed back
    when the store has read it. A filled staging tile also tells that the compute warps are done with X_i and
    comb[i, :]: this warp hands those slots to the load warp, so the compute warps signal once per stream (each
    signal costs them a barrier among themselves)."""
    x_desc, dy_desc, du_desc, dx_desc, dz_desc, s_desc, st_desc = descs
    x_bufs, dy_bufs, du_buf, st_bufs, s_buf, dz_bufs, out_bufs, fn_bufs = bufs
    head_ready, head_empty, x_ready, x_empty, out_ready, out_empty = bars
    BLOCK_T: gl.constexpr = x_desc.block_type.shape[0]
    for it in range(blocks):
        t0 = (first + it) * BLOCK_T
        for i in gl.static_range(N):
            use = it * (N // 2) + i // 2  # earlier uses of staging tile i % 2
            mbarrier.wait(out_ready.index(i % 2), use & 1)
            mbarrier.arrive(x_empty.index(i), count=1)
            tma.async_copy_shared_to_global(dx_desc, [t0, i, c0], _as_box(out_bufs.index(i % 2), dx_desc))
            tma.store_wait(0)
            mbarrier.arrive(out_empty.index(i % 2), count=1)


# ------------------------------------------------------------------------------------------------
# The compute warps (the default partition)
# ------------------------------------------------------------------------------------------------

@gluon.jit
def _project(acc, dz, fn_bufs, i: gl.constexpr, WGMMA: gl.constexpr, L: gl.constexpr):
    """acc + dz @ fn_i through the tensor cores, K_STEP logits a call in order (each two TF32 k-steps of 8), dz's
    chunks from registers, fn_i's from shared memory. wgmma: issued asynchronously, one commit group a call; the
    caller waits (the accumulations still happen in order). mma.sync: the result."""
    KC: gl.constexpr = len(dz)
    if WGMMA:
        # TF32: the backend's default input precision (triton 3.6's warpgroup_mma cannot take it as an argument: it
        # does not unwrap the constexpr string; tests/test_gluon_builds.py checks the PTX)
        for kc in gl.static_range(KC):
            acc = warpgroup_mma(dz[kc], fn_bufs.index(i * KC + kc).permute([1, 0]), acc, is_async=True)
    else:
        for kc in gl.static_range(KC):
            acc = mma_v2(dz[kc], fn_bufs.index(i * KC + kc).permute([1, 0]).load(gl.DotOperandLayout(1, L, 1)), acc,
                         input_precision="tf32")
    return acc


@gluon.jit
def _stage(dx, i: gl.constexpr, it, out_bufs, out_ready, out_empty, N: gl.constexpr):
    """dX_i of block ``it`` rounded into staging tile i % 2 (once the store warp has handed it back) and handed to
    the store warp, which also hands X_i's slots back to the load warp."""
    use = it * (N // 2) + i // 2  # earlier uses of staging tile i % 2
    mbarrier.wait(out_empty.index(i % 2), (use & 1) ^ 1)
    out_bufs.index(i % 2).store(dx.to(out_bufs.dtype))
    fence_async_shared()  # the staging writes and the X_i / comb reads before the TMA's accesses
    mbarrier.arrive(out_ready.index(i % 2), count=1)


@gluon.jit
def _dx_compute(descs, bufs, bars, c0, first, blocks, N: gl.constexpr, WGMMA: gl.constexpr, WARPS_C: gl.constexpr):
    """dX of each block, output stream by stream, from the tiles the load warp brings (``_dx_tile``'s order).
    With the wgmma, stream i's projection runs while the warps compute stream i + 1's elementwise terms (its
    chain is waited for, and staged, after i + 1's is issued)."""
    x_desc, dy_desc, du_desc, dx_desc, dz_desc, s_desc, st_desc = descs
    x_bufs, dy_bufs, du_buf, st_bufs, s_buf, dz_bufs, out_bufs, fn_bufs = bufs
    head_ready, head_empty, x_ready, x_empty, out_ready, out_empty = bars
    KC: gl.constexpr = dz_bufs.shape[0]
    BLOCK_C: gl.constexpr = x_desc.block_type.shape[2]
    L: gl.constexpr = acc_layout(WGMMA, WARPS_C, BLOCK_C)
    for it in range(blocks):
        phase = it & 1
        mbarrier.wait(head_ready.index(0), phase)
        du = du_buf.load(L).to(gl.float32)
        s = _column(s_buf, 0, L)
        dys = ()
        pres = ()
        for j in gl.static_range(N):
            dys = dys + (dy_bufs.index(j).load(L).to(gl.float32),)
            pres = pres + (_column(st_bufs.index(0), j, L),)  # column PRE(N) + j
        dz = ()  # the MMAs' A operand, in registers for the whole block
        for kc in gl.static_range(KC):
            dz = dz + (dz_bufs.index(kc).load(gl.DotOperandLayout(0, L, 1)),)
        fence_async_shared()  # these reads (generic proxy) before the next TMA writes into the slots (async proxy)
        mbarrier.arrive(head_empty.index(0), count=1)

        for i in gl.static_range(N):
            mbarrier.wait(x_ready.index(i), phase)
            comb = st_bufs.index(1 + i)
            x = x_bufs.index(i).load(L).to(gl.float32)
            # _dx_tile's order: pre_i*dU - x_i*s, then + comb[i,j]*dY_j for j = 0..n-1, then the projection
            acc = pres[i] * du - x * s
            for j in gl.static_range(N):
                acc += _column(comb, j, L) * dys[j]
            acc = _project(acc, dz, fn_bufs, i, WGMMA, L)
            if WGMMA:
                if i > 0:  # the previous stream's chain is done when at most this stream's KC groups are pending
                    _stage(warpgroup_mma_wait(KC, deps=(pending,)), i - 1, it, out_bufs, out_ready, out_empty, N)
                pending = acc
            else:
                _stage(acc, i, it, out_bufs, out_ready, out_empty, N)
        if WGMMA:
            _stage(warpgroup_mma_wait(0, deps=(pending,)), N - 1, it, out_bufs, out_ready, out_empty, N)


@gluon.jit
def _dx_gluon_kernel(x_desc, dy_desc, du_desc, dx_desc, dz_desc, s_desc, st_desc, FN, C, stride_fn, columns,
                     blocks_per_split, token_blocks, N: gl.constexpr, WGMMA: gl.constexpr, WARPS_C: gl.constexpr,
                     num_warps: gl.constexpr):
    """dX for one column chunk (program_id % columns) over one range of token blocks (program_id // columns).

    Descriptors: X, dY, dX rank 3 ([T, n, C], boxes [BLOCK_T, 1, BLOCK_C]); dU rank 2 ([T, C]); dz [T, M] in
    boxes of [BLOCK_T, K_STEP] and s as dz's column M (a [BLOCK_T, 4] box of [T, M_PAD]); stats in boxes of
    [BLOCK_T, max(4, n)] (pre from column PRE(n) = M + 1, comb[i, :] from column COMB(n) + n*i = M + 2n + 1 + n*i).
    FN: fn [M, n*C] (row stride
    stride_fn), read once per program. num_warps: the compute warps (4 * WARPS_C); the load and the store warp
    come on top."""
    BLOCK_T: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_C: gl.constexpr = x_desc.block_type.shape[2]
    M: gl.constexpr = 2 * N + N * N
    KC: gl.constexpr = (M + K_STEP - 1) // K_STEP
    dtype: gl.constexpr = x_desc.dtype
    tile: gl.constexpr = flat_layout(x_desc.layout)

    bufs = (gl.allocate_shared_memory(dtype, [N, BLOCK_T, BLOCK_C], tile),                        # X_i
            gl.allocate_shared_memory(dtype, [N, BLOCK_T, BLOCK_C], tile),                        # dY_j
            gl.allocate_shared_memory(dtype, [BLOCK_T, BLOCK_C], du_desc.layout),                 # dU
            gl.allocate_shared_memory(gl.float32, [N + 1] + st_desc.block_type.shape, st_desc.layout),  # pre, comb
            gl.allocate_shared_memory(gl.float32, s_desc.block_type.shape, s_desc.layout),        # s
            gl.allocate_shared_memory(gl.float32, [KC] + dz_desc.block_type.shape, dz_desc.layout),  # dz
            gl.allocate_shared_memory(dtype, [2, BLOCK_T, BLOCK_C], tile),                        # dX staging
            gl.allocate_shared_memory(gl.float32, [N * KC, BLOCK_C, K_STEP], fn_layout(BLOCK_C)))  # fn^T
    # head_*: a block's top-of-block group; x_*: stream i's group; out_*: the staging tiles. *_ready are completed
    # by the TMA loads (out_ready: by the compute warps), *_empty by the warps done with the slots
    bars = (_barriers(1), _barriers(1), _barriers(N), _barriers(N), _barriers(2), _barriers(2))

    pid = gl.program_id(0)
    c0 = (pid % columns) * BLOCK_C
    first = (pid // columns) * blocks_per_split
    blocks = gl.minimum(blocks_per_split, token_blocks - first)

    # fn[m, i*C + c] for the chunk's columns, every stream; logits past M and columns past C zero (as _dx_kernel
    # masks them: the zero logits meet dz's zero columns). Every chunk is loaded before any is stored: Triton puts a
    # CTA barrier between stores into one allocation, and loads issued after it would wait a round trip each.
    fn_bufs = bufs[7]
    FL: gl.constexpr = fn_load_layout(num_warps, BLOCK_C)
    k = gl.arange(0, K_STEP, layout=gl.SliceLayout(1, FL))
    c = c0 + gl.arange(0, BLOCK_C, layout=gl.SliceLayout(0, FL))
    chunks = ()
    for i in gl.static_range(N):
        for kc in gl.static_range(KC):
            m = kc * K_STEP + k
            chunks = chunks + (gl.load(FN + m[:, None] * stride_fn + i * C + c[None, :],
                                       mask=(m < M)[:, None] & (c < C)[None, :], other=0.0),)
    for q in gl.static_range(N * KC):
        fn_bufs.index(q).store(gl.permute(chunks[q], [1, 0]))
    fence_async_shared()  # the wgmma reads fn through the async proxy
    cta_barrier()

    descs = (x_desc, dy_desc, du_desc, dx_desc, dz_desc, s_desc, st_desc)
    # the default partition returns nothing (the one convention triton 3.6 and 3.7+ share); worker_num_regs given
    # (required by 3.6)
    gl.warp_specialize([
        (_dx_compute, (descs, bufs, bars, c0, first, blocks, N, WGMMA, WARPS_C)),
        (_dx_load, (descs, bufs, bars, c0, first, blocks, N)),
        (_dx_store, (descs, bufs, bars, c0, first, blocks, N)),
    ], [1, 1], [WORKER_REGS, WORKER_REGS])

    for g in gl.static_range(6):
        _invalidate(bars[g])


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DxConfig:
    """Launch shape of the Gluon kernel B. Not yet measured on a GPU: chosen from sm_90 builds (triton 3.6 and
    3.8) to keep the compute warps' registers under their 240 without spills and the program's shared memory
    under sm_90's 227 KB (tests/test_gluon_builds.py prints both)."""
    block_c: Optional[int] = None  # columns per stream and program; None: 64 for n <= 4, 32 for n = 8 (n = 8's fn
    #                                columns, 80 logits x 8 streams in FP32, take 80 KB of shared memory at 32)
    warps_c: int = 2               # compute warps along the columns (4 along the tokens): 8 compute warps, with
    #                                the load and the store warp 12 warps (a warpgroup's worth for the two)
    per_sm: int = 1                # programs per SM (12 warps at 168 registers fill the register file)

    def resolve(self, n: int, C: int) -> "DxConfig":
        """This config for n streams of C columns: the default width for n, never wider than C needs (nor narrower
        than 8 columns per warp: an MMA tile)."""
        block_c = self.block_c or (32 if n > 4 else 64)
        return DxConfig(max(8 * self.warps_c, min(block_c, 1 << (C - 1).bit_length())), self.warps_c, self.per_sm)

    @staticmethod
    def candidates(n: int):
        """The other launch shapes worth timing at n streams (python -m cakeops.bench.gluon_dx --sweep), each built
        for sm_90 without spills and within its shared memory by tests/test_gluon_builds.py: wider column tiles at
        n = 2 (140 KB), narrower ones at n = 4 and 8 (n = 8 at 64 columns would need 360 KB; 4 compute warps
        spill at n = 8 and hold 255 registers at n = 4)."""
        return {2: (DxConfig(block_c=128),), 4: (DxConfig(block_c=32),), 8: (DxConfig(block_c=16),)}[n]


def _layout(block, dtype: torch.dtype):
    """The NVMMA shared layout (the widest swizzle the box's rows allow) of a TMA box of ``block``."""
    return _layout_of(tuple(block), dtype)


@functools.lru_cache(maxsize=None)  # per call of the launcher, on the host path
def _layout_of(block: tuple, dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16,
                                                              torch.float32: gl.float32}[dtype])


def _aligned(t: torch.Tensor, *strides: int) -> bool:
    return t.data_ptr() % 16 == 0 and all(s * t.element_size() % 16 == 0 for s in strides)


def takes(X: torch.Tensor, dY: torch.Tensor, dU: torch.Tensor, stats: torch.Tensor, dz: torch.Tensor,
          dX: torch.Tensor) -> bool:
    """Whether TMA can address these tensors as the kernel does: 16-byte aligned bases and row strides (the
    launcher's other assumptions, unit stride along C and along the stats rows, are mhc_backward_finish's)."""
    return (_aligned(X, X.stride(0), X.stride(1)) and _aligned(dY, dY.stride(0), dY.stride(1))
            and _aligned(dX, dX.stride(0), dX.stride(1)) and _aligned(dU, dU.stride(0))
            and _aligned(stats, stats.stride(0)) and _aligned(dz))


class _Plan:
    """The grid and the descriptors' boxes of one call (host arithmetic only)."""

    def __init__(self, T: int, n: int, C: int, device: torch.device, cfg: DxConfig):
        self.block_c = cfg.block_c
        self.columns = cdiv(C, cfg.block_c)
        self.token_blocks = cdiv(T, TOKENS)
        programs = persistent_programs(device, self.columns * self.token_blocks, cfg.per_sm)
        splits = max(1, min(programs // self.columns, self.token_blocks))
        self.blocks_per_split = cdiv(self.token_blocks, splits)
        self.grid = (self.columns * cdiv(self.token_blocks, self.blocks_per_split),)


# _dx_load restates the record's columns (a Gluon kernel calls no Triton constexpr function): they must agree
def _columns_agree() -> bool:
    from .._triton import mhc_columns as cols
    return all(cols.PRE(n) == 1 + 2 * n + n * n and cols.COMB(n) == cols.PRE(n) + 2 * n for n in (2, 4, 8))


_COLUMNS_AGREE = _columns_agree()
assert _COLUMNS_AGREE, "_dx_load's stats columns differ from cakeops/_triton/mhc_columns.py"


def descriptors(X, dY, dU, dX, dz, stats, n: int, block_c: int):
    """The kernel's seven TMA descriptors (its argument order): X, dY, dU, dX, dz's logits, s, the stats boxes."""
    T, _, C = X.shape
    M, m_pad = 2 * n + n * n, logits_pad(n)
    box = [TOKENS, 1, block_c]
    data = _layout(box, X.dtype)
    coef = [TOKENS, max(COEF_MIN, n)]

    def streams(t):
        return TensorDescriptor(t, [T, n, C], [t.stride(0), t.stride(1), 1], box, data)

    return (streams(X), streams(dY),
            TensorDescriptor(dU, [T, C], [dU.stride(0), 1], [TOKENS, block_c], _layout([TOKENS, block_c], X.dtype)),
            streams(dX),
            # dz's shape ends at column M: the boxes read zeros past it
            TensorDescriptor(dz, [T, M], [m_pad, 1], [TOKENS, K_STEP.value], _layout([TOKENS, K_STEP.value],
                                                                                     torch.float32)),
            TensorDescriptor(dz, [T, m_pad], [m_pad, 1], [TOKENS, COEF_MIN], _layout([TOKENS, COEF_MIN],
                                                                                   torch.float32)),
            TensorDescriptor(stats, [T, stats.shape[1]], [stats.stride(0), 1], coef, _layout(coef, torch.float32)))


def dx(X: torch.Tensor, dY: torch.Tensor, dU: torch.Tensor, fn: torch.Tensor, stats: torch.Tensor,
       dz: torch.Tensor, dX: torch.Tensor, config: Optional[DxConfig] = None) -> None:
    """Writes dX [T, n, C] (X.dtype, bf16 or fp16) from X, dY [T, n, C], dU [T, C], fn [M, n*C] (FP32, unit
    column stride), the stats record [T, S] and kernel A's dz rows (FP32, T * logits_pad(n) elements, row-major:
    the logits, then s at column M): what backward_finish gives ``_dx_kernel``. T > 0; ``takes`` holds."""
    T, n, C = X.shape
    cfg = (config or DxConfig()).resolve(n, C)
    plan = _Plan(T, n, C, X.device, cfg)
    descs = descriptors(X, dY, dU, dX, dz.view(T, logits_pad(n)), stats, n, cfg.block_c)
    _dx_gluon_kernel[plan.grid](*descs, fn, C, fn.stride(0), plan.columns, plan.blocks_per_split,
                                plan.token_blocks, N=n, WGMMA=n > 4, WARPS_C=cfg.warps_c, num_warps=4 * cfg.warps_c)
