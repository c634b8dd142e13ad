"""Launch configs per GPU: the target a kernel is built for, and the fallback that makes a default fit there.

The defaults were measured on an H200 (sm_90, 227 KB of shared memory per block). Other GPUs offer other limits
(sm_80 163 KB, sm_120 99 KB), and Triton builds the same kernel differently for them: its software pipeline keeps
one buffer per stage of every tile on sm_100 (tcgen05), and a copy more of some, where sm_90 (wgmma) keeps one
fewer for a tile also read in registers and sm_80 / sm_120 (mma.sync) one fewer for every tile. forward_prepare's projection at its
sm_90 default (128 x 64 tiles, 8 warps, 3 stages, bf16, n = 4) takes 224 KB there, 352-360 KB on sm_100 and 192
KB on sm_80 / sm_120; with fp32 X the sizes differ again, so no one formula predicts them.

So a launcher asks ``first_fit``: each candidate config, its preferred (the measured default) first and then
fewer stages, then smaller tiles, is built by Triton for the device's target (``built_shared_memory``: compiled,
not launched, for ``GPUTarget("cuda", capability, 32)``; cached per kernel, arguments and target) until one
needs no more shared memory than the device has. On sm_90 every default fits, so it stays what was measured.
Where nothing can be built (the interpreter, a triton without its NVIDIA backend, an AMD GPU) the preferred
config is taken as before and Triton reports at launch what does not fit.

The device's target comes from ``torch.cuda.get_device_properties`` (once per device); for tensors on no GPU
(meta tensors: ``python -m cakeops.bench.build_check``, the tests) it is the one ``assume`` names, else sm_90's.
"""
import contextlib
import functools
from typing import Callable, Iterable, NamedTuple, Optional, TypeVar

import torch
from torch.utils._python_dispatch import _disable_current_modes


class Target(NamedTuple):
    capability: int     # 10 * major + minor: 80, 90, 100, 120
    shared_memory: int  # bytes of shared memory a block may use (the opt-in limit), what a build is checked against


# The GPUs build_check and the tests build for (the opt-in shared memory per block of CUDA's tables: A100 163 KB,
# RTX 30 / 40 and RTX 50 99 KB, H100 / H200 and B200 227 KB).
TARGETS = {80: Target(80, 166912), 86: Target(86, 101376), 89: Target(89, 101376), 90: Target(90, 232448),
           100: Target(100, 232448), 120: Target(120, 101376)}
REFERENCE = TARGETS[90]  # where the defaults were measured (H200)

_assumed: Optional[Target] = None


@contextlib.contextmanager
def assume(target: Target):
    """Within: launchers given tensors on no GPU (meta tensors) resolve their configs for ``target``."""
    global _assumed
    before, _assumed = _assumed, target
    try:
        yield target
    finally:
        _assumed = before


@functools.lru_cache(maxsize=None)
def _cuda_target(index: int) -> Optional[Target]:
    if torch.version.hip is not None:  # an AMD GPU: its builds are not CUDA targets
        return None
    props = torch.cuda.get_device_properties(index)
    return Target(10 * props.major + props.minor, props.shared_memory_per_block_optin)


def target_of(device: Optional[torch.device]) -> Optional[Target]:
    """The target launches on ``device`` are built for: the GPU's own, or (no GPU) the assumed one, else sm_90's."""
    if device is not None and device.type == "cuda" and torch.cuda.is_available():
        return _cuda_target(device.index if device.index is not None else torch.cuda.current_device())
    return _assumed or REFERENCE


def _example(arg):
    """A launch argument from its description: a torch.dtype stands for a tensor of that dtype (a meta tensor:
    its pointer is 16-byte aligned), anything else is passed as it is."""
    return torch.empty(16, dtype=arg, device="meta") if isinstance(arg, torch.dtype) else arg


def bind(kernel, backend, args, kwargs):
    """(signature, constexprs, attrs, options) of a launch ``kernel[grid](*args, **kwargs)`` bound as Triton's own
    launcher binds it (types, constexprs, alignment attributes, num_warps / num_stages / maxnreg), for ``backend``."""
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, _ = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, None)
    return signature, constexprs, attrs, options


@functools.lru_cache(maxsize=None)
def _built(kernel, target: Target, args: tuple, kwargs: tuple) -> Optional[int]:
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, make_backend
        from triton.runtime.jit import JITFunction

        if not isinstance(kernel, JITFunction):  # the interpreter's kernels compile to nothing
            return None
        gpu = GPUTarget("cuda", target.capability, 32)
        backend = make_backend(gpu)
        # torch.compile may be tracing the launcher (fake tensors, a proxy mode): the stand-ins are plain meta
        # tensors, made and bound outside its modes
        with _disable_current_modes():
            signature, constexprs, attrs, options = bind(kernel, backend, [_example(a) for a in args],
                                                         {k: _example(v) for k, v in kwargs})
        compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=gpu,
                                  options=options.__dict__)
        return compiled.metadata.shared
    except Exception:  # no NVIDIA backend, a triton whose internals differ, a target it cannot build for
        return None


def built_shared_memory(target: Target, kernel, args, kwargs: dict) -> Optional[int]:
    """Bytes of shared memory Triton's build of ``kernel[grid](*args, **kwargs)`` for ``target`` asks for, or None
    where it cannot be built here. ``args`` / ``kwargs``: the launch's, a tensor given as its torch.dtype; integer
    arguments should be divisible by 16 as the real ones mostly are (only the alignment of a build depends on them).
    Cached: one build per kernel, arguments and target in a process (and Triton's cache on disk across them)."""
    return _built(kernel, target, tuple(args), tuple(sorted(kwargs.items())))


C = TypeVar("C")


def first_fit(target: Optional[Target], candidates: Iterable[C], build: Callable[[C], tuple]) -> C:
    """The first of ``candidates`` whose build fits ``target``'s shared memory; ``build(candidate)`` gives
    (kernel, args, kwargs) of its launch. The first candidate when its build cannot be measured (or no target),
    the last when none fits (Triton then says so at launch)."""
    candidate = None
    for candidate in candidates:
        if target is None:
            return candidate
        shared = built_shared_memory(target, *build(candidate))
        if shared is None or shared <= target.shared_memory:
            return candidate
    return candidate


def fewer_stages(stages: int, least: int = 1) -> range:
    """A pipeline's depths from ``stages`` down to ``least``: what ``first_fit`` tries before smaller tiles."""
    return range(stages, min(stages, least) - 1, -1)
