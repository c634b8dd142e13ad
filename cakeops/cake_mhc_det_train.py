"""FlashInfer 0.7.4's primary mHC module name, ``flashinfer.cake_mhc_det_train``: every ``cake_mhc_det_train_*`` /
``CakeMHCDetTrain*`` name here is the very object of ``cakeops.cake_mhc_train``'s ``cake_mhc_train_*`` /
``CakeMHCTrain*`` name (identity, not a wrapper), as FlashInfer's ``cake_mhc_train`` names are its det names.

FlashInfer's det functions have no ``deterministic`` keyword; cakeops' take it (keyword only, default True: the
deterministic path, so a FlashInfer call gets what FlashInfer's det module gives). See ``cakeops.cake_mhc_train``
for the API, the stats layout and the ``deterministic=False`` fallback.
"""
from .cake_mhc_train import ARCHES, SUPPORTED_COMPUTE_CAPABILITIES, route_key  # noqa: F401
from .cake_mhc_train import CakeMHCTrainFinishFunction as CakeMHCDetTrainFinishFunction  # noqa: F401
from .cake_mhc_train import CakeMHCTrainHeadFunction as CakeMHCDetTrainHeadFunction  # noqa: F401
from .cake_mhc_train import CakeMHCTrainPrepareFunction as CakeMHCDetTrainPrepareFunction  # noqa: F401
from .cake_mhc_train import (  # noqa: F401
    cake_mhc_train_backward_finish as cake_mhc_det_train_backward_finish,
    cake_mhc_train_backward_prepare as cake_mhc_det_train_backward_prepare,
    cake_mhc_train_backward_workspace as cake_mhc_det_train_backward_workspace,
    cake_mhc_train_backward_workspace_bytes as cake_mhc_det_train_backward_workspace_bytes,
    cake_mhc_train_finish as cake_mhc_det_train_finish,
    cake_mhc_train_forward_finish as cake_mhc_det_train_forward_finish,
    cake_mhc_train_forward_prepare as cake_mhc_det_train_forward_prepare,
    cake_mhc_train_forward_stats as cake_mhc_det_train_forward_stats,
    cake_mhc_train_forward_workspace as cake_mhc_det_train_forward_workspace,
    cake_mhc_train_forward_workspace_bytes as cake_mhc_det_train_forward_workspace_bytes,
    cake_mhc_train_head as cake_mhc_det_train_head,
    cake_mhc_train_head_backward as cake_mhc_det_train_head_backward,
    cake_mhc_train_head_forward as cake_mhc_det_train_head_forward,
    cake_mhc_train_prepare as cake_mhc_det_train_prepare,
    cake_mhc_train_reset_workspace as cake_mhc_det_train_reset_workspace,
    is_cake_mhc_train_head_supported as is_cake_mhc_det_train_head_supported,
    is_cake_mhc_train_supported as is_cake_mhc_det_train_supported,
)

__all__ = [
    "ARCHES", "SUPPORTED_COMPUTE_CAPABILITIES", "CakeMHCDetTrainFinishFunction", "CakeMHCDetTrainHeadFunction",
    "CakeMHCDetTrainPrepareFunction", "cake_mhc_det_train_backward_finish", "cake_mhc_det_train_backward_prepare",
    "cake_mhc_det_train_backward_workspace", "cake_mhc_det_train_backward_workspace_bytes",
    "cake_mhc_det_train_finish", "cake_mhc_det_train_forward_finish", "cake_mhc_det_train_forward_prepare",
    "cake_mhc_det_train_forward_stats", "cake_mhc_det_train_forward_workspace",
    "cake_mhc_det_train_forward_workspace_bytes", "cake_mhc_det_train_head", "cake_mhc_det_train_head_backward",
    "cake_mhc_det_train_head_forward", "cake_mhc_det_train_prepare", "cake_mhc_det_train_reset_workspace",
    "is_cake_mhc_det_train_head_supported", "is_cake_mhc_det_train_supported", "route_key",
]
