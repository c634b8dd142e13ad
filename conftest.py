"""Shared test setup. Without a GPU, Triton kernels run on CPU tensors through the interpreter,
which must be switched on before triton is first imported."""
import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest -n N: the N workers share the machine's cores. Each takes its share for torch's threads, and so do
    # the processes the tests start (the environment) and Inductor's C++ compiles (one at a time, in the worker)
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _threads = str(max(1, _cores // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TORCHINDUCTOR_COMPILE_THREADS"):
        os.environ.setdefault(_var, _threads)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

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


@pytest.fixture
def deterministic_inductor(monkeypatch):
    """Inductor's deterministic mode, for tests that compare two compiled graphs bit for bit. Without it Inductor
    picks some of its kernels' configurations (so their reduction orders) by timing them on the device, and its
    embedding backward adds atomically: two compiles, even of the same model, may then differ in the last bits
    (seen on an H100, 2026-12-06). ``torch._inductor.config.deterministic`` and torch's deterministic algorithms
    (warn-only: the ops without a deterministic version still run) remove both."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "deterministic", True)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


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


# The longest tests on a 2-core CPU (cold caches), longest first. Under pytest -n, xdist hands tests out in
# collection order, so these start at once, beside the rest, instead of becoming the tail of a worker's queue; its
# first deal is two tests per worker, so the second longest goes third (to the other worker). The order of the
# others is kept.
LONG_FIRST = (
    "compile_tests/test_deep_model.py::test_sixteen_block_model_compiles_and_matches_eager",
    "tests/test_build_races.py::test_no_kernel_refills_a_buffer_an_asynchronous_mma_reads",
    "compile_tests/test_inductor_kernels.py::test_kernels_build_as_inductor_copies_and_launches_them",
    "tests/test_arch_builds.py::test_a_launcher_traced_by_torch_compile_measures_the_same_build",
    "compile_tests/test_deep_model.py::test_bf16_compiled_gradients_as_close_to_float32_as_eager",
    "compile_tests/test_inductor_kernels.py::test_inductor_hands_traced_kernels_whole_buffers",
    "tests/test_distributed.py::test_two_processes_train_like_one",
    "compile_tests/test_mhc_transformer.py::test_inductor_training_step_close_to_eager",
    "tests/test_distributed.py::test_readme_torchrun_command_trains",
)


def pytest_collection_modifyitems(config, items):
    first = {nodeid: i for i, nodeid in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("[")[0], len(first)))


def pytest_configure(config):
    # pytest -n: xdist keeps two tests queued per worker and deals out the rest one at a time as workers free up
    # (unless --maxschedchunk says otherwise), not a quarter of each worker's share in one piece, which would put
    # every test of LONG_FIRST on one worker
    if config.getoption("dist", "no") == "load" and config.getoption("maxschedchunk", 0) is None:
        config.option.maxschedchunk = 1
