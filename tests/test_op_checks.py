"""Every ``torch.ops.cakeops.*`` op rejects what the public functions reject, eagerly and under fake tensors.

Each case is one bad input, given to the public function and to the op it reaches with the same tensors: both
must raise (the op naming itself and the argument), never read past a buffer. A walk over the registered ops
checks that every op has cases here.
"""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cakeops  # noqa: F401  (registers the ops)
from cakeops.cake_mhc_train import (
    cake_mhc_train_gated_head_backward, cake_mhc_train_gated_head_forward,
    cake_mhc_train_backward_finish, cake_mhc_train_backward_prepare, cake_mhc_train_forward_finish,
    cake_mhc_train_forward_prepare, cake_mhc_train_forward_stats, cake_mhc_train_head_backward,
    cake_mhc_train_head_forward,
)
from cakeops.nn import MHC, StreamExpand, recompute_mhc
from cakeops.cake_rmsnorm_train import cake_rmsnorm_train_backward, cake_rmsnorm_train_forward
from cakeops.meta.mhc_head_layout import HEAD_STATS_WIDTH
from cakeops.meta.mhc_layout import GRAD_STATS_WIDTH, N_LOGITS, STATS_WIDTH
from conftest import DEVICE

T, N, C, H = 5, 4, 8, 64
ops = torch.ops.cakeops
BF16, F32 = torch.bfloat16, torch.float32


def _good():
    """Valid arguments of every op (values do not matter: the checks come before any kernel)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, dtype=F32):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    return dict(x=rand(4, H, dtype=BF16), w=rand(H, dtype=BF16), res=rand(4, H, dtype=BF16), rstd=rand(4).abs(),
                X=rand(T, N, C, dtype=BF16), fn=rand(N_LOGITS, N * C) * 0.1, scale=rand(3), base=rand(N_LOGITS),
                B=rand(T, C, dtype=BF16), stats=rand(T, STATS_WIDTH), gs=rand(T, GRAD_STATS_WIDTH),
                dY=rand(T, N, C, dtype=BF16), dU=rand(T, C, dtype=BF16), dYh=rand(T, C, dtype=BF16),
                hfn=rand(N, N * C) * 0.1, hscale=rand(1), hbase=rand(N), hstats=rand(T, HEAD_STATS_WIDTH))


def _edges(a):
    return ops.mhc_prepare(a["X"], a["fn"], a["scale"], a["base"], 1e-5, 1e-6, 3, True)[2:]


def _rc_edges(a):
    return ops.mhc_prepare_rc(a["X"], a["fn"], a["scale"], a["base"], 1e-5, 1e-6, 3, True)[2:]


# (op, what is bad, change to the good arguments, public call, op call)
HP = dict(rms_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=3)
CASES = [
    ("rmsnorm_fwd", "w shorter than the rows", dict(w=lambda a: a["w"][:16]),
     lambda a: cake_rmsnorm_train_forward(a["x"], a["w"], 1e-6),
     lambda a: ops.rmsnorm_fwd(a["x"], a["w"], 1e-6, True)),
    ("rmsnorm_fwd", "w in float64", dict(w=lambda a: a["w"].double()),
     lambda a: cake_rmsnorm_train_forward(a["x"], a["w"], 1e-6),
     lambda a: ops.rmsnorm_fwd(a["x"], a["w"], 1e-6, True)),
    ("rmsnorm_fwd", "w on another device", dict(w=lambda a: a["w"].to("meta")),
     lambda a: cake_rmsnorm_train_forward(a["x"], a["w"], 1e-6),
     lambda a: ops.rmsnorm_fwd(a["x"], a["w"], 1e-6, True)),
    ("rmsnorm_fwd", "eps = 0", {},
     lambda a: cake_rmsnorm_train_forward(a["x"], a["w"], 0.0),
     lambda a: ops.rmsnorm_fwd(a["x"], a["w"], 0.0, True)),
    ("add_rmsnorm_fwd", "residual with fewer rows", dict(res=lambda a: a["res"][:2]),
     lambda a: cake_rmsnorm_train_forward(a["x"], a["w"], 1e-6, residual=a["res"]),
     lambda a: ops.add_rmsnorm_fwd(a["x"], a["res"], a["w"], 1e-6, True)),
    ("add_rmsnorm_fwd", "residual of another dtype", dict(res=lambda a: a["res"].float()),
     lambda a: cake_rmsnorm_train_forward(a["x"], a["w"], 1e-6, residual=a["res"]),
     lambda a: ops.add_rmsnorm_fwd(a["x"], a["res"], a["w"], 1e-6, True)),
    ("rmsnorm_bwd", "rstd shorter than the rows", dict(rstd=lambda a: a["rstd"][:2]),
     lambda a: cake_rmsnorm_train_backward(a["res"], a["x"], a["w"], a["rstd"]),
     lambda a: ops.rmsnorm_bwd(a["res"], a["x"], a["w"], a["rstd"], None, True)),
    ("rmsnorm_bwd", "g narrower than x", dict(res=lambda a: a["res"][:, :32]),
     lambda a: cake_rmsnorm_train_backward(a["res"], a["x"], a["w"], a["rstd"]),
     lambda a: ops.rmsnorm_bwd(a["res"], a["x"], a["w"], a["rstd"], None, True)),
    ("rmsnorm_bwd", "g_residual with fewer rows", {},
     lambda a: cake_rmsnorm_train_backward(a["res"], a["x"], a["w"], a["rstd"], g_residual=a["res"][:1]),
     lambda a: ops.rmsnorm_bwd(a["res"], a["x"], a["w"], a["rstd"], a["res"][:1], True)),
    ("mhc_prepare", "fn with a column short", dict(fn=lambda a: a["fn"][:, :-1]),
     lambda a: cake_mhc_train_forward_prepare(a["X"], a["fn"], a["scale"], a["base"], **HP),
     lambda a: ops.mhc_prepare(a["X"], a["fn"], a["scale"], a["base"], 1e-5, 1e-6, 3, True)),
    ("mhc_prepare", "scale of 4 entries", dict(scale=lambda a: torch.ones(4, device=DEVICE)),
     lambda a: cake_mhc_train_forward_prepare(a["X"], a["fn"], a["scale"], a["base"], **HP),
     lambda a: ops.mhc_prepare(a["X"], a["fn"], a["scale"], a["base"], 1e-5, 1e-6, 3, True)),
    ("mhc_prepare", "base of 20 entries", dict(base=lambda a: a["base"][:20]),
     lambda a: cake_mhc_train_forward_prepare(a["X"], a["fn"], a["scale"], a["base"], **HP),
     lambda a: ops.mhc_prepare(a["X"], a["fn"], a["scale"], a["base"], 1e-5, 1e-6, 3, True)),
    ("mhc_prepare", "3 streams", dict(X=lambda a: a["X"][:, :3]),
     lambda a: cake_mhc_train_forward_prepare(a["X"], a["fn"], a["scale"], a["base"], **HP),
     lambda a: ops.mhc_prepare(a["X"], a["fn"], a["scale"], a["base"], 1e-5, 1e-6, 3, True)),
    ("mhc_prepare", "sinkhorn_iters = 0", {},
     lambda a: cake_mhc_train_forward_prepare(a["X"], a["fn"], a["scale"], a["base"], sinkhorn_iters=0),
     lambda a: ops.mhc_prepare(a["X"], a["fn"], a["scale"], a["base"], 1e-5, 1e-6, 0, True)),
    ("mhc_stats", "hc_eps = 0", {},
     lambda a: cake_mhc_train_forward_stats(a["X"], a["fn"], a["scale"], a["base"], hc_eps=0.0),
     lambda a: ops.mhc_stats(a["X"], a["fn"], a["scale"], a["base"], 1e-5, 0.0, 3)),
    ("mhc_stats", "fn in float64", dict(fn=lambda a: a["fn"].double()),
     lambda a: cake_mhc_train_forward_stats(a["X"], a["fn"], a["scale"], a["base"], **HP),
     lambda a: ops.mhc_stats(a["X"], a["fn"], a["scale"], a["base"], 1e-5, 1e-6, 3)),
    ("mhc_finish", "B with fewer tokens", dict(B=lambda a: a["B"][:3]),
     lambda a: cake_mhc_train_forward_finish(a["X"], a["B"], a["stats"]),
     lambda a: ops.mhc_finish(a["X"], a["B"], a["stats"], *_edges(a))),
    ("mhc_finish", "stats narrower than the record", dict(stats=lambda a: a["stats"][:, :32]),
     lambda a: cake_mhc_train_forward_finish(a["X"], a["B"], a["stats"]),
     lambda a: ops.mhc_finish(a["X"], a["B"], a["stats"], *_edges(a))),
    # stream recompute's custom-op pair and rebuild (what nn.MHC under recompute_mhc dispatches while compiled)
    ("mhc_prepare_rc", "fn with a column short", dict(fn=lambda a: a["fn"][:, :-1]),
     lambda a: cake_mhc_train_forward_prepare(a["X"], a["fn"], a["scale"], a["base"], **HP),
     lambda a: ops.mhc_prepare_rc(a["X"], a["fn"], a["scale"], a["base"], 1e-5, 1e-6, 3, True)),
    ("mhc_finish_rc", "B with fewer tokens", dict(B=lambda a: a["B"][:3]),
     lambda a: cake_mhc_train_forward_finish(a["X"], a["B"], a["stats"]),
     lambda a: ops.mhc_finish_rc(a["X"], a["B"], a["stats"], *_rc_edges(a), 4)),
    ("mhc_finish_rc", "group_size = 1", {},
     lambda a: recompute_mhc(MHC(torch.nn.Identity(), C, N), 0),
     lambda a: ops.mhc_finish_rc(a["X"], a["B"], a["stats"], *_rc_edges(a), 1)),
    ("mhc_rebuild", "a record narrower than the layout", dict(stats=lambda a: a["stats"][:, :32]),
     lambda a: cake_mhc_train_forward_finish(a["X"], a["B"], a["stats"]),
     lambda a: ops.mhc_rebuild(a["X"], [a["B"]], [a["stats"]], a["dY"])),
    ("mhc_rebuild", "a record missing", {},
     lambda a: cake_mhc_train_forward_finish(a["X"], a["B"], None),
     lambda a: ops.mhc_rebuild(a["X"], [a["B"]], [], a["dY"])),
    ("mhc_rebuild_every", "B with fewer tokens", dict(B=lambda a: a["B"][:3]),
     lambda a: cake_mhc_train_forward_finish(a["X"], a["B"], a["stats"]),
     lambda a: ops.mhc_rebuild_every(a["X"], [a["B"]], [a["stats"]], a["dY"])),
    ("stream_expand", "3 streams", {},
     lambda a: StreamExpand(3),
     lambda a: ops.stream_expand(a["B"], 3)),
    ("mhc_head_fwd", "X without a stream dim", dict(X=lambda a: a["X"].reshape(T, N * C)),
     lambda a: cake_mhc_train_head_forward(a["X"]),
     lambda a: ops.mhc_head_fwd(a["X"])),
    ("mhc_head_bwd", "dY of 3 dims", dict(dYh=lambda a: a["dY"]),
     lambda a: cake_mhc_train_head_backward(a["dYh"]),
     lambda a: ops.mhc_head_bwd(a["dYh"], 4)),
    ("mhc_backward_prepare", "dY with fewer tokens", dict(dY=lambda a: a["dY"][:2]),
     lambda a: cake_mhc_train_backward_prepare(a["dY"], a["B"], a["X"], a["stats"]),
     lambda a: ops.mhc_backward_prepare(a["dY"], a["B"], a["X"], a["stats"])),
    ("mhc_backward_prepare", "B narrower than X", dict(B=lambda a: a["B"][:, :4]),
     lambda a: cake_mhc_train_backward_prepare(a["dY"], a["B"], a["X"], a["stats"]),
     lambda a: ops.mhc_backward_prepare(a["dY"], a["B"], a["X"], a["stats"])),
    ("mhc_backward_finish", "grad_stats narrower than the record", dict(gs=lambda a: a["gs"][:, :20]),
     lambda a: cake_mhc_train_backward_finish(a["X"], a["dY"], a["dU"], None, a["fn"], a["scale"], a["base"],
                                              a["stats"], a["gs"], **HP),
     lambda a: ops.mhc_backward_finish(a["X"], a["dY"], a["dU"], a["fn"], a["scale"], a["base"], a["stats"],
                                       a["gs"], 1e-5, 1e-6, 3, True)),
    ("mhc_backward_finish", "dU with fewer tokens", dict(dU=lambda a: a["dU"][:1]),
     lambda a: cake_mhc_train_backward_finish(a["X"], a["dY"], a["dU"], None, a["fn"], a["scale"], a["base"],
                                              a["stats"], a["gs"], **HP),
     lambda a: ops.mhc_backward_finish(a["X"], a["dY"], a["dU"], a["fn"], a["scale"], a["base"], a["stats"],
                                       a["gs"], 1e-5, 1e-6, 3, True)),
    ("mhc_backward_finish", "base of 20 entries", dict(base=lambda a: a["base"][:20]),
     lambda a: cake_mhc_train_backward_finish(a["X"], a["dY"], a["dU"], None, a["fn"], a["scale"], a["base"],
                                              a["stats"], a["gs"], **HP),
     lambda a: ops.mhc_backward_finish(a["X"], a["dY"], a["dU"], a["fn"], a["scale"], a["base"], a["stats"],
                                       a["gs"], 1e-5, 1e-6, 3, True)),
    ("mhc_gated_head_fwd", "fn of an mHC layer", dict(hfn=lambda a: a["fn"]),
     lambda a: cake_mhc_train_gated_head_forward(a["X"], a["hfn"], a["hscale"], a["hbase"]),
     lambda a: ops.mhc_gated_head_fwd(a["X"], a["hfn"], a["hscale"], a["hbase"], 1e-5, 1e-6, True)),
    ("mhc_gated_head_fwd", "3 streams", dict(X=lambda a: a["X"][:, :3]),
     lambda a: cake_mhc_train_gated_head_forward(a["X"], a["hfn"], a["hscale"], a["hbase"]),
     lambda a: ops.mhc_gated_head_fwd(a["X"], a["hfn"], a["hscale"], a["hbase"], 1e-5, 1e-6, True)),
    ("mhc_gated_head_fwd", "scale of 3 entries", dict(hscale=lambda a: a["scale"]),
     lambda a: cake_mhc_train_gated_head_forward(a["X"], a["hfn"], a["hscale"], a["hbase"]),
     lambda a: ops.mhc_gated_head_fwd(a["X"], a["hfn"], a["hscale"], a["hbase"], 1e-5, 1e-6, True)),
    ("mhc_gated_head_bwd", "stats of an mHC layer", dict(hstats=lambda a: a["stats"]),
     lambda a: cake_mhc_train_gated_head_backward(a["dYh"], a["X"], a["hfn"], a["hscale"], a["hbase"], a["hstats"]),
     lambda a: ops.mhc_gated_head_bwd(a["dYh"], a["X"], a["hfn"], a["hscale"], a["hbase"], a["hstats"], 1e-5, 1e-6,
                                      True)),
    ("mhc_gated_head_bwd", "dY with fewer tokens", dict(dYh=lambda a: a["dYh"][:2]),
     lambda a: cake_mhc_train_gated_head_backward(a["dYh"], a["X"], a["hfn"], a["hscale"], a["hbase"], a["hstats"]),
     lambda a: ops.mhc_gated_head_bwd(a["dYh"], a["X"], a["hfn"], a["hscale"], a["hbase"], a["hstats"], 1e-5, 1e-6,
                                      True)),
    ("mhc_gated_head_bwd", "hc_eps = 0", {},
     lambda a: cake_mhc_train_gated_head_backward(a["dYh"], a["X"], a["hfn"], a["hscale"], a["hbase"], a["hstats"],
                                                  hc_eps=0.0),
     lambda a: ops.mhc_gated_head_bwd(a["dYh"], a["X"], a["hfn"], a["hscale"], a["hbase"], a["hstats"], 1e-5, 0.0,
                                      True)),
]
IDS = [f"{op}: {what}" for op, what, *_ in CASES]


def _bad(change):
    a = _good()
    a.update({k: f(a) for k, f in change.items()})
    return a


@pytest.mark.parametrize("op, what, change, public, direct", CASES, ids=IDS)
def test_op_rejects_what_the_public_function_rejects(op, what, change, public, direct):
    with pytest.raises((ValueError, TypeError, NotImplementedError)):
        public(_bad(change))
    with pytest.raises((ValueError, TypeError, NotImplementedError), match=f"cakeops::{op}"):
        direct(_bad(change))


@pytest.mark.parametrize("op, what, change, public, direct", CASES, ids=IDS)
def test_fake_rejects_it_too(op, what, change, public, direct):
    """The same check while tracing: the op's fake implementation on fake tensors."""
    a = _bad(change)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = {k: mode.from_tensor(v) for k, v in a.items()}
        with pytest.raises((ValueError, TypeError, NotImplementedError), match=f"cakeops::{op}"):
            direct(fake)


def test_every_op_has_cases():
    from cakeops._ops import inductor

    assert {op.name().split("::")[1] for op in inductor._OPS} == {case[0] for case in CASES}


def test_good_arguments_pass_every_op():
    """The cases' baseline is valid: each call whose bad input is a changed tensor succeeds unchanged (so the
    case fails for its one change; cases with a bad scalar carry it in the call itself)."""
    for op, what, change, public, direct in CASES:
        if change:
            direct(_good())
            public(_good())
