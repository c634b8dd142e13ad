"""Device functions of the mHC math that the forward and the backward kernels share.

The backward (kernel A) replays the forward's Sinkhorn to get the iterates its exact gradient needs; the
replay is only exact if it computes the very same bits as forward_prepare, so both call ``sinkhorn`` here, the
replay with ``RECORD`` set (tests/test_sinkhorn_replay.py holds the two modes to each other and to the record).
Same code is not enough on a GPU: a sum over 4 elements is evaluated in an order that depends on how the
[BLOCK_T, n, n] tile is spread over threads, so both kernels run the Sinkhorn on tiles of SINKHORN_TILE.
"""
import triton
import triton.language as tl

# (tokens per block, warps) of the kernels that run the Sinkhorn: the gates kernel of forward_prepare and kernel
# A of backward_finish. One layout for both, or the replay is only close to the forward, not equal.
SINKHORN_TILE = (8, 1)


@triton.jit
def sigmoid(z):
    return tl.div_rn(1.0, 1.0 + tl.exp(-z))


@triton.jit
def logit(mix, scale, base):
    """mix * scale + base as one explicit fused multiply-add. Written as ``mix * scale + base`` the compiler may
    fuse the product into the add or not, depending on the code around it and the kernel's specialization (as
    forward_finish's mix did: mhc_streams._mix_in), and the forward's gates and the backward's replay of them must
    round alike. Shapes broadcast as ``mix * scale + base`` would."""
    z = mix * scale + base  # only its shape is used: dead code to the compiler
    return tl.fma(tl.broadcast_to(mix, z.shape), tl.broadcast_to(scale, z.shape), tl.broadcast_to(base, z.shape))


@triton.jit
def bf16_pieces(v):
    """FP32 v as bf16 (hi, lo), hi = round(v), lo = round(v - hi): ~16 mantissa bits together, so two bf16 MMAs
    against a bf16 operand (exact in bf16) beat one TF32 MMA in accuracy and, on an H200, in speed."""
    hi = v.to(tl.bfloat16)
    return hi, (v - hi.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def dot_bf16(a, b, acc, INTERPRET: tl.constexpr):
    """acc + a @ b with bf16 operands. The interpreter's bf16 dot is broken: the same values through an FP32 dot."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def softmax_rows(a):
    """Softmax over the last axis of [BLOCK_T, N, N]."""
    e = tl.exp(a - tl.max(a, axis=2)[:, :, None])
    return tl.div_rn(e, tl.sum(e, axis=2)[:, :, None])


@triton.jit
def normalize(p, AXIS: tl.constexpr, hc_eps):
    """p / (sum over AXIS + eps): AXIS 2 normalizes rows, AXIS 1 columns."""
    return tl.div_rn(p, tl.expand_dims(tl.sum(p, axis=AXIS), AXIS) + hc_eps)


@triton.jit
def sinkhorn(mix_res, scale_res, base_res, hc_eps, iters, scr, STEP: tl.constexpr, RECORD: tl.constexpr):
    """comb [BLOCK_T, N, N] from the residual logits' normalized projections: a = mix*scale + base, row softmax
    + eps, columns, then (rows, columns) * (iters - 1). Returns (comb, softmax(a)).

    RECORD: the input of normalization step s is stored at ``scr + s*STEP`` (2*iters - 1 steps) for the
    backward; the arithmetic is the same either way."""
    s = softmax_rows(logit(mix_res, scale_res, base_res))
    p = s + hc_eps
    if RECORD:
        tl.store(scr, p)
    p = normalize(p, 1, hc_eps)
    for k in range(1, iters):
        if RECORD:
            tl.store(scr + (2 * k - 1) * STEP, p)
        p = normalize(p, 2, hc_eps)
        if RECORD:
            tl.store(scr + 2 * k * STEP, p)
        p = normalize(p, 1, hc_eps)
    return p, s
