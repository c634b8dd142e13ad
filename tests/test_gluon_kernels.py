"""The Gluon kernel B (cakeops/_gluon/mhc_backward_dx.py) on an sm_90 GPU, against its Triton twin and fp64 math.

Gluon has no interpreter: these tests skip (with the reason) unless a CUDA device of capability (9, 0) is present
and this triton's Gluon imports; tests/test_gluon_builds.py is what CI checks of the kernel on a CPU.

* Kernel B alone (``mhc_backward_finish.launch_dx``), the Gluon and the Triton kernel on the same random inputs
  (CAKEOPS_GLUON toggled; the inputs and the switch are python -m cakeops.bench.gluon_dx's): dX bitwise equal, by construction (the same FP32 sum in the same order, the same TF32
  tensor-core instruction with the same accumulator, chained over the same logits; test_gluon_builds checks the
  instructions); with a diagnostic of how far apart they are when they are not. A ragged token tail (T not a
  multiple of 64), column tails (C not a multiple of the column tile), n = 2, 4, 8, bf16 and fp16.
* The same through the whole backward_finish op: dX equal, and dfn / dscale / dbase equal too (the other kernels
  are unchanged: a Gluon kernel writing out of bounds would show there).
* Run to run: the Gluon kernel's dX bitwise the same (no cross-token sum: nothing to reorder).
* backward_finish with the Gluon kernel against the fp64 reference math at tests/test_mhc_backward_kernels.py's
  GPU tolerances (1e-2 with 16-bit data), eps values large enough to matter, a Sinkhorn far from uniform.
"""
import math
import os
import zlib

import pytest
import torch

from cakeops import _gluon
from cakeops import cake_mhc_train as mhc
from cakeops._triton.mhc_columns import logits_pad
from cakeops.bench.gluon_dx import KernelB, kernel_b
from cakeops.meta import mhc_layout
from cakeops.reference import mhc as ref
from cakeops.testing import rel_err

SM90 = torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(
    not (SM90 and _gluon.importable()),
    reason="the Gluon kernels need a CUDA device of capability (9, 0) (H100 / H200) and a triton whose Gluon imports "
           f"({_gluon.SUPPORTED_TRITON}); here: "
           + (f"capability {torch.cuda.get_device_capability()}" if torch.cuda.is_available() else "no CUDA device")
           + ("" if _gluon.importable() else ", Gluon does not import"))

STREAMS = (2, 4, 8)
DTYPES = (torch.bfloat16, torch.float16)
# (T, C): ragged token tails (1000, 777: not multiples of 64), a column tail (1000: not a multiple of 64 or 32),
# C not a power of two (1536), the bench's shape, a tiny one
SHAPES = ((1000, 1024), (1000, 1536), (777, 1000), (16384, 4096), (64, 40))
HP = dict(rms_eps=0.5, hc_eps=0.05, sinkhorn_iters=7)  # eps that matter, as the other mHC tests use
DEVICE = "cuda"


def _dtype_id(dtype):
    return str(dtype).replace("torch.", "")


@pytest.fixture(autouse=True)
def gluon_on(monkeypatch):
    """The Gluon path taken (it is off by default until a GPU has checked it: _gluon.DEFAULT_ON)."""
    monkeypatch.setenv("CAKEOPS_GLUON", "1")


@pytest.fixture
def gen(request):
    """A CUDA generator seeded from the test id: every parametrization draws its own inputs."""
    return torch.Generator(device=DEVICE).manual_seed(zlib.crc32(request.node.nodeid.encode()))


def _randn(gen, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen, device=DEVICE) * scale).to(dtype)


def _dx(case: KernelB) -> torch.Tensor:
    """Kernel B's dX written into a NaN-poisoned buffer (an element left unwritten stays NaN)."""
    case.dX.fill_(float("nan"))
    out = case.run().clone()
    torch.cuda.synchronize()
    return out


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest distance between a and b in units of the data dtype's last place at the larger of the two."""
    mantissa_bits = {torch.bfloat16: 7, torch.float16: 10}[a.dtype]
    a, b = a.float(), b.float()
    _, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))
    ulp = torch.ldexp(torch.ones_like(a), exponent - 1 - mantissa_bits)
    return ((a - b).abs() / ulp).nan_to_num(0.0).max().item()


@pytest.mark.parametrize("T, C", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("n", STREAMS)
def test_gluon_dx_equals_triton_kernel_b(gen, n, dtype, T, C):
    """Kernel B's inputs as backward_finish hands them over (bench.gluon_dx.KernelB: dz's padding past s poisoned
    with NaN, which neither kernel may read)."""
    case = KernelB(T, n, C, dtype, DEVICE, gen)
    assert _gluon.takes_dx(case.X, case.dY, case.dU, case.stats, case.dz, case.dX), "the Gluon path is not taken"
    gluon = _dx(case)
    with kernel_b("triton"):
        assert not _gluon.takes_dx(case.X, case.dY, case.dU, case.stats, case.dz, case.dX)
        twin = _dx(case)
    assert not twin.isnan().any(), "the Triton kernel left NaN: bad inputs"
    assert not gluon.isnan().any(), f"Gluon dX: {gluon.isnan().sum().item()} elements unwritten (NaN)"
    if not torch.equal(gluon, twin):
        differ = (gluon != twin)
        where = differ.nonzero()[:5].tolist()
        pytest.fail(f"Gluon dX != Triton's at {differ.sum().item()} of {differ.numel()} elements (first [t, i, c]: "
                    f"{where}); at most {_ulps_apart(gluon, twin):.1f} ulps apart, rel err "
                    f"{rel_err(gluon, twin):.3g}")


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("n", STREAMS)
def test_gluon_dx_is_bitwise_reproducible(gen, n, dtype):
    case = KernelB(16384 - 17, n, 1536, dtype, DEVICE, gen)
    first = _dx(case)
    for _ in range(3):
        assert torch.equal(_dx(case), first)


def _layer(gen, T, n, C, dtype):
    """One layer's backward_finish inputs through the Triton forward kernels: X with tokens of different scales,
    fn ~ N(0, 9/K), scales that put the Sinkhorn far from uniform, random upstream gradients."""
    M = 2 * n + n * n
    X = (torch.randn(T, n, C, generator=gen, device=DEVICE)
         * torch.exp(0.5 * torch.randn(T, 1, 1, generator=gen, device=DEVICE))).to(dtype)
    fn = _randn(gen, M, n * C, scale=3 / math.sqrt(n * C))
    scale = torch.tensor([1.0, 1.5, 4.0], device=DEVICE)
    base = _randn(gen, M)
    B, dU = _randn(gen, T, C, dtype=dtype), _randn(gen, T, C, dtype=dtype)
    dY = _randn(gen, T, n, C, dtype=dtype)
    _, stats = mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, **HP)
    _, gs = mhc.cake_mhc_train_backward_prepare(dY, B, X, stats)
    return X, dY, dU, fn, scale, base, stats, gs


@pytest.mark.parametrize("T, C", ((1000, 1536), (16384, 4096)), ids=lambda v: str(v))
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("n", STREAMS)
def test_gluon_backward_finish_equals_triton(gen, n, dtype, T, C):
    """The whole op with either kernel B: every output the same bits (dX through kernel B; dfn, dscale, dbase from
    kernels that did not change)."""
    X, dY, dU, fn, scale, base, stats, gs = _layer(gen, T, n, C, dtype)
    gluon = mhc.cake_mhc_train_backward_finish(X, dY, dU, None, fn, scale, base, stats, gs, **HP)
    with kernel_b("triton"):
        twin = mhc.cake_mhc_train_backward_finish(X, dY, dU, None, fn, scale, base, stats, gs, **HP)
    for name, a, b in zip(("dX", "dfn", "dscale", "dbase"), gluon, twin):
        assert torch.equal(a, b), f"{name}: rel err {rel_err(a, b):.3g} between the Gluon and the Triton path"


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("n", STREAMS)
def test_gluon_backward_finish_matches_fp64_reference(gen, n, dtype):
    T, C = 1000, 1536
    X, dY, dU, fn, scale, base, _, _ = _layer(gen, T, n, C, dtype)
    f64 = [t.double() for t in (X, dY, dU, fn, scale, base)]
    stats64 = ref.forward_stats(*f64[:1], *f64[3:], HP["rms_eps"], HP["hc_eps"], HP["sinkhorn_iters"])
    B = _randn(gen, T, C, dtype=dtype)
    gs64 = ref.backward_prepare(f64[1], B.double(), f64[0], stats64)[1]
    assert _gluon.takes_dx(X, dY, dU, stats64.float(), torch.empty(T * logits_pad(n), device=DEVICE), X)
    got = mhc.cake_mhc_train_backward_finish(X, dY, dU, None, fn, scale, base, stats64.float(), gs64.float(), **HP)
    want = ref.backward_finish(*f64, stats64, gs64, HP["rms_eps"], HP["hc_eps"], HP["sinkhorn_iters"])
    L = mhc_layout.layout_for(n)
    assert (stats64[:, L.COMB:L.COMB + n * n] - 1.0 / n).abs().max() > 0.1  # the Sinkhorn had work to do
    for name, g, w in zip(("dX", "dfn", "dscale", "dbase"), got, want):
        assert not g.isnan().any(), name
        assert rel_err(g, w) <= 1e-2, f"{name}: rel err {rel_err(g, w):.3g} > 1e-2"


def test_gluon_dx_leaves_tensors_tma_cannot_address_to_triton(gen):
    """A view whose stream stride is no multiple of 16 bytes takes the Triton kernel (and gives its dX)."""
    case = KernelB(100, 4, 64, torch.bfloat16, DEVICE, gen)
    wide = torch.empty(100, 4, 67, dtype=torch.bfloat16, device=DEVICE)
    X = wide[:, :, :64].copy_(case.X)
    assert not _gluon.takes_dx(X, case.dY, case.dU, case.stats, case.dz, case.dX)
    with kernel_b("triton"):
        expected = _dx(case)
    case.X = X
    assert torch.equal(_dx(case), expected)


def test_gluon_switch_reads_the_environment_per_call(monkeypatch):
    monkeypatch.setenv("CAKEOPS_GLUON", "1")
    assert _gluon.available(torch.device(DEVICE), torch.bfloat16, 4)
    monkeypatch.setenv("CAKEOPS_GLUON", "0")
    assert not _gluon.available(torch.device(DEVICE), torch.bfloat16, 4)
    assert os.environ["CAKEOPS_GLUON"] == "0"
