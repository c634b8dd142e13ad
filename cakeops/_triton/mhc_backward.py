"""mHC backward kernels' launchers, one import for the op layer: backward_prepare (the finish node's
backward) in mhc_backward_prepare.py, backward_finish (the prepare node's) in mhc_backward_finish.py, with their
launch configs."""
from .mhc_backward_finish import FinishConfig, backward_finish, backward_finish_workspace_numel  # noqa: F401
from .mhc_backward_prepare import BackwardPrepareConfig, backward_prepare  # noqa: F401
