"""What every launcher needs to size its grid: tile shapes, warps, the persistent-grid width.

Host arithmetic is plain Python: ``triton.cdiv`` / ``triton.next_power_of_2`` are constexpr-function wrappers
that cost microseconds per call, and a layer's launchers made ~35 such calls per forward + backward.
"""
import functools
from typing import Callable, Dict, TypeVar

import torch

from .. import _backend


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (0 for 0, as triton's)."""
    return 0 if n <= 0 else 1 << (int(n) - 1).bit_length()


def tile_config(width: int, elem_bytes: int, tile_elems: int = 4096, thread_bytes: int = 32,
                max_tile: int = 16384):
    """Row tile for a [T, width] pass: (ROWS, BLOCK, NUM_CHUNKS, num_warps).

    Rows up to ``max_tile`` elements live whole in registers (one HBM read per element); wider rows are
    walked in chunks. Narrow rows are packed several to a program so each program moves ``tile_elems``
    elements; warps are chosen so each thread holds ``thread_bytes`` of each tensor.
    """
    block = min(next_power_of_2(max(width, 1)), max_tile)
    chunks = cdiv(width, block)
    rows = max(1, min(64, tile_elems // block)) if chunks == 1 else 1
    per_thread = max(1, thread_bytes // elem_bytes)
    warps = next_power_of_2(max(1, min(16, rows * block // (32 * per_thread))))
    return rows, block, chunks, warps


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_programs(device: torch.device, work_items: int, per_sm: int = 2) -> int:
    """Programs for a persistent grid: enough to fill the GPU, never more than the work."""
    if device.type == "cuda":
        width = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) * per_sm
    else:
        width = 4 if _backend.interpreting() else 1
    return max(1, min(work_items, width))


def pipeline_stages(stages) -> dict:
    """Launch options for a software-pipeline depth (none for None: Triton's default)."""
    return {} if stages is None else {"num_stages": stages}


def register_cap(maxnreg) -> dict:
    """Launch options for a register cap per thread (none for None): a compile option of the CUDA backend; the
    interpreter has no registers to cap."""
    return {} if maxnreg is None or _backend.interpreting() else {"maxnreg": maxnreg}


P = TypeVar("P")
KEPT_PLANS = 256  # per launcher: every layer of a model shares one, a few shapes each (tokens per batch)


def kept_per_shape(make: Callable[..., P]) -> Callable[..., P]:
    """``make(X, *args)``, kept per (X's shape, dtype and device, ``args``): for a launcher's resolved configs and
    plan, which follow from those alone, and which resolving per call made a third of the mHC launchers' host
    time. ``args`` are hashable (a config dataclass, flags). Meta tensors are never kept: their configs follow
    the GPU ``arch.assume`` names and build_check's stand-ins, which no key holds. The oldest plan goes past
    ``KEPT_PLANS``."""
    kept: Dict[tuple, P] = {}

    @functools.wraps(make)
    def plan(X: torch.Tensor, *args) -> P:
        device = X.device
        if device.type == "meta":
            return make(X, *args)
        key = (X.shape, X.dtype, device, args)
        made = kept.get(key)
        if made is None:
            made = kept[key] = make(X, *args)
            if len(kept) > KEPT_PLANS:
                del kept[next(iter(kept))]
        return made

    plan.cache_clear = kept.clear
    return plan
