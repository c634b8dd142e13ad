"""Shared test setup. Without a GPU, Triton kernels run on CPU tensors through the interpreter,
which must be switched on before triton is first imported."""
import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _check_interpreter_numpy() -> None:
    """triton 3.6's interpreter turns a program id into a Python int by ``int(array)``, which NumPy 2.4 refuses
    for 1-element arrays (triton 3.7 fixed it): say so up front instead of failing every kernel test."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy
    import triton

    def version(module):
        return tuple(int(p) for p in module.__version__.split("+")[0].split(".")[:2])

    if version(triton) < (3, 7) and version(numpy) >= (2, 4):
        raise pytest.UsageError(f"the Triton {triton.__version__} interpreter (kernel tests on CPU) needs NumPy < 2.4, "
                                f"found {numpy.__version__}: pip install 'numpy<2.4' (or triton >= 3.7)")


_check_interpreter_numpy()

from cakeops import _backend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ON_GPU = DEVICE == "cuda"


@pytest.fixture(params=["triton", "reference"] if not ON_GPU else ["triton"])
def backend(request):
    """Run the test through the Triton kernels (CUDA, or the interpreter on CPU) and the reference math."""
    if ON_GPU:
        yield request.param
        return
    with _backend.cpu_kernels(request.param):
        yield request.param


@pytest.fixture
def triton_kernels():
    """Force the Triton kernels (interpreter on CPU)."""
    if ON_GPU:
        yield
        return
    with _backend.cpu_kernels("triton"):
        yield


@pytest.fixture
def opaque_ops(monkeypatch):
    """The cakeops ops kept as ops under torch.compile on a GPU too, where they are otherwise traced as their
    kernels (cakeops/_ops/inductor.py): for tests of the op-level graphs."""
    from cakeops._ops import inductor

    monkeypatch.setattr(inductor, "_TRACE", "none")


def test_seed(nodeid: str) -> int:
    """The seed of a test, the same in every process and run (crc32 of its id, unlike ``hash``)."""
    return zlib.crc32(nodeid.encode())


@pytest.fixture(autouse=True)
def _stable_seed(request):
    """Every test starts from its own stable seed; a test that seeds explicitly overrides it."""
    torch.manual_seed(test_seed(request.node.nodeid))
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed:
        report.sections.append(("cakeops seed", f"torch.manual_seed({test_seed(item.nodeid)}) (crc32 of the test id; "
                                                "tests that seed explicitly name their seed in the code)"))


# ---- caller buffers of any layout (the FlashInfer-style functions' out=, dX= ...) ----

BUFFER_LAYOUTS = ("column_offset", "row_stride", "transposed", "unaligned")


def buffer_view(values: torch.Tensor, layout: str):
    """(backing, view): ``view`` holds ``values`` (its shape, dtype and device) in ``layout``, inside ``backing``
    whose other elements hold a sentinel. Layouts: ``column_offset``, the last dim a slice at an odd offset of a
    16-wider one (non-contiguous and unaligned); ``row_stride``, the rows of a one-wider tensor (an odd row
    stride); ``transposed``, the last two dims swapped in memory; ``unaligned``, contiguous but one element off
    an aligned address. A 1-D buffer has no rows: ``row_stride`` and ``transposed`` take every other element."""
    shape, last = tuple(values.shape), values.shape[-1]

    def filled(*backing_shape):
        return torch.full(backing_shape, -77.0, dtype=values.dtype, device=values.device)

    if layout == "column_offset":
        backing = filled(*shape[:-1], last + 16)
        view = backing[..., 1:1 + last]
    elif layout == "unaligned":
        backing = filled(values.numel() + 1)
        view = backing[1:].view(shape)
    elif values.dim() == 1:
        backing = filled(2 * last)
        view = backing[::2]
    elif layout == "row_stride":
        backing = filled(*shape[:-1], last + 1)
        view = backing[..., :last]
    elif layout == "transposed":
        backing = filled(*shape[:-2], last, shape[-2])
        view = backing.transpose(-1, -2)
    else:
        raise ValueError(f"layout: one of {BUFFER_LAYOUTS}, got {layout!r}")
    assert view.shape == values.shape
    view.copy_(values)
    return backing, view


def assert_written_in_view(backing: torch.Tensor, before: torch.Tensor, view: torch.Tensor, want: torch.Tensor):
    """``backing`` is ``before`` (its contents before the call) but for ``view``, which holds ``want`` bit for bit."""
    expected = before.clone()
    expected.as_strided(view.shape, view.stride(), view.storage_offset() - backing.storage_offset()).copy_(want)
    assert torch.equal(backing, expected), "the call wrote outside the buffer's view, or wrote other values into it"
