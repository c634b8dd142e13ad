"""Parameters in any float dtype: mHC mappings and RMSNorm weights cast to bf16/fp16 (model.to(dtype), FSDP2
mixed precision) run through the same FP32 math and get gradients in their own dtype; autocast works."""
import pytest
import torch

import cakeops
from cakeops.cake_mhc_train import cake_mhc_train_finish, cake_mhc_train_prepare
from cakeops.cake_rmsnorm_train import cake_rmsnorm
from cakeops.tiny_lm import TinyLM
from conftest import DEVICE

LOW = [torch.bfloat16, torch.float16]


def _compiled_or_eager(mode, fn):
    if mode == "compiled":
        torch._dynamo.reset()
        return torch.compile(fn, fullgraph=True, backend="aot_eager")
    return fn


def _mhc_layer(X, fn, scale, base):
    U, handle = cake_mhc_train_prepare(X, fn, scale, base, hc_eps=0.05, sinkhorn_iters=4)
    return cake_mhc_train_finish(X, torch.tanh(U), handle)


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("pdtype", LOW, ids=["bf16", "fp16"])
def test_mhc_low_precision_mapping_is_the_fp32_math(backend, mode, pdtype):
    """A bf16/fp16 mapping computes exactly what its FP32 widening computes (every bf16/fp16 value is an FP32
    value): the same Y, and parameter gradients equal to the FP32 gradients rounded once to the parameter dtype."""
    g = torch.Generator().manual_seed(7)
    T, C = 6, 16
    X = torch.randn(T, 4, C, generator=g).to(DEVICE, torch.bfloat16)
    low = [(torch.randn(24, 4 * C, generator=g) * 0.2).to(DEVICE, pdtype),
           torch.tensor([1.0, 1.0, 3.0]).to(DEVICE, pdtype), torch.randn(24, generator=g).to(DEVICE, pdtype)]
    wide = [p.float() for p in low]
    gY = torch.randn(T, 4, C, generator=g).to(DEVICE, torch.bfloat16)
    layer = _compiled_or_eager(mode, _mhc_layer)
    results = []
    for params in (low, wide):
        leaves = [X.clone().requires_grad_()] + [p.clone().requires_grad_() for p in params]
        Y = layer(*leaves)
        results.append((Y, torch.autograd.grad(Y, leaves, gY)))
    (Y_low, g_low), (Y_wide, g_wide) = results
    assert torch.equal(Y_low, Y_wide)
    assert torch.equal(g_low[0], g_wide[0])  # dX
    for got, want, p in zip(g_low[1:], g_wide[1:], low):
        assert got.dtype == pdtype
        assert torch.equal(got, want.to(pdtype))


@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rmsnorm_weight_in_any_float_dtype(backend, wdtype):
    x = torch.randn(5, 64, device=DEVICE, requires_grad=True)  # fp32 activations, e.g. an FP32 residual stream
    w = (1 + 0.1 * torch.randn(64, device=DEVICE)).to(wdtype).requires_grad_()
    y = cake_rmsnorm(x, w, 1e-6)
    g = torch.randn_like(y)
    y.backward(g)
    w_wide = w.detach().float().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    y_wide = cake_rmsnorm(x2, w_wide, 1e-6)
    y_wide.backward(g)
    assert torch.equal(y, y_wide) and torch.equal(x.grad, x2.grad)
    assert w.grad.dtype == wdtype and torch.equal(w.grad, w_wide.grad.to(wdtype))


def _step(model, tokens):
    model.zero_grad(set_to_none=True)
    loss = model.loss(tokens)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def test_model_to_bfloat16_trains(backend):
    """The most common line of a training script: model.to(torch.bfloat16), then train."""
    torch.manual_seed(0)
    model = TinyLM(48, 32, layers=1, heads=4).to(DEVICE).to(torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    tokens = torch.randint(0, 48, (2, 9), device=DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss, grads = _step(model, tokens)
    assert torch.isfinite(loss) and all(g is not None and g.dtype == torch.bfloat16 for g in grads)
    opt.step()
    compiled = torch.compile(model.loss, fullgraph=True, backend="aot_eager")
    model.zero_grad(set_to_none=True)
    c_loss = compiled(tokens)
    c_loss.backward()
    c_grads = [p.grad.clone() for p in model.parameters()]
    e_loss, e_grads = _step(model, tokens)
    assert torch.equal(c_loss.detach(), e_loss) and all(torch.equal(a, b) for a, b in zip(c_grads, e_grads))


@pytest.mark.parametrize("module", ["mhc", "gated head"])
def test_keep_fp32_mapping_survives_model_casts(module):
    def make(**kw):
        if module == "mhc":
            return cakeops.nn.MHC(torch.nn.Linear(16, 16), hidden_size=16, **kw)
        return torch.nn.Sequential(torch.nn.Linear(16, 16), cakeops.nn.MHCHead(4, gated=True, hidden_size=16, **kw))

    block = make(keep_fp32_mapping=True)
    owner = block if module == "mhc" else block[1]
    fp32_before = [p.detach().clone() for p in (owner.fn, owner.scale, owner.base)]
    block.to(torch.bfloat16)
    block.half()
    assert next(p for p in block.parameters() if p.dim() == 2 and p.shape == (16, 16)).dtype == torch.float16
    for p, before in zip((owner.fn, owner.scale, owner.base), fp32_before):
        assert p.dtype == torch.float32 and torch.equal(p.detach(), before)  # not re-widened rounded values
    plain = make().to(torch.bfloat16)
    assert (plain if module == "mhc" else plain[1]).fn.dtype == torch.bfloat16


def test_autocast_around_an_mhc_model(backend):
    """Under torch.autocast the branch runs in bf16 while the residual streams stay FP32: the ops take a bf16
    branch output next to FP32 streams, and the step trains."""
    torch.manual_seed(1)
    model = TinyLM(48, 32, layers=1, heads=4).to(DEVICE)
    tokens = torch.randint(0, 48, (2, 9), device=DEVICE)
    with torch.autocast(device_type=torch.device(DEVICE).type, dtype=torch.bfloat16):
        loss = model.loss(tokens)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("name", ["mhc", "gated head", "rmsnorm"])
def test_autocast_leaves_the_ops_math_fp32(backend, name):
    """Inside an autocast region the cakeops layers still compute in FP32 (autocast picks the branch's dtype,
    not the layer's math): FP32 inputs give the same values and gradients as outside it. The CPU reference path
    once ran its matmuls in bf16 there (U 2e-2 off, the gated head's output 1.3e-2)."""
    torch.manual_seed(7)
    C = 16
    layers = {"mhc": (cakeops.nn.MHC(torch.nn.Identity(), hidden_size=C, rms_eps=0.5, hc_eps=0.05), (5, 4, C)),
              "gated head": (cakeops.nn.MHCHead(gated=True, n_streams=4, hidden_size=C), (5, 4, C)),
              "rmsnorm": (cakeops.nn.RMSNorm(C), (5, C))}
    layer, shape = layers[name]
    layer = layer.to(DEVICE)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(shape, device=DEVICE)
    g = torch.randn_like(layer(x))

    def run(autocast: bool):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        with torch.autocast(device_type=torch.device(DEVICE).type, dtype=torch.bfloat16, enabled=autocast):
            y = layer(xx)
            y.backward(g)
        return [y.detach(), xx.grad] + [p.grad for p in layer.parameters()]

    for k, (got, want) in enumerate(zip(run(True), run(False))):
        assert got.dtype == want.dtype, k
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6, msg=lambda m: f"output {k}: {m}")
