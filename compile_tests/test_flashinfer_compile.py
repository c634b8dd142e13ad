"""The FlashInfer-style functions (no autograd, caller buffers, workspaces) under torch.compile(fullgraph=True):
a FlashInfer user compiles a model that calls them in its own autograd.Function, and every call must trace and
give eager's values, writing (or adding into) the buffers the caller gave as eager does."""
import os

import pytest
import torch
import torch._dynamo

from cakeops import _backend

from cakeops import cake_mhc_train as mhc
from cakeops import cake_rmsnorm_train as rms
from conftest import BUFFER_LAYOUTS, DEVICE, assert_written_in_view, buffer_view, test_seed as seed_of

HP = dict(rms_eps=0.5, hc_eps=0.05, sinkhorn_iters=3)
T, C = 7, 16


def _interpreted() -> bool:
    return DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" and _backend.use_triton(torch.empty(0))


def _mhc_inputs(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    M = 2 * n + n * n
    X = torch.randn(T, n, C, generator=g).to(DEVICE, dtype)
    fn = (torch.randn(M, n * C, generator=g) / (n * C) ** 0.5).to(DEVICE)
    scale = (torch.rand(3, generator=g) + 0.5).to(DEVICE)
    base = torch.randn(M, generator=g).to(DEVICE)
    return X, fn, scale, base


def _compiled(f, backend):
    torch._dynamo.reset()
    return torch.compile(f, fullgraph=True, backend=backend, dynamic=False)


def _assert_same(got, want, rounded_by_torch=()):
    """Equal values: the compiled call runs the same kernels or reference math (the inductor backend may fuse
    the copies into the caller's buffers, which move bits unchanged). ``rounded_by_torch``: outputs that a
    compiled call rounds with torch ops (the head backward's sum into a given dX), which the Triton interpreter's
    kernel rounds otherwise (toward zero; the GPU to nearest, as torch): a 16-bit ulp apart there."""
    got, want = (got,) if isinstance(got, torch.Tensor) else got, (want,) if isinstance(want, torch.Tensor) else want
    assert len(got) == len(want)
    for k, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == w.dtype and g.shape == w.shape, k
        if k in rounded_by_torch and _interpreted():
            torch.testing.assert_close(g, w, rtol=2 ** -7, atol=0, msg=lambda m: f"output {k}: {m}")
        else:
            torch.testing.assert_close(g, w, rtol=0, atol=0, msg=lambda m: f"output {k}: {m}")


# Caller buffers of every layout under aot_eager; Inductor (slower to compile) with contiguous and one other
_LAYOUT_RUNS = ([("aot_eager", layout) for layout in ("contiguous",) + BUFFER_LAYOUTS]
                + [("inductor", "contiguous"), ("inductor", BUFFER_LAYOUTS[0])])


def _placed(buffers, layout):
    """The buffers (name -> tensor) as views in ``layout`` (conftest.buffer_view), and (backing, its contents,
    view) of each to check afterwards (``_untouched_outside``)."""
    if layout == "contiguous":
        return buffers, []
    placed = {k: buffer_view(v, layout) for k, v in buffers.items()}
    return {k: view for k, (_, view) in placed.items()}, [(b, b.clone(), v) for b, v in placed.values()]


def _untouched_outside(records):
    for backing, before, view in records:  # the view's values are compared by the test
        assert_written_in_view(backing, before, view, view)


@pytest.mark.parametrize("compile_backend,layout", _LAYOUT_RUNS)
@pytest.mark.parametrize("n", [4, 8])
def test_mhc_functions_compile_with_buffers_and_workspaces(backend, compile_backend, layout, n, request):
    """forward_prepare -> forward_finish -> head, then head_backward -> backward_prepare -> backward_finish, every
    call with its caller buffers (random contents, overwritten or added into; contiguous, or all of them views in
    another ``layout``) and workspaces, compiled in one fullgraph function against the same calls eager."""
    seed = seed_of(request.node.nodeid)
    dtype = torch.bfloat16
    X, fn, scale, base = _mhc_inputs(n, dtype, seed)
    M = 2 * n + n * n
    g = torch.Generator().manual_seed(seed + 1)
    B = torch.randn(T, C, generator=g).to(DEVICE, dtype)
    dHead = torch.randn(T, C, generator=g).to(DEVICE, dtype)
    dU = torch.randn(T, C, generator=g).to(DEVICE, dtype)
    fws = mhc.cake_mhc_train_forward_workspace(T, DEVICE, hidden=C, n_streams=n)
    bws = mhc.cake_mhc_train_backward_workspace(T, DEVICE, hidden=C, n_streams=n, sinkhorn_iters=3)

    def buffers():
        r = torch.Generator().manual_seed(seed + 2)
        def like(shape, dt):
            return torch.randn(shape, generator=r).to(DEVICE, dt)
        return dict(U=like((T, C), dtype), stats=like((T, 64 if n == 4 else 256), torch.float32),
                    Y=like((T, n, C), dtype), head=like((T, C), dtype), dY=like((T, n, C), dtype),
                    dB=like((T, C), dtype), dfn=like((M, n * C), torch.float32), dscale=like((3,), torch.float32),
                    dbase=like((M,), torch.float32), dX=like((T, n, C), dtype))

    def layer(X, fn, scale, base, B, dHead, dU, b):
        U, stats = mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, **HP, out=b["U"], stats_out=b["stats"],
                                                      workspace=fws)
        stats2 = mhc.cake_mhc_train_forward_stats(X, fn, scale, base, **HP, workspace=fws)
        Y = mhc.cake_mhc_train_forward_finish(X, B + U, stats, out=b["Y"])
        head = mhc.cake_mhc_train_head_forward(Y, out=b["head"])
        dY = mhc.cake_mhc_train_head_backward(dHead, dX=b["dY"], accumulate=True)
        dY_layer = Y - X  # not dY: the interpreter rounds dY otherwise than a compiled call (_assert_same)
        dB, grad_stats = mhc.cake_mhc_train_backward_prepare(dY_layer, B + U, X, stats, dB=b["dB"])
        grads = mhc.cake_mhc_train_backward_finish(X, dY_layer, dU + dB, B, fn, scale, base, stats, grad_stats, **HP,
                                                   accumulate=True, workspace=bws, dX=b["dX"], dfn=b["dfn"],
                                                   dscale=b["dscale"], dbase=b["dbase"])
        return (U, stats, stats2, Y, head, dY, dB, grad_stats) + tuple(grads)

    want_b, (got_b, placed) = buffers(), _placed(buffers(), layout)
    want = layer(X, fn, scale, base, B, dHead, dU, want_b)
    got = _compiled(layer, compile_backend)(X, fn, scale, base, B, dHead, dU, got_b)
    _assert_same(got, want, rounded_by_torch=(5,))
    for name in want_b:  # the caller's buffers hold what eager left in them
        _assert_same(got_b[name], want_b[name], rounded_by_torch=(0,) if name == "dY" else ())
    _untouched_outside(placed)
    # the returned tensors are the caller's buffers themselves, as in eager
    assert got[0] is got_b["U"] and got[1] is got_b["stats"] and got[-4] is got_b["dX"]


@pytest.mark.parametrize("compile_backend,layout", _LAYOUT_RUNS)
def test_gated_head_and_rmsnorm_functions_compile(backend, compile_backend, layout, request):
    seed = seed_of(request.node.nodeid)
    n, dtype = 4, torch.bfloat16
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, n, C, generator=g).to(DEVICE, dtype)
    fn = (torch.randn(n, n * C, generator=g) / (n * C) ** 0.5).to(DEVICE)
    scale, base = torch.rand(1, generator=g).to(DEVICE) + 0.5, torch.randn(n, generator=g).to(DEVICE)
    dY = torch.randn(T, C, generator=g).to(DEVICE, dtype)
    x = torch.randn(T, C, generator=g).to(DEVICE, dtype)
    res = torch.randn(T, C, generator=g).to(DEVICE, dtype)
    w = torch.randn(C, generator=g).to(DEVICE, torch.bfloat16)
    gy = torch.randn(T, C, generator=g).to(DEVICE, dtype)
    x3 = torch.randn(2, 3, C, generator=g).to(DEVICE, dtype)  # [..., H]: rstd [2, 3]
    rws = rms.cake_rmsnorm_train_backward_workspace(T, C, DEVICE)

    def buffers():
        r = torch.Generator().manual_seed(seed + 1)
        return dict(Y=torch.randn(T, C, generator=r).to(DEVICE, dtype),
                    dfn=torch.randn(n, n * C, generator=r).to(DEVICE), dscale=torch.randn(1, generator=r).to(DEVICE),
                    dbase=torch.randn(n, generator=r).to(DEVICE), y=torch.randn(T, C, generator=r).to(DEVICE, dtype),
                    rstd=torch.randn(T, generator=r).to(DEVICE), dw=torch.randn(C, generator=r).to(DEVICE),
                    y3=torch.randn(2, 3, C, generator=r).to(DEVICE, dtype),
                    rstd3=torch.randn(2, 3, generator=r).to(DEVICE),
                    h3=torch.randn(2, 3, C, generator=r).to(DEVICE, dtype),
                    dx3=torch.randn(2, 3, C, generator=r).to(DEVICE, dtype))

    def step(X, fn, scale, base, dY, x, res, w, gy, x3, b):
        Y, stats = mhc.cake_mhc_train_gated_head_forward(X, fn, scale, base, rms_eps=0.5, hc_eps=0.05, out=b["Y"])
        grads = mhc.cake_mhc_train_gated_head_backward(dY, X, fn, scale, base, stats, rms_eps=0.5, hc_eps=0.05,
                                                       accumulate=True, dfn=b["dfn"], dscale=b["dscale"],
                                                       dbase=b["dbase"])
        y, rstd = rms.cake_rmsnorm_train_forward(x, w, 1e-5, out=b["y"], rstd=b["rstd"])
        y2, rstd2, h = rms.cake_rmsnorm_train_forward(x, w, 1e-5, residual=res)
        dx, dw = rms.cake_rmsnorm_train_backward(gy, h, w, rstd2, g_residual=gy, workspace=rws, dw=b["dw"])
        y3, rstd3, h3 = rms.cake_rmsnorm_train_forward(x3, w, 1e-5, residual=x3, out=b["y3"], rstd=b["rstd3"],
                                                       residual_out=b["h3"])
        dx3, _ = rms.cake_rmsnorm_train_backward(y3, h3, w, rstd3, dx=b["dx3"])
        return (Y, stats) + tuple(grads) + (y3, rstd3, h3, dx3) + (y, rstd, y2, rstd2, h, dx, dw)

    want_b, (got_b, placed) = buffers(), _placed(buffers(), layout)
    want = step(X, fn, scale, base, dY, x, res, w, gy, x3, want_b)
    got = _compiled(step, compile_backend)(X, fn, scale, base, dY, x, res, w, gy, x3, got_b)
    _assert_same(got, want)
    for name in want_b:
        _assert_same(got_b[name], want_b[name])
    _untouched_outside(placed)
    assert got[-1].dtype == torch.float32  # dw FP32 as eager returns it, for a bf16 w


def test_workspace_checks_still_apply_while_compiled(backend):
    """What can be checked of a workspace while traced (type, dtype, device) is; its address is not there."""
    X, fn, scale, base = _mhc_inputs(4, torch.float32, 0)
    bad = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    f = _compiled(lambda X: mhc.cake_mhc_train_forward_prepare(X, fn, scale, base, workspace=bad), "aot_eager")
    with pytest.raises(Exception, match="workspace: expected a uint8 buffer"):
        f(X)
