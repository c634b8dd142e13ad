"""The host side of a launch is on every step's critical path when the GPU work is short: what runs there must
stay cheap. triton.cdiv / triton.next_power_of_2 are constexpr-function wrappers (microseconds per call); the
launchers' ~35 such calls per mHC layer cost ~0.45 ms of host time per layer on the H200's host."""
import pytest
import torch
import triton

from cakeops.bench import mhc_cases
from cakeops.cake_rmsnorm_train import cake_rmsnorm

from conftest import DEVICE


@pytest.fixture
def no_triton_host_helpers(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a launcher called triton.cdiv / triton.next_power_of_2 on the host path")
    monkeypatch.setattr(triton, "cdiv", forbidden)
    monkeypatch.setattr(triton, "next_power_of_2", forbidden)


def test_mhc_layer_launchers_use_plain_host_arithmetic(triton_kernels, no_triton_host_helpers):
    s = mhc_cases._make(torch.device(DEVICE), torch.bfloat16, {"T": 17, "C": 40})
    dX, dfn, dscale, dbase = mhc_cases._layer(s)
    assert dX.shape == s.X.shape and not dX.isnan().any() and dfn.isfinite().all()


@pytest.mark.parametrize("H", [40, 20000], ids=["row", "wide-row"])
def test_rmsnorm_launchers_use_plain_host_arithmetic(triton_kernels, no_triton_host_helpers, H):
    x = torch.randn(3, H, device=DEVICE, requires_grad=True)
    w = torch.randn(H, device=DEVICE, requires_grad=True)
    cake_rmsnorm(x, w, 1e-6).backward(torch.randn(3, H, device=DEVICE))
    assert x.grad.isfinite().all() and w.grad.isfinite().all()


def test_rmsnorm_backward_shape_is_worked_out_once_per_size(triton_kernels):
    """The default backward's launch shape (tile, persistent grid) is cached per (device, T, H, dtype size): the
    same sizes again take the cached entry, any other size or dtype a new one, and the launch computes the same
    bits as one whose shape is worked out on the call (an explicit default config)."""
    from cakeops._triton.rmsnorm import RMSNormConfig, _default_backward_shape, backward
    from cakeops.reference import rmsnorm as reference
    from cakeops.testing import rel_err

    _default_backward_shape.cache_clear()
    for T, H, dtype, new in ((33, 40, torch.bfloat16, True), (33, 40, torch.bfloat16, False),
                             (34, 40, torch.bfloat16, True), (33, 48, torch.bfloat16, True),
                             (33, 40, torch.float32, True)):
        x = torch.randn(T, H, device=DEVICE, dtype=dtype)
        w, g = torch.randn(H, device=DEVICE), torch.randn_like(x)
        rstd = torch.rand(T, device=DEVICE) + 0.5
        misses = _default_backward_shape.cache_info().misses
        outs = []
        for config in (None, RMSNormConfig()):
            dx, dw = torch.empty_like(x), torch.empty(H, device=DEVICE)
            backward(g, x, w, rstd, dx, dw, config=config)
            outs.append((dx, dw))
        assert _default_backward_shape.cache_info().misses == misses + new
        assert _default_backward_shape(x.device, T, H, x.element_size()) == \
            RMSNormConfig().backward_shape(x.device, T, H, x.element_size())
        assert all(torch.equal(a, b) for a, b in zip(*outs))
        ref_dx, ref_dw = reference.backward(g, x, w, rstd)
        assert rel_err(outs[0][0], ref_dx) <= 1e-2 and rel_err(outs[0][1], ref_dw) <= 1e-5
