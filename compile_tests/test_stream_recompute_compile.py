"""Stream recompute under torch.compile: compiled models with recompute_mhc keep only their groups' first inputs,
rebuild the other layers' streams in the backward graph (``cakeops::mhc_rebuild``), and give the gradients of the
same model compiled without it, bit for bit; compiled branches inside eager MHC layers keep the eager recompute.
The ops' own groups (_ops/mhc_recompute.py) also serve eager calls under a dispatch mode."""
import copy

import pytest
import torch
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode

from cakeops import _recompute
from cakeops import nn as cnn
from cakeops._ops import mhc_recompute
from cakeops.tiny_lm import TinyLM
from conftest import DEVICE


def _grads(model, tokens, loss_fn=None):
    model.zero_grad(set_to_none=True)
    loss = (loss_fn or model.loss)(tokens)
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"tensor {i} differs"


@pytest.fixture
def eager_rebuilds(monkeypatch):
    asked = []
    original = _recompute.StreamGroup.streams
    monkeypatch.setattr(_recompute.StreamGroup, "streams", lambda g, k: asked.append(k) or original(g, k))
    return asked


def _models(layers=2, dim=32, group_size=None):
    torch.manual_seed(3)
    plain = TinyLM(vocab=30, dim=dim, layers=layers, heads=2, max_len=16).to(DEVICE)
    return plain, cnn.recompute_mhc(copy.deepcopy(plain), group_size)


class _Graphs:
    """An aot_autograd backend with Inductor's partitioner (min-cut) that keeps the forward and backward graphs."""

    def __init__(self):
        self.forward = self.backward = None
        self.backend = aot_autograd(fw_compiler=self._keep("forward"), bw_compiler=self._keep("backward"),
                                    partition_fn=min_cut_rematerialization_partition)

    def _keep(self, name):
        def compiler(gm, example_inputs):
            setattr(self, name, gm)
            return make_boxed_func(gm.forward)
        return compiler

    def saved(self):
        """The forward graph's saved tensors (its outputs after the loss), one entry per storage: name -> fake."""
        out = next(n for n in self.forward.graph.nodes if n.op == "output").args[0]
        return {id(a.meta["val"].untyped_storage()): a.meta["val"] for a in out[1:]
                if isinstance(getattr(a, "meta", {}).get("val"), torch.Tensor)}

    def rebuilds(self, graph, op=torch.ops.cakeops.mhc_rebuild.default):
        """The number of earlier layers each ``op`` (a rebuild) in ``graph`` finishes through."""
        return sorted(len(n.args[1]) for n in graph.graph.nodes if n.target is op)


def _compiled_grads(model, tokens):
    torch._dynamo.reset()
    graphs = _Graphs()
    return _grads(model, tokens, torch.compile(model.loss, fullgraph=True, backend=graphs.backend)), graphs


def test_compiled_model_keeps_only_group_inputs_and_rebuilds_in_the_backward():
    plain, rc = _models(layers=4, group_size=4)  # 8 mHC layers: two groups of 4
    tokens = torch.randint(0, 30, (2, 13), device=DEVICE)
    want, without = _compiled_grads(plain, tokens)
    got, graphs = _compiled_grads(rc, tokens)
    _assert_bitwise(want, got)
    # the first group rooted at StreamExpand's h: its first layer rebuilds too (through no layer); followed by as
    # many layers as its own, it rebuilds its layers 1..3 in one pass, the last group one layer at a time
    every = torch.ops.cakeops.mhc_rebuild_every.default
    assert graphs.rebuilds(graphs.backward) == [0, 1, 2, 3] and graphs.rebuilds(graphs.backward, every) == [3]
    assert not graphs.rebuilds(graphs.forward) and not graphs.rebuilds(graphs.forward, every)
    assert not graphs.rebuilds(without.backward)
    streams_bytes, h_bytes = 2 * 12 * 4 * 32 * 4, 2 * 12 * 32 * 4  # one layer's X [tokens, n, C], h: FP32
    saved_without = sum(t.untyped_storage().nbytes() for t in without.saved().values())
    saved_with = sum(t.untyped_storage().nbytes() for t in graphs.saved().values())
    # no follower's X (6), and h instead of the first group's X0
    assert saved_without - saved_with == 7 * streams_bytes - h_bytes, (saved_without, saved_with)


def test_inductor_compiled_model_with_recompute_matches_without(deterministic_inductor):
    """Bit for bit in Inductor's deterministic mode (conftest.deterministic_inductor: outside it two compiles of the
    same model may differ in the last bits, recompute or not)."""
    plain, rc = _models()
    tokens = torch.randint(0, 30, (2, 9), device=DEVICE)
    torch._dynamo.reset()
    want = _grads(plain, tokens, torch.compile(plain.loss, fullgraph=True))
    torch._dynamo.reset()
    got = _grads(rc, tokens, torch.compile(rc.loss, fullgraph=True))
    _assert_bitwise(want, got)


class _Chain(torch.nn.Module):
    """StreamExpand, then MHC layers with tanh branches; ``between``: an op on the streams after layer 1."""

    def __init__(self, n, C, layers, between=False):
        super().__init__()
        self.expand = cnn.StreamExpand(n)
        self.layers = torch.nn.ModuleList(cnn.MHC(torch.nn.Sequential(torch.nn.Linear(C, C), torch.nn.Tanh()), C, n)
                                          for _ in range(layers))
        self.head = cnn.MHCHead()
        self.between = between

    def forward(self, h):
        X = self.expand(h)
        for i, layer in enumerate(self.layers):
            X = layer(X)
            if self.between and i == 1:
                X = X * 1.0  # the identity, but an op: a new group starts after it
        return self.head(X)


@pytest.mark.parametrize("n, dtype", [(2, torch.float32), (8, torch.float32), (4, torch.bfloat16)])
def test_streams_and_dtypes(n, dtype):
    torch.manual_seed(n)
    C = 16
    plain = _Chain(n, C, layers=5).to(DEVICE, dtype)
    rc = cnn.recompute_mhc(copy.deepcopy(plain), 3)
    h = torch.randn(2, 7, C, device=DEVICE, dtype=dtype)
    g = torch.randn(2, 7, C, device=DEVICE, dtype=dtype)
    results = []
    for model in (plain, rc):
        torch._dynamo.reset()
        graphs = _Graphs()
        x = h.clone().requires_grad_()
        torch.compile(model, fullgraph=True, backend=graphs.backend)(x).backward(g)
        results.append(([x.grad] + [p.grad for p in model.parameters()], graphs))
    _assert_bitwise(results[0][0], results[1][0])
    graphs = results[1][1]  # groups (0, 1, 2) rooted, followed by 2 layers only: layer by layer; (3, 4)
    assert graphs.rebuilds(graphs.backward) == [0, 1, 1, 2]
    assert not graphs.rebuilds(graphs.backward, torch.ops.cakeops.mhc_rebuild_every.default)


def test_an_op_between_layers_starts_a_new_group():
    torch.manual_seed(0)
    plain = _Chain(4, 16, layers=4, between=True).to(DEVICE)
    rc = cnn.recompute_mhc(copy.deepcopy(plain))
    h, g = torch.randn(3, 16, device=DEVICE), torch.randn(3, 16, device=DEVICE)
    grads, rebuilds = [], None
    for model in (plain, rc):
        torch._dynamo.reset()
        graphs = _Graphs()
        x = h.clone().requires_grad_()
        torch.compile(model, fullgraph=True, backend=graphs.backend)(x).backward(g)
        grads.append([x.grad] + [p.grad for p in model.parameters()])
        rebuilds = graphs.rebuilds(graphs.backward)
    _assert_bitwise(*grads)
    assert rebuilds == [0, 1, 1]  # layers 0 (rooted at h), 1 and 3: none across the op


def test_checkpointed_blocks_under_compile():
    plain, rc = _models(layers=3)
    for model in (plain, rc):
        block = model.blocks[2]
        model.blocks[2] = torch.distributed.algorithms._checkpoint.checkpoint_wrapper.checkpoint_wrapper(block)
    tokens = torch.randint(0, 30, (2, 9), device=DEVICE)
    want, _ = _compiled_grads(plain, tokens)
    got, graphs = _compiled_grads(rc, tokens)
    _assert_bitwise(want, got)
    assert graphs.rebuilds(graphs.backward)


def test_compiled_branches_in_eager_layers_recompute(eager_rebuilds):
    plain, rc = _models()
    for model in (plain, rc):
        for block in model.blocks:
            block.branch.compile(fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, 30, (2, 9), device=DEVICE)
    _assert_bitwise(_grads(plain, tokens), _grads(rc, tokens))
    # 4 layers, one group rooted at StreamExpand's h: every layer rebuilt, each asked twice
    assert sorted(eager_rebuilds) == sorted(2 * [0, 1, 2, 3])


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.fixture
def op_rebuilds(monkeypatch):
    asked = []
    original = mhc_recompute._mhc_rebuild
    monkeypatch.setattr(mhc_recompute, "_mhc_rebuild", lambda X0, Bs, *rest: asked.append(len(Bs)) or
                        original(X0, Bs, *rest))
    return asked


def test_eager_calls_under_a_dispatch_mode_use_the_ops_groups(op_rebuilds, eager_rebuilds):
    """Under a dispatch mode the layers dispatch the custom ops (as FlopCounterMode or a memory tracker needs):
    the ops' groups rebuild, and a second backward through the graph works (the ops keep X0, B's and records)."""
    plain, rc = _models()
    tokens = torch.randint(0, 30, (2, 9), device=DEVICE)
    want = _grads(plain, tokens)
    with _Passthrough():
        got = _grads(rc, tokens)
        assert sorted(op_rebuilds) == [0, 1, 2, 3] and not eager_rebuilds
        rc.zero_grad(set_to_none=True)
        loss = rc.loss(tokens)
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in rc.parameters()]
        rc.zero_grad(set_to_none=True)
        loss.backward()
    _assert_bitwise(want, got)
    _assert_bitwise(first, [p.grad for p in rc.parameters()])


def test_in_place_change_between_eager_layers_starts_a_new_group(op_rebuilds):
    torch.manual_seed(1)
    model = cnn.recompute_mhc(_Chain(4, 16, layers=4).to(DEVICE))
    h, g = torch.randn(3, 16, device=DEVICE), torch.randn(3, 16, device=DEVICE)

    def run(recompute):
        model.zero_grad(set_to_none=True)
        x = h.clone().requires_grad_()
        X = model.expand(x)
        for i, layer in enumerate(model.layers):
            X = layer(X)
            if i == 1:
                X.mul_(0.5)  # same tensor object, new version: the rebuild of layer 2 would miss it
        model.head(X).backward(g)
        return [x.grad] + [p.grad for p in model.parameters()]

    with _Passthrough():
        got = run(True)
    assert sorted(op_rebuilds) == [0, 1, 1]  # layer 0 from h; layers 1 and 3
    cnn.recompute_mhc(model, 1)
    _assert_bitwise(run(False), got)


def test_flop_counter_counts_the_rebuilds():
    """Under FlopCounterMode (a dispatch mode) the recompute model's step counts its rebuilds: one finish per layer
    rebuilt through, on top of the model's FLOPs without recompute."""
    from torch.utils.flop_counter import FlopCounterMode

    plain, rc = _models()
    tokens = torch.randint(0, 30, (2, 9), device=DEVICE)
    counts = []
    for model in (plain, rc):
        with FlopCounterMode(display=False) as counter:
            model.loss(tokens).backward()
        counts.append(counter.get_flop_counts()["Global"])
    ops = torch.ops.cakeops
    T, n, C = 2 * 8, 4, 32
    assert counts[1][ops.mhc_rebuild] == (1 + 2 + 3) * (2 * T * n * n * C + 2 * T * n * C)
    assert counts[1][ops.mhc_finish_rc] == counts[0][ops.mhc_finish]
    assert sum(counts[1].values()) - sum(counts[0].values()) == counts[1][ops.mhc_rebuild]
