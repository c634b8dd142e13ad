"""mHC (manifold-constrained hyper-connections) training ops, FlashInfer ``cake_mhc_train``-compatible API.

The residual stream is widened to n streams ``X [T, n, C]``, n in {2, 4, 8} (4 is the usual choice; other n
raise NotImplementedError). Per token, the RMS-normalized flattened streams are projected by
``fn [2n + n*n, n*C]`` (``[24, 4C]`` for n = 4) to logits that give the ``pre`` gates (collapse to the layer input
``U = sum_i pre_i X_i``), the ``post`` gates and a doubly-stochastic mixing matrix ``comb`` (Sinkhorn), and the
layer output is ``Y = post * B + comb^T X`` with ``B = branch(U)``.

Layers of this module: the FlashInfer-style functions (no autograd, explicit records, caller buffers), the
autograd.Functions (eager path, calling the kernels directly), and ``cake_mhc_train_prepare`` /
``cake_mhc_train_finish`` / ``cake_mhc_train_head``, which become the ``torch.ops.cakeops.mhc_*`` custom ops
under torch.compile. This module is their one public face; the code lives in ``cakeops/_mhc/``: ``functions.py``
(the FlashInfer-style functions and their checks), ``workspace.py`` (workspace sizes and carving, support
queries), ``autograd.py`` (the eager Functions, the handle, prepare / finish / head) and ``gated_head.py``.

Decisions where FlashInfer leaves room: inputs X, B, dY, dU may be row-strided (unit last stride) and are read
in place, other layouts are copied once (by the ``*_impl`` entry, eager and compiled alike); caller buffers
(``out``, ``dX`` ...) may have any layout (cakeops/_buffers.py) and are overwritten, except dfn/dscale/dbase
with ``accumulate=True`` (and ``dX`` of the head backward) which are added into. Under torch.compile the stats are
always kept for the backward (``save_stats`` applies to the eager path); the gradients are the same bits either way.
Workspaces (``workspace=``, ``backward_workspace=``, ``cake_mhc_train_*_workspace[_bytes]``): FlashInfer's
signatures; the layouts are cakeops' own (docs/design.md §2), sized for every token count up to T, zero-filled
uint8 like FlashInfer's though the kernels need no zeroing; size-checked everywhere, unused by the CPU reference
and under torch.compile.
cakeops' extensions to FlashInfer's signatures are keyword arguments only, after FlashInfer's own (``n_streams``,
``sinkhorn_iters`` of the backward workspace size, ``out=`` of ``forward_stats``, its older name for
``stats_out=``); tests/test_flashinfer_signatures.py holds every signature to FlashInfer 0.7.4's.

FlashInfer 0.7.4 names: ``flashinfer.cake_mhc_det_train`` is the primary (deterministic) module and
``flashinfer.cake_mhc_train`` its alias; ``flashinfer.experimental.cake.cake_mhc_train`` adds ``deterministic=`` to
every entry point but the finish. cakeops has one implementation: this module's functions take ``deterministic=``
(default True) where FlashInfer's experimental ones do, and ``cakeops.cake_mhc_det_train`` binds its
``cake_mhc_det_train_*`` / ``CakeMHCDetTrain*`` names to these very objects. ``deterministic=False`` under
``torch.use_deterministic_algorithms(True)`` runs the deterministic path and warns once per process, as
FlashInfer's experimental facade does; the non-deterministic backward itself (the op, or a layer prepared with
``deterministic=False`` before the deterministic algorithms were enabled) raises PyTorch's alert, as FlashInfer's
non-deterministic package does.

The stats record has FlashInfer's columns ``r | z[M] | pre[n] | post[n] | C[n*n] | pad`` (n = 4: ``[T, 64]``,
``r | z[24] | pre[4] | post[4] | C[16] | pad[15]``); meta/mhc_layout.py has the offsets for every n.
"""
from ._mhc.autograd import (  # noqa: F401  (_LayerState, _prepare: nn.MHC and the stream recompute use them)
    CakeMHCTrainFinishFunction, CakeMHCTrainHeadFunction, CakeMHCTrainPrepareFunction, MHCTrainHandle, _LayerState,
    _prepare, cake_mhc_train_finish, cake_mhc_train_head, cake_mhc_train_prepare,
)
from ._mhc.functions import (  # noqa: F401
    cake_mhc_train_backward_finish, cake_mhc_train_backward_prepare, cake_mhc_train_forward_finish,
    cake_mhc_train_forward_prepare, cake_mhc_train_forward_stats, cake_mhc_train_head_backward,
    cake_mhc_train_head_forward,
)
from ._mhc.gated_head import (  # noqa: F401
    CakeMHCTrainGatedHeadFunction, cake_mhc_train_gated_head, cake_mhc_train_gated_head_backward,
    cake_mhc_train_gated_head_forward,
)
from ._support import ARCHES, SUPPORTED_COMPUTE_CAPABILITIES  # noqa: F401
from ._support import mhc_route_key as route_key  # noqa: F401
from ._support import reset_workspace as cake_mhc_train_reset_workspace  # noqa: F401
from ._mhc.workspace import (  # noqa: F401
    cake_mhc_train_backward_workspace, cake_mhc_train_backward_workspace_bytes, cake_mhc_train_forward_workspace,
    cake_mhc_train_forward_workspace_bytes, is_cake_mhc_train_head_supported, is_cake_mhc_train_supported,
)

__all__ = [
    "cake_mhc_train_forward_prepare", "cake_mhc_train_forward_stats", "cake_mhc_train_forward_finish",
    "cake_mhc_train_head_forward", "cake_mhc_train_head_backward", "cake_mhc_train_backward_prepare",
    "cake_mhc_train_backward_finish", "cake_mhc_train_prepare", "cake_mhc_train_finish", "cake_mhc_train_head",
    "CakeMHCTrainPrepareFunction", "CakeMHCTrainFinishFunction", "CakeMHCTrainHeadFunction", "MHCTrainHandle",
    "cake_mhc_train_gated_head_forward", "cake_mhc_train_gated_head_backward", "cake_mhc_train_gated_head",
    "CakeMHCTrainGatedHeadFunction",
    "is_cake_mhc_train_supported", "is_cake_mhc_train_head_supported", "cake_mhc_train_forward_workspace_bytes",
    "cake_mhc_train_forward_workspace", "cake_mhc_train_backward_workspace_bytes", "cake_mhc_train_backward_workspace",
    "cake_mhc_train_reset_workspace", "route_key", "ARCHES", "SUPPORTED_COMPUTE_CAPABILITIES",
]
