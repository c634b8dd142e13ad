"""Stream recompute beside torch.compile: a compiled model with recompute_mhc traces whole and keeps its streams
(the same gradients as compiled without it); compiled branches inside eager MHC layers keep the recompute."""
import copy

import pytest
import torch

from cakeops import _recompute
from cakeops import nn as cnn
from cakeops.tiny_lm import TinyLM


def _grads(model, tokens, loss_fn=None):
    model.zero_grad(set_to_none=True)
    loss = (loss_fn or model.loss)(tokens)
    loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters()]


def _assert_bitwise(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"tensor {i} differs"


@pytest.fixture
def rebuilds(monkeypatch):
    asked = []
    original = _recompute.StreamGroup.streams
    monkeypatch.setattr(_recompute.StreamGroup, "streams", lambda g, k: asked.append(k) or original(g, k))
    return asked


def _models():
    torch.manual_seed(3)
    plain = TinyLM(vocab=30, dim=32, layers=2, heads=2, max_len=16)
    return plain, cnn.recompute_mhc(copy.deepcopy(plain))


def test_compiled_model_with_recompute_traces_and_keeps_its_streams(rebuilds):
    plain, rc = _models()
    tokens = torch.randint(0, 30, (2, 9))
    want = _grads(plain, tokens, torch.compile(plain.loss, fullgraph=True, backend="aot_eager"))
    got = _grads(rc, tokens, torch.compile(rc.loss, fullgraph=True, backend="aot_eager"))
    _assert_bitwise(want, got)
    assert not rebuilds  # under torch.compile the layers keep their streams (design.md §6)
    _assert_bitwise(want[1:], _grads(rc, tokens)[1:])  # and the same model eager rebuilds them, same bits
    assert rebuilds


def test_compiled_branches_in_eager_layers_recompute(rebuilds):
    plain, rc = _models()
    for model in (plain, rc):
        for block in model.blocks:
            block.branch.compile(fullgraph=True, backend="aot_eager")
    tokens = torch.randint(0, 30, (2, 9))
    _assert_bitwise(_grads(plain, tokens), _grads(rc, tokens))
    assert sorted(rebuilds) == sorted(2 * [1, 2, 3])  # 4 layers, one group: 3 followers, each asked twice
