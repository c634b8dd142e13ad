"""Layouts: inputs the kernels read in place (unit stride along the last dim, any other strides), and outputs
handed back in the caller's shape."""
import torch
from torch import Tensor


def unit_last(t: Tensor) -> Tensor:
    """The tensor itself when its last dim is unit-stride (rows read in place), else one contiguous copy."""
    # is_contiguous() first: the usual case, at a third of stride(-1)'s cost (a contiguous t with another last
    # stride has a last dim of size 1, whose stride is never used: contiguous() would return t itself too)
    return t if t.is_contiguous() or t.stride(-1) == 1 or t.numel() == 0 else t.contiguous()


def in_shape(t: Tensor, shape) -> Tensor:
    """An op's fresh [T, ...] output in the caller's shape, as a compiled graph's output. Not ``t.view(shape)``: a
    graph output that views an intermediate is one AOTAutograd hides from autograd itself, by dispatching
    ``aten._unsafe_view`` on it at every call (even for an unchanged shape), and hands back as a view (``_base``
    set) -- which FSDP2's output hooks or an in-place op would lose. This is that same call traced into the graph,
    where Inductor makes it a free reinterpretation; sound for the same reason: nothing else sees the op's output.
    (Eagerly, for DTensors, it shares the output's storage as ``.view`` did, with the same reshaping backward.)"""
    return torch.ops.aten._unsafe_view(t, shape)
