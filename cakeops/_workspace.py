"""Caller-owned workspaces: a flat byte buffer that a launcher carves into the scratch tensors it would otherwise
allocate per call (FlashInfer's ``workspace=`` arguments; what CUDA-graph capture and static-buffer users need).

A workspace is a contiguous uint8 tensor on the op's device (as FlashInfer hands out; cakeops' earlier FP32
RMSNorm workspaces still serve) whose bytes are reinterpreted; regions start at multiples of ``ALIGN`` bytes.
"""
import functools
from typing import Sequence, Tuple

import torch

from . import _traced

ALIGN = 256  # bytes: every region starts at a multiple (cudaMalloc's alignment, so vector loads stay aligned)


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def layout_bytes(regions: Sequence[Tuple[Tuple[int, ...], torch.dtype]]) -> int:
    """Bytes of a workspace holding ``regions`` ((shape, dtype) pairs) one after the other, each aligned."""
    total = 0
    for shape, dtype in regions:
        numel = 1
        for s in shape:
            numel *= s
        total = _align(total) + numel * dtype.itemsize
    return total


def as_bytes(name: str, workspace, device: torch.device) -> torch.Tensor:
    """The caller's workspace as a flat uint8 view, after the checks every public function makes."""
    if not isinstance(workspace, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor (e.g. from the *_workspace() helper), "
                        f"got {type(workspace).__name__}")
    if workspace.dtype not in (torch.uint8, torch.float32):
        raise ValueError(f"{name}: expected a uint8 buffer (from the *_workspace() helper; FP32 also serves), got "
                         f"{str(workspace.dtype).replace('torch.', '')}")
    if workspace.device != torch.device(device):
        raise ValueError(f"{name}: expected a tensor on {device} (the device of the op's inputs), got one on "
                         f"{workspace.device}")
    if not workspace.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous buffer (allocate it with the *_workspace() helper)")
    if workspace.numel() and not _traced.through_ops() and workspace.data_ptr() % 16:  # traced / fake: no address
        raise ValueError(f"{name}: expected a buffer aligned to 16 bytes, got address {workspace.data_ptr():#x} "
                         f"(a slice at an odd offset?); allocate it with the *_workspace() helper")
    flat = workspace.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def check_size(name: str, workspace_bytes: torch.Tensor, need: int, helper: str) -> None:
    if workspace_bytes.numel() < need:
        raise ValueError(f"{name}: this call needs {need} bytes of workspace, got {workspace_bytes.numel()}; "
                         f"allocate it with {helper}")


def carve(workspace_bytes: torch.Tensor, regions: Sequence[Tuple[Tuple[int, ...], torch.dtype]]):
    """Views of ``workspace_bytes`` (uint8, large enough: see layout_bytes) in the regions' shapes and dtypes."""
    views, offset = [], 0
    for shape, dtype in regions:
        offset = _align(offset)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * dtype.itemsize
        views.append(workspace_bytes[offset:offset + nbytes].view(dtype).view(shape))
        offset += nbytes
    return views


def fp32_scratch_numel(sizes: Sequence[int]) -> int:
    """FP32 elements ``fp32_scratch`` carves ``sizes`` from: ``layout_bytes``' layout of FP32 pieces."""
    return layout_bytes([((size,), torch.float32) for size in sizes]) // 4


def fp32_scratch(sizes: Sequence[int], workspace, device: torch.device, separate: bool):
    """FP32 scratch tensors of ``sizes`` elements, in order, each starting at a multiple of ``ALIGN`` bytes: views
    of ``workspace`` (flat FP32, or uint8 whose bytes are read as FP32) when it holds ``fp32_scratch_numel(sizes)``
    elements, else new memory: one buffer per call, or, when ``separate``, one buffer per piece.

    ``separate`` while torch.compile traces the launches: Inductor (torch 2.11, H200) miscopied kernel-written views
    of one buffer at depth -- a copy of 4.3 M elements read from a 1.6 M-element buffer, an illegal memory access in
    a 16-block model's backward -- and whole buffers give it no views to copy. The alignment makes both forms
    launch the same kernels: Triton specializes a pointer on its 16-byte alignment, and the specialization can
    change a reduction's layout, so a piece at an odd offset summed its partials in another order (a gated-head
    model's fn gradient, traced against eager, H200)."""
    need, offsets = _fp32_layout(tuple(sizes))
    if workspace is not None and workspace.dtype == torch.uint8:
        workspace = workspace[:4 * need].view(torch.float32)
    if workspace is None or workspace.numel() < need:
        if separate:
            return tuple(torch.empty(size, dtype=torch.float32, device=device) for size in sizes)
        workspace = torch.empty(need, dtype=torch.float32, device=device)
    # carve's offsets, sliced from FP32 (a third of carve's host time: a backward's hot path)
    return tuple(workspace[offset:offset + size] for offset, size in zip(offsets, sizes))


@functools.lru_cache(maxsize=256)  # per call on a backward's hot path; one layout per launch shape
def _fp32_layout(sizes: Tuple[int, ...]) -> Tuple[int, Tuple[int, ...]]:
    """(``fp32_scratch_numel(sizes)``, the FP32 offset of each piece)."""
    offsets, offset = [], 0
    for size in sizes:
        offset = _align(4 * offset) // 4
        offsets.append(offset)
        offset += size
    return fp32_scratch_numel(sizes), tuple(offsets)
