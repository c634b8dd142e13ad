"""Eager calls under a TorchDispatchMode dispatch the cakeops custom ops, as compiled code does: the tools built on
such modes see them. FakeTensorMode (shapes and memory without data: kernels launched on fake tensors failed),
selective activation checkpointing (its policy never saw a cakeops op, so a policy naming them did nothing), and
dispatch loggers; outside any mode, eager calls keep their direct path (no op dispatch: host time)."""
import functools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from cakeops import nn as cn
from cakeops.cake_mhc_train import (cake_mhc_train_forward_prepare, cake_mhc_train_head_forward,
                                    cake_mhc_train_gated_head_forward)
from cakeops.cake_rmsnorm_train import cake_rmsnorm_train_forward
from conftest import DEVICE

C = 32


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _cases():
    return {
        "rmsnorm": (lambda: cn.RMSNorm(C), (3, 5, C)),
        "mhc2": (lambda: cn.MHC(torch.nn.Linear(C, C), C, 2), (3, 5, 2, C)),
        "mhc4": (lambda: cn.MHC(torch.nn.Linear(C, C), C, 4), (3, 5, 4, C)),
        "mhc8": (lambda: cn.MHC(torch.nn.Linear(C, C), C, 8), (3, 5, 8, C)),
        "head": (lambda: cn.MHCHead(), (3, 5, 4, C)),
        "gated_head": (lambda: cn.MHCHead(4, gated=True, hidden_size=C), (3, 5, 4, C)),
    }


CAKEOPS_OPS = {
    "rmsnorm": {"cakeops.rmsnorm_fwd.default", "cakeops.rmsnorm_bwd.default"},
    "mhc": {"cakeops.mhc_prepare.default", "cakeops.mhc_finish.default", "cakeops.mhc_backward_prepare.default",
            "cakeops.mhc_backward_finish.default"},
    "head": {"cakeops.mhc_head_fwd.default", "cakeops.mhc_head_bwd.default"},
    "gated_head": {"cakeops.mhc_gated_head_fwd.default", "cakeops.mhc_gated_head_bwd.default"},
}


def _family(name):
    return "mhc" if name.startswith("mhc") else name


@pytest.mark.parametrize("name", list(_cases()))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_modules_run_under_fake_tensor_mode(name, dtype, backend):
    """What a real run gives, shape and dtype, forward and backward; no kernel sees a fake tensor."""
    make, shape = _cases()[name]
    module = make().to(DEVICE, dtype)
    x = torch.randn(shape, device=DEVICE, dtype=dtype, requires_grad=True)
    want = module(x)
    with FakeTensorMode() as mode:  # the module's parameters as fake tensors (torch cannot .to() a module here)
        params = {k: mode.from_tensor(p).requires_grad_() for k, p in module.named_parameters()}
        fx = mode.from_tensor(x).requires_grad_()
        y = torch.func.functional_call(module, params, (fx,))
        y.backward(torch.randn_like(y))
    assert (y.shape, y.dtype, y.device.type) == (want.shape, want.dtype, want.device.type)
    assert fx.grad.shape == x.shape and fx.grad.dtype == x.dtype
    assert all(p.grad is not None and p.grad.shape == p.shape for p in params.values())


def test_functions_run_under_fake_tensor_mode(backend):
    """The FlashInfer-style functions too, with the caller's buffers and workspaces left as given (fake)."""
    with FakeTensorMode():
        X = torch.randn(6, 4, C, device=DEVICE, dtype=torch.bfloat16)
        fn = torch.randn(24, 4 * C, device=DEVICE)
        scale, base = torch.ones(3, device=DEVICE), torch.zeros(24, device=DEVICE)
        U, stats = cake_mhc_train_forward_prepare(X, fn, scale, base, rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=5,
                                                  workspace=torch.empty(1 << 20, dtype=torch.uint8, device=DEVICE))
        assert U.shape == (6, C) and U.dtype == torch.bfloat16 and stats.dtype == torch.float32
        Y = torch.empty(6, C, device=DEVICE, dtype=torch.bfloat16)
        assert cake_mhc_train_head_forward(X, out=Y) is Y
        Yg, gstats = cake_mhc_train_gated_head_forward(X, torch.randn(4, 4 * C, device=DEVICE),
                                                       torch.ones(1, device=DEVICE), torch.zeros(4, device=DEVICE))
        assert Yg.shape == (6, C) and gstats.shape[0] == 6
        y, rstd = cake_rmsnorm_train_forward(torch.randn(6, C, device=DEVICE), torch.ones(C, device=DEVICE), 1e-6)
        assert y.shape == (6, C) and rstd.shape[0] == 6


@pytest.mark.parametrize("name", list(_cases()))
def test_a_dispatch_mode_sees_the_cakeops_ops_forward_and_backward(name, backend):
    make, shape = _cases()[name]
    module = make().to(DEVICE)
    x = torch.randn(shape, device=DEVICE, requires_grad=True)
    with _OpLog() as log:
        y = module(x)
        y.backward(torch.randn_like(y))
    assert CAKEOPS_OPS[_family(name)] <= set(log.ops), sorted(set(log.ops))


def test_no_mode_keeps_the_direct_eager_path(backend):
    """Outside any mode the eager Functions run (no custom-op dispatch): what a mode sees is only where one is on."""
    module = cn.MHC(torch.nn.Identity(), C, 4).to(DEVICE)
    x = torch.randn(3, 4, C, device=DEVICE, requires_grad=True)
    y = module(x)
    assert type(y.grad_fn).__name__.startswith("CakeMHCTrainFinish"), type(y.grad_fn).__name__


def _policy(decision, seen):
    def policy(ctx, op, *args, **kwargs):
        name = str(op)
        if name.startswith("cakeops."):
            seen.add(name)
            return decision
        return CheckpointPolicy.PREFER_RECOMPUTE
    return policy


@pytest.mark.parametrize("decision", [CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_RECOMPUTE])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_selective_checkpointing_policy_sees_and_decides_the_cakeops_ops(n, decision, backend):
    """Eager selective activation checkpointing over a block (RMSNorm inside the branch, an MHC layer, the gated
    head): the policy is asked about every cakeops forward op, and the gradients -- random upstream, every
    parameter and the input -- are those of the block without checkpointing, bit for bit (same kernels, same
    order). MUST_SAVE keeps the cakeops forwards out of the recompute."""
    torch.manual_seed(torch.seed())
    block = torch.nn.Sequential(cn.MHC(torch.nn.Sequential(cn.RMSNorm(C), torch.nn.Linear(C, C)), C, n),
                                cn.MHCHead(n, gated=True, hidden_size=C)).to(DEVICE)
    x = torch.randn(2, 5, n, C, device=DEVICE, requires_grad=True)
    gy = torch.randn(2, 5, C, device=DEVICE)
    params = [x, *block.parameters()]
    want = torch.autograd.grad(block(x), params, gy)
    seen = set()
    context = functools.partial(create_selective_checkpoint_contexts, _policy(decision, seen))
    with _OpLog() as log:
        y = checkpoint(block, x, use_reentrant=False, context_fn=context)
        forward_ops = len(log.ops)
        got = torch.autograd.grad(y, params, gy)
    assert {"cakeops.mhc_prepare.default", "cakeops.mhc_finish.default", "cakeops.rmsnorm_fwd.default",
            "cakeops.mhc_gated_head_fwd.default"} <= seen, sorted(seen)
    recomputed = [op for op in log.ops[forward_ops:] if op in seen]
    if decision == CheckpointPolicy.MUST_SAVE:
        assert recomputed == [], recomputed
    else:
        assert "cakeops.mhc_prepare.default" in recomputed, recomputed
    for g, w, p in zip(got, want, ["x", *(k for k, _ in block.named_parameters())]):
        torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m: f"{p}: {m}")


def _torch_matmul_flops(fn, *args):
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn(*args)
    return counter.get_total_flops()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_flop_counter_counts_the_layers_matmul_work_as_torch_counts_matmuls(n, backend):
    """FlopCounterMode (MFU accounting) counts each mHC op: its projection as torch counts the same matmul
    (X [T, n*C] @ fn^T), plus the mixing and gate sums at 2 FLOPs per multiply-add; the gated head likewise."""
    from torch.utils.flop_counter import FlopCounterMode

    T = 6
    layer = cn.MHC(torch.nn.Identity(), C, n).to(DEVICE)
    head = cn.MHCHead(n, gated=True, hidden_size=C).to(DEVICE)
    X = torch.randn(2, T // 2, n, C, device=DEVICE, requires_grad=True)
    with FlopCounterMode(display=False) as counter:
        y = head(layer(X))
        y.backward(torch.randn_like(y))
    got = {str(k): v for k, v in counter.get_flop_counts()["Global"].items()}
    M = 2 * n + n * n
    projection = _torch_matmul_flops(lambda: X.detach().reshape(T, n * C) @ layer.fn.detach().t())
    head_projection = _torch_matmul_flops(lambda: X.detach().reshape(T, n * C) @ head.fn.detach().t())
    assert projection == 2 * T * n * C * M and head_projection == 2 * T * n * C * n
    mix, gate = 2 * T * n * n * C, 2 * T * n * C
    assert got == {"cakeops.mhc_prepare": projection + gate, "cakeops.mhc_finish": mix + gate,
                   "cakeops.mhc_backward_prepare": 2 * gate + mix,
                   "cakeops.mhc_backward_finish": 2 * projection + mix + 2 * gate,
                   "cakeops.mhc_gated_head_fwd": head_projection + gate,
                   "cakeops.mhc_gated_head_bwd": 2 * head_projection + 2 * gate}, got


def test_a_flop_counter_built_before_cakeops_registered_its_formulas_counts_them():
    """The formulas are registered at the first op dispatched under a mode; a FlopCounterMode copies torch's
    registry when built, so the first one of a process must get them too (a fresh process)."""
    import subprocess
    import sys

    code = ("import torch, cakeops.nn as cn\n"
            "from torch.utils.flop_counter import FlopCounterMode\n"
            "m = cn.MHCHead(4, gated=True, hidden_size=8)\n"
            "with FlopCounterMode(display=False) as c:\n"
            "    m(torch.randn(3, 4, 8))\n"
            "print(c.get_total_flops())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout.split()[-1]) == 2 * 3 * 32 * 4 + 2 * 3 * 4 * 8
