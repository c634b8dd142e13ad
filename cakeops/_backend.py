"""Which implementation runs an op on a given tensor: the Triton kernels or the reference math.

CUDA tensors always take the Triton kernels. CPU tensors take the reference math, unless the
Triton interpreter is asked to run the kernels on CPU (``CAKEOPS_CPU_KERNELS=triton`` with
``TRITON_INTERPRET=1``, both set before cakeops and triton are imported; numpy installed) -- that is
how the kernels themselves are tested on machines without a GPU (the tests switch per test with
``cpu_kernels``; ``conftest.py`` sets ``TRITON_INTERPRET=1``).
"""
import contextlib
import functools
import os

import torch

_cpu_runs_triton = os.environ.get("CAKEOPS_CPU_KERNELS", "reference") == "triton"
# asked for by the environment without the interpreter, where Triton fails with "0 active drivers" (the host-time
# tools switch _cpu_runs_triton on under a fake driver instead: bench/host_rmsnorm.fake_driver)
_MISSING_INTERPRETER = _cpu_runs_triton and os.environ.get("TRITON_INTERPRET") != "1"
_NO_INTERPRETER = ("CAKEOPS_CPU_KERNELS=triton runs the Triton kernels on CPU tensors through Triton's interpreter: "
                   "set TRITON_INTERPRET=1 as well (before triton is imported) and install numpy, or unset "
                   "CAKEOPS_CPU_KERNELS for the reference math")


def use_triton(t: torch.Tensor) -> bool:
    if t.is_cuda:
        return True
    if _cpu_runs_triton and t.device.type == "cpu":
        if _MISSING_INTERPRETER:
            raise RuntimeError(_NO_INTERPRETER)
        return True
    return False


@contextlib.contextmanager
def cpu_kernels(kind: str):
    """Within the block, CPU tensors run ``"triton"`` kernels (interpreter) or the ``"reference"``."""
    global _cpu_runs_triton
    if kind not in ("triton", "reference"):
        raise ValueError(f"cpu_kernels: kind must be 'triton' or 'reference', got {kind!r}")
    if kind == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton is imported")
    saved, _cpu_runs_triton = _cpu_runs_triton, kind == "triton"
    try:
        yield
    finally:
        _cpu_runs_triton = saved


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def kernel_device(t: torch.Tensor):
    """A context in which Triton kernels for ``t`` launch on ``t``'s GPU.

    Triton launches on the *current* CUDA device and its current stream, whatever device the pointers live on:
    with a tensor on cuda:1 while cuda:0 is current (model-parallel code, a second GPU in a notebook) the kernel
    would run on the wrong GPU. A no-op (no device switch, ~0.3 us) in the common case where the device is
    already current.
    """
    if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def device_switch(t: torch.Tensor):
    """``(switch, device)``: ``kernel_device(t)``, or None where no switch is needed (a hot path then skips the
    ``with`` altogether: entering a null context costs as much as the check), and the CUDA device current inside
    it (None for a CPU tensor), which the launchers take so as not to ask for it again per launch."""
    if not t.is_cuda:
        return None, None
    current, index = torch.cuda.current_device(), t.device.index
    if index is None or index == current:
        return None, current
    return torch.cuda.device(t.device), index


class AutocastOff:
    """A reference-math module (``cakeops.reference``) whose functions run with CPU autocast off: the CPU path
    computes in FP32 as the kernels do, inside a ``torch.autocast("cpu", dtype=torch.bfloat16)`` region too, where
    autocast would otherwise run the projection's and the mixing's matmuls in bf16 (an mHC layer's U 2e-2 off)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            with torch.autocast("cpu", enabled=False):
                return fn(*args, **kwargs)
        return run
