"""The mHC record layout (meta/mhc_layout.py) as Triton constexprs, functions of the stream count N: a kernel
writes ``_COMB(N)`` where it needs the column, and each N compiles to its own constants (no kernel per n).
Called from host code they return plain ints.

The layouts reach the functions as a default argument: Triton re-checks every global a kernel reads on each
launch (and refuses plain Python functions there), while a default is read once, when the function is defined.
"""
import triton

from ..meta import mhc_layout as layout

_LAYOUTS = {n: layout.layout_for(n) for n in layout.SUPPORTED_STREAMS}


@triton.constexpr_function
def PRE(N, layouts=_LAYOUTS):
    return layouts[N].PRE


@triton.constexpr_function
def POST(N, layouts=_LAYOUTS):
    return layouts[N].POST


@triton.constexpr_function
def COMB(N, layouts=_LAYOUTS):
    return layouts[N].COMB


@triton.constexpr_function
def RSTD(N, layouts=_LAYOUTS):
    return layouts[N].RSTD


@triton.constexpr_function
def MIX(N, layouts=_LAYOUTS):
    return layouts[N].MIX


@triton.constexpr_function
def STATS_USED(N, layouts=_LAYOUTS):
    return layouts[N].STATS_USED


@triton.constexpr_function
def STATS_WIDTH(N, layouts=_LAYOUTS):
    return layouts[N].STATS_WIDTH


@triton.constexpr_function
def DPOST(N, layouts=_LAYOUTS):
    return layouts[N].DPOST


@triton.constexpr_function
def DCOMB(N, layouts=_LAYOUTS):
    return layouts[N].DCOMB


@triton.constexpr_function
def GRAD_STATS_USED(N, layouts=_LAYOUTS):
    return layouts[N].GRAD_STATS_USED


@triton.constexpr_function
def GRAD_STATS_WIDTH(N, layouts=_LAYOUTS):
    return layouts[N].GRAD_STATS_WIDTH


def logits_pad(n: int) -> int:
    """Width of the kernels' per-token logit rows (the projection's partials, backward_finish's dz rows): the
    M = 2n + n*n logits plus one column (sum of x^2, resp. the scalar s) at M, padded to a power of two >= 16
    (a tl.dot dimension). n = 2: 16, n = 4: 32, n = 8: 128."""
    M = 2 * n + n * n
    return max(16, 1 << M.bit_length())  # the smallest power of two > M
