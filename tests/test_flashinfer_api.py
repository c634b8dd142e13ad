"""FlashInfer drop-in: every public function called with FlashInfer's documented keywords (docs.flashinfer.ai,
``flashinfer.cake_mhc_train`` / ``flashinfer.cake_rmsnorm_train``), caller-owned workspaces (a call given its
outputs and a workspace allocates nothing), their size errors, and a CUDA graph of forward + backward."""
import contextlib
import traceback
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cakeops import _traced
from cakeops import cake_mhc_train as mhc
from cakeops import cake_rmsnorm_train as rms
from conftest import BUFFER_LAYOUTS, DEVICE, ON_GPU, assert_written_in_view, buffer_view

T, N, C, M = 5, 4, 32, 24


def _inputs(dtype=torch.bfloat16, T=T):
    g = torch.Generator().manual_seed(0)
    X = torch.randn(T, N, C, generator=g).to(DEVICE, dtype)
    fn = (torch.randn(M, N * C, generator=g) * 0.05).to(DEVICE)
    scale = torch.tensor([0.5, 0.3, 0.8], device=DEVICE)
    base = (torch.randn(M, generator=g) * 0.5).to(DEVICE)
    return X, fn, scale, base


def test_mhc_functions_take_flashinfers_keywords(backend):
    X, fn, scale, base = _inputs()
    hp = dict(rms_eps=1e-5, hc_eps=1e-6, sinkhorn_iters=20)
    fws = mhc.cake_mhc_train_forward_workspace(T, X.device, hidden=C)
    bws = mhc.cake_mhc_train_backward_workspace(T, X.device, hidden=C)
    assert fws.dtype == bws.dtype == torch.uint8
    assert fws.numel() == mhc.cake_mhc_train_forward_workspace_bytes(T, X.device, hidden=C)
    assert bws.numel() == mhc.cake_mhc_train_backward_workspace_bytes(T, X.device, hidden=C)
    U, stats = mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, **hp, out=torch.empty(T, C, device=DEVICE,
                                                  dtype=X.dtype), stats_out=torch.empty(T, 64, device=DEVICE),
                                                  workspace=fws)
    replay = mhc.cake_mhc_train_forward_stats(X, fn, scale, base, **hp, stats_out=torch.empty(T, 64, device=DEVICE),
                                              workspace=fws)
    assert torch.equal(replay, stats)
    B = torch.tanh(U)
    Y = mhc.cake_mhc_train_forward_finish(X, B, stats, out=torch.empty_like(X))
    dY = torch.randn_like(Y)
    dB, gs = mhc.cake_mhc_train_backward_prepare(dY, B, X, stats, dB=torch.empty_like(B),
                                                 grad_stats_out=torch.empty(T, 32, device=DEVICE))
    dX, dfn, dscale, dbase = mhc.cake_mhc_train_backward_finish(
        X, dY, dB, B, fn, scale, base, stats, gs, **hp, accumulate=False, workspace=bws, dX=torch.empty_like(X),
        dfn=torch.empty_like(fn), dscale=torch.empty(3, device=DEVICE), dbase=torch.empty(M, device=DEVICE))
    ref = mhc.cake_mhc_train_backward_finish(X, dY, dB, None, fn, scale, base, stats, gs, **hp)
    for got, want in zip((dX, dfn, dscale, dbase), ref):
        assert torch.equal(got, want)
    head = mhc.cake_mhc_train_head_forward(X)
    mhc.cake_mhc_train_head_backward(head, dX=torch.empty_like(X), accumulate=False)
    assert mhc.is_cake_mhc_train_supported(X.device, hidden=C)
    assert mhc.is_cake_mhc_train_head_supported(X.device, hidden=C)

    Xg = X.detach().requires_grad_()
    U, handle = mhc.cake_mhc_train_prepare(Xg, fn, scale, base, **hp, save_stats=False, workspace=fws,
                                           backward_workspace=bws)
    Y = mhc.cake_mhc_train_finish(Xg, torch.tanh(U), handle)
    Y.backward(dY)
    Xr = X.detach().requires_grad_()
    U, handle = mhc.cake_mhc_train_prepare(Xr, fn, scale, base, **hp)
    mhc.cake_mhc_train_finish(Xr, torch.tanh(U), handle).backward(dY)
    assert torch.equal(Xg.grad, Xr.grad)
    assert mhc.cake_mhc_train_head(Xg).shape == (T, C)


def test_forward_stats_keeps_its_older_out_keyword(backend):
    X, fn, scale, base = _inputs()
    buf = torch.empty(T, 64, device=DEVICE)
    assert mhc.cake_mhc_train_forward_stats(X, fn, scale, base, out=buf) is buf
    with pytest.raises(ValueError, match=r"^out: an older name of stats_out"):
        mhc.cake_mhc_train_forward_stats(X, fn, scale, base, out=buf, stats_out=buf)


def test_rmsnorm_functions_take_flashinfers_keywords(backend):
    x = torch.randn(T, 64, device=DEVICE, dtype=torch.bfloat16)
    w = torch.ones(64, device=DEVICE, dtype=torch.bfloat16)
    r = torch.randn_like(x)
    y, rstd, h = rms.cake_rmsnorm_train_forward(x, w, 1e-6, residual=r, out=torch.empty_like(x),
                                                rstd=torch.empty(T, device=DEVICE), residual_out=torch.empty_like(x))
    ws = rms.cake_rmsnorm_train_backward_workspace(T, 64, x.device, residual=True)
    assert ws.dtype == torch.uint8
    assert ws.numel() == rms.cake_rmsnorm_train_backward_workspace_bytes(T, 64, x.device, residual=True)
    g = torch.randn_like(y)
    dx, dw = rms.cake_rmsnorm_train_backward(g, h, w, rstd, deterministic=True, g_residual=r, workspace=ws,
                                             dx=torch.empty_like(x), dw=torch.empty(64, device=DEVICE))
    ref = rms.cake_rmsnorm_train_backward(g, h, w, rstd, g_residual=r)
    assert torch.equal(dx, ref[0]) and torch.equal(dw, ref[1])
    y2 = rms.cake_rmsnorm(x, w, eps=1e-6, residual=None, deterministic=True)
    assert torch.equal(y2, rms.cake_rmsnorm_train_forward(x, w, 1e-6)[0])
    assert rms.is_cake_rmsnorm_train_supported(x.device, 64)


# ---- caller buffers of any layout ----

def _buffer_cases():
    """name -> (call taking the buffers as keywords, {keyword: a tensor of the buffer's shape and dtype}), the
    keywords in the order of the call's results."""
    X, fn, scale, base = _inputs()
    U, stats = mhc.cake_mhc_train_forward_prepare(X, fn, scale, base)
    B, dY = torch.tanh(U), torch.randn_like(X)
    dB, gs = mhc.cake_mhc_train_backward_prepare(dY, B, X, stats)
    gfn, gscale, gbase = fn[:N] * 4, scale[:1], base[:N]
    Yg, gstats = mhc.cake_mhc_train_gated_head_forward(X, gfn, gscale, gbase)
    x = torch.randn(2, 3, 64, device=DEVICE, dtype=torch.bfloat16)  # [..., H]: rstd [2, 3]
    w, res = torch.randn(64, device=DEVICE), torch.randn_like(x)
    y, rstd, h = rms.cake_rmsnorm_train_forward(x, w, 1e-6, residual=res)
    finish = (X, dY, dB, B, fn, scale, base, stats, gs)
    gated_bwd = (U, X, gfn, gscale, gbase, gstats)
    grads, gated_grads = dict(dX=X, dfn=fn, dscale=scale, dbase=base), dict(dX=X, dfn=gfn, dscale=gscale, dbase=gbase)
    return {
        "forward_prepare": (lambda **b: mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, **b),
                            dict(out=U, stats_out=stats)),
        "forward_stats": (lambda **b: mhc.cake_mhc_train_forward_stats(X, fn, scale, base, **b),
                          dict(stats_out=stats)),
        "forward_finish": (lambda **b: mhc.cake_mhc_train_forward_finish(X, B, stats, **b), dict(out=X)),
        "head_forward": (lambda **b: mhc.cake_mhc_train_head_forward(X, **b), dict(out=U)),
        "head_backward": (lambda **b: mhc.cake_mhc_train_head_backward(U, **b), dict(dX=X)),
        "head_backward_accumulate": (lambda **b: mhc.cake_mhc_train_head_backward(U, accumulate=True, **b),
                                     dict(dX=X)),
        "backward_prepare": (lambda **b: mhc.cake_mhc_train_backward_prepare(dY, B, X, stats, **b),
                             dict(dB=B, grad_stats_out=gs)),
        "backward_finish": (lambda **b: mhc.cake_mhc_train_backward_finish(*finish, **b), grads),
        "backward_finish_accumulate": (
            lambda **b: mhc.cake_mhc_train_backward_finish(*finish, accumulate=True, **b), grads),
        "gated_head_forward": (lambda **b: mhc.cake_mhc_train_gated_head_forward(X, gfn, gscale, gbase, **b),
                               dict(out=U, stats_out=gstats)),
        "gated_head_backward": (lambda **b: mhc.cake_mhc_train_gated_head_backward(*gated_bwd, **b), gated_grads),
        "gated_head_backward_accumulate": (
            lambda **b: mhc.cake_mhc_train_gated_head_backward(*gated_bwd, accumulate=True, **b), gated_grads),
        "rmsnorm_forward": (lambda **b: rms.cake_rmsnorm_train_forward(x, w, 1e-6, **b), dict(out=y, rstd=rstd)),
        "add_rmsnorm_forward": (lambda **b: rms.cake_rmsnorm_train_forward(x, w, 1e-6, residual=res, **b),
                                dict(out=y, rstd=rstd, residual_out=h)),
        "rmsnorm_backward": (lambda **b: rms.cake_rmsnorm_train_backward(y, h, w, rstd, g_residual=res, **b),
                             dict(dx=x, dw=w)),
    }


class _PassThrough(TorchDispatchMode):
    """A dispatch mode that changes nothing: under it the functions take the ops' path (cakeops/_traced.py)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layout", BUFFER_LAYOUTS + ("mixed",))
@pytest.mark.parametrize("case", list(_buffer_cases()))
def test_caller_buffers_of_any_layout(backend, case, layout):
    """Every caller buffer, non-contiguous or unaligned (``mixed``: the first one column-offset, the others
    contiguous): the call writes (or adds into) its view exactly what it writes into a contiguous buffer of the
    same contents, touches nothing else of its storage, and returns the view itself. Eager, and under a dispatch
    mode (the ops' path) for the first layout."""
    call, likes = _buffer_cases()[case]
    g = torch.Generator().manual_seed(len(case))
    initial = {k: torch.randn(v.shape, generator=g).to(v.device, v.dtype) for k, v in likes.items()}
    for mode in (contextlib.nullcontext, _PassThrough) if layout == BUFFER_LAYOUTS[0] else (contextlib.nullcontext,):
        want = {k: v.clone() for k, v in initial.items()}
        with mode():
            call(**want)
        backings, views = {}, {}
        for k, (name, v) in enumerate(initial.items()):
            if layout == "mixed" and k > 0:
                backings[name] = views[name] = v.clone()
            else:
                backings[name], views[name] = buffer_view(v, "column_offset" if layout == "mixed" else layout)
        before = {k: b.clone() for k, b in backings.items()}
        with mode():
            got = call(**views)
        got = (got,) if isinstance(got, torch.Tensor) else got
        assert len(got) >= len(views) and all(r is views[k] for r, k in zip(got, views)), "not the caller's buffers"
        for k in views:
            assert_written_in_view(backings[k], before[k], views[k], want[k])


@pytest.mark.parametrize("layout", BUFFER_LAYOUTS)
def test_outputs_in_caller_views_serve_as_the_next_calls_inputs(backend, layout):
    """A layer's forward and backward with every output in a view of ``layout``, each fed to the calls after it
    (the record rows at a row stride, say): the values of the same chain with contiguous buffers."""
    X, fn, scale, base = _inputs()
    g = torch.Generator().manual_seed(1)
    dY = torch.randn(X.shape, generator=g).to(DEVICE, X.dtype)

    def chain(make):
        U, stats = mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, out=make(T, C, dtype=X.dtype),
                                                      stats_out=make(T, 64))
        Y = mhc.cake_mhc_train_forward_finish(X, U, stats, out=make(T, N, C, dtype=X.dtype))
        dB, gs = mhc.cake_mhc_train_backward_prepare(dY, U, X, stats, dB=make(T, C, dtype=X.dtype),
                                                     grad_stats_out=make(T, 32))
        grads = mhc.cake_mhc_train_backward_finish(X, dY, dB, U, fn, scale, base, stats, gs,
                                                   dX=make(T, N, C, dtype=X.dtype), dfn=make(M, N * C),
                                                   dscale=make(3), dbase=make(M))
        return (U, stats, Y, dB, gs) + grads

    def view(*shape, dtype=torch.float32):
        return buffer_view(torch.zeros(shape, dtype=dtype, device=DEVICE), layout)[1]

    def contiguous(*shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device=DEVICE)

    for got, want in zip(chain(view), chain(contiguous)):
        assert torch.equal(got, want)


def test_caller_buffer_errors_name_the_buffer(backend):
    """Layout is free; shape, dtype and device are not, and a view whose elements share memory is refused."""
    x, w = torch.randn(T, 64, device=DEVICE), torch.ones(64, device=DEVICE)
    with pytest.raises(ValueError, match=r"^out: expected shape \(5, 64\), got \(5, 63\)"):
        rms.cake_rmsnorm_train_forward(x, w, 1e-6, out=torch.empty(T, 80, device=DEVICE)[:, 1:64])
    with pytest.raises(ValueError, match=r"^rstd: expected dtype in \(float32\), got bfloat16"):
        rms.cake_rmsnorm_train_forward(x, w, 1e-6, rstd=torch.empty(2 * T, device=DEVICE, dtype=torch.bfloat16)[::2])
    with pytest.raises(ValueError, match=r"^dw: expected a tensor on .*, got one on meta"):
        rms.cake_rmsnorm_train_backward(x, x, w, torch.ones(T, device=DEVICE), dw=torch.empty(64, device="meta"))
    X = _inputs()[0]
    with pytest.raises(ValueError, match=r"^out: expected a buffer whose elements do not share memory"):
        mhc.cake_mhc_train_head_forward(X, out=torch.empty(C, device=DEVICE, dtype=X.dtype).expand(T, C))


# ---- a call with its outputs and a workspace allocates nothing ----

_FACTORIES = ("empty", "zeros", "ones", "full", "clone", "_to_copy", "new_", "rand", "like")


class _Allocations(TorchDispatchMode):
    """Every tensor-creating aten op, except those of Triton's interpreter (it copies kernel arguments to host
    buffers and back: the CPU stand-in for a GPU launch, which allocates nothing)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if any(f in name for f in _FACTORIES):
            stack = traceback.extract_stack()
            if not any("triton/runtime/interpreter" in frame.filename.replace("\\", "/") for frame in stack):
                self.seen.append((name, "".join(traceback.format_list(stack[-6:-1]))))
        return func(*args, **(kwargs or {}))


def _no_allocations(call):
    call()  # first call: compiles (GPU) and warms caches
    # the spy is a dispatch mode, under which calls go through the custom ops (which allocate their outputs); the
    # direct eager path is the one measured, as it runs outside any mode
    with mock.patch.object(_traced, "through_ops", lambda: False), _Allocations() as a:
        call()
    assert not a.seen, f"allocated: {a.seen[0][0]} at\n{a.seen[0][1]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_call_with_a_workspace_allocates_nothing(triton_kernels, dtype):
    X, fn, scale, base = _inputs(dtype)
    U, stats = torch.empty(T, C, device=DEVICE, dtype=dtype), torch.empty(T, 64, device=DEVICE)
    fws = mhc.cake_mhc_train_forward_workspace(T, X.device, hidden=C)
    bws = mhc.cake_mhc_train_backward_workspace(T, X.device, hidden=C)
    _no_allocations(lambda: mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, out=U, stats_out=stats,
                                                               workspace=fws))
    _no_allocations(lambda: mhc.cake_mhc_train_forward_stats(X, fn, scale, base, stats_out=stats, workspace=fws))
    B, Y, dY = torch.tanh(U), torch.empty_like(X), torch.randn_like(X)
    _no_allocations(lambda: mhc.cake_mhc_train_forward_finish(X, B, stats, out=Y))
    dB, gs = torch.empty_like(B), torch.empty(T, 32, device=DEVICE)
    _no_allocations(lambda: mhc.cake_mhc_train_backward_prepare(dY, B, X, stats, dB=dB, grad_stats_out=gs))
    dX, dfn, dscale, dbase = (torch.empty_like(X), torch.empty_like(fn), torch.empty(3, device=DEVICE),
                              torch.empty(M, device=DEVICE))
    for accumulate in (False, True):
        _no_allocations(lambda: mhc.cake_mhc_train_backward_finish(
            X, dY, dB, B, fn, scale, base, stats, gs, accumulate=accumulate, workspace=bws, dX=dX, dfn=dfn,
            dscale=dscale, dbase=dbase))
    _no_allocations(lambda: mhc.cake_mhc_train_head_forward(X, out=U))
    _no_allocations(lambda: mhc.cake_mhc_train_head_backward(U, dX=dX))

    x, w = torch.randn(T, 64, device=DEVICE, dtype=dtype), torch.ones(64, device=DEVICE, dtype=dtype)
    y, rstd = torch.empty_like(x), torch.empty(T, device=DEVICE)
    _no_allocations(lambda: rms.cake_rmsnorm_train_forward(x, w, 1e-6, out=y, rstd=rstd))
    dw = torch.empty(64)
    ws, dx, dw = rms.cake_rmsnorm_train_backward_workspace(T, 64, x.device), torch.empty_like(x), dw.to(DEVICE)
    _no_allocations(lambda: rms.cake_rmsnorm_train_backward(y, x, w, rstd, workspace=ws, dx=dx, dw=dw))


@pytest.mark.parametrize("n", [2, 8])
def test_a_workspace_sized_for_n_streams_serves_its_calls(triton_kernels, n):
    """The workspace helpers' ``n_streams``: n = 2 and 8 calls with their workspace allocate nothing either."""
    g = torch.Generator().manual_seed(n)
    m = 2 * n + n * n
    X = torch.randn(T, n, C, generator=g).to(DEVICE, torch.bfloat16)
    fn = (torch.randn(m, n * C, generator=g) * 0.05).to(DEVICE)
    scale, base = torch.tensor([1.0, 1.5, 4.0], device=DEVICE), torch.randn(m, generator=g).to(DEVICE)
    U, stats = torch.empty(T, C, device=DEVICE, dtype=X.dtype), torch.empty(T, {2: 32, 8: 256}[n], device=DEVICE)
    fws = mhc.cake_mhc_train_forward_workspace(T, X.device, hidden=C, n_streams=n)
    bws = mhc.cake_mhc_train_backward_workspace(T, X.device, hidden=C, n_streams=n)
    _no_allocations(lambda: mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, out=U, stats_out=stats,
                                                               workspace=fws))
    B, dY = torch.tanh(U), torch.randn_like(X)
    gs = mhc.cake_mhc_train_backward_prepare(dY, B, X, stats)[1]
    dX, dfn = torch.empty_like(X), torch.empty_like(fn)
    dscale, dbase = torch.empty(3, device=DEVICE), torch.empty(m, device=DEVICE)
    _no_allocations(lambda: mhc.cake_mhc_train_backward_finish(X, dY, B, B, fn, scale, base, stats, gs,
                                                               workspace=bws, dX=dX, dfn=dfn, dscale=dscale,
                                                               dbase=dbase))
    ref = mhc.cake_mhc_train_backward_finish(X, dY, B, B, fn, scale, base, stats, gs)
    for got, want in zip((dX, dfn, dscale, dbase), ref):
        assert torch.equal(got, want)
    small = mhc.cake_mhc_train_forward_workspace(T, X.device, hidden=C, n_streams=4)
    if n == 8:  # a workspace sized for 4 streams is too small for 8, and says how to size it
        with pytest.raises(ValueError, match="n_streams=n"):
            mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, workspace=small)


def test_a_workspace_serves_every_smaller_token_count(triton_kernels):
    """Sized for T tokens, it serves every T' <= T (the column-sliced partials are not monotone in T)."""
    from cakeops._triton.mhc_backward import backward_finish_workspace_numel
    from cakeops._triton.mhc_prepare import PrepareConfig, workspace_regions
    from cakeops._workspace import layout_bytes

    device, big, H = torch.device(DEVICE), (20000 if ON_GPU else 64), 4096
    fwd = mhc.cake_mhc_train_forward_workspace_bytes(big, device, hidden=H)
    bwd = mhc.cake_mhc_train_backward_workspace_bytes(big, device, hidden=H)
    assert bwd >= mhc.cake_mhc_train_backward_workspace_bytes(big, device, hidden=H, sinkhorn_iters=20) > 0
    for t in sorted({1, 2, 16, 63, 64, 127, 128, 129, 1000, 4096, 8191, 8192, 8193, 16384, big}):
        if t > big:
            continue
        for dtype in (torch.bfloat16, torch.float32):
            need = layout_bytes(workspace_regions(t, N, H, dtype, PrepareConfig().resolve_for(t, H, device)))
            assert need <= fwd, t
        for iters in (1, 20, 64):
            assert 4 * backward_finish_workspace_numel(t, H, iters, device) <= bwd, (t, iters)


def test_the_forward_workspace_size_follows_the_gpus_slicing_rule(monkeypatch):
    """On a GPU the projection's column slices depend on T against the multiprocessor count (the H200's 132 stood in
    here): the size for T must cover the partials of every T' <= T, the largest by elements (found on the H200:
    20000 tokens' size picked the shape with most slices, 256 bytes short of T' = 8193's)."""
    from cakeops._triton import mhc_prepare
    from cakeops._workspace import layout_bytes

    monkeypatch.setattr(mhc_prepare, "persistent_programs", lambda device, work, per_sm=2: min(work, 132 * per_sm))
    gpu = torch.device("cuda")
    # every dtype (their columns per chunk and, at n = 8, programs per SM differ, so do their slices), the layer's
    # default and resolve's rule, a hidden size whose chunks bound the slices
    for n, big, H in ((4, 20000, 4096), (8, 12000, 4096), (8, 3000, 64)):
        size = mhc_prepare.workspace_bytes_max(big, n, H, gpu)
        for t in sorted({1, 100, 2048, 2049, 4096, 8192, 8193, 8320, 8448, 8449, 12000, 16384, big}):
            for base in (mhc_prepare.PrepareConfig(), mhc_prepare.layer_config(None, n, True)):
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    if t <= big:
                        cfg = base.resolve_for(t, H, gpu, n=n, dtype=dtype)
                        need = layout_bytes(mhc_prepare.workspace_regions(t, n, H, dtype, cfg))
                        assert need <= size, (n, t, H, dtype, base)


def test_workspace_errors_say_what_is_needed(backend):
    """The same errors through the kernels and the reference math (which leaves a workspace unused)."""
    X, fn, scale, base = _inputs()
    with pytest.raises(ValueError, match=r"^workspace: this call needs \d+ bytes of workspace, got 16; "
                                         r"allocate it with cake_mhc_train_forward_workspace"):
        mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, workspace=torch.zeros(16, dtype=torch.uint8,
                                                                                      device=DEVICE))
    with pytest.raises(ValueError, match=r"^backward_workspace: this call needs \d+ bytes.*"
                                         r"cake_mhc_train_backward_workspace"):
        mhc.cake_mhc_train_prepare(X, fn, scale, base, backward_workspace=torch.zeros(16, dtype=torch.uint8,
                                                                                        device=DEVICE))
    with pytest.raises(ValueError, match=r"^workspace: expected a tensor on .*got one on meta"):
        mhc.cake_mhc_train_forward_stats(X, fn, scale, base, workspace=torch.zeros(1 << 20, dtype=torch.uint8,
                                                                                    device="meta"))
    with pytest.raises(TypeError, match=r"^workspace: expected a torch.Tensor"):
        mhc.cake_mhc_train_forward_stats(X, fn, scale, base, workspace=1024)
    with pytest.raises(ValueError, match=r"^workspace: expected a buffer aligned to 16 bytes"):
        ws = mhc.cake_mhc_train_forward_workspace(T, X.device, hidden=C)
        mhc.cake_mhc_train_forward_stats(X, fn, scale, base, workspace=torch.zeros(ws.numel() + 8, dtype=torch.uint8,
                                                                                    device=DEVICE)[1:])
    x = X[:, 0]
    with pytest.raises(ValueError, match=r"^workspace: this call needs \d+ bytes.*cake_rmsnorm_train_backward_workspace"):
        rms.cake_rmsnorm_train_backward(x, x, torch.ones(C, device=DEVICE), torch.ones(T, device=DEVICE),
                                        workspace=torch.zeros(4, dtype=torch.uint8, device=DEVICE))


# ---- CUDA graphs ----

@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
def test_cuda_graph_of_forward_and_backward_with_caller_buffers():
    """One mHC layer (branch: RMSNorm) forward + backward captured with caller buffers and workspaces; a replay
    on new inputs copied into the static inputs gives the eager bits."""
    T_, C_ = 256, 512
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape, dtype=torch.bfloat16, s=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * s).to(dtype)

    X, fn, scale, base = rand(T_, N, C_), rand(M, N * C_, dtype=torch.float32, s=0.02), \
        torch.tensor([0.5, 0.3, 0.8], device="cuda"), rand(M, dtype=torch.float32, s=0.5)
    w, dY = rand(C_, s=1.0), rand(T_, N, C_)
    fws = mhc.cake_mhc_train_forward_workspace(T_, X.device, hidden=C_)
    bws = mhc.cake_mhc_train_backward_workspace(T_, X.device, hidden=C_)
    rws = rms.cake_rmsnorm_train_backward_workspace(T_, C_, X.device)
    U, stats, B, rstd, Y = (torch.empty(T_, C_, device="cuda", dtype=X.dtype), torch.empty(T_, 64, device="cuda"),
                            torch.empty(T_, C_, device="cuda", dtype=X.dtype), torch.empty(T_, device="cuda"),
                            torch.empty_like(X))
    dB, gs, dU, dw = (torch.empty_like(B), torch.empty(T_, 32, device="cuda"), torch.empty_like(B),
                      torch.empty(C_, device="cuda"))
    dX, dfn, dscale, dbase = (torch.empty_like(X), torch.empty_like(fn), torch.empty(3, device="cuda"),
                              torch.empty(M, device="cuda"))

    def step():
        mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, out=U, stats_out=stats, workspace=fws)
        rms.cake_rmsnorm_train_forward(U, w, 1e-6, out=B, rstd=rstd)
        mhc.cake_mhc_train_forward_finish(X, B, stats, out=Y)
        mhc.cake_mhc_train_backward_prepare(dY, B, X, stats, dB=dB, grad_stats_out=gs)
        rms.cake_rmsnorm_train_backward(dB, U, w, rstd, workspace=rws, dx=dU, dw=dw)
        mhc.cake_mhc_train_backward_finish(X, dY, dU, B, fn, scale, base, stats, gs, workspace=bws, dX=dX, dfn=dfn,
                                           dscale=dscale, dbase=dbase)
        return Y, dX, dfn, dscale, dbase, dw

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile every kernel outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    X.copy_(rand(T_, N, C_))
    dY.copy_(rand(T_, N, C_))
    graph.replay()
    torch.cuda.synchronize()
    got = [t.clone() for t in (Y, dX, dfn, dscale, dbase, dw)]
    want = [t.clone() for t in step()]
    for a, b in zip(got, want):
        assert torch.equal(a, b)
