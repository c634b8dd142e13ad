"""The mHC forward launchers in one place: forward_prepare / forward_stats (mhc_prepare.py), forward_finish
and the head with its backward (mhc_streams.py), with their launch configs."""
from .mhc_prepare import PrepareConfig, prepare
from .mhc_streams import RebuildConfig, StreamConfig, finish, head_backward, head_forward, rebuild, rebuild_table

__all__ = ["prepare", "finish", "rebuild", "rebuild_table", "head_forward", "head_backward", "PrepareConfig", "StreamConfig", "RebuildConfig"]
