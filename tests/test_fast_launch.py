"""The launch cache of ``_triton/fast_launch.py``: its key is at least as fine as Triton's own specialization
(checked against Triton's binder, on CPU), and its cached route hands the compiled kernel's launcher exactly what
``kernel[grid](...)`` hands it (checked against Triton's JIT path with a stand-in driver, in a subprocess without
the interpreter). Under the interpreter the launchers take ``kernel[grid]``: the positional form binds as the
keyword form did."""
import inspect
import itertools
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cakeops._triton import fast_launch, partials, rmsnorm

ROOT = Path(__file__).resolve().parent.parent
INTS = [0, 1, 2, 3, 15, 16, 17, 32, 48, 4096, 2 ** 31 - 16, 2 ** 31 - 1, 2 ** 31, 2 ** 31 + 16, 2 ** 32,
        2 ** 63 - 16, 2 ** 63 - 1, 2 ** 63, 2 ** 63 + 16, -1, -16, -(2 ** 31), -(2 ** 31) - 1, -(2 ** 31) - 16]


def _binder(kernel):
    """Triton's own argument binder for a CUDA sm_90 target (it needs no GPU): returns the specialization list."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    jit = JITFunction(getattr(kernel, "fn", kernel))
    bind = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
    return jit, lambda *args: tuple(map(tuple, bind(*args)[1]))


def _sample(jit, rng, base):
    """Arguments like ``base`` (a real launch's), each runtime one varied: tensor dtype and alignment, int value."""
    buf = torch.empty(64, dtype=torch.float32)
    args = []
    for p, a in zip(jit.params, base):
        if p.is_constexpr:
            args.append(a)
        elif isinstance(a, torch.Tensor):
            dtype = rng.choice([torch.bfloat16, torch.float16, torch.float32])
            args.append(buf.view(dtype)[rng.choice([0, 1, 2, 4, 8, 16])])  # 0..64-byte offsets
        elif type(a) is int:
            args.append(rng.choice(INTS))
        else:
            args.append(a)
    return args


def _launch_args():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    f = torch.zeros(64)
    fwd = (x, x, x[0], x, x, f, 4, 64, 64, 64, 64, 64, 1e-6, False, 4, 64, 1)
    bwd = (x, x, x[0], f, x, x, f.view(1, 64), 4, 64, 64, 64, 64, 64, 64, False, True, 4, 64, 1)
    part = (f.view(1, 64), f, 1, 64, 64, False, 32, 64)
    return [(rmsnorm._rmsnorm_fwd_kernel, fwd), (rmsnorm._rmsnorm_bwd_kernel, bwd),
            (partials._sum_partials_kernel, part)]


@pytest.mark.parametrize("which", [0, 1, 2], ids=["forward", "backward", "sum_partials"])
def test_key_is_at_least_as_fine_as_triton_specialization(which):
    kernel, base = _launch_args()[which]
    jit, specialize = _binder(kernel)
    key_fn = fast_launch._make_key_fn(tuple(p.is_constexpr for p in jit.params), base)
    rng = random.Random(which)
    seen = {}
    for _ in range(400):
        args = _sample(jit, rng, base)
        keyed = key_fn(0, 4, *args)
        assert keyed is not None
        key, passed = keyed
        # the launcher receives the arguments as given, tensors as their data pointers
        assert passed == tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)
        spec = specialize(*args)
        assert seen.setdefault(key, spec) == spec, "one fast-launch key for two Triton specializations"
    assert len(seen) > 50  # the samples did vary what Triton keys on


def test_key_rejects_other_argument_types():
    jit, _ = _binder(partials._sum_partials_kernel)
    part = _launch_args()[2][1]
    key_fn = fast_launch._make_key_fn(tuple(p.is_constexpr for p in jit.params), part)
    assert key_fn(0, 4, *part) is not None
    for i, other in itertools.product(range(len(part)), (None, 1.5, 3)):
        if type(other) is type(part[i]):
            continue
        args = list(part)
        args[i] = other
        assert key_fn(0, 4, *args) is None, f"argument {i} of another type must not find a route"


def test_constexprs_and_options_are_keyed_by_value():
    jit, _ = _binder(partials._sum_partials_kernel)
    part = _launch_args()[2][1]
    key_fn = fast_launch._make_key_fn(tuple(p.is_constexpr for p in jit.params), part)
    keys = {key_fn(0, 4, *part)[0], key_fn(1, 4, *part)[0], key_fn(0, 8, *part)[0],
            key_fn(0, 4, *part[:5], True, 32, 64)[0], key_fn(0, 4, *part[:6], 16, 64)[0],
            key_fn(0, 4, *part[:7], 128)[0]}
    assert len(keys) == 6


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter comparison is for CPU runs")
def test_positional_launch_binds_as_keyword_launch_under_the_interpreter(triton_kernels):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 48, generator=g).bfloat16()
    r = torch.randn(5, 48, generator=g).bfloat16()
    w = torch.randn(48, generator=g)
    outs = []
    for positional in (True, False):
        y, h, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty(5)
        part, dw = torch.randn(3, 48, generator=torch.Generator().manual_seed(4)), torch.empty(48)
        if positional:
            rmsnorm._fwd_launch((2,), (x, r, w, y, h, rstd, 5, 48, 48, 48, 48, 48, 1e-6, True, 4, 64, 1), 2)
            partials._launch((3,), (part, dw, 3, 48, 48, False, 32, 16), 4)
        else:
            rmsnorm._rmsnorm_fwd_kernel[(2,)](x, r, w, y, h, rstd, 5, 48, 48, 48, 48, 48, 1e-6, HAS_RESIDUAL=True,
                                              ROWS=4, BLOCK=64, NUM_CHUNKS=1, num_warps=2)
            partials._sum_partials_kernel[(3,)](part, dw, 3, 48, 48, ACCUMULATE=False, BLOCK_P=32, BLOCK=16,
                                                num_warps=4)
        outs.append((y, h, rstd, dw))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


_RECEIVED = textwrap.dedent('''    # What the launcher received, position by position: a pointer (a tensor from Triton's path, its data pointer as
    # an int from the cached route) as (address, the tensor FastKernel.run was given there), else (type, value).
    given = []
    pointers_as_ints = []  # one flag per launch: did the launcher receive every pointer as an int?
    _run = fast_launch.FastKernel.run

    def run(self, grid, args, *rest, **kw):
        given[:] = args
        return _run(self, grid, args, *rest, **kw)

    fast_launch.FastKernel.run = run

    def received(args):
        assert len(args) == len(given)
        pointers_as_ints.append(all(type(a) is int for a, g in zip(args, given) if isinstance(g, torch.Tensor)))
        out = []
        for a, g in zip(args, given):
            if isinstance(g, torch.Tensor):
                address = a.data_ptr() if isinstance(a, torch.Tensor) else a
                assert type(address) is int and address == g.data_ptr(), (a, g.data_ptr())
                out.append((address, g))
            else:
                assert type(a) is type(g) and a == g, (a, g)
                out.append((type(a), a))
        return out
''')


_ROUTE_SCRIPT = textwrap.dedent('''
    import collections, torch
    from cakeops.bench.host_rmsnorm import fake_driver
    from cakeops.cake_rmsnorm_train import cake_rmsnorm
    from cakeops._triton import fast_launch
    assert fast_launch._ENABLED, "fast launch disabled"
    calls = collections.defaultdict(list)

    #RECEIVED

    def launcher(name, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit, *args):
        # launch_metadata and the hooks differ by design: Triton passes its (empty) hook chains, the route None
        calls[name].append((gx, gy, gz, stream, function, metadata, tuple(
            (p[0], p[1].dtype, tuple(p[1].shape)) if isinstance(p[1], torch.Tensor) else p for p in received(args))))

    with fake_driver(launcher):
        x = torch.randn(6, 40).bfloat16().requires_grad_()
        w = torch.randn(40).bfloat16().requires_grad_()
        r = torch.randn(6, 40).bfloat16()
        dy = torch.randn(6, 40).bfloat16()
        for _ in range(2):  # first: Triton's JIT path (kept in the cache); second: the cached route
            y, h = cake_rmsnorm(x, w, 1e-6, residual=r)
            y.backward(dy)
            torch.manual_seed(0)
    from cakeops._triton import partials, rmsnorm
    assert all(k.routes for k in (rmsnorm._fwd_launch, rmsnorm._bwd_launch, partials._launch)), "no route kept"
    names = sorted(calls)
    assert names == ["_rmsnorm_bwd_kernel", "_rmsnorm_fwd_kernel", "_sum_partials_kernel"], names
    for name in names:
        first, second = calls[name]
        # Same launch except the tensors' addresses, which may move between iterations: compare their dtype/shape
        strip = lambda c: c[:6] + (tuple(a[1:] if len(a) == 3 else a for a in c[6]),)
        assert strip(first) == strip(second), (name, first, second)
        assert len(first[6]) == len(second[6])
    # Triton's path hands the launcher tensors; the cached route their data pointers (ints)
    assert pointers_as_ints == [False] * 3 + [True] * 3, pointers_as_ints
    print("routes ok", {n: len(c) for n, c in calls.items()})
''').replace("#RECEIVED\n", _RECEIVED)


def test_cached_route_launches_as_triton_does():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["CAKEOPS_FAST_LAUNCH"] = "1"
    done = subprocess.run([sys.executable, "-c", _ROUTE_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "routes ok" in done.stdout


def _mhc_kernels():
    from cakeops._triton import mhc_backward_dx, mhc_backward_finish, mhc_prepare, mhc_streams
    return [mhc_backward_dx._dx_kernel, mhc_prepare._project_kernel, mhc_streams._finish_kernel,
            mhc_backward_finish._params_reduce_kernel]


@pytest.mark.parametrize("which", range(4))
def test_keyword_launch_binds_as_triton_does(which):
    """``fast(kernel)[grid](*args, **kwargs)``: positional prefix, the rest by name, defaults applied -- the same
    arguments, in the same order, as Triton's own binder."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    kernel = JITFunction(getattr(_mhc_kernels()[which], "fn", _mhc_kernels()[which]))  # the interpreter's too
    params = list(kernel.signature.parameters.values())
    rng = random.Random(which)
    t = torch.zeros(8)
    for split in range(len(params) + 1):
        values = {p.name: (t if p.annotation is inspect.Parameter.empty and not _is_constexpr(kernel, p.name) and
                           rng.random() < 0.5 else rng.choice([1, 16, 48]))
                  for p in params}
        # leave out some defaulted parameters so their defaults apply
        names = [p.name for p in params]
        positional = [values[n] for n in names[:split]]
        keywords = {n: values[n] for n in names[split:]
                    if params[names.index(n)].default is inspect.Parameter.empty or rng.random() < 0.5}
        ours = fast_launch._make_binder(kernel)(*positional, **keywords)
        theirs = create_function_from_signature(kernel.signature, kernel.params,
                                                make_backend(GPUTarget("cuda", 90, 32)))(*positional, **keywords)[0]
        assert len(ours) == len(theirs) == len(params)
        for a, b in zip(ours, theirs.values()):
            assert a is b or a == b


def _is_constexpr(kernel, name):
    return any(p.name == name and p.is_constexpr for p in kernel.params)


_MHC_ROUTE_SCRIPT = textwrap.dedent('''
    import collections, torch
    from cakeops.bench import host
    from cakeops.bench.host_rmsnorm import fake_driver
    from cakeops._triton import fast_launch
    assert fast_launch._ENABLED, "fast launch disabled"
    calls = collections.defaultdict(list)

    #RECEIVED

    def launcher(name, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit, *args):
        calls[name].append((gx, gy, gz, stream, function, metadata, tuple(
            (p[1].dtype, tuple(p[1].shape), p[1].stride()) if isinstance(p[1], torch.Tensor) else p
            for p in received(args))))

    with fake_driver(launcher):
        layer = host.paths(40, 48, torch.device("cpu"))["eager"]
        for _ in range(2):  # first: Triton's JIT path (kept in the cache); second: the cached route
            layer()
    routes = {k.kernel.__name__: len(k.routes) for k in fast_launch._FAST.values()}
    for name, launches in calls.items():
        assert len(launches) % 2 == 0 and routes.get(name), (name, len(launches), routes)
        half = len(launches) // 2
        assert launches[:half] == launches[half:], name
    # launch options are part of the key: another num_stages is another route (and another compiled kernel)
    from cakeops._triton.partials import _sum_partials_kernel
    part, out = torch.zeros(3, 64), torch.zeros(64)
    with fake_driver(launcher):
        for stages in (2, 3, 2):
            fast_launch.fast(_sum_partials_kernel)[(1,)](part, out, 3, 64, 64, ACCUMULATE=False, BLOCK_P=4,
                                                         BLOCK=64, num_warps=4, num_stages=stages)
    assert len(fast_launch.fast(_sum_partials_kernel).routes) >= 2
    print("routes ok", sorted(calls))
''').replace("#RECEIVED\n", _RECEIVED)


def test_mhc_layer_launches_take_the_cached_route_as_triton_does():
    """An mHC layer's forward + backward twice under a stand-in driver: every kernel's second launch (cached
    route, keyword call form) hands the launcher exactly what Triton's path handed it the first time."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["CAKEOPS_FAST_LAUNCH"] = "1"
    done = subprocess.run([sys.executable, "-c", _MHC_ROUTE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "routes ok" in done.stdout
