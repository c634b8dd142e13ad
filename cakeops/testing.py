"""Helpers for tests of code built on cakeops: comparisons, and multi-process runs."""
import os
import tempfile
import warnings

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (the absolute error when ref is all zeros). NaN stays NaN."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if out.shape != ref.shape:
        raise ValueError(f"rel_err: shapes differ, {tuple(out.shape)} vs {tuple(ref.shape)}")
    diff = (out - ref).norm().item()
    denom = ref.norm().item()
    return diff if denom == 0.0 else diff / denom


def spawn_ranks(worker, world: int, *args) -> None:
    """worker(rank, init_file, *args) on ``world`` processes (torch.multiprocessing.spawn); ``init_file`` is a
    fresh path for ``init_process_group(init_method=f"file://{init_file}")``.

    Workers should end with a barrier after their last check, then ``destroy_process_group``. With gloo (seen in
    CI on torch 2.11) a rank has died of SIGABRT on its way out with no Python error ("terminate called without
    an active exception": a C++ thread object destroyed while running, as at the interpreter's exit). Each rank
    writes a file once ``worker`` returns: a rank that dies of a signal after that had passed every check, so
    this warns and returns; one that dies before raises AssertionError saying how far the ranks got."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(_finishing, args=(worker, tmp, args), nprocs=world, join=True)
        except mp.ProcessExitedException as e:
            finished = [r for r in range(world) if os.path.exists(os.path.join(tmp, f"finished-{r}"))]
            if e.signal_name is None:
                raise
            if e.error_index not in finished:
                raise AssertionError(f"rank {e.error_index} died of {e.signal_name} before it finished "
                                     f"(ranks finished: {finished})") from e
            warnings.warn(f"rank {e.error_index} passed every check, then died of {e.signal_name} on its way out "
                          f"(torch {torch.__version__})")


def _finishing(rank, worker, tmp, args):
    worker(rank, os.path.join(tmp, "init"), *args)
    with open(os.path.join(tmp, f"finished-{rank}"), "w"):
        pass
