"""RMSNorm (optionally fused with a residual add) forward and backward kernels, and their launchers.

Rows are tiled [ROWS, BLOCK]: a row of up to BLOCK elements is read from HBM once and kept in registers;
wider rows (NUM_CHUNKS > 1) are walked twice, the second pass served mostly by L2.
All statistics and accumulations are FP32; each output is rounded once.
"""
import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .fast_launch import fast
from .launch import cdiv, next_power_of_2, persistent_programs, tile_config
from .partials import ROUNDS_TO_NEAREST, sum_partials  # noqa: F401 - the ops read ROUNDS_TO_NEAREST here


@triton.jit
def _rstd(sum_sq, width, eps):
    # IEEE sqrt and division, as the reference computes them: no fast-math approximations.
    return tl.div_rn(1.0, tl.sqrt_rn(sum_sq / width + eps))


@triton.jit
def _load_normalized_input(X, R, H_OUT, offs_x, offs_r, offs_h, mask, HAS_RESIDUAL: tl.constexpr,
                           KEEP_X: tl.constexpr):
    """The tensor that is normalized, in FP32: x, or round(x + residual), which is also stored as h_new.
    ``KEEP_X``: ask L2 to keep x (the chunked walk reads it again)."""
    if KEEP_X:
        x = tl.load(X + offs_x, mask=mask, other=0.0, eviction_policy="evict_last").to(tl.float32)
    else:
        x = tl.load(X + offs_x, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + offs_r, mask=mask, other=0.0).to(tl.float32)
        h = (x + r).to(H_OUT.dtype.element_ty)
        tl.store(H_OUT + offs_h, h, mask=mask)
        x = h.to(tl.float32)
    return x


@triton.jit
def _rmsnorm_fwd_kernel(
    X, R, W, Y, H_OUT, RSTD,
    T, H, stride_x, stride_r, stride_y, stride_h, eps,
    HAS_RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
):
    # eps arrives as FP32 from Triton's launcher, as FP64 from Inductor's (a traced launch): one FP32 either way
    eps = tl.cast(eps, tl.float32)
    row_ids = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = row_ids < T
    rows = row_ids.to(tl.int64)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    if NUM_CHUNKS == 1:
        mask = row_ok[:, None] & (cols < H)
        h = _load_normalized_input(X, R, H_OUT, rows * stride_x + cols, rows * stride_r + cols,
                                   rows * stride_h + cols, mask, HAS_RESIDUAL, False)
        rstd = _rstd(tl.sum(h * h, axis=1), H, eps)
        w = tl.load(W + cols, mask=cols < H, other=0.0).to(tl.float32)
        tl.store(Y + rows * stride_y + cols, ((h * rstd[:, None]) * w).to(Y.dtype.element_ty), mask=mask)
    else:
        # Two passes over the row, as Inductor's looped reduction: the first asks L2 to keep x for the second
        # (with a residual, h_new is re-read from its store), the second lets it go and keeps w, which every row
        # reads; the squares summed as a vector, reduced across threads once (H200, T=16384 H=8192, 2026-12-02:
        # with a reduction per chunk and no hints 134.9 us at best, as now 128.9)
        sum_sq = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
        for k in range(NUM_CHUNKS):
            c = cols + k * BLOCK
            mask = row_ok[:, None] & (c < H)
            h = _load_normalized_input(X, R, H_OUT, rows * stride_x + c, rows * stride_r + c,
                                       rows * stride_h + c, mask, HAS_RESIDUAL, not HAS_RESIDUAL)
            sum_sq += h * h
        rstd = _rstd(tl.sum(sum_sq, axis=1), H, eps)
        for k in range(NUM_CHUNKS):
            c = cols + k * BLOCK
            mask = row_ok[:, None] & (c < H)
            src = H_OUT + rows * stride_h + c if HAS_RESIDUAL else X + rows * stride_x + c
            h = tl.load(src, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            w = tl.load(W + c, mask=c < H, other=0.0, eviction_policy="evict_last").to(tl.float32)
            tl.store(Y + rows * stride_y + c, ((h * rstd[:, None]) * w).to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + row_ids, rstd, mask=row_ok)


@triton.jit
def _dx_row_tile(g, x, w, rstd, width):
    """dx = rstd*g*w - x*rstd^3*mean(g*w*x) on a [ROWS, BLOCK] tile (FP32)."""
    gw = g * w
    c1 = tl.sum(gw * x, axis=1) / width
    return rstd[:, None] * gw - x * (rstd * rstd * rstd * c1)[:, None]


@triton.jit
def _load_bwd_rows(G, X, RSTD, GRES, block, T, H, stride_g, stride_x, stride_gres, cols,
                   HAS_GRES: tl.constexpr, ROWS: tl.constexpr):
    """(g, x, rstd, g_residual or 0) of one row block in FP32; rows past T read as zeros (no traffic)."""
    rows = block * ROWS + tl.arange(0, ROWS)
    row_ok = rows < T
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    rows = rows.to(tl.int64)[:, None]
    mask = row_ok[:, None] & (cols < H)
    g = tl.load(G + rows * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_GRES:
        gres = tl.load(GRES + rows * stride_gres + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        gres = tl.zeros_like(g)
    return g, x, rstd, gres


@triton.jit
def _rmsnorm_bwd_kernel(
    G, X, W, RSTD, GRES, DX, DW_OUT,
    T, H, stride_g, stride_x, stride_gres, stride_dx, stride_dw,
    HAS_GRES: tl.constexpr, ATOMIC_DW: tl.constexpr,
    ROWS: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
):
    """Persistent over row blocks; each program sums its rows' dw in a fixed order, then either stores
    that partial in its own workspace row (deterministic) or adds it atomically into dw (fast)."""
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_blocks = tl.cdiv(T, ROWS)
    cols = tl.arange(0, BLOCK)[None, :]
    if NUM_CHUNKS == 1:
        col_ok = cols < H
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        # The next row block is loaded before this one is reduced and stored: a row's dx needs its whole
        # row first, so without the prefetch each program would idle for a full HBM latency per block.
        block = pid
        g, x, rstd, gres = _load_bwd_rows(G, X, RSTD, GRES, block, T, H, stride_g, stride_x, stride_gres, cols,
                                          HAS_GRES, ROWS)
        for _ in range(pid, num_blocks, num_programs):
            nxt = block + num_programs
            g_n, x_n, rstd_n, gres_n = _load_bwd_rows(G, X, RSTD, GRES, nxt, T, H, stride_g, stride_x,
                                                      stride_gres, cols, HAS_GRES, ROWS)
            rows = block * ROWS + tl.arange(0, ROWS)
            mask = (rows < T)[:, None] & col_ok
            dx = _dx_row_tile(g, x, w, rstd, H) + gres
            tl.store(DX + rows.to(tl.int64)[:, None] * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
            dw += tl.sum(g * x * rstd[:, None], axis=0)
            g, x, rstd, gres, block = g_n, x_n, rstd_n, gres_n, nxt
        dw_cols = tl.arange(0, BLOCK)
        if ATOMIC_DW:
            tl.atomic_add(DW_OUT + dw_cols, dw, mask=dw_cols < H)
        else:
            tl.store(DW_OUT + pid * stride_dw + dw_cols, dw, mask=dw_cols < H)
    else:
        # Wide rows: two passes per row; the program's dw partial lives in its own workspace row.
        for block in range(pid, num_blocks, num_programs):
            row = block
            rstd = tl.load(RSTD + row)
            row = row.to(tl.int64)
            c1 = tl.zeros([1], dtype=tl.float32)
            for k in range(NUM_CHUNKS):
                c = cols + k * BLOCK
                g, x, w, m = _load_wide_chunk(G, X, W, row, stride_g, stride_x, c, H)
                c1 += tl.sum(g * w * x, axis=1)
            c1 = c1 / H
            for k in range(NUM_CHUNKS):
                c = cols + k * BLOCK
                g, x, w, m = _load_wide_chunk(G, X, W, row, stride_g, stride_x, c, H)
                dx = rstd * g * w - x * (rstd * rstd * rstd * c1)[:, None]
                if HAS_GRES:
                    dx += tl.load(GRES + row * stride_gres + c, mask=m, other=0.0).to(tl.float32)
                tl.store(DX + row * stride_dx + c, dx.to(DX.dtype.element_ty), mask=m)
                part = DW_OUT + pid * stride_dw + c
                tl.store(part, tl.load(part, mask=m, other=0.0) + g * x * rstd, mask=m)


@triton.jit
def _load_wide_chunk(G, X, W, row, stride_g, stride_x, c, H):
    """One chunk of a wide row's g, x, w (FP32) and its mask: both passes of the wide-row backward read it."""
    m = c < H
    g = tl.load(G + row * stride_g + c, mask=m, other=0.0).to(tl.float32)
    x = tl.load(X + row * stride_x + c, mask=m, other=0.0).to(tl.float32)
    w = tl.load(W + c, mask=m, other=0.0).to(tl.float32)
    return g, x, w, m


# Launched through the per-specialization cache (fast_launch.py): all arguments positional, in signature order.
_fwd_launch = fast(_rmsnorm_fwd_kernel)
_bwd_launch = fast(_rmsnorm_bwd_kernel)


# The forward (without a residual) keeps rows up to FORWARD_WHOLE_ROW elements whole in registers and walks wider
# ones in at least two chunks of up to FORWARD_CHUNK, 16 B per thread: level with or ahead of Inductor's looped
# reduction at H = 4096-16384, T = 8192-32768, where whole rows were 1-9 % slower (H200, bf16, 2026-12-02: T=16384
# H=4096 67.7 us against 70.3, H=8192 128.9 against 133.1; the table is in docs/perf.md, eleventh session).
FORWARD_WHOLE_ROW = 2048
FORWARD_CHUNK = 4096


@dataclass(frozen=True)
class RMSNormConfig:
    """Row tiles of the RMSNorm kernels (``launch.tile_config``): elements per program and bytes per thread of
    each tensor. Measured on an H200 (bf16, H = 4096 to 16384): forward rows up to 2048 elements whole, 16K
    elements per program and 128 B per thread; wider rows walked twice in two or more chunks of up to 4096
    elements (16 B per thread: 8 warps at H = 4096, 16 past it), as Inductor's looped reduction; with the
    residual, 8K and 32 B (three streams in flight instead of two) and rows up to 16384 whole; backward 4K and
    32 B (16 elements per thread) with 16 warps per SM: 2 programs of 8 warps or 1 of 16. None: these defaults."""
    tile_elems: Optional[int] = None
    thread_bytes: Optional[int] = None
    warps_per_sm: int = 16  # backward: resident warps per SM of the persistent grid
    max_tile: Optional[int] = None  # widest row kept whole in registers; wider rows are walked twice in chunks

    def forward_tile(self, H: int, elem_bytes: int, has_residual: bool):
        """(ROWS, BLOCK, NUM_CHUNKS, num_warps) of the forward."""
        if has_residual:
            tile, thread, widest = 8192, 32, 16384
        elif next_power_of_2(H) > FORWARD_WHOLE_ROW:
            chunk = min(FORWARD_CHUNK, next_power_of_2(H) // 2)
            tile, thread, widest = chunk, 16, chunk
        else:
            tile, thread, widest = 16384, 128, 16384
        return tile_config(H, elem_bytes, tile_elems=self.tile_elems or tile, thread_bytes=self.thread_bytes or thread,
                           max_tile=self.max_tile or widest)

    def backward_shape(self, device: torch.device, T: int, H: int, elem_bytes: int):
        """(ROWS, BLOCK, NUM_CHUNKS, num_warps, programs) of the persistent backward."""
        rows, block, chunks, warps = tile_config(H, elem_bytes, tile_elems=self.tile_elems or 4096,
                                                 thread_bytes=self.thread_bytes or 32, max_tile=self.max_tile or 16384)
        programs = persistent_programs(device, cdiv(max(T, 1), rows), per_sm=max(1, self.warps_per_sm // warps))
        return rows, block, chunks, warps, programs

    @staticmethod
    def candidates():
        # rows up to 16384 whole in registers (the forward's default until 2026-12-02)
        for tile, thread in ((4096, 32), (8192, 32), (8192, 64), (16384, 64), (16384, 128)):
            yield RMSNormConfig(tile_elems=tile, thread_bytes=thread, max_tile=16384)
        # one row per program walked in chunks of other shapes (the default: FORWARD_CHUNK above)
        for chunk, thread in ((2048, 8), (2048, 16), (4096, 8), (4096, 16), (4096, 32)):
            yield RMSNormConfig(tile_elems=chunk, thread_bytes=thread, max_tile=chunk)


@functools.lru_cache(maxsize=None)
def _default_forward_tile(H: int, elem_bytes: int, has_residual: bool):
    # The tile depends on (H, dtype, residual) only: worked out once per layer shape, not per call.
    return RMSNormConfig().forward_tile(H, elem_bytes, has_residual)


def forward(x: torch.Tensor, w: torch.Tensor, eps: float, y: torch.Tensor, rstd: torch.Tensor,
            residual: Optional[torch.Tensor] = None, h_out: Optional[torch.Tensor] = None, *,
            config: Optional[RMSNormConfig] = None, device: Optional[int] = None) -> None:
    """x, residual [T, H] with unit column stride; writes y [T, H], rstd [T] and, with residual, h_out.
    ``device``: the current CUDA device where the caller has read it (None: the launch asks)."""
    T, H = x.shape
    if T == 0:
        return
    has_res = residual is not None
    if config is None:
        rows, block, chunks, warps = _default_forward_tile(H, x.element_size(), has_res)
    else:
        rows, block, chunks, warps = config.forward_tile(H, x.element_size(), has_res)
    sx, sy = x.stride(0), y.stride(0)
    if has_res:
        r, h, sr, sh = residual, h_out, residual.stride(0), h_out.stride(0)
    else:  # R and H_OUT are never read or written: any valid pointers
        r, h, sr, sh = x, y, sx, sy
    _fwd_launch((cdiv(T, rows),), (
        x, r, w, y, h, rstd, T, H, sx, sr, sy, sh, eps,
        has_res, rows, block, chunks,  # HAS_RESIDUAL, ROWS, BLOCK, NUM_CHUNKS
    ), warps, device)


@functools.lru_cache(maxsize=4096)
def _default_backward_shape(device: torch.device, T: int, H: int, elem_bytes: int):
    # Worked out once per (device, sizes), not per call: the persistent grid reads the device's SM count besides
    # the tile. ``device`` is always a tensor's: a CUDA one carries its index, so no entry depends on which device
    # was current when it was made. Bounded: T may take many values.
    return RMSNormConfig().backward_shape(device, T, H, elem_bytes)


def workspace_rows(device: torch.device, T: int, H: int, elem_bytes: int = 2) -> int:
    """Rows of the FP32 [P, H] dw-partials workspace the deterministic backward uses for these sizes."""
    return RMSNormConfig().backward_shape(device, T, H, elem_bytes)[4]


def backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor, dx: torch.Tensor,
             dw: torch.Tensor, g_residual: Optional[torch.Tensor] = None, deterministic: bool = True,
             workspace: Optional[torch.Tensor] = None, accumulate_dw: bool = False, *,
             config: Optional[RMSNormConfig] = None, device: Optional[int] = None) -> None:
    """Writes dx [T, H] (one rounding, g_residual folded in) and dw [H] FP32 (or adds into it). A dw of another
    float dtype (not with accumulate_dw) receives the FP32 sum rounded once, by the fixed-order reduction itself
    (the same bits as ``dw_fp32.to(dtype)``, without a separate cast launch); the atomic path needs FP32.
    ``device``: the current CUDA device where the caller has read it (None: each launch asks)."""
    T, H = x.shape
    if T == 0:
        if not accumulate_dw:
            dw.zero_()
        return
    if config is None:
        rows, block, chunks, warps, programs = _default_backward_shape(x.device, T, H, x.element_size())
    else:
        rows, block, chunks, warps, programs = config.backward_shape(x.device, T, H, x.element_size())
    atomic = not deterministic and chunks == 1
    if dw.dtype != torch.float32 and (atomic or accumulate_dw):
        raise ValueError("backward: dw must be FP32 with atomics or accumulate_dw")
    if atomic:
        if not accumulate_dw:
            dw.zero_()
        target = dw
    else:
        need = programs * H
        if workspace is None or workspace.numel() < need:
            target = x.new_empty(programs, H, dtype=torch.float32)
        else:
            target = workspace[:need].view(programs, H)
        if chunks > 1:
            target.zero_()
    has_gres = g_residual is not None
    sg = g.stride(0)
    gres, sgres = (g_residual, g_residual.stride(0)) if has_gres else (g, sg)  # GRES unread without it
    _bwd_launch((programs,), (
        g, x, w, rstd, gres, dx, target, T, H,
        sg, x.stride(0), sgres, dx.stride(0), H,
        has_gres, atomic, rows, block, chunks,  # HAS_GRES, ATOMIC_DW, ROWS, BLOCK, NUM_CHUNKS
    ), warps, device)
    if not atomic:
        sum_partials(target, dw, accumulate_dw, device=device)
