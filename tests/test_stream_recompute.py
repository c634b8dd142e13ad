"""Stream recompute (cakeops.nn.recompute_mhc): gradients bitwise those without it, groups that never cross what
they must not, errors in the user's terms, and the activation memory it saves (live bytes, CPU)."""
import copy
import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from cakeops import nn as cnn
from cakeops.tiny_lm import TinyLM
from conftest import DEVICE, ON_GPU


def _stack(n: int, C: int, layers: int, dtype=torch.float32, gated: bool = False, **mhc):
    """Expand -> `layers` MHC layers around small nonlinear branches -> head: every layer's streams differ."""
    torch.manual_seed(1234 + layers)
    blocks = [cnn.StreamExpand(n)]
    for _ in range(layers):
        blocks.append(cnn.MHC(nn.Sequential(cnn.RMSNorm(C), nn.Linear(C, C), nn.GELU()), C, n, **mhc))
    blocks.append(cnn.MHCHead(n, gated=gated, hidden_size=C if gated else None))
    model = nn.Sequential(*blocks).to(DEVICE, dtype)
    with torch.no_grad():  # mixing far from uniform, gates far from their start: every term of the backward matters
        for m in model.modules():
            if isinstance(m, cnn.MHC):
                m.scale.fill_(0.5)
                m.base.add_(torch.randn_like(m.base))
    return model


def _grads(model, h, dY):
    h = h.detach().requires_grad_()
    out = model(h)
    out.backward(dY)
    return [h.grad] + [p.grad for p in model.parameters()], out


def _assert_bitwise(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x is not None and y is not None, i
        assert torch.equal(x, y), f"gradient {i} differs: max |diff| {(x.float() - y.float()).abs().max()}"


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("group_size", [2, 3, None])  # None: n (at most the 5 layers)
def test_gradients_bitwise(backend, n, group_size, monkeypatch):
    """5 layers in groups of 2 / 3 / the default: outputs and every gradient (streams' input, mappings, branches)
    bitwise equal to the same model without recompute, random upstream gradient; the followers' streams were
    rebuilt (each layer but a group's first asked for them, twice: finish and prepare nodes; and the first layer of
    the first group, whose input StreamExpand copied from h)."""
    from cakeops import _recompute

    C, layers = 16, 5
    plain = _stack(n, C, layers)
    rc = cnn.recompute_mhc(copy.deepcopy(plain), group_size)
    asked = []
    original = _recompute.StreamGroup.streams
    monkeypatch.setattr(_recompute.StreamGroup, "streams", lambda g, k: asked.append(k) or original(g, k))
    h = torch.randn(2, 3, C, device=DEVICE)
    dY = torch.randn(2, 3, C, device=DEVICE)
    g_plain, y_plain = _grads(plain, h, dY)
    assert not asked
    passes = _spy_rebuild_passes(monkeypatch)
    g_rc, y_rc = _grads(rc, h, dY)
    size = rc[1].recompute_group
    # the first group's first layer too: its input is StreamExpand's copy of h, rebuilt from h (k = 0)
    assert sorted(asked) == sorted(2 * [k % size for k in range(layers) if k % size or k == 0])
    assert sorted(passes) == _expected_passes(layers, size)
    assert torch.equal(y_plain, y_rc)
    _assert_bitwise(g_plain, g_rc)


def _spy_rebuild_passes(monkeypatch):
    """The rebuilds run: (layers finished through, every layer's streams written)."""
    from cakeops._ops import mhc as ops

    passes, original = [], ops.rebuild_impl
    monkeypatch.setattr(ops, "rebuild_impl", lambda X0, links, table=None, every=False: passes.append(
        (len(links), every)) or original(X0, links, table, every))
    return passes


def _expected_passes(layers: int, size: int):
    """Groups of ``size`` from the first layer (rooted at h: its first layer rebuilt from h, through no layer): a
    group followed by at least as many layers as its own rebuilds its layers 1.. in one pass, where there are two
    or more; a group nearer the end one layer at a time."""
    passes = [(0, False)]
    for start in range(0, layers, size):
        own = min(size, layers - start)
        if own >= 3 and layers - start - own >= own:
            passes.append((own - 1, True))
        else:
            passes += [(k, False) for k in range(1, own)]
    return sorted(passes)


def test_groups_rebuilt_in_one_pass(backend, monkeypatch):
    """Groups of 3 over 10 layers, [0 1 2] [3 4 5] [6 7 8] [9]: the first two rebuild their layers 1 and 2 in one
    pass each, [6 7 8] (followed by one layer) layer by layer; groups of 4, [0 1 2 3] [4 5 6 7] [8 9]: the first at
    once, the second layer by layer. Gradients bitwise without recompute."""
    C, layers = 16, 10
    plain = _stack(4, C, layers)
    h, dY = torch.randn(3, C, device=DEVICE), torch.randn(3, C, device=DEVICE)
    g_plain, _ = _grads(plain, h, dY)
    for size, at_once in ((3, [2, 2]), (4, [3])):
        rc = cnn.recompute_mhc(copy.deepcopy(plain), size)
        passes = _spy_rebuild_passes(monkeypatch)
        g_rc, _ = _grads(rc, h, dY)
        assert sorted(passes) == _expected_passes(layers, size), size
        assert [k for k, every in passes if every] == at_once
        _assert_bitwise(g_plain, g_rc)


def test_bf16_gated_head_save_stats_off(backend):
    """bf16 model (model.to(bf16)), the gated head, save_stats=False, a group spanning all layers."""
    C = 32
    plain = _stack(4, C, 4, dtype=torch.bfloat16, gated=True, save_stats=False)
    rc = cnn.recompute_mhc(copy.deepcopy(plain), 4)
    h = torch.randn(6, C, device=DEVICE, dtype=torch.bfloat16)
    dY = torch.randn(6, C, device=DEVICE, dtype=torch.bfloat16)
    _assert_bitwise(_grads(plain, h, dY)[0], _grads(rc, h, dY)[0])


def test_language_model_trains_the_same(backend):
    """TinyLM (attention + MLP branches, 4 mHC layers in groups of 3), three AdamW steps: losses and parameters
    bitwise equal."""
    torch.manual_seed(7)
    plain = TinyLM(vocab=50, dim=16, layers=2, heads=2, max_len=16).to(DEVICE)
    rc = cnn.recompute_mhc(copy.deepcopy(plain), 3)
    tokens = torch.randint(0, 50, (2, 6), device=DEVICE)
    for model in (plain, rc):
        model.opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        losses = []
        for model in (plain, rc):
            model.opt.zero_grad()
            loss = model.loss(tokens)
            loss.backward()
            model.opt.step()
            losses.append(loss.detach())
        assert torch.equal(*losses)
    for p, q in zip(plain.parameters(), rc.parameters()):
        assert torch.equal(p, q)


def test_groups_follow_the_chain():
    """Groups of 3 over 5 layers: [0 1 2] [3 4]; an op on the streams between two layers starts a new group;
    under checkpoint or no_grad the layers keep their streams (gradients: the bitwise tests around)."""
    from cakeops import _recompute

    C = 16
    model = cnn.recompute_mhc(_stack(4, C, 5), 3)
    layers = [m for m in model if isinstance(m, cnn.MHC)]
    seen = []
    original = _recompute.RecomputePlan.enter

    def spy(plan, X, X3):
        link = original(plan, X, X3)
        seen.append(None if link is None else link.k)
        return link

    h = torch.randn(4, C, device=DEVICE, requires_grad=True)
    try:
        _recompute.RecomputePlan.enter = spy
        out = model(h)
        out.backward(torch.randn_like(out))
        assert seen == [0, 1, 2, 0, 1]
        seen.clear()
        X = model[0](h)
        X = layers[0](X)
        X = layers[1](X * 1.0)  # not the previous layer's output: a new group
        X = layers[2](X)
        out = torch.utils.checkpoint.checkpoint(layers[3], X, use_reentrant=False)
        out.backward(torch.randn_like(out))
        assert seen[:3] == [0, 0, 1] and seen[3:] == [None, None]  # checkpointed: once in forward, once replayed
        seen.clear()
        with torch.no_grad():
            model(h)
        assert seen == [None] * 5
    finally:
        _recompute.RecomputePlan.enter = original


def test_checkpointed_blocks_bitwise(backend):
    """Whole-block activation checkpointing around pairs of layers with recompute on: the same gradients."""
    C = 16
    plain = _stack(4, C, 4)
    rc = cnn.recompute_mhc(copy.deepcopy(plain), 4)

    def run(model, h, dY):
        h = h.detach().requires_grad_()
        X = model[0](h)
        X = torch.utils.checkpoint.checkpoint(nn.Sequential(model[1], model[2]), X, use_reentrant=False)
        X = model[3](model[4](X))
        model[5](X).backward(dY)
        return [h.grad] + [p.grad for p in model.parameters()]

    h, dY = torch.randn(5, C, device=DEVICE), torch.randn(5, C, device=DEVICE)
    _assert_bitwise(run(plain, h, dY), run(rc, h, dY))


def test_retain_graph_second_backward_raises():
    model = cnn.recompute_mhc(_stack(4, 16, 3), 3)
    out = model(torch.randn(3, 16, device=DEVICE, requires_grad=True))
    dY = torch.randn_like(out)
    out.backward(dY, retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph=True.*group_size=1"):
        out.backward(dY)


def test_turn_off_repr_copies():
    model = _stack(4, 16, 12)
    assert cnn.recompute_mhc(model) is model
    layer = model[1]
    assert layer.recompute_group == 6 and "recompute_group=6" in repr(layer)  # n + 2
    # the groups n + 2 asks for share the layers evenly: 7 or 8 layers at n = 4 in two groups of 4
    assert [cnn.recompute_mhc(_stack(4, 16, L))[1].recompute_group for L in (7, 8, 13)] == [4, 4, 5]
    assert cnn.recompute_mhc(_stack(2, 16, 8))[1].recompute_group == 4
    assert cnn.recompute_mhc(_stack(8, 16, 6))[1].recompute_group == 6  # n = 8, at most the 6 layers
    clone = copy.deepcopy(model)
    assert clone[1].recompute_group == 6 and clone[1]._recompute is clone[2]._recompute
    cnn.recompute_mhc(model, group_size=1)
    assert layer.recompute_group == 1 and "recompute" not in repr(layer)
    out = model(torch.randn(3, 16, device=DEVICE))
    torch.save(cnn.recompute_mhc(model, 5), __import__("io").BytesIO())  # a whole-model save pickles the setting


@pytest.mark.parametrize("bad, error, match", [
    (0, ValueError, "group_size: expected an int >= 1"), (-2, ValueError, "group_size"),
    (2.0, TypeError, "group_size: expected an int"), (True, TypeError, "group_size"),
])
def test_bad_group_size(bad, error, match):
    model = _stack(4, 16, 2)
    with pytest.raises(error, match=match):
        cnn.recompute_mhc(model, bad)
    assert all(m.recompute_group == 1 for m in model if isinstance(m, cnn.MHC))  # nothing changed


def test_no_mhc_inside():
    with pytest.raises(ValueError, match="module: Sequential holds no cakeops.nn.MHC"):
        cnn.recompute_mhc(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(TypeError, match="module: expected an nn.Module"):
        cnn.recompute_mhc([cnn.MHC(nn.Identity(), 4)])


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the interpreter's numpy on inf - inf
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("C", [200, 16])
def test_rebuild_kernel_is_chained_finishes(triton_kernels, n, dtype, C):
    """The one-pass rebuild kernel against the forward_finish kernel chained, bit for bit: K = 1..4 layers,
    random records (any post / comb values), a C that is not a power of two and one divisible by 16 (Triton builds
    each kernel apart for the two: the compiler's fusing of multiply-adds once differed between them), a branch
    output with a row stride, a negative zero and an inf among the streams."""
    from cakeops._ops import mhc as ops
    from cakeops.meta import mhc_layout as layout

    T = 5
    X0 = torch.randn(T, n, C, device=DEVICE).to(dtype)
    X0[0, 0, 0], X0[1, n - 1, 3] = -0.0, float("inf")
    links = []
    for _ in range(4):
        B = torch.randn(T, C + 8, device=DEVICE).to(dtype)[:, 3:3 + C]
        stats = torch.randn(T, layout.stats_width(n), device=DEVICE)
        links.append((B, stats))
        chained = X0
        for B_, s_ in links:
            chained = ops.finish_impl(chained, B_, s_)
        rebuilt = ops.rebuild_impl(X0, links)
        assert rebuilt.dtype == dtype and rebuilt.shape == X0.shape
        assert torch.equal(rebuilt.view(torch.int8), chained.view(torch.int8)), f"K={len(links)}"
    every = ops.rebuild_impl(X0, links, every=True)  # each layer's streams, in one pass
    chained = X0
    for k, (B_, s_) in enumerate(links):
        chained = ops.finish_impl(chained, B_, s_)
        assert every[k].dtype == dtype and every[k].is_contiguous()
        assert torch.equal(every[k].view(torch.int8), chained.view(torch.int8)), f"every, layer {k}"
    if ON_GPU:  # every launch shape the tuner may pick: the tiling must not change a bit
        from cakeops._triton import mhc_forward as kernels

        Bs, stats_list = [B for B, _ in links], [s for _, s in links]
        for config in kernels.RebuildConfig.candidates():
            Y = torch.empty_like(X0)
            kernels.rebuild(X0, Bs, stats_list, Y, config=config)
            assert torch.equal(Y.view(torch.int8), chained.view(torch.int8)), config
            Ys = [torch.empty_like(X0) for _ in Bs]
            kernels.rebuild(X0, Bs, stats_list, Ys, config=config)
            assert all(torch.equal(Y.view(torch.int8), want.view(torch.int8)) for Y, want in zip(Ys, every)), config


def _live_bytes() -> int:
    """Bytes the C allocator holds for the process now (glibc's mallinfo2: heap in use plus mmap'd blocks): every
    CPU tensor's storage, whatever made it."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in
                    "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def _activation_peak(model, tokens) -> int:
    """Peak live bytes of a training step above what lived before it, the gradients already allocated: sampled
    after the forward and whenever a module's output receives its gradient (hooks on outputs, not on saved
    tensors, so the sampling does not change what autograd keeps)."""
    import gc

    samples = []

    def watch(module, inputs, out):
        if isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(lambda grad: samples.append(_live_bytes()))

    handles = [m.register_forward_hook(watch) for m in model.modules()]
    try:
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()  # allocates the gradients
        model.zero_grad(set_to_none=False)
        gc.collect()
        before = _live_bytes()
        samples.clear()
        loss = model.loss(tokens[:, :-1], tokens[:, 1:])
        samples.append(_live_bytes())
        loss.backward()
        return max(samples) - before
    finally:
        for h in handles:
            h.remove()


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux") or DEVICE != "cpu",
                    reason="counts CPU tensors through glibc's mallinfo2 (Linux, CPU tensors)")
def test_activation_memory_ratio():
    """The memory saving, guarded: a Llama-like stack (bench model_zoo, 4 blocks = 8 mHC layers, FP32, CPU reference
    math; the eager path), peak activation bytes of a step over the plain-residual model's, the loss's share small
    (vocab 256): cakeops keeps the streams (1.54x measured), recompute_mhc with its default groups (n = 4 layers,
    the first rooted at StreamExpand's h) 1.27x -- what this design keeps (B, a share of X0, the records) and holds
    while a layer's backward runs (its rebuilt streams and the n-stream gradient), design.md §6. A layer that kept
    its streams again would put it back above 1.45x."""
    from cakeops.bench.model_zoo import Config, build

    cfg = Config(dim=256, blocks=4, ffn=704, heads=4, batch=2, seq=513, vocab=256)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    peaks = {v: _activation_peak(build(cfg, v, "cpu", torch.float32), tokens)
             for v in ("plain", "cakeops", "cakeops-recompute")}
    ratio = {v: peaks[v] / peaks["plain"] for v in peaks}
    assert ratio["cakeops"] > 1.45, ratio  # the streams kept: what recompute is for
    assert ratio["cakeops-recompute"] <= 1.3 and ratio["cakeops"] - ratio["cakeops-recompute"] >= 0.2, ratio


class _LiveTensorBytes(TorchDispatchMode):
    """Bytes of the storages made by ops under the mode and still alive; ``peak`` the most at any op's end. Every
    tensor a step makes passes through dispatch, so this sees what autograd keeps and what a backward holds, however
    recompute is built (under a dispatch mode cakeops dispatches its custom ops: _ops/mhc_recompute.py)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._sizes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._sizes:
                    self._sizes[key] = storage.nbytes()
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._freed, key)
        self.peak = max(self.peak, self.live)
        return out

    def _freed(self, key):
        self.live -= self._sizes.pop(key)


def _step_peak_through_dispatch(model, tokens) -> int:
    model.loss(tokens[:, :-1], tokens[:, 1:]).backward()  # the gradients allocated before the measured step
    with _LiveTensorBytes() as mode:
        model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
    return mode.peak


def test_peak_memory_ratio_through_a_dispatch_mode():
    """The bench's ratio (peak above the weights over plain residual's, loss included) on a small Llama-like stack of
    the bench's proportions (vocab / hidden as C=2048 / vocab 32000), 4 and 8 blocks: recompute_mhc at most 1.2x
    (measured 1.12x / 1.16x; cakeops without it 1.31x / 1.38x). The activations alone: test_activation_memory_ratio."""
    from cakeops.bench.model_zoo import Config, build

    for blocks in (4, 8):
        cfg = Config(dim=128, blocks=blocks, ffn=352, heads=2, batch=2, seq=257, vocab=2000)
        tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
        peaks = {}
        for variant in ("plain", "cakeops", "cakeops-recompute"):
            torch.manual_seed(0)
            peaks[variant] = _step_peak_through_dispatch(build(cfg, variant, "cpu", torch.float32), tokens)
        ratio = {v: round(peaks[v] / peaks["plain"], 3) for v in peaks}
        assert ratio["cakeops"] > 1.25, (blocks, ratio)  # the streams kept: what recompute is for
        assert ratio["cakeops-recompute"] <= 1.2, (blocks, ratio)


def _distributed_worker(rank, init_file, scenarios):
    for parallel in scenarios:  # one spawn for several scenarios: the processes' start is most of the time
        _distributed_scenario(rank, init_file + "-" + parallel, parallel)


def _distributed_scenario(rank, init_file, parallel):
    """Each rank trains its half of the batch twice, one model with recompute_mhc and one without, wrapped alike
    (DDP, or FSDP2 per block with and without a bf16 policy, or FSDP2 with block 3 checkpointed): losses and
    every gradient bitwise equal, step after step (groups span the FSDP units: the rebuild reads no parameter)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from cakeops import _recompute

    rebuilt = []
    original = _recompute.StreamGroup.streams
    _recompute.StreamGroup.streams = lambda group, k: rebuilt.append(k) or original(group, k)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        base = TinyLM(vocab=40, dim=32, layers=3, heads=2, max_len=16)
        models = []
        for recompute in (False, True):
            model = copy.deepcopy(base)
            if recompute:
                cnn.recompute_mhc(model, 4)
            if parallel == "ddp":
                model = DDP(model)
            else:
                mesh = init_device_mesh("cpu", (2,))
                policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if parallel == "fsdp2-bf16" else None
                for i, block in enumerate(model.blocks):
                    if parallel == "fsdp2-ac" and i == 3:
                        model.blocks[i] = block = torch.distributed.algorithms._checkpoint.checkpoint_wrapper \
                            .checkpoint_wrapper(block)
                    fully_shard(block, mesh=mesh, **({"mp_policy": policy} if policy else {}))
                fully_shard(model, mesh=mesh, **({"mp_policy": policy} if policy else {}))
            models.append((model, torch.optim.SGD(model.parameters(), lr=0.1)))
        gen = torch.Generator().manual_seed(1)
        for step in range(2):
            tokens = torch.randint(0, 40, (4, 11), generator=gen).chunk(2)[rank]
            results = []
            for model, opt in models:
                opt.zero_grad(set_to_none=True)
                if parallel == "ddp":  # through DDP's forward, which arms its gradient sync
                    logits = model(tokens[:, :-1])
                    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 40), tokens[:, 1:].reshape(-1))
                else:
                    loss = model.loss(tokens)
                loss.backward()
                results.append([loss.detach()] + [getattr(p.grad, "_local_tensor", p.grad).clone()
                                                   for p in model.parameters()])
                opt.step()
            for i, (a, b) in enumerate(zip(*results)):
                assert torch.equal(a, b), f"{parallel} rank {rank} step {step}: tensor {i} differs"
            # 6 layers in groups of 4, the first rooted at StreamExpand's h (its first layer rebuilt too), streams
            # asked twice; block 3 checkpointed: [0 1 2] 3 [4 5]
            assert len(rebuilt) == (8 if parallel == "fsdp2-ac" else 10), (parallel, rebuilt)
            rebuilt.clear()
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="this torch has no torch.distributed")
def test_two_processes_bitwise():
    from cakeops.testing import spawn_ranks

    spawn_ranks(_distributed_worker, 2, ("ddp", "fsdp2", "fsdp2-bf16", "fsdp2-ac"))


def test_rebuild_chained_in_place_when_the_kernel_cannot_run(triton_kernels):
    """Branch outputs of two dtypes (an autocast branch beside a plain one): the finishes chained in one buffer, in
    place, bitwise the chained finishes out of place (on a GPU the same path serves CUDA-graph capture)."""
    from cakeops._ops import mhc as ops
    from cakeops.meta import mhc_layout as layout

    T, n, C = 4, 4, 96
    X0 = torch.randn(T, n, C, device=DEVICE)
    links = [(torch.randn(T, C, device=DEVICE).to(dtype), torch.randn(T, layout.stats_width(n), device=DEVICE))
             for dtype in (torch.float32, torch.bfloat16, torch.float32)]
    chained = X0
    for B, stats in links:
        chained = ops.finish_impl(chained, B, stats)
    assert torch.equal(ops.rebuild_impl(X0, links).view(torch.int8), chained.view(torch.int8))


@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a CUDA device")
def test_cuda_graphs_eager_capture_and_reduce_overhead(deterministic_inductor):
    """A training step captured in a CUDA graph (eager layers: the rebuild chains finish kernels in place, no
    host-to-device table) and a model compiled with mode="reduce-overhead" (Inductor's CUDA graphs around the
    ops' groups) give the gradients of the same model without recompute, bit for bit, replay after replay
    (compiled: in Inductor's deterministic mode, conftest.deterministic_inductor)."""
    torch.manual_seed(0)
    base = TinyLM(vocab=40, dim=64, layers=2, heads=2, max_len=32).cuda()
    tokens = torch.randint(0, 40, (2, 17), device="cuda")

    def grads(model):
        model.zero_grad(set_to_none=False)  # in place: the captured graph writes into these gradients
        model.loss(tokens).backward()
        return [p.grad.clone() for p in model.parameters()]

    want = grads(base)
    rc = cnn.recompute_mhc(copy.deepcopy(base))
    grads(rc)  # every kernel built and the gradients allocated outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grads(rc)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    rc.zero_grad(set_to_none=False)
    with torch.cuda.graph(graph):
        rc.loss(tokens).backward()
    for _ in range(2):
        rc.zero_grad(set_to_none=False)
        graph.replay()
        torch.cuda.synchronize()
        for i, (a, b) in enumerate(zip(want, [p.grad for p in rc.parameters()])):
            assert torch.equal(a, b), f"eager capture: gradient {i}"

    torch._dynamo.reset()
    plain, rc = copy.deepcopy(base), cnn.recompute_mhc(copy.deepcopy(base))
    compiled = {m: torch.compile(m.loss, fullgraph=True, mode="reduce-overhead") for m in (plain, rc)}

    def graph_grads(model):
        # The gradients are outputs of the CUDA graphs, overwritten by the next run of either model: a new step is
        # marked before each run, the last step's gradients dropped (not zeroed in place), and the new ones copied.
        model.zero_grad(set_to_none=True)
        torch.compiler.cudagraph_mark_step_begin()
        compiled[model](tokens).backward()
        return [p.grad.clone() for p in model.parameters()]

    for _ in range(3):  # warm-up, recording, replay
        want, got = graph_grads(plain), graph_grads(rc)
        for i, (a, b) in enumerate(zip(want, got)):
            assert torch.equal(a, b), f"reduce-overhead: gradient {i}"


def test_hidden_state_modified_after_stream_expand():
    """A group rooted at StreamExpand's h must not rebuild from a changed h: changed before the first layer, the
    group keeps the streams instead (same gradients as without recompute); changed after, the backward raises."""
    C = 16
    plain = _stack(4, C, 3)
    rc = cnn.recompute_mhc(copy.deepcopy(plain), 3)
    h0, dY = torch.randn(2, 3, C, device=DEVICE), torch.randn(2, 3, C, device=DEVICE)

    def run(model, modify_after_layer):
        model.zero_grad(set_to_none=True)
        leaf = h0.clone().requires_grad_()
        h = leaf * 1.0
        X = model[0](h)
        for i, layer in enumerate(model[1:-1]):
            if i == modify_after_layer:
                h.mul_(2.0)
            X = layer(X)
        model[-1](X).backward(dY)
        return [leaf.grad] + [p.grad for p in model.parameters()]

    _assert_bitwise(run(plain, 0), run(rc, 0))  # before the first layer: not rooted
    with pytest.raises(RuntimeError, match="StreamExpand.*modified in place"):
        run(rc, 1)


def test_rebuild_tables_are_kept_by_their_addresses(triton_kernels):
    """A rebuild table is a function of the addresses it holds: the same layers find their host table made (no new
    pinned copy per compiled rebuild), other layers another, and the rebuild through a table is still bitwise the
    chained finishes. The table handed out is the caller's alone: nothing of the device's stays behind the call
    (a kept device table outlived a compiled rebuild in the CUDA-graph pool of mode="reduce-overhead": "tensors in
    the cudagraph pool not tracked as outputs", seen on an H100)."""
    from cakeops._ops import mhc as ops
    from cakeops._triton import mhc_forward as kernels
    from cakeops._triton import mhc_streams
    from cakeops.meta import mhc_layout as layout

    T, n, C = 3, 4, 32
    X0 = torch.randn(T, n, C, device=DEVICE)
    links = [(torch.randn(T, C, device=DEVICE), torch.randn(T, layout.stats_width(n), device=DEVICE))
             for _ in range(2)]
    kept = len(mhc_streams._HOST_TABLES)
    first = kernels.rebuild_table([B for B, _ in links], [s for _, s in links], X0.device)
    again = kernels.rebuild_table([B for B, _ in links], [s for _, s in links], X0.device)
    assert len(mhc_streams._HOST_TABLES) <= kept + 1 and torch.equal(again, first)
    assert all(t.device.type == "cpu" for t in mhc_streams._HOST_TABLES.values())
    assert all(t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
               for t in mhc_streams._HOST_TABLES.values())
    gone = weakref.ref(first)
    del first, again
    assert gone() is None, "a rebuild table outlives its caller"
    other = kernels.rebuild_table([links[1][0], links[0][0]], [s for _, s in links], X0.device)
    assert other[0].tolist() == [links[1][0].data_ptr(), links[0][0].data_ptr()]
    chained = ops.finish_impl(ops.finish_impl(X0, *links[0]), *links[1])
    for _ in range(2):
        assert torch.equal(ops.rebuild_impl(X0, links), chained)


# ---- the functional API's hook: cakeops.nn.StreamRecompute, cake_mhc_train_prepare(recompute=), stream_expand ----

def _functional_stack(h, params, plan, n):
    """stream_expand -> len(params) prepare/branch/finish layers -> the plain head, through the functional API."""
    from cakeops.cake_mhc_train import cake_mhc_train_finish, cake_mhc_train_head, cake_mhc_train_prepare

    X = cnn.stream_expand(h, n, recompute=plan)
    for fn, scale, base, w in params:
        U, handle = cake_mhc_train_prepare(X, fn, scale, base, rms_eps=1e-6, hc_eps=0.01, sinkhorn_iters=5,
                                           recompute=plan)
        X = cake_mhc_train_finish(X, torch.tanh(U @ w), handle)
    return cake_mhc_train_head(X)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_functional_hook_bitwise(compiled):
    n, C, layers = 4, 32, 5
    gen = torch.Generator().manual_seed(7)
    params = [tuple(t.requires_grad_() for t in (torch.randn(2 * n + n * n, n * C, generator=gen) * 0.3,
                                                   torch.rand(3, generator=gen) + 0.5,
                                                   torch.randn(2 * n + n * n, generator=gen),
                                                   torch.randn(C, C, generator=gen) / C ** 0.5))
              for _ in range(layers)]
    h0 = torch.randn(3, 7, C, generator=gen)
    dY = torch.randn(3, 7, C, generator=gen)

    def grads(plan):
        h = h0.clone().requires_grad_()
        run = _functional_stack
        if compiled:
            torch._dynamo.reset()
            run = torch.compile(_functional_stack, fullgraph=True, backend="aot_eager")
        run(h, params, plan, n).backward(dY)
        out = [h.grad] + [p.grad.clone() for ps in params for p in ps]
        for ps in params:
            for p in ps:
                p.grad = None
        return out

    want = grads(None)
    for plan in (cnn.StreamRecompute(4), cnn.StreamRecompute(2)):
        for a, b in zip(grads(plan), want):
            assert torch.equal(a, b)


def test_functional_hook_keeps_less_and_checks_its_argument(monkeypatch):
    from cakeops import _recompute
    from cakeops.cake_mhc_train import cake_mhc_train_prepare

    links, enter = [], _recompute.RecomputePlan.enter

    def spy(self, X, X3):  # (k, rebuilds) as the layer joins: the group lets its root go after the backward
        link = enter(self, X, X3)
        links.append((link.k, link.rebuilds))
        return link

    monkeypatch.setattr(_recompute.RecomputePlan, "enter", spy)
    C = 16
    params = [tuple(t.requires_grad_() for t in (torch.randn(24, 4 * C) * 0.3, torch.rand(3) + 0.5,
                                                 torch.randn(24), torch.eye(C))) for _ in range(5)]
    h0, dY = torch.randn(6, C), torch.randn(6, C)

    def grads(plan):
        h = h0.clone().requires_grad_()
        _functional_stack(h, params, plan, 4).backward(dY)
        out = [h.grad] + [p.grad for ps in params for p in ps]
        for ps in params:
            for p in ps:
                p.grad = None
        return out

    got = grads(cnn.StreamRecompute(4))
    # groups of 4 rooted at the expansion's h: no layer keeps its streams but the second group's first
    assert links == [(0, True), (1, True), (2, True), (3, True), (0, False)]
    for a, b in zip(got, grads(None)):  # and the rebuilt streams give the gradients kept ones give
        assert torch.equal(a, b)

    X = torch.randn(2, 4, 8)
    with pytest.raises(TypeError, match="StreamRecompute"):
        cake_mhc_train_prepare(X, torch.zeros(24, 32), torch.ones(3), torch.zeros(24), recompute=4)
    with pytest.raises(TypeError, match="StreamRecompute"):
        cnn.stream_expand(torch.randn(2, 8), 4, recompute=True)
    with pytest.raises(ValueError, match="group_size"):
        cnn.StreamRecompute(1)
    assert repr(cnn.StreamRecompute(3)) == "StreamRecompute(group_size=3)"
