"""Models built on the meta device, as large-model training builds them: ``with torch.device("meta")``, then
``to_empty`` and every module's ``reset_parameters`` (FSDP2 in between on several ranks). cakeops' modules must come
out as if built on the device: the documented start of the mapping, torch.nn.RMSNorm's ones, and nothing left
holding whatever the uninitialised memory held (the no-weight RMSNorm's ones are no state: no checkpoint restores
them)."""
import math

import pytest
import torch
import torch.distributed as dist

from cakeops import nn as cn
from cakeops.testing import spawn_ranks

C = 16


def _reset_all(model):
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()


def _modules():
    return {
        "rmsnorm": lambda: cn.RMSNorm(C, eps=1e-6),
        "rmsnorm_no_weight": lambda: cn.RMSNorm(C, elementwise_affine=False),
        "mhc2": lambda: cn.MHC(torch.nn.Identity(), C, 2),
        "mhc4": lambda: cn.MHC(torch.nn.Identity(), C, 4),
        "mhc8_bf16": lambda: cn.MHC(torch.nn.Identity(), C, 8, dtype=torch.bfloat16),
        "gated_head": lambda: cn.MHCHead(4, gated=True, hidden_size=C),
        "gated_head8": lambda: cn.MHCHead(8, gated=True, hidden_size=C),
    }


def _input(name, gen):
    if name.startswith("rmsnorm"):
        return torch.randn(5, C, generator=gen)
    n = int(name[3]) if name.startswith("mhc") else 8 if name.endswith("8") else 4
    return torch.randn(5, n, C, generator=gen)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", list(_modules()))
def test_built_on_meta_then_to_empty_and_reset_equals_built_on_the_device(name, device):
    seed = torch.seed()
    make = _modules()[name]
    torch.manual_seed(seed)
    with torch.device(device):
        direct = make()
    with torch.device("meta"):
        lazy = make()
    assert all(p.is_meta for p in lazy.parameters())
    lazy.to_empty(device=device)
    torch.manual_seed(seed)  # the draws of construction, in the same order
    _reset_all(lazy)
    for (key, want), got in zip(direct.state_dict().items(), lazy.state_dict().values()):
        assert torch.equal(got, want), f"{name}: {key} after reset_parameters differs from a fresh build"
    x = _input(name, torch.Generator().manual_seed(seed)).to(device)
    torch.testing.assert_close(lazy(x), direct(x), rtol=0, atol=0)


def test_a_model_built_on_meta_and_loaded_with_assign_runs():
    """``load_state_dict(state, assign=True)`` onto a model built on the meta device (how checkpoints are loaded
    without a first allocation): the parameters come from the state dict, and nothing the state dict does not hold
    is left on the meta device (the no-weight RMSNorm's ones were a buffer there: 'w: expected a tensor on cpu')."""
    def make():
        return torch.nn.ModuleDict({"norm": cn.RMSNorm(C, elementwise_affine=False),
                                    "mhc": cn.MHC(torch.nn.Linear(C, C), C, 4),
                                    "head": cn.MHCHead(4, gated=True, hidden_size=C)})

    real = make()
    with torch.device("meta"):
        lazy = make()
    lazy.load_state_dict(real.state_dict(), assign=True)
    assert not any(t.is_meta for t in (*lazy.parameters(), *lazy.buffers()))
    x = torch.randn(3, 4, C)
    for name in ("norm", "mhc", "head"):
        arg = x.mean(-2) if name == "norm" else x
        torch.testing.assert_close(lazy[name](arg), real[name](arg), rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_no_weight_rmsnorm_from_meta_normalizes_without_reset_parameters(device):
    """A user who loads a checkpoint after ``to_empty`` (no reset_parameters) gets torch.nn.RMSNorm's output."""
    with torch.device("meta"):
        lazy = cn.RMSNorm(C, elementwise_affine=False)
    lazy.to_empty(device=device)
    lazy.load_state_dict(torch.nn.RMSNorm(C, elementwise_affine=False).state_dict())
    x = torch.randn(7, C, device=device)
    torch.testing.assert_close(lazy(x), torch.nn.RMSNorm(C, eps=None, elementwise_affine=False).to(device)(x))


def test_reset_parameters_restores_each_modules_documented_start():
    torch.manual_seed(torch.seed())
    norm, torch_norm = cn.RMSNorm(C), torch.nn.RMSNorm(C)
    with torch.no_grad():
        norm.weight.uniform_(-3, 3)
        torch_norm.weight.uniform_(-3, 3)
    norm.reset_parameters()
    torch_norm.reset_parameters()
    assert torch.equal(norm.weight, torch_norm.weight)
    for n in (2, 4, 8):
        mhc = cn.MHC(torch.nn.Identity(), 512, n)
        head = cn.MHCHead(n, gated=True, hidden_size=512)
        for module in (mhc, head):
            with torch.no_grad():
                for p in module.parameters():
                    p.uniform_(-3, 3)
            module.reset_parameters()
        pre = -math.log(n - 1)
        want_base = torch.cat([torch.full((n,), pre), torch.zeros(n), 4.0 * torch.eye(n).reshape(-1)])
        assert torch.equal(mhc.base, want_base) and torch.equal(mhc.scale, torch.full((3,), 0.01))
        assert torch.equal(head.base, torch.full((n,), pre)) and torch.equal(head.scale, torch.full((1,), 0.01))
        for fn in (mhc.fn, head.fn):  # N(0, 1/(n*C)): thousands of draws, so the std within 10 %
            assert abs(fn.std().item() * math.sqrt(n * 512) - 1) < 0.1
            assert abs(fn.mean().item()) * math.sqrt(n * 512) < 0.1
    cn.MHCHead().reset_parameters()  # the plain head has nothing to reset, and says nothing


class _Model(torch.nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.expand = cn.StreamExpand(n)
        self.blocks = torch.nn.ModuleList(
            cn.MHC(torch.nn.Sequential(cn.RMSNorm(C, elementwise_affine=False), torch.nn.Linear(C, C)), C, n)
            for _ in range(2))
        self.head = cn.MHCHead(n, gated=True, hidden_size=C)
        self.norm = cn.RMSNorm(C)

    def forward(self, h):
        X = self.expand(h)
        for block in self.blocks:
            X = block(X)
        return self.norm(self.head(X))


def _fsdp2_meta_worker(rank, init_file):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))  # else fully_shard takes the machine's GPU, where there is one
        with torch.device("meta"):
            model = _Model()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.to_empty(device="cpu")
        _reset_all(model)
        full = {k: (v.full_tensor() if isinstance(v, DTensor) else v) for k, v in model.state_dict().items()}
        torch.manual_seed(0)  # the same twin on both ranks
        twin = _Model()  # built on the device: the documented start
        for key, want in twin.state_dict().items():
            if not key.endswith(".fn") and "Linear" not in key and not key.endswith((".1.weight", ".1.bias")):
                assert torch.equal(full[key], want), f"rank {rank}: {key} after reset_parameters on shards"
        for key in ("blocks.0.fn", "blocks.1.fn", "head.fn"):
            std = full[key].std().item() * math.sqrt(full[key].shape[1])
            assert 0.8 < std < 1.2, f"rank {rank}: {key} std {std} after reset_parameters on shards"
        # the twin's values into the shards: outputs and gradients as one process's (the no-weight norms' ones
        # are no state, so they come from to_empty's fill alone)
        with torch.no_grad():
            for (key, p), want in zip(model.named_parameters(), twin.parameters()):
                p.copy_(distribute_tensor(want, p.device_mesh, p.placements, src_data_rank=None))
        gen = torch.Generator().manual_seed(3)
        h, gy = torch.randn(6, C, generator=gen), torch.randn(6, C, generator=gen)
        y = model(h)
        y.backward(gy)
        y_twin = twin(h)
        y_twin.backward(gy)
        torch.testing.assert_close(y, y_twin, rtol=1e-5, atol=1e-6)
        for (key, p), want in zip(model.named_parameters(), twin.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), want.grad, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"rank {rank}: grad {key}: {m}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")
def test_fsdp2_model_built_on_meta_starts_as_built_on_the_device():
    spawn_ranks(_fsdp2_meta_worker, 2)


def test_reprs_show_what_was_chosen():
    assert repr(cn.StreamExpand(8)) == "StreamExpand(n_streams=8)"
    text = repr(cn.MHC(torch.nn.Identity(), C, 2, deterministic=False, save_stats=False, keep_fp32_mapping=True))
    assert "n_streams=2" in text and "deterministic=False, save_stats=False, keep_fp32_mapping=True" in text, text
    assert "deterministic" not in repr(cn.MHC(torch.nn.Identity(), C))  # defaults stay quiet
    head = repr(cn.MHCHead(8, gated=True, hidden_size=C, keep_fp32_mapping=True))
    assert head == (f"MHCHead(gated=True, hidden_size={C}, n_streams=8, rms_eps=1e-05, hc_eps=1e-06, "
                    f"keep_fp32_mapping=True)")


@pytest.mark.parametrize("given", [dict(hidden_size=C), dict(keep_fp32_mapping=True)])
def test_the_plain_head_refuses_what_only_the_gated_head_takes(given):
    (name,) = given
    with pytest.raises(ValueError, match=f"{name}: the plain head .* pass gated=True"):
        cn.MHCHead(**given)
    cn.MHCHead(gated=True, **{"hidden_size": C, **given})


@pytest.mark.parametrize("name", list(_modules()))
def test_modules_run_on_meta_tensors(name):
    """A model on the meta device runs forward and backward on meta inputs -- how pipeline parallelism infers a
    stage's shapes (torch.distributed.pipelining) and how memory planners trace -- with a real run's shapes and
    dtypes (nn.MHC's reference read a tensor of counts there: repeat_interleave failed on meta)."""
    real = _modules()[name]()
    x = _input(name, torch.Generator().manual_seed(0))
    want = real(x)
    with torch.device("meta"):
        lazy = _modules()[name]()
    mx = x.to("meta").requires_grad_()
    y = lazy(mx)
    y.backward(torch.ones_like(y))
    assert (y.shape, y.dtype, y.is_meta) == (want.shape, want.dtype, True)
    assert mx.grad.shape == x.shape and all(p.grad is not None and p.grad.is_meta for p in lazy.parameters())
