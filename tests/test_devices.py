"""Kernels launch on their tensors' GPU, not on whichever GPU is current (Triton launches on the current device)."""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from cakeops import _backend
from cakeops.cake_mhc_train import cake_mhc_train_finish, cake_mhc_train_prepare
from cakeops.cake_rmsnorm_train import cake_rmsnorm


def test_kernel_device_switches_only_to_another_gpu(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def recording_device(device):
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", recording_device)
    on = lambda index: SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))  # noqa: E731
    with _backend.kernel_device(on(1)):
        pass
    assert entered == [torch.device("cuda", 1)]
    for t in (on(0), torch.zeros(1)):  # already current / not a GPU tensor: nothing to switch
        with _backend.kernel_device(t):
            pass
    assert entered == [torch.device("cuda", 1)]


def test_rmsnorm_device_switch_hands_its_launches_the_device_it_read(monkeypatch):
    """The RMSNorm ops read the current device once per forward / backward (with the switch) and hand it to
    their launches, which then do not ask again: it must be the device current inside the switch."""
    entered, asked = [], []

    @contextlib.contextmanager
    def recording_device(device):
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "current_device", lambda: asked.append(1) or 0)
    monkeypatch.setattr(torch.cuda, "device", recording_device)
    on = lambda index: SimpleNamespace(is_cuda=True, device=torch.device("cuda", index))  # noqa: E731
    assert _backend.device_switch(on(0)) == (None, 0)
    switch, device = _backend.device_switch(on(1))
    assert device == 1 and switch is not None and entered == []
    with switch:
        pass
    assert entered == [torch.device("cuda", 1)] and len(asked) == 2
    assert _backend.device_switch(torch.zeros(1)) == (None, None) and len(asked) == 2  # a CPU tensor asks nothing


def _mhc_layer_grads(device, gen_seed=0):
    g = torch.Generator(device="cpu").manual_seed(gen_seed)
    T, C = 64, 256
    X = torch.randn(T, 4, C, generator=g).bfloat16().to(device).requires_grad_()
    fn = (torch.randn(24, 4 * C, generator=g) / (4 * C) ** 0.5).to(device).requires_grad_()
    scale = torch.tensor([1.0, 1.0, 3.0], device=device, requires_grad=True)
    base = torch.randn(24, generator=g).to(device).requires_grad_()
    dY = torch.randn(T, 4, C, generator=g).bfloat16().to(device)
    U, handle = cake_mhc_train_prepare(X, fn, scale, base)
    Y = cake_mhc_train_finish(X, U * 2, handle)
    leaves = (X, fn, scale, base)
    return (Y,) + torch.autograd.grad(Y, leaves, dY)


def _rmsnorm_grads(device):
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(33, 1000, generator=g).bfloat16().to(device).requires_grad_()
    w = torch.randn(1000, generator=g).bfloat16().to(device).requires_grad_()
    y = cake_rmsnorm(x, w)
    return (y,) + torch.autograd.grad(y, (x, w), torch.randn_like(y))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("run", [_mhc_layer_grads, _rmsnorm_grads], ids=["mhc-layer", "rmsnorm"])
def test_tensors_on_the_second_gpu_while_the_first_is_current(run):
    torch.manual_seed(0)
    with torch.cuda.device(1):
        want = run(torch.device("cuda", 1))
    torch.manual_seed(0)
    with torch.cuda.device(0):
        got = run(torch.device("cuda", 1))
        torch.cuda.synchronize(1)
    for a, b in zip(got, want):
        assert a.device == torch.device("cuda", 1)
        assert torch.equal(a, b)
