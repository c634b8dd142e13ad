"""mHC one-pass stream kernels: forward_finish (mix the streams back with the branch output), forward_prepare's
collapse U, and the head (the model's final collapse) with its backward. Memory-bound: one program per
(token, C block), 16-byte accesses, the per-token coefficients (pre, post, comb) read from the stats record.

Every kernel runs on a 1-D grid with a token's C blocks consecutive, so programs launched together cover whole
rows (H200, bf16, T=16384, C=4096: head backward 175 -> 166 us, the collapse and head forward 164 -> 161 us
against the 2-D (token, C block) grid; finish unchanged at 300 us), and T is not bound by the 65535 limit of a
grid's second dimension.

FP32 inside, streams summed in order, every output rounded once. Launchers do no argument validation;
X / Y / dX are [T, n, C] with unit stride along C and any token / stream strides.
"""
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .fast_launch import fast
from .mhc_columns import POST, COMB, STATS_WIDTH
from .launch import cdiv, next_power_of_2


@triton.jit
def _token_and_columns(c_blocks, BLOCK_C: tl.constexpr):
    """This program's token (int64) and column offsets on the 1-D grid of T * c_blocks programs."""
    pid = tl.program_id(0).to(tl.int64)
    return pid // c_blocks, (pid % c_blocks) * BLOCK_C + tl.arange(0, BLOCK_C)


@triton.jit
def _mix_in(y, comb, x):
    """y + comb * x as one explicit fused multiply-add per element of y (comb and x broadcast to y's shape: the
    finish kernel's [N, 1] x [1, BLOCK_C] tile, the rebuild kernel's scalar x row). Written as ``y += a * b`` the
    compiler may fuse either product of ``post * B + comb_0 * x_0`` into the add, and which one it picks depends on
    the kernel's code around it and on its specialization (C divisible by 16 or not, Inductor's build or Triton's):
    forward_finish and the rebuild kernel then differed in the last bit (H200, n = 2, C = 16). An explicit fma
    leaves the compiler no choice, so both kernels round alike wherever they are built."""
    return tl.fma(tl.broadcast_to(comb, y.shape), tl.broadcast_to(x, y.shape), y)


@triton.jit
def _finish_kernel(
    X, B, STATS, Y, C, stride_xt, stride_xi, stride_bt, stride_yt, stride_yi, c_blocks,
    N: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One (token, C block): Y[j, c] = post_j * B[c] + sum_i comb[i, j] * X[i, c], streams in order."""
    t, c = _token_and_columns(c_blocks, BLOCK_C)
    c_ok = c < C
    j = tl.arange(0, N)
    s_row = STATS + t * STATS_WIDTH(N)
    b = tl.load(B + t * stride_bt + c, mask=c_ok, other=0.0).to(tl.float32)
    y = tl.load(s_row + POST(N) + j)[:, None] * b[None, :]
    for i in tl.static_range(N):
        x = tl.load(X + t * stride_xt + i * stride_xi + c, mask=c_ok, other=0.0).to(tl.float32)
        y = _mix_in(y, tl.load(s_row + COMB(N) + i * N + j)[:, None], x[None, :])
    tl.store(Y + t * stride_yt + j[:, None] * stride_yi + c[None, :], y.to(Y.dtype.element_ty),
             mask=c_ok[None, :])


@triton.jit
def _rebuild_kernel(
    X0, B0, B_PTRS, B_STRIDES, S_PTRS, Y, Y_PTRS, C, K, stride_xt, stride_xi, stride_yt, stride_yi, c_blocks,
    N: tl.constexpr, EVERY: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """One (token, C block) of K forward_finishes in a row from X0 (stream recompute): layer l's branch output
    and record at the addresses B_PTRS[l] (row stride B_STRIDES[l], B0's dtype) and S_PTRS[l]. Each layer's
    arithmetic is _finish_kernel's per element, in its order (post_j * B, then one fma per input stream), and its
    streams are rounded as finish stores them, so the result is bitwise the K-th finish's output. The streams are
    held as N separate rows, each output row formed from the input rows with the record's coefficients as scalars:
    no reduction across a tile's stream axis per layer (the [N, BLOCK_C] tile form extracted each input row with a
    sum across threads; H100, n = 4, 5 layers: 65-75 % of copy). EVERY: every layer's streams are stored, layer
    l's at Y_PTRS[l] (Y's dtype and strides), not only the last's at Y -- a whole group rebuilt in one pass."""
    t, c = _token_and_columns(c_blocks, BLOCK_C)
    c_ok = c < C
    xs = ()
    for i in tl.static_range(N):
        xs = xs + (tl.load(X0 + t * stride_xt + i * stride_xi + c, mask=c_ok, other=0.0).to(tl.float32),)
    for layer in range(K):
        b_at = tl.load(B_PTRS + layer).to(tl.pointer_type(B0.dtype.element_ty))
        s_row = tl.load(S_PTRS + layer).to(tl.pointer_type(tl.float32)) + t * STATS_WIDTH(N)
        b = tl.load(b_at + t * tl.load(B_STRIDES + layer) + c, mask=c_ok, other=0.0).to(tl.float32)
        ys = ()
        for j in tl.static_range(N):
            y = tl.load(s_row + POST(N) + j) * b
            for i in tl.static_range(N):
                y = _mix_in(y, tl.load(s_row + COMB(N) + i * N + j), xs[i])
            ys = ys + (y.to(Y.dtype.element_ty).to(tl.float32),)
        xs = ys
        if EVERY:
            y_at = tl.load(Y_PTRS + layer).to(tl.pointer_type(Y.dtype.element_ty))
            for j in tl.static_range(N):
                tl.store(y_at + t * stride_yt + j * stride_yi + c, xs[j].to(Y.dtype.element_ty), mask=c_ok)
    if not EVERY:
        for j in tl.static_range(N):
            tl.store(Y + t * stride_yt + j * stride_yi + c, xs[j].to(Y.dtype.element_ty), mask=c_ok)


@triton.jit
def _collapse_kernel(X, STATS, Y, C, stride_xt, stride_xi, stride_yt, stride_st, c_blocks,
                     N: tl.constexpr, WEIGHTED: tl.constexpr, BLOCK_C: tl.constexpr):
    """WEIGHTED: Y = sum_i pre_i * X_i, pre_i at column i of STATS' rows (stride_st floats apart; STATS points at
    the first gate of the record: the mHC stats' PRE column for forward_prepare's collapse U, the gated head's GATE,
    meta/mhc_head_layout.py); else the
    head, Y = ((0 + X0) + X1) + ... + X_{n-1}) / n: the order and the one rounding of X.mean(dim=1)."""
    t, c = _token_and_columns(c_blocks, BLOCK_C)
    c_ok = c < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in tl.static_range(N):
        x = tl.load(X + t * stride_xt + i * stride_xi + c, mask=c_ok, other=0.0).to(tl.float32)
        if WEIGHTED:
            acc += tl.load(STATS + t * stride_st + i) * x
        else:
            acc += x
    if not WEIGHTED:
        acc = tl.div_rn(acc, N * 1.0)
    tl.store(Y + t * stride_yt + c, acc.to(Y.dtype.element_ty), mask=c_ok)


@triton.jit
def _head_backward_kernel(DY, DX, C, stride_dyt, stride_dxt, stride_dxi, c_blocks,
                          N: tl.constexpr, ACCUMULATE: tl.constexpr, BLOCK_C: tl.constexpr):
    """dX[i, c] = round(dY[c] / n), or round(dX[i, c] + dY[c] / n) when accumulating."""
    t, c = _token_and_columns(c_blocks, BLOCK_C)
    c_ok = c < C
    g = tl.div_rn(tl.load(DY + t * stride_dyt + c, mask=c_ok, other=0.0).to(tl.float32), N * 1.0)
    i = tl.arange(0, N)
    ptrs = DX + t * stride_dxt + i[:, None] * stride_dxi + c[None, :]
    mask = c_ok[None, :] & (i < N)[:, None]
    if ACCUMULATE:
        dx = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) + g[None, :]
    else:
        dx = tl.broadcast_to(g[None, :], [N, BLOCK_C])
    tl.store(ptrs, dx.to(DX.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class StreamConfig:
    """Launch shape of the one-pass stream kernels (finish, the collapse U, the head and its backward): 16-byte
    accesses, up to 2048 columns per program (H200, bf16, C = 4096: 2048 measured 1-2% above 1024 for finish
    and head), a warp per 256 columns. ``block_c`` None: chosen from C by ``resolve``."""
    block_c: Optional[int] = None

    def resolve(self, C: int):
        """(BLOCK_C, num_warps) for rows of C columns."""
        block_c = self.block_c if self.block_c is not None else min(2048, next_power_of_2(C))
        return block_c, max(1, min(8, block_c // 256))

    @staticmethod
    def candidates():
        for block_c in (512, 1024, 4096):
            yield StreamConfig(block_c=block_c)


def finish(X: torch.Tensor, B: torch.Tensor, stats: torch.Tensor, Y: torch.Tensor, *,
           config: Optional[StreamConfig] = None) -> None:
    """Y[t, j, c] = round(post_j * B[t, c] + sum_i comb[i, j] * X[t, i, c]), FP32 inside."""
    T, n, C = X.shape
    if T == 0:
        return
    sx, sb, sy = X.stride(), B.stride(), Y.stride()
    assert sx[2] == 1 and sb[1] == 1 and sy[2] == 1 and stats.is_contiguous()
    block_c, warps = (config or StreamConfig()).resolve(C)
    c_blocks = cdiv(C, block_c)
    fast(_finish_kernel)[(T * c_blocks,)](
        X, B, stats, Y, C, sx[0], sx[1], sb[0], sy[0], sy[1], c_blocks,
        N=n, BLOCK_C=block_c, num_warps=warps,
    )


_HOST_TABLES: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_HOST_TABLES_KEPT = 64


def rebuild_table(Bs, stats_list, device, outputs=None) -> torch.Tensor:
    """The rebuild kernel's table of layers, int64 [3, K] on ``device``: the branch outputs' addresses and row
    strides, the records' addresses; with ``outputs`` (one tensor per layer: a whole group rebuilt) [4, K], their
    addresses last. Copied from pinned host memory, non-blocking: a pageable copy would wait for
    the GPU's queue (measured: +15 % on an eager step); made once per group, its first K' columns serve K' layers.

    The pinned host tables are kept by their contents (the last 64): a table is a function of the addresses it
    holds, and a compiled step allocates its buffers at the same addresses step after step, so each compiled
    rebuild (an op, no group to keep a table) finds its host side made. The device table is the caller's alone and
    dies with the rebuild: kept here, it would outlive the call in whatever memory pool was current when it was
    made -- under ``mode="reduce-overhead"`` the CUDA-graph pool, whose warm-up run then finds tensors it does not
    track ("Detected 3 tensor(s) in the cudagraph pool not tracked as outputs"). An evicted host table goes back to
    torch's pinned-memory cache, which hands a block out again only after the copies that read it completed."""
    rows = ((B.data_ptr() for B in Bs), (B.stride(0) for B in Bs), (s.data_ptr() for s in stats_list))
    if outputs is not None:
        rows += ((Y.data_ptr() for Y in outputs),)
    rows = tuple(tuple(row) for row in rows)
    is_cuda = torch.device(device).type == "cuda"
    key = (is_cuda, rows)  # only a pinned table is copied non-blocking
    host = _HOST_TABLES.get(key)
    if host is None:
        host = torch.tensor(rows, dtype=torch.int64, pin_memory=is_cuda)
        _HOST_TABLES[key] = host
        if len(_HOST_TABLES) > _HOST_TABLES_KEPT:
            _HOST_TABLES.popitem(last=False)
    else:
        _HOST_TABLES.move_to_end(key)
    return host.to(device, non_blocking=True) if is_cuda else host.clone()


@dataclass(frozen=True)
class RebuildConfig:
    """Launch shape of the rebuild kernel: ``elements`` stream values (n * BLOCK_C) per program, held in registers
    through every layer; ``warps`` None: a warp per 256 columns, at most 8, and in the every-layer form at least a
    warp per 1024 stream values. The default measured best or level among ``candidates`` on the H200 (K = 4, bf16;
    n = 4, T=16384 C=4096: 658 us against 803 at 8192 elements). The every-layer bound is n = 8's: its rows and
    the stored ones at 64 values a thread took 201 registers (sm_90, triton 3.6; 10 warps per SM), and 4 warps
    instead of 2 were 8 % faster on the H100 (T=8192 C=2048, 4 layers: 743 against 808 us); chained, where 2 warps
    hold 128 registers, 4 were 8 % slower (416 against 386 us), docs/perf.md."""
    elements: int = 4096
    warps: Optional[int] = None

    def resolve(self, C: int, n: int, every: bool = False):
        block_c = min(2048, next_power_of_2(C), max(1, self.elements // n))
        warps = max(block_c // 256, n * block_c // 1024) if every else block_c // 256
        return block_c, self.warps or max(1, min(8, warps))

    @staticmethod
    def candidates():
        for elements, warps in ((4096, None), (4096, 4), (8192, 4), (8192, 16), (16384, 8), (2048, 2)):
            yield RebuildConfig(elements, warps)


def rebuild(X0: torch.Tensor, Bs, stats_list, Y, table: Optional[torch.Tensor] = None, *,
            config: Optional[RebuildConfig] = None) -> None:
    """Y = the streams after len(Bs) forward_finishes of X0 with the branch outputs ``Bs`` ([T, C], one dtype,
    unit stride along C) and records ``stats_list`` (contiguous), in one pass: bitwise the chained finishes.
    Y a list of len(Bs) tensors of one dtype and strides: Y[l] = the streams after l + 1 finishes (a whole group,
    each layer written once). ``table``: ``rebuild_table`` of these layers (or of a longer run starting with
    them; with the outputs where Y is a list), else made here. The table is a device tensor: not capturable in a
    CUDA graph (the caller chains ``finish`` there)."""
    T, n, C = X0.shape
    if T == 0 or not Bs:
        return
    every = not isinstance(Y, torch.Tensor)
    outputs = list(Y) if every else [Y]
    assert not every or len(outputs) == len(Bs)
    assert len({(Yl.dtype, Yl.stride()) for Yl in outputs}) == 1
    assert X0.stride(2) == 1 and outputs[0].stride(2) == 1 and all(B.stride(1) == 1 for B in Bs)
    assert all(s.is_contiguous() for s in stats_list) and len({B.dtype for B in Bs}) == 1
    if table is None:
        table = rebuild_table(Bs, stats_list, X0.device, outputs if every else None)
    block_c, warps = (config or RebuildConfig()).resolve(C, n, every)
    c_blocks = cdiv(C, block_c)
    Y0 = outputs[0]
    fast(_rebuild_kernel)[(T * c_blocks,)](
        X0, Bs[0], table[0], table[1], table[2], Y0, table[3] if every else table[0], C, len(Bs),
        X0.stride(0), X0.stride(1), Y0.stride(0), Y0.stride(1), c_blocks,
        N=n, EVERY=every, BLOCK_C=block_c, num_warps=warps,
    )


def head_forward(X: torch.Tensor, Y: torch.Tensor, *, config: Optional[StreamConfig] = None) -> None:
    """Y[t, c] = round((((X0 + X1) + ...) + X_{n-1}) / n), summed in FP32 from zero: bitwise X.mean(dim=1) on a
    GPU."""
    _collapse(X, None, Y, config)


def collapse(X: torch.Tensor, stats: torch.Tensor, U: torch.Tensor, gates: int, *,
             config: Optional[StreamConfig] = None) -> None:
    """U[t, c] = round(sum_i pre_i * X[t, i, c]), FP32 inside, pre_i at column ``gates`` + i of a record row (the
    mHC stats' PRE(n), or the gated head's record's GATE)."""
    assert stats.stride(1) == 1
    _collapse(X, stats[:, gates:], U, config)


def _collapse(X, stats, Y, config):
    T, n, C = X.shape
    if T == 0:
        return
    sx, sy = X.stride(), Y.stride()
    assert sx[2] == 1 and sy[1] == 1
    block_c, warps = (config or StreamConfig()).resolve(C)
    c_blocks = cdiv(C, block_c)
    fast(_collapse_kernel)[(T * c_blocks,)](
        X, Y if stats is None else stats, Y, C, sx[0], sx[1], sy[0],
        0 if stats is None else stats.stride(0), c_blocks,
        N=n, WEIGHTED=stats is not None, BLOCK_C=block_c, num_warps=warps,
    )


def head_backward(dY: torch.Tensor, dX: torch.Tensor, accumulate: bool, *,
                  config: Optional[StreamConfig] = None) -> None:
    """dX[t, i, c] = round(dY[t, c] / n); with accumulate, dX = round(dX + dY / n) in FP32."""
    T, n, C = dX.shape
    if T == 0:
        return
    assert dY.shape == (T, C) and dY.stride(1) == 1 and dX.stride(2) == 1
    block_c, warps = (config or StreamConfig()).resolve(C)
    c_blocks = cdiv(C, block_c)
    fast(_head_backward_kernel)[(T * c_blocks,)](
        dY, dX, C, dY.stride(0), dX.stride(0), dX.stride(1), c_blocks,
        N=n, ACCUMULATE=bool(accumulate), BLOCK_C=block_c, num_warps=warps,
    )
