"""How Inductor runs the cakeops ops: as explicit fallback kernels, registered when Inductor is loaded.

Inductor gives a custom op that has no lowering an *implicit* fallback the first time it meets it. torch 2.11
and 2.12 then format ``log.info("Creating implicit fallback for: ...")`` eagerly, whatever the log level, and an
IR node's text embeds the text of its inputs' producers: exponential in depth for an op first met deep in a
graph. A model of 8 mHC layers did not finish compiling in 10 minutes that way (the head op first appears after
the last layer, the backward ops at the far end of the backward graph). torch 2.13 formats lazily.

The fix here is to register, for every cakeops op, the very lowering the implicit path would create -- a
fallback kernel with the layout constraint of the op's tags -- before Inductor lowers a graph, so the implicit
path (and its log line) is never taken. Compiled code is the same as with the implicit fallback, on every
supported torch, and compile time is linear in depth.

Where the launch is static, torch.compile goes one step further (``register_visible_kernels``): it traces, in the
op's place, the op's body with every launch made through ``torch.library.wrap_triton`` (``fast_launch.
launches_traced``) -- what ``torch.library.triton_op`` does, done here as a rule of the op under AOTAutograd's
functionalization, so the op stays one op in eager code, in exported programs and on CPU. Inductor then allocates
the outputs and workspaces and launches the kernels from its own generated code: per call, none of the Python a
fallback kernel runs (the dispatcher's call into Python, the op's body, the launch cache's key). The kernels and
launch shapes are the eager path's (the body is the eager body), so the results are the same bits. Static means:
CUDA tensors and the compiled Triton (not the interpreter), sizes that are plain ints (with symbolic sizes every
launch shape would be a guard: the fallback below serves those), and not inside ``torch.export``. The cost is
compile time: Inductor runs a Triton front-end pass over each traced launch to find the tensors it writes (three
times per launch on a GPU; ~60 ms each for the mHC kernels), so ``_cache_kernel_analysis`` keeps that analysis per
cakeops kernel and argument kinds: the 2n layers of a model repeat the same launches.
By default every op is traced, on the torch versions where a GPU ran them so (``GPU_CHECKED_TORCH``);
``CAKEOPS_INDUCTOR_KERNELS=1`` traces them on any torch (with a warning on the others), ``=0`` never. On an H200
(torch 2.11, 2026-12-02) the compile tests pass with every op traced, and a 16-block model trains with the ops'
losses in a compiled step of 71 ms against 98 ms with the ops. Scratch buffers are whole tensors while traced:
Inductor miscopied kernel-written views of one split workspace in a deep model (an illegal memory access,
``_workspace.fp32_scratch``). Compiled graphs hold the bodies, which torch's AOTAutograd cache cannot see:
``stamp_compile_caches`` keys torch.compile's caches on the cakeops sources.

Backward ops stay ops while compiled autograd is on when the graph is traced (``torch._dynamo.config.
compiled_autograd`` or inside ``compiled_autograd._enable``): compiled autograd copies a compiled backward graph into
its own and traces that with Dynamo, which cannot trace Inductor's kernel-launch operator (torch 2.11-2.14: a graph
break at every kernel, results still right). A forward compiled before compiled autograd is switched on keeps its
traced backward: ``CAKEOPS_INDUCTOR_KERNELS=0`` for that order.

The fallback kernel is not the op itself but its unchecked twin (``define_unchecked``): compiled graphs skip the
Python a ``custom_op`` runs per call, which made the compiled public RMSNorm path host-bound (H200, T=16384
H=4096 fwd+bwd: 1225 -> 785 us per call, docs/perf.md).

``make_fallback`` and the layout-constraint helpers are Inductor internals (the same calls the implicit path
makes). Importing Inductor costs 2-3 s, so registration waits until Inductor is loaded: the ops' fake
implementations check on each call (a dict lookup) and register once; Inductor always traces a graph through
them (AOTAutograd) before it lowers it. If the internals ever move, the ops keep working through the implicit
path, with a warning on the torch versions whose implicit path is slow at depth.
"""
import copy
import functools
import hashlib
import os
import sys
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

from .. import _backend

_OPS: List[torch._ops.OpOverload] = []
_UNCHECKED: Dict[torch._ops.OpOverload, torch._ops.OpOverload] = {}
_LIB = torch.library.Library("cakeops", "FRAGMENT")
_registered = False


def register_fake(op, fake: Callable, unchecked: Optional[Callable] = None) -> None:
    """``op.register_fake(fake)``, with the fallbacks registered on the first call made while Inductor is loaded.

    ``unchecked``: the op's body without its argument checks, taking the op's arguments. It becomes the kernel of
    a twin op, ``cakeops::<name>_unchecked`` (same schema and tags, same fake, no autograd registration), that
    Inductor's fallback for ``op`` calls: see ``define_unchecked``."""
    overload = getattr(torch.ops.cakeops, op._name).default
    _OPS.append(overload)

    @functools.wraps(fake)
    def fake_registering_fallbacks(*args, **kwargs):
        if not _registered:
            register_fallbacks_if_inductor_loaded()
        return fake(*args, **kwargs)

    op.register_fake(fake_registering_fallbacks)
    if unchecked is not None:
        _UNCHECKED[overload] = define_unchecked(overload, fake, unchecked)


# The torch versions whose Inductor compiled and ran the traced kernels on a GPU, bit for bit as eager (H200, torch
# 2.11: RMSNorm 2026-12-01, the mHC and gated-head ops 2026-12-02).
GPU_CHECKED_TORCH = ((2, 11),)


def _trace_mode() -> str:
    """Which ops torch.compile traces as their kernels: "checked" (the GPU-checked ops, on the GPU-checked torch
    versions: the default), "all" (``CAKEOPS_INDUCTOR_KERNELS=1``), "none" (``=0``, or another torch by default)."""
    chosen = os.environ.get("CAKEOPS_INDUCTOR_KERNELS")
    if chosen is not None:
        return "none" if chosen == "0" else "all"
    return "checked" if _torch_version() in GPU_CHECKED_TORCH else "none"


def _torch_version():
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])


_TRACE = _trace_mode()


def source_stamp() -> str:
    """A digest of the cakeops sources (this package and cakeops.meta): what a traced body launches."""
    import importlib

    digest = hashlib.sha256()
    for package in map(importlib.import_module, ("cakeops", "cakeops.meta")):
        root = Path(package.__file__).resolve().parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def stamp_compile_caches() -> None:
    """Adds ``cakeops-<source_stamp()>`` to torch.compile's cache key tag (at import).

    torch's AOTAutograd cache keys a compiled graph on the Dynamo graph, in which a cakeops op is its name: it does
    not see the body torch.compile traced in the op's place (``register_visible_kernels``) -- the launchers'
    Python and kernels -- nor an op's fake. After a cakeops upgrade the cache would hand back code compiled
    against the old version (seen on this machine: a fixed launcher kept its bug through a warm cache). The tag is
    part of every torch.compile cache key (Inductor's FX graph cache, AOTAutograd's, autotuning's): entries made
    with other cakeops sources miss. A tag the user set is kept, ours appended."""
    config = getattr(torch.compiler, "config", None)
    tag = getattr(config, "cache_key_tag", None)
    if tag is None:
        return
    mark = f"cakeops-{source_stamp()}"
    if mark not in tag:
        config.cache_key_tag = f"{tag}|{mark}" if tag else mark


def register_visible_kernels(op, body: Callable, gpu_checked: bool = False, backward: bool = False) -> None:
    """Under AOTAutograd (torch.compile), ``op`` is traced as ``body`` (the op's arguments) with every launch it
    makes taken over by Inductor (``fast_launch.launches_traced``), wherever ``_kernels_visible`` allows it, else
    kept as the op (module docstring). ``gpu_checked``: a GPU ran the traced form (traced by default).
    ``backward``: a backward op, kept as the op while compiled autograd is on."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    def trace_body(mode, func, types, args, kwargs):
        if not all(map(_plain, types)):  # a tensor subclass (DTensor) dispatches first
            return NotImplemented
        if ((_TRACE == "all" or (_TRACE == "checked" and gpu_checked)) and _kernels_visible(args)
                and not _given_workspace(func, args, kwargs) and not (backward and compiled_autograd_on())):
            from .._triton.fast_launch import launches_traced  # triton loads on first use, not at import

            _cache_kernel_analysis()
            if _TRACE == "all" and not (gpu_checked and _torch_version() in GPU_CHECKED_TORCH):
                _warn_unchecked_once()
            with mode, launches_traced():
                return body(*args, **kwargs)
        return mode.__torch_dispatch__(func, types, args, kwargs)

    op.register_torch_dispatch(FunctionalTensorMode, trace_body)


_ANALYSES = ("identify_mutated_tensors", "identify_accessed_tensors")  # torch 2.11-2.12, 2.13+


def _cache_kernel_analysis() -> None:
    """Caches Inductor's analysis of which tensors a cakeops kernel reads and writes (a Triton front-end pass) by
    kernel and argument kinds: tensors by dtype, other arguments by value. What a kernel writes follows from its
    code and constexprs alone, so identical launches (every layer of a model) share one pass. Other kernels are
    analysed as before. Installed once; Inductor looks the analysis up in its module on every call."""
    from torch._higher_order_ops import triton_kernel_wrap as wrap

    for name in _ANALYSES:
        analyse = getattr(wrap, name, None)
        if analyse is None or getattr(analyse, "_cakeops_cache", None) is not None:
            continue
        cache = {}

        @functools.wraps(analyse)
        def cached(kernel, kwargs, tma_descriptor_metadata, *rest, _analyse=analyse, _cache=cache):
            key = _analysis_key(kernel, kwargs, tma_descriptor_metadata) if not rest else None
            if key is None:
                return _analyse(kernel, kwargs, tma_descriptor_metadata, *rest)
            if key not in _cache:
                _cache[key] = _analyse(kernel, kwargs, tma_descriptor_metadata)
            return copy.copy(_cache[key])

        cached._cakeops_cache = cache
        setattr(wrap, name, cached)


def _analysis_key(kernel, kwargs, tma_descriptor_metadata):
    """(kernel, argument kinds) for a cakeops kernel's launch, or None (not ours, or an argument it cannot key)."""
    # a launch with options reaches Inductor as a fresh Autotuner around the JITFunction, its options as configs
    configs = tuple(str(c) for c in getattr(kernel, "configs", ()) or ())
    jit = kernel
    while hasattr(jit, "configs"):
        jit = jit.fn
    if not getattr(getattr(jit, "fn", None), "__module__", "").startswith("cakeops.") or tma_descriptor_metadata:
        return None
    kinds = [configs]
    for name, value in sorted(kwargs.items()):
        if value is None or isinstance(value, (bool, int, float, str)):
            kinds.append((name, value))
            continue
        dtype = getattr(value, "dtype", None)  # a tensor (fake, functional) or an Inductor IR node
        if dtype is None and hasattr(value, "get_dtype"):
            dtype = value.get_dtype()
        if dtype is None:
            try:
                kinds.append((name, int(value)))  # a sympy integer
                continue
            except (TypeError, ValueError):
                return None
        kinds.append((name, "tensor", str(dtype)))
    return (jit, tuple(kinds))


_warned_unchecked = False


def _warn_unchecked_once() -> None:
    global _warned_unchecked
    if not _warned_unchecked:
        _warned_unchecked = True
        warnings.warn(f"CAKEOPS_INDUCTOR_KERNELS=1: torch.compile traces the cakeops ops as their Triton kernels on "
                      f"torch {torch.__version__}, where no GPU has run them so (checked on torch "
                      f"{', '.join('.'.join(map(str, v)) for v in GPU_CHECKED_TORCH)}); if a compiled model fails, "
                      f"unset it (the ops stay ops on this torch) and report the failure.",
                      RuntimeWarning, stacklevel=2)


def compiled_autograd_on() -> bool:
    """Whether a backward traced now will be re-traced by compiled autograd (module docstring)."""
    from torch._dynamo import compiled_autograd, config

    # AOTAutograd traces with compiled autograd paused (``_disable``), so its flag reads False here; ``depth``
    # counts the ``_enable`` contexts entered (torch 2.11-2.14)
    return bool(config.compiled_autograd or compiled_autograd.compiled_autograd_enabled
                or getattr(compiled_autograd, "depth", 0) > 0)


def _kernels_visible(args) -> bool:
    if not _compiled_triton(args[0]):
        return False
    if any(type(s) is not int for a in args if isinstance(a, torch.Tensor) for s in a.shape):
        return False
    from torch.export._trace import custom_triton_ops_decomposition_disabled

    return not custom_triton_ops_decomposition_disabled()


def _given_workspace(op, args, kwargs) -> bool:
    """Whether the caller handed the op a workspace: it stays the op, which carves its scratch from that buffer
    (traced, the kernels would write views of a graph input: the views Inductor miscopied, ``fp32_scratch``)."""
    for i, argument in enumerate(op._schema.arguments):
        if "workspace" in argument.name:
            given = args[i] if i < len(args) else kwargs.get(argument.name)
            if given is not None:
                return True
    return False


def _compiled_triton(x: torch.Tensor) -> bool:
    """Whether ``x``'s kernels are compiled Triton ones (CUDA, not the interpreter): what Inductor can launch."""
    return x.is_cuda and not _backend.interpreting()


def _plain(t: type) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return issubclass(t, FakeTensor) or t in (torch.Tensor, FunctionalTensor)


def define_unchecked(op: torch._ops.OpOverload, fake: Callable, kernel: Callable) -> torch._ops.OpOverload:
    """The twin of ``op`` that compiled graphs call: ``op``'s schema and tags, ``kernel`` on CPU and CUDA.

    What a compiled graph saves by calling it (per call; 40 us of this 2-core CPU, ~4x that on the H200's host):
    a ``custom_op`` runs a chain of Python wrappers before its body -- the registered autograd kernel, a
    redispatch below autograd, the backend wrapper with its aliasing check -- and then the body's argument checks.
    In a compiled graph all of it is redundant: the graph runs with gradients off (AOTAutograd's own autograd
    node owns the backward), the fake already checked every argument at trace time, and the graph's guards
    hold the arguments' shapes, dtypes and devices to what was traced. The twin is a plain ``torch.library``
    op: the C++ dispatcher calls ``kernel`` straight away (its Autograd key falls through: no Python)."""
    name = op._schema.name.split("::")[1] + "_unchecked"
    schema = str(op._schema).split("(", 1)[1]
    _LIB.define(f"{name}({schema}", tags=tuple(op.tags))
    for key in ("CPU", "CUDA"):
        _LIB.impl(name, kernel, key)
    torch.library.register_fake(f"cakeops::{name}", fake, lib=_LIB)
    return getattr(torch.ops.cakeops, name).default


def register_fallbacks_if_inductor_loaded() -> bool:
    """Registers the fallback lowering of every cakeops op once Inductor's lowering module is imported: each op
    lowers to a fallback kernel that calls its unchecked twin."""
    global _registered
    if _registered or "torch._inductor.lowering" not in sys.modules:
        return _registered
    _registered = True
    try:
        from torch._inductor import lowering
        from torch._library.utils import get_layout_constraint_tag

        for op in _OPS:
            if op not in lowering.lowerings:
                constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
                lowering.make_fallback(op, layout_constraint=constraint, warn=False)
                if op in _UNCHECKED:  # the same lowering with the twin as the fallback kernel
                    lowering.register_lowering(op, type_promotion_kind=None)(
                        lowering.fallback_handler(_UNCHECKED[op]))
    except (ImportError, AttributeError, TypeError) as error:  # Inductor internals moved: implicit fallbacks
        if torch.__version__ < "2.13":
            warnings.warn(f"cakeops could not register its Inductor fallbacks ({error!r}); deep models may compile "
                          "slowly on this torch.", RuntimeWarning, stacklevel=2)
    return True


def fallbacks_registered() -> List[str]:
    """Names of the cakeops ops that Inductor lowers through the explicit fallback (for tests)."""
    if "torch._inductor.lowering" not in sys.modules:
        return []
    from torch._inductor.lowering import lowerings

    return [op.name() for op in _OPS if op in lowerings]


def unchecked_twins() -> Dict[str, str]:
    """op name -> the name of the twin its compiled fallback calls (for tests)."""
    return {op.name(): twin.name() for op, twin in _UNCHECKED.items()}
