"""``torchrun --standalone --nproc-per-node 2 -m cakeops.parallel_demo``: the demo's mHC language model trained
on several processes, one per GPU (NCCL) or on the CPU (gloo), with PyTorch's own parallelism.

``--parallel``: ``ddp`` (DistributedDataParallel around the compiled model), ``fsdp2`` (``fully_shard`` per
transformer block and at the root, each block compiled), ``fsdp2-bf16`` (the same with a bf16
``MixedPrecisionPolicy``, FP32 gradient reduction). ``--checkpoint`` recomputes each block in the backward
(activation checkpointing). cakeops needs nothing else from the user: its ops take bf16 parameters as FP32 math
and return gradients in their dtype. Each rank trains on its own batches; rank 0 prints the mean loss.
"""
import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

from .demo import ALPHABET, batches, corpus, encode
from .tiny_lm import TinyLM

PARALLEL = ("ddp", "fsdp2", "fsdp2-bf16")


def checkpoint_blocks(model: TinyLM) -> None:
    """Each block's forward under non-reentrant activation checkpointing (recomputed in the backward)."""
    for block in model.blocks:
        forward = block.forward
        block.forward = (lambda f: lambda x: torch.utils.checkpoint.checkpoint(f, x, use_reentrant=False))(forward)


def wrap(model: TinyLM, parallel: str, device: torch.device, backend: str = "aot_eager",
         checkpoint: bool = False) -> torch.nn.Module:
    """The model made ready for ``parallel`` (one of PARALLEL), its blocks compiled with fullgraph=True."""
    if parallel not in PARALLEL:
        raise ValueError(f"parallel: expected one of {PARALLEL}, got {parallel!r}")
    if checkpoint:
        checkpoint_blocks(model)
    if parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model.compile(fullgraph=True, backend=backend)
        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if parallel == "fsdp2-bf16" else MixedPrecisionPolicy())
    # the mesh of the ranks' device: without one fully_shard takes the machine's accelerator, so ranks training
    # on the CPU (gloo) of a machine with a GPU had their parameters sharded onto a CUDA mesh
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        block.compile(fullgraph=True, backend=backend)
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def next_token_loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1]).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="torchrun --nproc-per-node N -m cakeops.parallel_demo",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--parallel", default="fsdp2", choices=PARALLEL, help="how the ranks share the model (fsdp2)")
    p.add_argument("--checkpoint", action="store_true", help="activation checkpointing of every block")
    p.add_argument("--steps", type=int, default=50, help="training steps (50)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step (8)")
    p.add_argument("--length", type=int, default=64, help="tokens per sequence (64)")
    p.add_argument("--dim", type=int, default=64, help="hidden size (64)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (2)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (3e-3)")
    p.add_argument("--device", default=None, help="cuda (NCCL, one GPU per rank) or cpu (gloo); default: cuda when "
                                                  "there are enough GPUs")
    args = p.parse_args(argv)
    if "RANK" not in os.environ:
        p.error("start it with torchrun, e.g. torchrun --standalone --nproc-per-node 2 -m cakeops.parallel_demo")
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])
    use_cuda = args.device == "cuda" or (args.device is None and torch.cuda.device_count() >= world)
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # the ranks share the machine's cores
    # device_id binds the NCCL communicator to this rank's GPU up front (barrier() would otherwise guess it)
    dist.init_process_group("nccl" if use_cuda else "gloo", **({"device_id": device} if use_cuda else {}))
    try:
        torch.manual_seed(0)  # the same initial weights on every rank
        model = TinyLM(len(ALPHABET), args.dim, args.layers, heads=4, max_len=args.length + 1).to(device)
        model = wrap(model, args.parallel, device, backend="inductor" if use_cuda else "aot_eager",
                     checkpoint=args.checkpoint)
        opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
        data = encode(corpus(20000, seed=0)).to(device)
        stream = batches(data, args.batch, args.length, seed=100 + rank)  # each rank its own batches
        if rank == 0:
            print(f"cakeops parallel demo: {world} ranks on {device.type} ({'nccl' if use_cuda else 'gloo'}), "
                  f"{args.parallel}{' + checkpointing' if args.checkpoint else ''}, {args.steps} steps", flush=True)
        t0, first = time.time(), None
        for step in range(args.steps):
            loss = next_token_loss(model, next(stream))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean = mean.item() / world
            first = mean if first is None else first
            if rank == 0 and (step % max(1, args.steps // 10) == 0 or step == args.steps - 1):
                print(f"step {step:4d}  loss {mean:.3f}  {time.time() - t0:6.1f} s", flush=True)
        if rank == 0:
            print(f"loss {first:.3f} -> {mean:.3f}", flush=True)
        # every rank reaches teardown before any leaves: a gloo rank whose peer already closed its connection
        # can abort in destroy_process_group
        dist.barrier()
        return 0 if mean < first else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
