"""DTensor sharding rules of the cakeops ops: sequence (token) parallelism.

Every cakeops op works token by token: a token's outputs need only that token's inputs and the parameters. So
inputs sharded on the token dim (``Shard(0)``) with replicated parameters give outputs sharded the same way,
and the parameter gradients of the backward ops are per-rank partial sums (``Partial()``), which the engine
reduces. Fully replicated inputs run as they are. Any other placement -- the hidden dim or the streams
sharded -- would need the whole row on one rank; the public functions refuse it with a message that says to
redistribute (``placements``), instead of letting DTensor gather the rows silently.

Registered on the first call that meets a DTensor (``ensure_registered``), so that importing cakeops does not
import torch.distributed.
"""
import sys

import torch

_registered = False

# For each op: the token-dim role of every positional argument ("t": sharded on tokens, "r": replicated, None:
# not a tensor) and of every output ("t", or "p": a parameter gradient, a partial sum over the ranks' tokens).
_ROLES = {
    "rmsnorm_fwd": (("t", "r", None, None), ("t", "t")),
    "add_rmsnorm_fwd": (("t", "t", "r", None, None), ("t", "t", "t")),
    "rmsnorm_bwd": (("t", "t", "r", "t", "t", None), ("t", "p")),
    "mhc_prepare": (("t", "r", "r", "r", None, None, None, None), ("t", "t", "t", "t")),
    "mhc_stats": (("t", "r", "r", "r", None, None, None), ("t",)),
    "mhc_finish": (("t", "t", "t", "t", "t"), ("t",)),
    "mhc_head_fwd": (("t",), ("t",)),
    "mhc_head_bwd": (("t", None), ("t",)),
    "mhc_backward_prepare": (("t", "t", "t", "t"), ("t", "t")),
    "mhc_backward_finish": (("t", "t", "t", "r", "r", "r", "t", "t", None, None, None, None), ("t", "p", "p", "p")),
    "mhc_gated_head_fwd": (("t", "r", "r", "r", None, None, None), ("t", "t")),
    "mhc_gated_head_bwd": (("t", "t", "r", "r", "r", "t", None, None, None), ("t", "p", "p", "p")),
}


def is_dtensor(t) -> bool:
    """Whether t is a DTensor (never imports torch.distributed: no DTensor exists before it is imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def check_placements(name: str, t) -> None:
    """A DTensor argument must be replicated or sharded on its first (token) dim only."""
    from torch.distributed.tensor import Replicate, Shard

    bad = [p for p in t.placements if not (isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 0))]
    if bad:
        raise ValueError(
            f"{name}: a DTensor with placements {tuple(t.placements)}; cakeops ops work token by token and need "
            f"the tokens sharded (Shard(0)) or the tensor replicated, with the hidden size and the streams whole "
            f"on every rank: redistribute first, e.g. {name}.redistribute(placements=[Shard(0)])")


def any_dtensor(**tensors) -> bool:
    """True when any argument is a DTensor: its placements are checked, the rules registered, and the caller
    takes the custom-op path (DTensor dispatches ops, not the eager Functions' direct kernel calls)."""
    found = False
    for name, t in tensors.items():
        if is_dtensor(t):
            check_placements(name, t)
            found = True
    if found:
        ensure_registered()
    return found


def ensure_registered() -> None:
    global _registered
    if _registered:
        return
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor.experimental import register_sharding

    def placement(role):
        return {"t": Shard(0), "r": Replicate(), "p": Partial(), None: None}[role]

    def rule(inputs, outputs):
        def strategies(*args):
            roles = [None if a is None else r for a, r in zip(args, inputs)]  # an absent optional tensor
            token_parallel = ([placement(r) for r in outputs], [placement(r) for r in roles])
            replicated = ([Replicate() for _ in outputs], [None if r is None else Replicate() for r in roles])
            return [token_parallel, replicated]
        return strategies

    for name, (inputs, outputs) in _ROLES.items():
        register_sharding(getattr(torch.ops.cakeops, name).default)(rule(inputs, outputs))
    _registered = True
