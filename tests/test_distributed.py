"""An mHC transformer trained on 2 processes (DDP, FSDP2 per block, with and without bf16 mixed precision and
activation checkpointing, the blocks compiled with fullgraph) against one process on the concatenated batch.

CPU and gloo here (CI); the same workers run with NCCL on 2 GPUs when CAKEOPS_DIST_BACKEND=nccl is set on a
machine with 2 GPUs. Each rank trains on its half of every batch; rank 0 also trains a single-process twin on
the whole batch and compares losses and every gradient after each step. Also: sequence parallel with DTensors,
and pipeline parallel (two stages on two processes, gloo only).
"""
import copy
import os

import pytest
import torch
import torch.distributed as dist

from cakeops.parallel_demo import wrap
from cakeops.testing import spawn_ranks
from cakeops.tiny_lm import TinyLM

WORLD = 2
STEPS = 3
VOCAB, DIM = 48, 32
# fp32: the two halves' gradients are summed in another order than one batch's: a few fp32 ulps. bf16: the twin
# reproduces the policy's arithmetic (bf16 halves, FP32 average), so only the reduction order differs too.
TOL = {"fp32": dict(rtol=1e-4, atol=1e-6), "bf16": dict(rtol=1e-4, atol=1e-6)}


def _loss(model, tokens):
    logits = model(tokens[:, :-1]).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _model(device):
    torch.manual_seed(0)
    return TinyLM(VOCAB, DIM, layers=2, heads=4).to(device)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _twin_step(twin, tokens, bf16):
    """One process's loss and gradients for the whole batch. With bf16 compute it does what the mixed-precision
    policy does across the ranks: each half through a bf16 copy of the FP32 weights, the halves' bf16
    gradients averaged in FP32 (reduce_dtype); FP32 compute takes the whole batch at once."""
    if not bf16:
        twin.zero_grad(set_to_none=True)
        loss = _loss(twin, tokens)
        loss.backward()
        return loss.detach(), [p.grad.float() for p in twin.parameters()]
    losses, grads = [], []
    for half in tokens.chunk(WORLD):
        compute = copy.deepcopy(twin).to(torch.bfloat16)
        loss = _loss(compute, half)
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.float() for p in compute.parameters()])
    return torch.stack(losses).mean(), [sum(gs) / WORLD for gs in zip(*grads)]


def _worker(rank, init_file, scenario, backend):
    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        parallel = "ddp" if scenario == "ddp" else "fsdp2-bf16" if "bf16" in scenario else "fsdp2"
        model = wrap(_model(device), parallel, device, checkpoint="ac" in scenario)
        twin = _model(device)
        bf16 = "bf16" in scenario
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        tol = TOL["bf16" if bf16 else "fp32"]
        gen = torch.Generator().manual_seed(1)
        for step in range(STEPS):
            tokens = torch.randint(0, VOCAB, (2 * WORLD, 17), generator=gen).to(device)
            mine = tokens.chunk(WORLD)[rank]
            opt.zero_grad(set_to_none=True)
            loss = _loss(model, mine)
            loss.backward()
            losses = [torch.zeros_like(loss.detach()) for _ in range(WORLD)]
            dist.all_gather(losses, loss.detach())
            grads = [_full(p.grad).float() for p in model.parameters()]
            opt.step()
            if rank == 0:
                twin_loss, twin_grads = _twin_step(twin, tokens, bf16)
                torch.testing.assert_close(torch.stack(losses).mean(), twin_loss, **tol,
                                           msg=lambda m: f"{scenario} step {step} loss: {m}")
                for (name, _), g, want in zip(twin.named_parameters(), grads, twin_grads):
                    torch.testing.assert_close(g, want, **tol, msg=lambda m: f"{scenario} step {step} grad {name}: {m}")
                with torch.no_grad():  # the twin's SGD step, on its FP32 weights
                    for p, g in zip(twin.parameters(), twin_grads):
                        p -= 0.05 * g
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(worker, *args):
    spawn_ranks(worker, WORLD, *args)


def _backend():
    backend = os.environ.get("CAKEOPS_DIST_BACKEND", "gloo")
    if backend == "nccl" and torch.cuda.device_count() < WORLD:
        pytest.skip(f"NCCL needs {WORLD} GPUs, found {torch.cuda.device_count()}")
    return backend


@pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")
@pytest.mark.parametrize("scenario", ["ddp", "fsdp2", "fsdp2-bf16", "fsdp2-ac"])
def test_two_processes_train_like_one(scenario):
    _spawn(_worker, scenario, _backend())


def _cpu_ranks_beside_an_accelerator_worker(rank, init_file):
    """gloo ranks on the CPU of a machine whose accelerator is CUDA (made to look so here): fully_shard without a
    mesh would build one on that accelerator; the demo's wrap shards onto the ranks' own device."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        real = torch._C._get_accelerator
        torch._C._get_accelerator = lambda: torch.device("cuda")
        try:
            model = wrap(_model(torch.device("cpu")), "fsdp2", torch.device("cpu"))
        finally:
            torch._C._get_accelerator = real
        assert all(p.device.type == "cpu" and p.device_mesh.device_type == "cpu" for p in model.parameters())
        tokens = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(rank))
        _loss(model, tokens).backward()
        assert all(p.grad is not None and p.grad.device.type == "cpu" for p in model.parameters())
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")
def test_fsdp2_demo_shards_on_the_ranks_device_beside_an_accelerator():
    _spawn(_cpu_ranks_beside_an_accelerator_worker)


# ---- sequence parallel: the residual stream as a DTensor sharded on tokens ----

class _TokenLocalModel(torch.nn.Module):
    """Streams -> two mHC layers with RMSNorm + MLP branches -> head -> RMSNorm: every op token by token."""

    def __init__(self, dim):
        super().__init__()
        from cakeops.nn import MHC, MHCHead, RMSNorm, StreamExpand
        from cakeops.tiny_lm import MLP, PreNorm

        self.expand, self.head, self.norm = StreamExpand(), MHCHead(), RMSNorm(dim)
        self.blocks = torch.nn.ModuleList(MHC(PreNorm(dim, MLP(dim)), dim, hc_eps=0.05) for _ in range(2))

    def forward(self, h):
        X = self.expand(h)
        for block in self.blocks:
            X = block(X)
        return self.norm(self.head(X))


def _dtensor_worker(rank, init_file, backend):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    from cakeops.nn import RMSNorm

    device_type = "cuda" if backend == "nccl" else "cpu"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh(device_type, (WORLD,))
        torch.manual_seed(0)
        reference = _TokenLocalModel(DIM).to(device_type)
        sharded = distribute_module(copy.deepcopy(reference), mesh)  # parameters replicated
        g = torch.Generator().manual_seed(2)
        h = torch.randn(10, DIM, generator=g).to(device_type)
        gy = torch.randn(10, DIM, generator=g).to(device_type)

        h_ref = h.clone().requires_grad_()
        reference(h_ref).backward(gy)
        h_d = distribute_tensor(h, mesh, [Shard(0)]).requires_grad_()
        y_d = sharded(h_d)
        assert y_d.placements == (Shard(0),), y_d.placements  # the output stays token-sharded
        y_d.backward(distribute_tensor(gy, mesh, [Shard(0)]))
        tol = TOL["fp32"]
        torch.testing.assert_close(y_d.full_tensor(), reference(h), **tol)
        torch.testing.assert_close(h_d.grad.full_tensor(), h_ref.grad, **tol)
        for (name, p), (_, q) in zip(sharded.named_parameters(), reference.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, **tol, msg=lambda m: f"grad {name}: {m}")

        # stream recompute on: DTensor layers (and StreamExpand of a DTensor h) keep their streams, same bits
        from cakeops.nn import recompute_mhc

        before = [p.grad.full_tensor().clone() for p in sharded.parameters()]
        recompute_mhc(sharded)
        sharded.zero_grad(set_to_none=True)
        y_rc = sharded(distribute_tensor(h, mesh, [Shard(0)]).requires_grad_())
        y_rc.backward(distribute_tensor(gy, mesh, [Shard(0)]))
        for a, p in zip(before, sharded.parameters()):
            assert torch.equal(a, p.grad.full_tensor())
        recompute_mhc(sharded, 1)

        # a norm without weight: its ones meet the token-sharded input as a replicated parameter would
        plain = RMSNorm(DIM, elementwise_affine=False).to(device_type)
        spread = distribute_module(RMSNorm(DIM, elementwise_affine=False).to(device_type), mesh)
        torch.testing.assert_close(spread(distribute_tensor(h, mesh, [Shard(0)])).full_tensor(), plain(h), **tol)

        # the hidden dim sharded: refused in the user's terms, with what to do
        x_hidden = distribute_tensor(torch.randn(10, 4, DIM).to(device_type), mesh, [Shard(2)])
        with pytest.raises(ValueError, match=r"redistribute"):
            sharded.blocks[0](x_hidden)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")
def test_sequence_parallel_dtensor_matches_one_device():
    _spawn(_dtensor_worker, _backend())


# ---- pipeline parallel: the residual streams [..., n, C] cross a stage boundary ----

class _FirstStage(torch.nn.Module):
    """Embedding -> streams -> an mHC layer (8 streams, the DeepSeek-V4-style width)."""

    def __init__(self, n=8):
        super().__init__()
        from cakeops.nn import MHC, RMSNorm, StreamExpand

        self.embed, self.expand = torch.nn.Embedding(VOCAB, DIM), StreamExpand(n)
        self.block = MHC(torch.nn.Sequential(RMSNorm(DIM), torch.nn.Linear(DIM, DIM)), DIM, n)

    def forward(self, tokens):
        return self.block(self.expand(self.embed(tokens)))


class _LastStage(torch.nn.Module):
    """An mHC layer -> the gated head -> RMSNorm -> logits."""

    def __init__(self, n=8):
        super().__init__()
        from cakeops.nn import MHC, MHCHead, RMSNorm

        self.block = MHC(torch.nn.Sequential(RMSNorm(DIM), torch.nn.Linear(DIM, DIM)), DIM, n)
        self.head, self.norm = MHCHead(n, gated=True, hidden_size=DIM), RMSNorm(DIM)
        self.out = torch.nn.Linear(DIM, VOCAB)

    def forward(self, X):
        return self.out(self.norm(self.head(self.block(X))))


def _pipeline_loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _pipeline_worker(rank, init_file):
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.manual_seed(0)
        whole = [_FirstStage(), _LastStage()]  # the same on both ranks: each keeps its stage, compares with all
        mine = copy.deepcopy(whole[rank])
        stage = PipelineStage(mine, rank, WORLD, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=_pipeline_loss)
        gen = torch.Generator().manual_seed(1)
        tokens, targets = torch.randint(0, VOCAB, (4, 9), generator=gen), torch.randint(0, VOCAB, (4, 9), generator=gen)
        losses = []
        if rank == 0:
            schedule.step(tokens)
        else:
            schedule.step(target=targets, losses=losses)
        # one process: the microbatches' losses, their mean's gradients (the schedule scales by 1/microbatches)
        logits = whole[1](whole[0](tokens))
        want = [_pipeline_loss(lo, ta) for lo, ta in zip(logits.chunk(2), targets.chunk(2))]
        (sum(want) / 2).backward()
        if rank == 1:
            torch.testing.assert_close(torch.stack(losses), torch.stack(want).detach(), rtol=1e-6, atol=1e-6)
        for (name, p), q in zip(mine.named_parameters(), whole[rank].parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL["fp32"], msg=lambda m: f"stage {rank} grad {name}: {m}")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="this torch has no torch.distributed")
def test_pipeline_parallel_stages_train_like_one_process():
    """torch.distributed.pipelining (GPipe, 2 stages on 2 processes, gloo): the [..., 8, C] streams cross the
    stage boundary; losses and every stage's gradients as one process's."""
    _spawn(_pipeline_worker)


def _abort_on_exit(rank, init_file, when):
    import atexit

    if rank == 1 and when == "before":
        os.abort()
    if rank == 1 and when == "at exit":
        atexit.register(os.abort)


def test_spawn_tells_a_crash_on_the_way_out_from_a_crash_before_the_checks_end():
    with pytest.warns(UserWarning, match=r"rank 1 passed every check, then died of SIGABRT"):
        _spawn(_abort_on_exit, "at exit")
    with pytest.raises(AssertionError, match=r"rank 1 died of SIGABRT before it finished"):
        _spawn(_abort_on_exit, "before")


def test_readme_torchrun_command_trains():
    """The README's multi-GPU command, on 2 CPU processes: FSDP2 with bf16 mixed precision and checkpointing."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "cakeops.parallel_demo", "--parallel", "fsdp2-bf16", "--checkpoint", "--steps", "12", "--device", "cpu"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "loss" in done.stdout and "->" in done.stdout
