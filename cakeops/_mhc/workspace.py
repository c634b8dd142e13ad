"""mHC workspaces and support queries: the ``cake_mhc_train_*_workspace[_bytes]`` helpers (sizes, layouts), the
glue that checks a caller's workspace against what one call carves, and ``is_cake_mhc_train[_head]_supported``.

Re-exported by ``cakeops.cake_mhc_train`` (the public module); the layers above (functions, autograd) import the
carving glue from here.
"""
from typing import Optional

import torch
from torch import Tensor

from .. import _traced
from .. import _mhc_args as args
from .._ops.determinism import resolve_deterministic
from ..meta import mhc_layout as layout


# ---------------------------------------------------------------------------------------------
# Workspace carving: a caller's workspace checked against what one call needs
# ---------------------------------------------------------------------------------------------
def _workspace_for(name: str, workspace, X: Tensor, need, helper: str) -> Optional[Tensor]:
    """The caller's workspace as checked uint8 bytes; ``need()`` gives the bytes this call carves. Its size is
    checked on the reference path too (CPU tensors without the interpreter, which leave it unused), so that code
    written on a CPU fails there as it would on the GPU."""
    if workspace is None:
        return None
    from .. import _workspace

    ws = _workspace.as_bytes(name, workspace, X.device)
    if _traced.through_ops():
        return None  # unused: Inductor plans the scratch (cakeops/_traced.py)
    _workspace.check_size(name, ws, need(), helper)
    return ws


_FWD_HELPER = "cake_mhc_train_forward_workspace(T, device, hidden=C, n_streams=n)"
_BWD_HELPER = "cake_mhc_train_backward_workspace(T, device, hidden=C, n_streams=n)"


def _forward_need(X: Tensor):
    def forward() -> int:
        from .._triton.mhc_prepare import workspace_bytes
        return workspace_bytes(X)
    return forward


def _backward_need(X: Tensor, sinkhorn_iters: int, deterministic: bool):
    def backward() -> int:
        from .._triton.mhc_backward import backward_finish_workspace_numel
        return 4 * backward_finish_workspace_numel(X.shape[0], X.shape[2], sinkhorn_iters, X.device, deterministic,
                                                   n=X.shape[1])
    return backward


# ---------------------------------------------------------------------------------------------
# Workspace sizes and helpers
# ---------------------------------------------------------------------------------------------

def _size_args(T, device, hidden) -> torch.device:
    if isinstance(T, bool) or not isinstance(T, int) or T < 0:
        raise ValueError(f"T: expected the largest token count the buffer serves, an int >= 0, got {T!r}")
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"hidden: expected the hidden size C (X.shape[-1]), an int >= 1, got {hidden!r}")
    return torch.device(device)


def cake_mhc_train_forward_workspace_bytes(T: int, device, *, hidden: int = 4096, deterministic: bool = True,
                                           n_streams: int = 4) -> int:
    """Bytes of the caller-owned forward workspace (forward_prepare, forward_stats, cake_mhc_train_prepare's
    ``workspace``) serving every call of up to ``T`` tokens of hidden size ``hidden`` (X.shape[-1]) on
    ``device``, any dtype of X, with ``n_streams`` streams (cakeops' extension: 2, 4 or 8, default 4). T == 0
    needs none (0).

    Layout (regions at 256-byte offsets): the bf16 hi / lo pieces of fn ``[2, M, n*hidden]`` (M = 2n + n*n; the
    projection feeds them to tensor cores; used for bf16 X), then the projection's FP32 partials
    ``[slices, T, M_PAD]`` (M_PAD = 16 / 32 / 128 for n = 2 / 4 / 8; ``slices``: column slices per token block,
    1 to 8, more when T is small next to the GPU). For n = 4 about ``384*hidden + 128*T*slices`` bytes. The kernels write before they read: no zeroing needed.
    ``deterministic`` (FlashInfer 0.7.4's keyword): one layout for both values, as FlashInfer's.

    >>> cake_mhc_train_forward_workspace_bytes(1024, "cpu", hidden=4096) > 0
    True
    """
    from .._triton.mhc_prepare import workspace_bytes_max

    device = _size_args(T, device, hidden)
    resolve_deterministic(deterministic, "cake_mhc_train_forward_workspace_bytes")
    return workspace_bytes_max(T, args.n_streams("n_streams", n_streams), hidden, device)


def cake_mhc_train_forward_workspace(T: int, device, *, hidden: int = 4096, deterministic: bool = True,
                                     n_streams: int = 4) -> Tensor:
    """A zero-filled uint8 forward workspace of ``cake_mhc_train_forward_workspace_bytes(T, device,
    hidden=hidden, deterministic=deterministic, n_streams=n_streams)`` bytes on ``device``: reusable by every later forward call of at most T tokens.

    >>> ws = cake_mhc_train_forward_workspace(5, "cpu", hidden=32)
    >>> X = torch.randn(5, 4, 32, dtype=torch.bfloat16)
    >>> U, stats = cake_mhc_train_forward_prepare(X, torch.zeros(24, 128), torch.ones(3), torch.zeros(24),
    ...                                           workspace=ws)
    >>> ws.dtype, U.shape
    (torch.uint8, torch.Size([5, 32]))
    """
    deterministic = resolve_deterministic(deterministic, "cake_mhc_train_forward_workspace")
    return torch.zeros(cake_mhc_train_forward_workspace_bytes(T, device, hidden=hidden, deterministic=deterministic,
                                                              n_streams=n_streams),
                       dtype=torch.uint8, device=device)


def cake_mhc_train_backward_workspace_bytes(T: int, device, *, hidden: int = 4096, deterministic: bool = True,
                                            sinkhorn_iters: Optional[int] = None, n_streams: int = 4) -> int:
    """Bytes of the caller-owned backward workspace (backward_finish's ``workspace``, cake_mhc_train_prepare's
    ``backward_workspace``) serving every call of up to ``T`` tokens of hidden size ``hidden`` on ``device``.

    Layout (FP32, one region after the other; n = 4 shown, M_PAD = 16 / 32 / 128 and M = 2n + n*n in general):
    per-token ``dz`` rows ``[T, 32]`` | the dlogits kernel's per-program dscale/dbase partials ``[P, 64]`` | its
    Sinkhorn scratch ``[P, 2*iters - 1, 8, 16]`` (P persistent programs, at most 64 MiB in all) | the dfn
    partials ``[splits, 24, 4*hidden]`` (deterministic only) | the dpre partials ``[slices, T, 4]``. cakeops'
    extensions (keywords FlashInfer lacks): ``n_streams`` (2, 4 or 8, default 4),
    ``sinkhorn_iters`` (None: sized for every count 1..64; give the count to size it for that count alone) and
    ``deterministic`` (FlashInfer 0.7.4's keyword: False needs no dfn partials; a deterministic workspace serves
    both; False under ``torch.use_deterministic_algorithms(True)`` sizes the deterministic one and warns once).

    >>> cake_mhc_train_backward_workspace_bytes(1024, "cpu", hidden=4096) > 0
    True
    """
    from .._triton.mhc_backward_finish import backward_finish_workspace_bytes_max

    device = _size_args(T, device, hidden)
    if sinkhorn_iters is not None:
        args.hparams(1.0, 1.0, sinkhorn_iters)
    deterministic = resolve_deterministic(deterministic, "cake_mhc_train_backward_workspace_bytes")
    return backward_finish_workspace_bytes_max(T, hidden, device, deterministic, sinkhorn_iters,
                                               n=args.n_streams("n_streams", n_streams))


def cake_mhc_train_backward_workspace(T: int, device, *, hidden: int = 4096, deterministic: bool = True,
                                      sinkhorn_iters: Optional[int] = None, n_streams: int = 4) -> Tensor:
    """A zero-filled uint8 backward workspace of ``cake_mhc_train_backward_workspace_bytes(T, device,
    hidden=hidden, deterministic=deterministic, sinkhorn_iters=sinkhorn_iters, n_streams=n_streams)`` bytes on
    ``device``, reusable by every later backward call of at most T tokens.

    >>> cake_mhc_train_backward_workspace(5, "cpu", hidden=32).dtype
    torch.uint8
    """
    deterministic = resolve_deterministic(deterministic, "cake_mhc_train_backward_workspace")
    return torch.zeros(cake_mhc_train_backward_workspace_bytes(T, device, hidden=hidden, deterministic=deterministic,
                                                               sinkhorn_iters=sinkhorn_iters, n_streams=n_streams),
                       dtype=torch.uint8, device=device)


# ---------------------------------------------------------------------------------------------
# Support queries
# ---------------------------------------------------------------------------------------------

def is_cake_mhc_train_supported(device, hidden: Optional[int] = None, *, deterministic: bool = True,
                                n_streams: int = layout.N_STREAMS) -> bool:
    """True where the layer ops run on ``device``: CPU (reference math) and CUDA GPUs of compute capability 8.0 or newer;
    ``hidden`` (C, optional): any int >= 1; ``deterministic`` (FlashInfer 0.7.4's keyword): both modes run
    wherever the ops do (False under ``torch.use_deterministic_algorithms(True)`` warns once, as FlashInfer's);
    ``n_streams`` (cakeops' extension, keyword only): 2, 4 or 8.

    >>> is_cake_mhc_train_supported("cpu", hidden=4096), is_cake_mhc_train_supported("cpu", hidden=0)
    (True, False)
    """
    from ..cake_rmsnorm_train import is_cake_rmsnorm_train_supported
    resolve_deterministic(deterministic, "is_cake_mhc_train_supported")
    supported = not isinstance(n_streams, bool) and n_streams in layout.SUPPORTED_STREAMS
    return supported and is_cake_rmsnorm_train_supported(device, hidden)


def is_cake_mhc_train_head_supported(device, hidden: Optional[int] = None) -> bool:
    """True where the head (cake_mhc_train_head_forward / _backward / cake_mhc_train_head) runs: the devices of
    is_cake_mhc_train_supported, any hidden size >= 1.

    >>> is_cake_mhc_train_head_supported("cpu", hidden=5120)
    True
    """
    return is_cake_mhc_train_supported(device, hidden)
