"""The mHC per-token records, defined once: kernels, reference math and fakes all index through here.

n residual streams, n in SUPPORTED_STREAMS = (2, 4, 8); M = 2n + n*n mapping logits. ``layout_for(n)`` gives
the columns of both records for n; the module-level constants below are n = 4's (``layout_for(4)``), kept for
the code that predates other n.

``stats [T, STATS_WIDTH]`` FP32, written by forward_prepare / forward_stats. Column order is FlashInfer 0.7.4's
(``flashinfer.cake_mhc_det_train``: ``r | z[24] | pre[4] | post[4] | C[16] | pad[15]`` for n = 4), the same order
with n's widths for n = 2 and 8, so a record either library wrote reads the same in the other:

    columns                       what (FlashInfer's name)
    RSTD  0                       r:    1/sqrt(mean(x^2) + rms_eps) over the K = n*C flattened streams
    MIX   1 .. M                  z:    mix_m = rstd * (fn @ x)_m, the normalized logits before scale / base
    PRE   M+1 .. M+n              pre:  pre_i  = sigmoid(mix_i*scale[0] + base_i) + hc_eps
    POST  M+n+1 .. M+2n           post: post_j = 2*sigmoid(mix_{n+j}*scale[1] + base_{n+j})
    COMB  M+2n+1 .. 2M            C:    comb[i, j] at COMB + i*n + j (Sinkhorn output, row-major)
    STATS_USED = 2M+1 .. WIDTH-1  pad:  zero

    n   M    RSTD  MIX  PRE  POST  COMB  STATS_USED  STATS_WIDTH
    2   8    0     1    9    11    13    17          32   (128 bytes per token)
    4   24   0     1    25   29    33    49          64   (256 bytes; FlashInfer's [T, 64])
    8   80   0     1    81   89    97    161         256  (1 KiB)

``z`` is FlashInfer's ``(u * r) @ fn.T`` with ``u`` the FP32 flattened streams: the raw normalized logits, before
``scale`` and ``base`` (cakeops computes ``r * (fn @ u)``, the same value: matmul first, multiply after, SPEC
section 2). Until FlashInfer 0.7.4 documented its order, cakeops wrote ``pre | post | comb | rstd | mix`` (the same
values and widths, other columns); no kernel output depends on the column order.

``mix`` is kept so the backward never recomputes ``fn @ x``: dscale needs it and the Sinkhorn backward replays
the n x n iteration from it (cheap, per token, in registers).

``grad_stats [T, GRAD_STATS_WIDTH]`` FP32, written by backward_prepare:

    DPOST   0 .. n-1               dpost_j    = sum_c dY[t,j,c]*B[t,c]
    DCOMB   n .. n+n*n-1           dcomb[i,j] = sum_c X[t,i,c]*dY[t,j,c] at DCOMB + i*n + j
    GRAD_STATS_USED .. WIDTH-1     zero

    n   DPOST  DCOMB  GRAD_STATS_USED  GRAD_STATS_WIDTH
    2   0      2      6                8     (32 bytes per token)
    4   0      4      20               32    (128 bytes)
    8   0      8      72               128   (512 bytes)

Widths: the used columns rounded up to a power of two. A power of two because the kernels address a whole row
with ``tl.arange(0, WIDTH)`` (which needs one) to zero the padding in the same pass, and rows then start on
aligned 32-byte sectors; the smallest such width, because every stats byte is read by finish, backward_prepare and
backward_finish and kept as activation memory between forward and backward (n = 8: 1 KiB per token, 1/64 of X
at C = 4096 in bf16). n = 4's widths (64, 32) are the record's original ones, unchanged.
"""
import operator
from dataclasses import dataclass

SUPPORTED_STREAMS = (2, 4, 8)
MAX_SINKHORN_ITERS = 64


def _pow2_ceil(v: int) -> int:
    return 1 << (v - 1).bit_length()


@dataclass(frozen=True)
class MHCLayout:
    """The column offsets of the stats and grad_stats records for n streams (module docstring)."""
    n: int
    N_LOGITS: int
    PRE: int
    POST: int
    COMB: int
    RSTD: int
    MIX: int
    STATS_USED: int
    STATS_WIDTH: int
    DPOST: int
    DCOMB: int
    GRAD_STATS_USED: int
    GRAD_STATS_WIDTH: int


def unsupported_streams_message(n) -> str:
    supported = ", ".join(map(str, SUPPORTED_STREAMS))
    return f"n = {n} residual streams is not supported; the mHC ops support n in {{{supported}}}"


def layout_for(n) -> MHCLayout:
    """The record layout for n streams (an int, or a traced size: it is specialized); NotImplementedError for an n
    outside SUPPORTED_STREAMS."""
    try:
        key = None if isinstance(n, bool) else operator.index(n)
    except TypeError:
        key = None
    if key not in _LAYOUTS:
        raise NotImplementedError(unsupported_streams_message(n))
    return _LAYOUTS[key]


def _layout(n: int) -> MHCLayout:
    M = 2 * n + n * n
    rstd, mix = 0, 1
    pre = mix + M
    post, comb = pre + n, pre + 2 * n
    used = comb + n * n
    dpost, dcomb = 0, n
    grad_used = dcomb + n * n
    return MHCLayout(n=n, N_LOGITS=M, PRE=pre, POST=post, COMB=comb, RSTD=rstd, MIX=mix, STATS_USED=used,
                     STATS_WIDTH=_pow2_ceil(used), DPOST=dpost, DCOMB=dcomb, GRAD_STATS_USED=grad_used,
                     GRAD_STATS_WIDTH=_pow2_ceil(grad_used))


_LAYOUTS = {n: _layout(n) for n in SUPPORTED_STREAMS}


def stats_width(n: int) -> int:
    return layout_for(n).STATS_WIDTH


def grad_stats_width(n: int) -> int:
    return layout_for(n).GRAD_STATS_WIDTH


def n_logits(n: int) -> int:
    return layout_for(n).N_LOGITS


# n = 4, the default (and until n became a parameter, the only) stream count
N_STREAMS = 4
_L4 = layout_for(N_STREAMS)
N_LOGITS = _L4.N_LOGITS  # 24

RSTD = _L4.RSTD  # 0
MIX = _L4.MIX  # 1
PRE = _L4.PRE  # 25
POST = _L4.POST  # 29
COMB = _L4.COMB  # 33
STATS_USED = _L4.STATS_USED  # 49
STATS_WIDTH = _L4.STATS_WIDTH  # 64

DPOST = _L4.DPOST  # 0
DCOMB = _L4.DCOMB  # 4
GRAD_STATS_USED = _L4.GRAD_STATS_USED  # 20
GRAD_STATS_WIDTH = _L4.GRAD_STATS_WIDTH  # 32
