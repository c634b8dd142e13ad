"""mHC bench cases: forward_prepare, forward_finish, head (fwd, bwd), the gated head (fwd, bwd), backward_prepare,
backward_finish, and one whole layer forward + backward with an identity branch. n = 4 streams unless a shape says
``n``: n = 2 and n = 8 rows at T=16384 C=4096 and at the X bytes of n = 4's T=16384 C=4096 row (n=2 T=32768,
n=8 T=8192), for the GB/s comparison of SPEC §4 ("n = 2 and n = 8, same bytes: within 15 % of n = 4's GB/s").

Peers run the reference math (``cakeops.reference.mhc``) in eager torch and under torch.compile; the oracle of
every check is that math in float64 on the same inputs.
"""
import functools
from types import SimpleNamespace

import torch

from .. import cake_mhc_train as mhc
from ..meta import mhc_layout as layout
from ..reference import mhc as ref
from ..reference import mhc_gated_head as gh_ref
from ..testing import rel_err
from .core import Case, generator, kernel_times_us, register

HP = dict(rms_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=20)
SHAPES = ({"T": 16384, "C": 4096}, {"T": 16384, "C": 7168}, {"T": 8192, "C": 4096},
          {"T": 8192, "C": 7168})  # the first one is `bench --quick`
STREAM_SHAPES = ({"T": 16384, "C": 4096, "n": 2}, {"T": 32768, "C": 4096, "n": 2},
                 {"T": 16384, "C": 4096, "n": 8}, {"T": 8192, "C": 4096, "n": 8})
TINY = {"T": 32, "C": 64}
OUT_TOL, STATS_TOL, GRAD_TOL = 4e-3, 1e-3, 1e-2  # design.md §3: bf16 outputs, FP32 records (bf16 projection), grads


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    return torch.compile(fn, dynamic=False)


def _make(device, dtype, size):
    T, C, N = size["T"], size["C"], size.get("n", layout.N_STREAMS)
    M = layout.n_logits(N)
    gen = generator(device, "mhc", T, C, *(() if N == layout.N_STREAMS else (N,)))

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    s = SimpleNamespace(X=randn(T, N, C), B=randn(T, C), dY=randn(T, N, C), dU=randn(T, C))
    s.fn = randn(M, N * C, dt=torch.float32) / (N * C) ** 0.5
    s.scale = torch.tensor([1.0, 1.0, 3.0], device=device)  # logits far from uniform
    s.base = randn(M, dt=torch.float32)
    s.U, s.stats = mhc.cake_mhc_train_forward_prepare(s.X, s.fn, s.scale, s.base, **HP)
    s.grad_stats = mhc.cake_mhc_train_backward_prepare(s.dY, s.B, s.X, s.stats)[1]
    return s


def _hp_args():
    return HP["rms_eps"], HP["hc_eps"], HP["sinkhorn_iters"]


def _d(s):
    return SimpleNamespace(**{k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in vars(s).items()})


def _errors(names, got, want):
    return {name: rel_err(g, w) for name, g, w in zip(names, got, want)}


# ---- forward ----

def _prepare(s):
    return mhc.cake_mhc_train_forward_prepare(s.X, s.fn, s.scale, s.base, **HP)


def _prepare_ref(s):
    return ref.forward_prepare(s.X, s.fn, s.scale, s.base, *_hp_args())


def _prepare_bytes(s):
    return s.X.nbytes + s.fn.nbytes + s.U.nbytes + s.stats.nbytes


def _prepare_check(s):
    d = _d(s)
    got = _prepare(s)
    want = _prepare_ref(d)
    return _errors(("U", "stats"), got, want)


def _finish(s):
    return mhc.cake_mhc_train_forward_finish(s.X, s.B, s.stats)


def _finish_ref(s):
    return ref.forward_finish(s.X, s.B, s.stats)


def _finish_bytes(s):
    return 2 * s.X.nbytes + s.B.nbytes + s.stats.nbytes


def _finish_check(s):
    return {"Y": rel_err(_finish(s), _finish_ref(_d(s)))}


def _head(s):
    return mhc.cake_mhc_train_head_forward(s.X)


def _head_bytes(s):
    return s.X.nbytes + s.X.nbytes // s.X.shape[1]


def _head_check(s):
    return {"Y": rel_err(_head(s), ref.head_forward(s.X.double()))}


def _head_bwd(s):
    return mhc.cake_mhc_train_head_backward(s.dU, n_streams=s.X.shape[1])


def _head_bwd_ref(s):
    return ref.head_backward(s.dU, s.X.shape[1])


def _head_bwd_check(s):
    return {"dX": rel_err(_head_bwd(s), ref.head_backward(s.dU.double(), s.X.shape[1]))}


# ---- the gated head (DeepSeek-V4's hc_head), forward and backward ----
# Minimal bytes, forward: X read once, fn read once, Y written, the record written (its 32 FP32 per token).
# Backward: X and dY read once, dX written, fn read, dfn written, the record read (scale, base, dscale, dbase
# are a few bytes). The kernels read X twice in each direction (a whole-row reduction first, DESIGN.md), so
# these rows sit below the copy ceiling by design, like forward_prepare's and backward_finish's.

GH_HP = dict(rms_eps=1e-5, hc_eps=1e-6)


def _make_gated(device, dtype, size):
    T, C, n = size["T"], size["C"], size.get("n", 4)
    gen = generator(device, "mhc gated head", T, C) if n == 4 else generator(device, "mhc gated head", T, C, n)

    def randn(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dt)

    s = SimpleNamespace(X=randn(T, n, C), dY=randn(T, C))
    s.fn = randn(n, n * C, dt=torch.float32) / (n * C) ** 0.5
    s.scale = torch.tensor([3.0], device=device)  # gates far from 1/2
    s.base = randn(n, dt=torch.float32)
    s.Y, s.stats = mhc.cake_mhc_train_gated_head_forward(s.X, s.fn, s.scale, s.base, **GH_HP)
    return s


def _gated_args(s):
    return s.X, s.fn, s.scale, s.base


def _gated_fwd(s):
    return mhc.cake_mhc_train_gated_head_forward(*_gated_args(s), **GH_HP)


def _gated_fwd_ref(s):
    return gh_ref.forward(*_gated_args(s), *GH_HP.values())


def _gated_fwd_bytes(s):
    return s.X.nbytes + s.fn.nbytes + s.Y.nbytes + s.stats.nbytes


def _gated_fwd_check(s):
    return _errors(("Y", "stats"), _gated_fwd(s), _gated_fwd_ref(_d(s)))


def _gated_bwd(s):
    return mhc.cake_mhc_train_gated_head_backward(s.dY, *_gated_args(s), s.stats, **GH_HP)


def _gated_bwd_ref(s):
    return gh_ref.backward(s.dY, *_gated_args(s), s.stats, GH_HP["hc_eps"])


def _gated_bwd_bytes(s):
    return 2 * s.X.nbytes + s.dY.nbytes + 2 * s.fn.nbytes + s.stats.nbytes  # X, dX; dY; fn, dfn; the record


def _gated_bwd_check(s):
    return _errors(("dX", "dfn", "dscale", "dbase"), _gated_bwd(s), _gated_bwd_ref(_d(s)))


# ---- backward ----

def _bwd_prepare(s):
    return mhc.cake_mhc_train_backward_prepare(s.dY, s.B, s.X, s.stats)


def _bwd_prepare_ref(s):
    return ref.backward_prepare(s.dY, s.B, s.X, s.stats)


def _bwd_prepare_bytes(s):
    return s.dY.nbytes + 2 * s.B.nbytes + s.X.nbytes + s.stats.nbytes + s.grad_stats.nbytes


def _bwd_prepare_check(s):
    return _errors(("dB", "grad_stats"), _bwd_prepare(s), _bwd_prepare_ref(_d(s)))


def _bwd_finish(s):
    return mhc.cake_mhc_train_backward_finish(s.X, s.dY, s.dU, None, s.fn, s.scale, s.base, s.stats, s.grad_stats,
                                              **HP)


def _bwd_finish_ref(s):
    return ref.backward_finish(s.X, s.dY, s.dU, s.fn, s.scale, s.base, s.stats, s.grad_stats, *_hp_args())


def _bwd_finish_bytes(s):
    return (3 * s.X.nbytes + s.dU.nbytes + 2 * s.fn.nbytes + s.stats.nbytes + s.grad_stats.nbytes
            + s.scale.nbytes + s.base.nbytes)  # X, dY, dX; dU; fn, dfn; records; dscale, dbase


def _bwd_finish_check(s):
    return _errors(("dX", "dfn", "dscale", "dbase"), _bwd_finish(s), _bwd_finish_ref(_d(s)))


# ---- one whole layer, forward + backward, identity branch ----

def _layer_leaves(s):
    if getattr(s, "leaves", None) is None:
        s.leaves = [t.detach().requires_grad_() for t in (s.X, s.fn, s.scale, s.base)]
    return s.leaves


def _layer(s):
    leaves = _layer_leaves(s)
    return torch.autograd.grad(_layer_forward(*leaves), leaves, s.dY)


def _layer_forward(X, fn, scale, base):
    U, handle = mhc.cake_mhc_train_prepare(X, fn, scale, base, **HP)
    return mhc.cake_mhc_train_finish(X, U, handle)


@functools.lru_cache(maxsize=None)
def _compiled_layer_forward():
    return torch.compile(_layer_forward, dynamic=False, fullgraph=True)


def _layer_compiled_cakeops(s):
    """The same layer as a torch.compile user runs it: forward traced whole (fullgraph) through the custom ops,
    backward from AOTAutograd's graph. Same kernels as the eager row; the difference is host time (Dynamo
    guards, AOTAutograd's runtime wrappers, the custom ops' dispatch). Not timed with CUDA graphs here: with
    X and dY as graph inputs, "reduce-overhead" copies both into its static buffers on every replay."""
    leaves = _layer_leaves(s)
    return torch.autograd.grad(_compiled_layer_forward()(*leaves), leaves, s.dY)


def _layer_math(X, fn, scale, base, dY):
    leaves = [t.detach().requires_grad_() for t in (X, fn, scale, base)]
    Y = ref.layer(*leaves, lambda u: u, *_hp_args())
    return torch.autograd.grad(Y, leaves, dY)


def _layer_ref(s):
    return _layer_math(s.X, s.fn, s.scale, s.base, s.dY)


def _layer_compiled(s):
    return _compiled(_layer_math)(s.X, s.fn, s.scale, s.base, s.dY)


def _layer_bytes(s):
    return (_prepare_bytes(s) + _finish_bytes(s) + _bwd_prepare_bytes(s) + _bwd_finish_bytes(s))


def _layer_notes(s):
    """The layer's kernel time per call (against its row's time: how host-bound the row is), what it keeps
    between forward and backward beyond X, and its peak extra memory in fwd+bwd."""
    if s.X.device.type != "cuda":
        return {}
    X, fn, scale, base = _layer_leaves(s)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    Y = _layer_forward(X, fn, scale, base)
    kept = torch.cuda.memory_allocated() - before - Y.nbytes
    torch.autograd.grad(Y, (X, fn, scale, base), s.dY)
    peak = torch.cuda.max_memory_allocated() - before
    stats_bytes = X.shape[0] * layout.stats_width(X.shape[1]) * 4
    return {**_kernels_note(_layer)(s),
            "kept beyond X after forward": f"{kept / 2**20:.1f} MiB (U = branch output {X.nbytes / X.shape[1] / 2**20:.1f} MiB, "
                                          f"stats {stats_bytes / 2**20:.1f} MiB; X is {X.nbytes / 2**20:.1f} MiB)",
            "peak extra during fwd+bwd": f"{peak / 2**20:.1f} MiB"}


def _layer_check(s):
    return _errors(("dX", "dfn", "dbase"), [g for i, g in enumerate(_layer(s)) if i != 2],
                   [g for i, g in enumerate(_layer_math(*(t.double() for t in (s.X, s.fn, s.scale, s.base, s.dY))))
                    if i != 2])


def _kernels_note(run):
    """The row's GPU kernel time per call (profiler): where the row's time is above it, the GPU waited for the host
    (do_bench's L2 flush hides only part of a public function's host path)."""
    def note(s):
        kernels_ms = sum(kernel_times_us(lambda: run(s), reps=3).values()) / 1e3
        return {"GPU kernel time per call": f"{kernels_ms:.3f} ms (a row time above it is the GPU waiting for the host)"}
    return note


def _cases():
    def peers(eager):
        return {"torch eager": eager, "torch.compile": lambda s: _compiled(eager)(s)}

    kinds = (
        ("mhc forward_prepare", _prepare, _prepare_bytes, _prepare_check, {"U": OUT_TOL, "stats": STATS_TOL},
         _prepare_ref),
        ("mhc forward_finish", _finish, _finish_bytes, _finish_check, {"Y": OUT_TOL}, _finish_ref),
        ("mhc head fwd", _head, _head_bytes, _head_check, {"Y": OUT_TOL}, lambda s: ref.head_forward(s.X)),
        ("mhc head bwd", _head_bwd, _head_bytes, _head_bwd_check, {"dX": OUT_TOL}, _head_bwd_ref),
        ("mhc backward_prepare", _bwd_prepare, _bwd_prepare_bytes, _bwd_prepare_check,
         {"dB": GRAD_TOL, "grad_stats": GRAD_TOL}, _bwd_prepare_ref),
        ("mhc backward_finish", _bwd_finish, _bwd_finish_bytes, _bwd_finish_check,
         {"dX": GRAD_TOL, "dfn": GRAD_TOL, "dscale": GRAD_TOL, "dbase": GRAD_TOL}, _bwd_finish_ref),
    )
    for name, run, nbytes, check, tol, eager in kinds:
        for i, size in enumerate(SHAPES + STREAM_SHAPES):
            tiny = TINY if "n" not in size else dict(TINY, n=size["n"])
            yield Case(family="mhc", name=name, size=size, make=_make, run=run, nbytes=nbytes, check=check, tol=tol,
                       peers=peers(eager), tiny=tiny, quick=i == 0, notes=_kernels_note(run) if i == 0 else None)
    gated = (
        ("mhc gated head fwd", _gated_fwd, _gated_fwd_bytes, _gated_fwd_check, {"Y": OUT_TOL, "stats": STATS_TOL},
         _gated_fwd_ref),
        ("mhc gated head bwd", _gated_bwd, _gated_bwd_bytes, _gated_bwd_check,
         {"dX": GRAD_TOL, "dfn": GRAD_TOL, "dscale": GRAD_TOL, "dbase": GRAD_TOL}, _gated_bwd_ref),
    )
    for name, run, nbytes, check, tol, eager in gated:
        for i, size in enumerate(SHAPES + STREAM_SHAPES):
            tiny = TINY if "n" not in size else dict(TINY, n=size["n"])
            yield Case(family="mhc", name=name, size=size, make=_make_gated, run=run, nbytes=nbytes, check=check,
                       tol=tol, peers=peers(eager), tiny=tiny, quick=i == 0,
                       notes=_kernels_note(run) if i == 0 else None)
    layer_peers = {"torch eager": _layer_ref, "torch.compile": _layer_compiled,
                   "cakeops under torch.compile": _layer_compiled_cakeops}
    for i, size in enumerate(SHAPES[:2] + STREAM_SHAPES):
        tiny = TINY if "n" not in size else dict(TINY, n=size["n"])
        yield Case(family="mhc", name="mhc layer fwd+bwd (identity branch)", size=size, make=_make, run=_layer,
                   nbytes=_layer_bytes, check=_layer_check, tol={"dX": GRAD_TOL, "dfn": GRAD_TOL, "dbase": GRAD_TOL},
                   peers=layer_peers, tiny=tiny, quick=i == 0, notes=_layer_notes)


register(*_cases())
