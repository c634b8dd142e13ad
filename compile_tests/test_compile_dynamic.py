"""torch.compile(fullgraph=True, dynamic=True): float arguments (eps values, module attributes) become symbolic
there, so the argument checks must trace with them; the modules and the FlashInfer-style functions over several
sequence lengths, gradients equal to eager's."""
import pytest
import torch
import torch._dynamo

import cakeops
from cakeops import cake_mhc_train as mhc
from conftest import DEVICE
from graph_tools import grads_after

C = 16


def _models():
    torch.manual_seed(0)
    return {
        "rmsnorm": (cakeops.nn.RMSNorm(C, eps=1e-6), 3),
        "mhc": (cakeops.nn.MHC(torch.nn.Linear(C, C), hidden_size=C, rms_eps=0.5, hc_eps=0.05), 4),
        "gated head": (cakeops.nn.MHCHead(gated=True, n_streams=4, hidden_size=C), 4),
    }


@pytest.mark.parametrize("name", ["rmsnorm", "mhc", "gated head"])
def test_modules_compile_with_dynamic_true(backend, name):
    model, dims = _models()[name]
    model = model.to(DEVICE)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend="aot_eager")
    for seq in (3, 5, 8):
        x = torch.randn(2, seq, 4, C, device=DEVICE) if dims == 4 else torch.randn(2, seq, C, device=DEVICE)
        g = torch.randn_like(model(x))
        for k, (got, ref) in enumerate(zip(grads_after(compiled, x, g), grads_after(model, x, g))):
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6, msg=lambda m: f"seq {seq}, grad {k}: {m}")


def test_function_compiles_with_a_float_argument_that_changes(backend):
    """A compiled function called again with another eps (torch then makes it symbolic: automatic dynamic)."""
    torch.manual_seed(1)
    n, T = 4, 5
    X = torch.randn(T, n, C, device=DEVICE)
    fn = torch.randn(24, n * C, device=DEVICE) * 0.1
    scale, base = torch.ones(3, device=DEVICE), torch.zeros(24, device=DEVICE)
    torch._dynamo.reset()
    f = torch.compile(lambda X, eps: mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, rms_eps=eps),
                      fullgraph=True, backend="aot_eager")
    for eps in (1e-5, 0.5, 2.0):
        got, want = f(X, eps), mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, rms_eps=eps)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
