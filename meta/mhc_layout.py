"""The mHC per-token records, defined once: kernels, reference math and fakes all index through here.

``stats [T, STATS_WIDTH]`` FP32, written by forward_prepare / forward_stats (n = 4 streams, M = 24 logits):

    columns            what
    PRE   0..3         pre_i  = sigmoid(mix_i*scale[0] + base_i) + hc_eps
    POST  4..7         post_j = 2*sigmoid(mix_{n+j}*scale[1] + base_{n+j})
    COMB  8..23        comb[i, j] at 8 + i*n + j  (Sinkhorn output, doubly stochastic)
    RSTD  24           1/sqrt(mean(x^2) + rms_eps) over the K = n*C flattened streams
    MIX   25..48       mix_m = rstd * (fn @ x)_m, the normalized logits before scale/base
    49..63             zero (padding to 64 floats = 256 bytes per token)

``mix`` is kept so the backward never recomputes ``fn @ x``: dscale needs it and the Sinkhorn
backward replays the 4x4 iteration from it (cheap, per token, in registers).

``grad_stats [T, GRAD_STATS_WIDTH]`` FP32, written by backward_prepare:

    DPOST   0..3       dpost_j    = sum_c dY[t,j,c]*B[t,c]
    DCOMB   4..19      dcomb[i,j] = sum_c X[t,i,c]*dY[t,j,c] at 4 + i*n + j
    20..31             zero
"""

N_STREAMS = 4
N_LOGITS = 2 * N_STREAMS + N_STREAMS * N_STREAMS  # 24

PRE = 0
POST = PRE + N_STREAMS  # 4
COMB = POST + N_STREAMS  # 8
RSTD = COMB + N_STREAMS * N_STREAMS  # 24
MIX = RSTD + 1  # 25
STATS_USED = MIX + N_LOGITS  # 49
STATS_WIDTH = 64

DPOST = 0
DCOMB = DPOST + N_STREAMS  # 4
GRAD_STATS_USED = DCOMB + N_STREAMS * N_STREAMS  # 20
GRAD_STATS_WIDTH = 32

MAX_SINKHORN_ITERS = 64
