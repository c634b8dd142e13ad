"""Shared test setup. Without a GPU, Triton kernels run on CPU tensors through the interpreter,
which must be switched on before triton is first imported."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

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
