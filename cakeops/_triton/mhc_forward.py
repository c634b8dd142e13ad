"""The mHC forward launchers in one place: forward_prepare / forward_stats (mhc_prepare.py), forward_finish
and the head with its backward (mhc_streams.py), with their launch configs."""
from .mhc_prepare import PrepareConfig, prepare
from .mhc_streams import StreamConfig, finish, head_backward, head_forward, rebuild

__all__ = ["prepare", "finish", "rebuild", "head_forward", "head_backward", "PrepareConfig", "StreamConfig"]
