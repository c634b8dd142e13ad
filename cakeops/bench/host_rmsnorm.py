"""``python -m cakeops.bench.host --op rmsnorm [--T 16384] [--H 4096] [--no-kernels | --fake-driver]``: the host
(CPU) cost per call of the public RMSNorm path (``cakeops.cake_rmsnorm``, bf16), eager and under
``torch.compile(fullgraph=True)``, forward alone (no_grad) and forward + backward, next to torch's ``F.rms_norm``
eager and compiled and Liger-Kernel's RMSNorm (eager; when ``liger_kernel`` is installed). The backward returns
its gradients (``torch.autograd.grad``), as in a model, where x is an activation: backed into a leaf's ``.grad``,
every call would also add dx into it (AccumulateGrad's read-modify-write of T x H, 60 % of the op's own bytes),
whichever path ran. On a GPU each fwd+bwd row also gives its share of the byte floor (x read twice, y written,
dy read, dx written, at the copy bandwidth measured in the same run).

Three modes:
- on a GPU (default there): kernels launched for real. Host time: the device is kept busy (``torch.cuda._sleep``)
  while ``calls`` calls are issued, so the clock measures issuing only. Step time: median of
  ``triton.testing.do_bench`` (what the issue's table reports: the larger of host and GPU time). GPU time: the
  device time of the kernels of one call, from torch.profiler. Default shapes: the issue's three.
- ``--no-kernels`` (default without a GPU): the RMSNorm launchers are no-ops, CPU tensors take the kernel path:
  the Python of cakeops and torch (checks, allocations, autograd, custom-op dispatch, Dynamo / AOTAutograd /
  Inductor wrappers), without any Triton launch.
- ``--fake-driver`` (CPU only): the launchers *run*, and Triton's launch path runs too -- ``JITFunction.run``'s
  binding, specialization and cache lookup -- against a stand-in driver whose "compiled kernel" does nothing. What
  is left out is the compiled launcher itself (triton's ``CudaLauncher.__call__`` and its C ``launch``).
The torch peers run their real CPU math in the CPU modes (small default shape, so that stays small).
"""
import contextlib
import importlib.util
import statistics
import time
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import _backend
from .core import host_time_per_call

EPS = 1e-6
GPU_SHAPES = ((16384, 4096), (32768, 4096), (16384, 8192))


@contextlib.contextmanager
def no_kernels():
    """The RMSNorm launchers do nothing and CPU tensors take the kernel path."""
    from .._triton import rmsnorm as kernels

    saved = kernels.forward, kernels.backward
    kernels.forward = kernels.backward = lambda *args, **kwargs: None
    runs_triton, _backend._cpu_runs_triton = _backend._cpu_runs_triton, True
    try:
        yield
    finally:
        _backend._cpu_runs_triton = runs_triton
        kernels.forward, kernels.backward = saved


@contextlib.contextmanager
def fake_driver(launcher: Optional[Callable[..., None]] = None):
    """Triton's launch path without a GPU: a stand-in CUDA driver (device 0, stream 0, an sm_90 target) and a
    "compile" that returns a CompiledKernel whose launcher does nothing (or calls ``launcher(name, *args)``: the
    tests compare what Triton's path and the fast route hand the launcher). Needs triton's JIT (no interpreter)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import CompiledKernel
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    if _backend.interpreting():
        raise RuntimeError("--fake-driver measures triton's JIT launch path: unset TRITON_INTERPRET")

    class Driver:
        target = GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return self.target

        def get_active_torch_device(self):
            return torch.device("cpu")

    def compile_stub(self, key, signature, device, constexprs, options, attrs, warmup):
        kernel = object.__new__(CompiledKernel)  # the real class: launch_metadata / run cost what they cost
        kernel.name, kernel.src, kernel.function, kernel.packed_metadata = self.fn.__name__, None, 0, None
        name = kernel.name
        kernel.module = object()
        kernel._run = (lambda *args: None) if launcher is None else (lambda *args: launcher(name, *args))
        self.device_caches[device][0][key] = kernel
        return kernel

    saved_active, saved_compile = driver._active, JITFunction._do_compile
    driver.set_active(Driver())
    JITFunction._do_compile = compile_stub
    runs_triton, _backend._cpu_runs_triton = _backend._cpu_runs_triton, True
    try:
        yield
    finally:
        _backend._cpu_runs_triton = runs_triton
        JITFunction._do_compile = saved_compile
        driver._active = saved_active


def _inputs(T: int, H: int, device: torch.device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(T, H, device=device, generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(H, device=device, generator=g)).bfloat16().requires_grad_()
    dy = torch.randn(T, H, device=device, generator=g).bfloat16()
    return x, w, dy


def _cake(x, w):
    from ..cake_rmsnorm_train import cake_rmsnorm

    return cake_rmsnorm(x, w, EPS)


def _torch(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def _liger(x, w):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    # positional (X, W, eps, offset, casting_mode, in_place): Liger's autograd Function takes no keywords
    return LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)


def _peers(on_gpu: bool):
    """(name, function, modes): cakeops and torch eager and compiled; Liger eager, on a GPU, when installed."""
    peers = [("cakeops", _cake, ("eager", "compiled")), ("torch", _torch, ("eager", "compiled"))]
    if on_gpu and importlib.util.find_spec("liger_kernel") is not None:
        peers.append(("liger", _liger, ("eager",)))
    return peers


def paths(T: int, H: int, device: torch.device, fwd_only: bool = False) -> Dict[str, Callable[[], object]]:
    """name -> one call. fwd: no_grad forward; fwd+bwd: forward, then the gradients of x and w returned."""
    x, w, dy = _inputs(T, H, device)
    runs: Dict[str, Callable[[], object]] = {}
    for peer, fn, modes in _peers(device.type == "cuda"):
        for mode in modes:
            f = fn if mode == "eager" else torch.compile(fn, dynamic=False, fullgraph=True)

            def fwd(f=f):
                with torch.no_grad():
                    return f(x, w)

            def fwd_bwd(f=f):
                return torch.autograd.grad(f(x, w), (x, w), dy)

            runs[f"{peer} {mode} fwd"] = fwd
            if not fwd_only:
                runs[f"{peer} {mode} fwd+bwd"] = fwd_bwd
    return runs


def floor_us(T: int, H: int, ceiling_gbps: float, backward: bool) -> float:
    """The path's byte floor at ``ceiling_gbps``: the forward reads x and writes y; the backward reads dy and x
    again and writes dx (bf16; w, dw and the FP32 rstd are under 0.1 % at these shapes and left out)."""
    return (5 if backward else 2) * T * H * 2 / (ceiling_gbps * 1e3)


def host_us_per_call(runs: Dict[str, Callable[[], object]], calls: int, reps: int,
                     on_gpu: bool) -> Dict[str, List[float]]:
    """CPU microseconds per call, one list of ``reps`` values per path; the paths alternate rep by rep. Without a
    GPU the clock is this process's CPU time: the host is shared, and time spent descheduled is not ours."""
    clock = time.perf_counter if on_gpu else time.process_time
    return host_time_per_call(runs, calls, reps, on_gpu, clock, 1e6)


def gpu_us_per_call(run: Callable[[], object], calls: int = 10) -> Tuple[float, float]:
    """(do_bench median µs: the step time as the issue measures it, kernel µs per call from torch.profiler)."""
    import triton.testing
    from torch.profiler import ProfilerActivity, profile

    from .core import self_time_us

    step = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median") * 1e3
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    kernels = sum(self_time_us(e, True) for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    return step, kernels / calls


def main(args) -> int:
    on_gpu = torch.cuda.is_available() and not (args.no_kernels or args.fake_driver)
    if on_gpu:
        device, ctx = torch.device("cuda"), contextlib.nullcontext()
        shapes = ((args.T, args.H or 4096),) if args.T else GPU_SHAPES
        what = f"{torch.cuda.get_device_name()}, kernels launched, GPU kept busy while issuing"
    else:  # the host cost does not depend on the size: small tensors keep the torch peers' CPU math cheap
        device = torch.device("cpu")
        ctx = fake_driver() if args.fake_driver else no_kernels()
        shapes = ((args.T or 64, args.H or 64),)
        what = ("CPU tensors, triton's launch path against a stand-in driver (no compiled launcher)"
                if args.fake_driver else "CPU tensors, RMSNorm launchers replaced by no-ops")
    print(f"RMSNorm public path, bf16, eps={EPS} ({what}); host: {args.reps} reps of {args.calls} calls")
    ceiling = None
    if on_gpu:
        from .core import copy_gbps

        ceiling = copy_gbps(device)
        print(f"copy ceiling {ceiling:.0f} GB/s (2 GiB bf16 device-to-device copy, read + write)")
    with ctx:
        for T, H in shapes:
            runs = paths(T, H, device)
            times = host_us_per_call(runs, args.calls, args.reps, on_gpu)
            print(f"T={T} H={H}" + (f"   floor µs: fwd {floor_us(T, H, ceiling, False):.1f}, fwd+bwd "
                                    f"{floor_us(T, H, ceiling, True):.1f}" if on_gpu else ""))
            for name, values in times.items():
                line = f"  {name:26s} host µs/call: median {statistics.median(values):8.1f}  min {min(values):8.1f}"
                if on_gpu:
                    step, kernels = gpu_us_per_call(runs[name])
                    floor = floor_us(T, H, ceiling, name.endswith("fwd+bwd"))
                    line += (f"   do_bench µs {step:8.1f} ({100 * floor / step:5.1f} % of floor)"
                             f"   GPU kernel µs/call {kernels:8.1f}")
                print(line, flush=True)
    return 0
