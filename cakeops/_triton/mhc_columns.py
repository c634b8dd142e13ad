"""The mHC record layout (meta/mhc_layout.py) as Triton constexprs, functions of the stream count N: a kernel
writes ``COMB(N)`` where it needs the column, and each N compiles to its own constants (no kernel per n).
Called from host code they return plain ints.

Each function computes its column from N alone, with no module global: Triton re-checks every global a kernel
reads on each launch, and Inductor, when it launches a kernel itself, copies the kernel's source and the sources of
the functions it calls into its own module, but not the globals those functions read. Kernels import them under
these names: torch 2.11's copy defines a function under its own name, not under an import alias. The formulas
restate meta/mhc_layout.py's ``_layout``; tests/test_mhc_nstreams.py checks them against it for every supported n.
"""
import triton


@triton.constexpr_function
def RSTD(N):
    return 0  # FlashInfer's r


@triton.constexpr_function
def MIX(N):
    return 1  # FlashInfer's z: M = 2N + N*N logits


@triton.constexpr_function
def PRE(N):
    return 1 + 2 * N + N * N


@triton.constexpr_function
def POST(N):
    return 1 + 3 * N + N * N


@triton.constexpr_function
def COMB(N):
    return 1 + 4 * N + N * N


@triton.constexpr_function
def STATS_USED(N):
    return 2 * (2 * N + N * N) + 1  # rstd, mix (M), gates and Sinkhorn output (M)


@triton.constexpr_function
def STATS_WIDTH(N):
    return 1 << (2 * (2 * N + N * N)).bit_length()  # STATS_USED rounded up to a power of two


@triton.constexpr_function
def DPOST(N):
    return 0


@triton.constexpr_function
def DCOMB(N):
    return N


@triton.constexpr_function
def GRAD_STATS_USED(N):
    return N + N * N


@triton.constexpr_function
def GRAD_STATS_WIDTH(N):
    return 1 << (N + N * N - 1).bit_length()  # GRAD_STATS_USED rounded up to a power of two


def logits_pad(n: int) -> int:
    """Width of the kernels' per-token logit rows (the projection's partials, backward_finish's dz rows): the
    M = 2n + n*n logits plus one column (sum of x^2, resp. the scalar s) at M, padded to a power of two >= 16
    (a tl.dot dimension). n = 2: 16, n = 4: 32, n = 8: 128."""
    M = 2 * n + n * n
    return max(16, 1 << M.bit_length())  # the smallest power of two > M
