"""Where cakeops runs, in FlashInfer 0.7.4's names: ``ARCHES``, ``SUPPORTED_COMPUTE_CAPABILITIES`` and
``route_key`` of ``flashinfer.cake_mhc_det_train`` / ``flashinfer.cake_rmsnorm_train``, and
``cake_mhc_train_reset_workspace``, with cakeops' values.

FlashInfer ships one verified CUDA build per architecture (``("sm_100a", "sm_103a", "sm_107a")``) and a registry of
routes, one per (call kind, hidden size[, residual, weight dtype]); ``route_key`` names a call's route and a call
whose route the registry lacks is refused. cakeops' Triton kernels are built on first launch for whatever GPU runs
them, for any hidden size: its ``ARCHES`` are the targets its launch configs are built and checked for
(``_triton/arch.py``'s TARGETS: every kernel is compiled for each of them in CI) plus ``"cpu"`` (the reference
math, or the Triton kernels under the interpreter), and a ``route_key`` names the compiled-program family a call
runs: Triton specializes each kernel on the hidden size (a constexpr block shape and the column count), so one key
is one set of compiled programs, the same key format as FlashInfer's.
"""
from typing import Tuple

import torch

from ._triton.arch import TARGETS

ARCHES: Tuple[str, ...] = tuple(f"sm_{cc}" for cc in sorted(TARGETS)) + ("cpu",)
SUPPORTED_COMPUTE_CAPABILITIES: Tuple[Tuple[int, int], ...] = tuple(sorted((cc // 10, cc % 10) for cc in TARGETS))

MHC_KINDS = ("fwd_prepare", "fwd_recompute", "fwd_finish", "bwd_prepare", "bwd_finish")
RMSNORM_KINDS = ("fwd", "bwd")
WEIGHT_DTYPES = ("bf16", "f16", "f32")  # FlashInfer's tokens are ("bf16", "f32"); cakeops takes fp16 weights too


def _hidden(hidden) -> int:
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"hidden must be an int >= 1 (cakeops runs every hidden size), got {hidden!r}")
    return hidden


def mhc_route_key(hidden: int, kind: str) -> str:
    """``<kind>_h<hidden>``: the route of one mHC call, ``kind`` one of ``MHC_KINDS`` (FlashInfer's: forward_prepare,
    forward_stats, forward_finish, backward_prepare, backward_finish), any ``hidden`` >= 1 (module docstring).

    >>> route_key(4096, "fwd_prepare"), route_key(1000, "bwd_finish")
    ('fwd_prepare_h4096', 'bwd_finish_h1000')
    """
    if kind not in MHC_KINDS:
        raise ValueError(f"kind must be one of {MHC_KINDS}, got {kind!r}")
    return f"{kind}_h{_hidden(hidden)}"


def rmsnorm_route_key(hidden: int, kind: str, residual: bool, w_dtype: str = "bf16") -> str:
    """``<kind>[_w16|_w32][_residual]_h<hidden>``: the route of one RMSNorm call (FlashInfer's format, plus
    ``_w16`` for an fp16 weight), ``kind`` ``"fwd"`` or ``"bwd"``, ``w_dtype`` one of ``WEIGHT_DTYPES``.

    >>> route_key(4096, "bwd", True, "f32"), route_key(96, "fwd", False)
    ('bwd_w32_residual_h4096', 'fwd_h96')
    """
    if kind not in RMSNORM_KINDS:
        raise ValueError(f"kind must be one of {RMSNORM_KINDS}, got {kind!r}")
    if w_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"w_dtype must be one of {WEIGHT_DTYPES}, got {w_dtype!r}")
    w = {"bf16": "", "f16": "_w16", "f32": "_w32"}[w_dtype]
    return f"{kind}{w}{'_residual' if residual else ''}_h{_hidden(hidden)}"


def reset_workspace(workspace: torch.Tensor) -> None:
    """Zero a caller-owned workspace (a 1-D uint8 tensor; ValueError for anything else), FlashInfer's
    ``cake_mhc_train_reset_workspace``: FlashInfer's kernels keep self-resetting tickets there that an interrupted
    launch can leave set. cakeops' kernels write every workspace byte before they read it and keep no state there,
    so a workspace never needs a reset; zeroing it is harmless and returns it to the state the
    ``*_workspace`` helpers allocate.

    >>> ws = cake_mhc_train_forward_workspace(8, "cpu", hidden=64)
    >>> ws.fill_(7); cake_mhc_train_reset_workspace(ws); bool((ws == 0).all())
    tensor(...)
    True
    """
    if not isinstance(workspace, torch.Tensor) or workspace.dtype != torch.uint8 or workspace.dim() != 1:
        raise ValueError("workspace must be a 1-D uint8 tensor")
    workspace.zero_()
