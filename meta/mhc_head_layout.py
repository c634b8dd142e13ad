"""The gated head's per-token record (DeepSeek-V4's hc_head), defined once: kernels, reference math and fakes
all index through here.

``head_stats [T, HEAD_STATS_WIDTH]`` FP32, written by the gated head forward, read by its backward. Fixed
columns for every supported stream count n in SUPPORTED_N (n <= MAX_N = 8); columns of streams >= n are zero:

    columns            what
    GATE  0..n-1       g_i   = sigmoid(mix_i*scale + base_i) + hc_eps   (the collapse weights of Y)
    MIX   8..8+n-1     mix_i = rstd * (fn_i . x), x = X[t].reshape(n*C) in FP32 (before scale / base)
    RSTD  16           1/sqrt(mean(x^2) + rms_eps)
    17..31             zero (padding to 32 floats = 128 bytes per token)

FlashInfer has no gated head: this record is cakeops' own and keeps its columns when the mHC record
(mhc_layout.py) took FlashInfer's order. The weighted collapse of ``_triton/mhc_streams.py`` and backward_finish's
``_dx_tile`` serve both records, told the row stride and the column of the first gate (GATE here, PRE there). ``mix`` is kept so the backward never recomputes ``fn @ x`` (dscale needs it; the sigmoid's slope
is recomputed from it: g - hc_eps loses small sigmoid values when hc_eps is large).
"""

SUPPORTED_N = (2, 4, 8)
MAX_N = 8

GATE = 0
MIX = GATE + MAX_N  # 8
RSTD = MIX + MAX_N  # 16
HEAD_STATS_USED = RSTD + 1  # 17
HEAD_STATS_WIDTH = 32
