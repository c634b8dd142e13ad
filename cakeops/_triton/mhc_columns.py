"""The mHC record layout (meta/mhc_layout.py) as Triton constexprs: kernels may read module globals only when
they are constexpr, so every mHC kernel module imports its column offsets from here."""
import triton.language as tl

from ..meta import mhc_layout as layout

PRE = tl.constexpr(layout.PRE)
POST = tl.constexpr(layout.POST)
COMB = tl.constexpr(layout.COMB)
RSTD = tl.constexpr(layout.RSTD)
MIX = tl.constexpr(layout.MIX)
STATS_USED = tl.constexpr(layout.STATS_USED)
STATS_WIDTH = tl.constexpr(layout.STATS_WIDTH)
DPOST = tl.constexpr(layout.DPOST)
DCOMB = tl.constexpr(layout.DCOMB)
GRAD_STATS_USED = tl.constexpr(layout.GRAD_STATS_USED)
GRAD_STATS_WIDTH = tl.constexpr(layout.GRAD_STATS_WIDTH)
