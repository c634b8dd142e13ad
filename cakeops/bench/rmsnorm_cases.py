"""RMSNorm bench cases: forward, add+forward, backward with deterministic and with fast (atomic) dw.

Peers run the reference math (``cakeops.reference.rmsnorm``) in eager torch and under torch.compile,
and Liger-Kernel's RMSNorm when ``liger_kernel`` is installed. The oracle of every check is the same
reference math in float64.
"""
import functools
import importlib.util
from types import SimpleNamespace

import torch

from ..cake_rmsnorm_train import cake_rmsnorm_train_backward, cake_rmsnorm_train_forward
from ..reference import rmsnorm as ref
from ..testing import rel_err
from .core import Case, generator, register

EPS = 1e-6
SHAPES = ({"T": 32768, "H": 4096}, {"T": 16384, "H": 8192})  # the first one is `bench --quick`
FWD_TOL = {"y": 4e-3, "rstd": 1e-5, "h_new": 4e-3}  # design.md §3, bf16 outputs and the FP32 record
BWD_TOL = {"dx": 1e-2, "dw": 1e-2}


@functools.lru_cache(maxsize=None)
def _compiled(fn):
    # One wrapper per reference function; static shapes, so each bench shape gets its own specialized graph.
    return torch.compile(fn, dynamic=False)


def _make(device, dtype, size, *, op, residual=False, grad=False):
    T, H = size["T"], size["H"]
    gen = generator(device, "rmsnorm", op, T, H)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(dtype)

    s = SimpleNamespace(eps=EPS, x=randn(T, H), residual=None, g=None, rstd=None, deterministic=True)
    s.w = (1.0 + 0.5 * torch.randn(H, generator=gen, device=device)).to(dtype)  # far from all-ones
    if residual:
        s.residual = randn(T, H)
    if grad:
        s.g = randn(T, H)
        s.rstd = ref.forward(s.x, s.w, s.eps)[1].float()
    return s


def _as_double(s):
    return {k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in vars(s).items()}


# ---- forward (with or without the residual add) ----

def _fwd(s):
    return cake_rmsnorm_train_forward(s.x, s.w, s.eps, residual=s.residual)


def _fwd_ref(s):
    return ref.forward(s.x, s.w, s.eps, residual=s.residual)


def _fwd_compiled(s):
    return _compiled(ref.forward)(s.x, s.w, s.eps, residual=s.residual)


def _fwd_check(s):
    out = dict(zip(("y", "rstd", "h_new"), _fwd(s)))
    d = SimpleNamespace(**_as_double(s))
    want = {}
    if s.residual is not None:
        # design.md §1: the op normalizes its own rounded h_new. So h_new is checked against the exact sum and
        # (y, rstd) against the oracle applied to that h_new -- which also holds where the rounding is
        # not to nearest (the Triton interpreter truncates).
        want["h_new"] = d.x + d.residual
        d.x, d.residual = out["h_new"].double(), None
    want["y"], want["rstd"] = _fwd_ref(d)
    return {name: rel_err(value, want[name]) for name, value in out.items()}


def _fwd_bytes(s):
    reads = s.x.nbytes + s.w.nbytes + (s.residual.nbytes if s.residual is not None else 0)
    writes = s.x.nbytes * (2 if s.residual is not None else 1) + s.x.shape[0] * 4  # y [+ h_new] + rstd
    return reads + writes


# ---- backward ----

def _bwd(s):
    return cake_rmsnorm_train_backward(s.g, s.x, s.w, s.rstd, deterministic=s.deterministic)


def _bwd_ref(s):
    return ref.backward(s.g, s.x, s.w, s.rstd)


def _bwd_compiled(s):
    return _compiled(ref.backward)(s.g, s.x, s.w, s.rstd)


def _bwd_check(s):
    d = SimpleNamespace(**_as_double(s))
    d.rstd = ref.forward(d.x, d.w, d.eps)[1]  # the oracle's own rstd, not the FP32 one the op is given
    return {name: rel_err(out, want) for name, out, want in zip(("dx", "dw"), _bwd(s), _bwd_ref(d))}


def _bwd_bytes(s):
    return s.g.nbytes + s.x.nbytes + s.w.nbytes + s.rstd.nbytes + s.x.nbytes + s.x.shape[1] * 4  # dw FP32


# ---- Liger-Kernel (optional peer) ----

def _liger_fwd(s):
    # Positional (X, [R,] W, eps, offset, casting_mode, in_place): Liger's autograd Functions take no kwargs.
    if s.residual is None:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        return LigerRMSNormFunction.apply(s.x, s.w, s.eps, 0.0, "llama", False)
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    return LigerFusedAddRMSNormFunction.apply(s.x, s.residual, s.w, s.eps, 0.0, "llama", False)


def _liger_bwd(s):
    # Liger exposes its backward only through autograd: build the graph once per state, replay its backward.
    if getattr(s, "liger_graph", None) is None:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        x, w = s.x.detach().requires_grad_(), s.w.detach().requires_grad_()
        s.liger_graph = (LigerRMSNormFunction.apply(x, w, s.eps, 0.0, "llama", False), x, w)
    y, x, w = s.liger_graph
    return torch.autograd.grad(y, (x, w), s.g, retain_graph=True)


def _peers(eager, compiled, liger):
    peers = {"torch eager": eager, "torch.compile": compiled}
    if importlib.util.find_spec("liger_kernel") is not None:
        peers["liger"] = liger
    return peers


def _cases():
    fwd_peers = _peers(_fwd_ref, _fwd_compiled, _liger_fwd)
    bwd_peers = _peers(_bwd_ref, _bwd_compiled, _liger_bwd)

    def bwd_make(deterministic):
        def make(device, dtype, size):
            s = _make(device, dtype, size, op="bwd", grad=True)
            s.deterministic = deterministic
            return s
        return make

    kinds = (
        ("rmsnorm fwd", functools.partial(_make, op="fwd"), _fwd, _fwd_bytes, _fwd_check, FWD_TOL, fwd_peers),
        ("add+rmsnorm fwd", functools.partial(_make, op="add_fwd", residual=True), _fwd, _fwd_bytes, _fwd_check,
         FWD_TOL, fwd_peers),
        ("rmsnorm bwd", bwd_make(True), _bwd, _bwd_bytes, _bwd_check, BWD_TOL, bwd_peers),
        ("rmsnorm bwd (fast dw)", bwd_make(False), _bwd, _bwd_bytes, _bwd_check, BWD_TOL, bwd_peers),
    )
    for name, make, run, nbytes, check, tol, peers in kinds:
        for i, size in enumerate(SHAPES):
            yield Case(family="rmsnorm", name=name, size=size, make=make, run=run, nbytes=nbytes, check=check,
                       tol=tol, peers=peers, quick=i == 0)


register(*_cases())
