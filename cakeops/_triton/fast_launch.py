"""Launching a Triton kernel with less host work than ``kernel[grid](...)``.

``JITFunction.run`` does, on every call: read the option knobs, bind the arguments to the signature, specialize
each one in C (dtype, 16-byte alignment of pointers, ``== 1`` and divisibility by 16 of integers), build a
cache key out of the specialization list and ``str(options)``, look the compiled kernel up, check the kernel's
global variables, build the launch metadata and call the compiled kernel's launcher. For a kernel of ~20
arguments that is tens of microseconds of Python per launch -- more than an RMSNorm kernel takes on an H200 at
small sizes, and a large share of the public RMSNorm path's host time (three launches per forward + backward).

``FastKernel`` keeps, per kernel, a dict from a key computed here -- at least as fine as Triton's own
specialization (see ``_arg_key``) -- to the compiled kernel that Triton returned for that key, and launches it
the way ``JITFunction.run`` does: ``compiled.run(grid_x, grid_y, grid_z, stream, function, packed_metadata,
launch_metadata, enter_hook, exit_hook, *all_arguments)``. That call is the same in triton 3.6, 3.7 and 3.8
(and is what ``CompiledKernel.__getitem__`` does too). Tensors reach the launcher as their data pointers (ints,
read once for the key): given a tensor, Triton's C launcher calls ``data_ptr()`` again and a driver query per
tensor argument (``_arg_key``). Triton's own path is taken whenever the cached route does
not apply: the first call of a key (Triton compiles or loads it, and we keep what it returns), the interpreter
(``TRITON_INTERPRET=1``: no compiled kernel), a triton version outside the checked range, launch hooks
installed (profilers such as proton see every launch as before), pre-run hooks on the kernel, and
``CAKEOPS_FAST_LAUNCH=0``.

While torch.compile traces an op's body for Inductor to launch its kernels (``launches_traced``, cakeops/_ops/
inductor.py) every launch goes through ``torch.library.wrap_triton`` instead, with the same arguments and options.

Two call forms: ``fast(kernel)[grid](*args, **kwargs)``, Triton's own form (arguments by position or name,
constexprs' defaults applied, launch options ``num_warps`` / ``num_stages`` / ``maxnreg``; other options take
Triton's path), and ``FastKernel(kernel)(grid, args, num_warps)`` with every argument positional in signature
order, constexprs included, as Triton's launcher receives them (the RMSNorm launchers: no binding at all).
"""
import inspect
import os
from typing import Dict, Optional, Sequence, Tuple

import torch
import triton

from .. import _backend


def _triton_version() -> Tuple[int, int]:
    try:
        return tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return (0, 0)


# The versions whose JITFunction.run / CompiledKernel.run were read for this (3.6 and 3.8 side by side; 3.7 lies
# between them). Anything else takes kernel[grid] on every call.
CHECKED_VERSIONS = ((3, 6), (3, 7), (3, 8))


def _enabled() -> bool:
    return (os.environ.get("CAKEOPS_FAST_LAUNCH", "1") != "0" and _triton_version() in CHECKED_VERSIONS
            and not _backend.interpreting())


_ENABLED = _enabled()

try:  # the names JITFunction.run reads; missing ones disable the fast route
    from triton import knobs as _knobs
    from triton.compiler.compiler import CompiledKernel as _CompiledKernel
    from triton.runtime import driver as _driver
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # pragma: no cover - a triton this module was not written for
    _ENABLED = False

def _arg_key(name: str, arg, constexpr: bool) -> Tuple[str, str, str]:
    """(kind, type check, launcher argument) of one argument, as source text, for the generated key function.

    Key: what Triton's specialization of a runtime argument can depend on, or finer. Tensors: dtype and whether
    the data pointer is 16-byte aligned (Triton's "D" attribute). Ints: ``== 1`` (specialized to a constant),
    divisibility by 16 ("D"), and the integer type the value needs (i32 / i64 / u64). Floats and bools: not
    specialized (fp32 / u1), only their type is checked. Constexprs: their value (and type: ``True == 1``).
    Launcher argument: a tensor's data pointer as an int (read once, for the key too), everything else as given.
    Triton's launcher (3.6-3.8) takes an int pointer as is; given a tensor it calls ``data_ptr()`` again and asks
    the driver (``cuPointerGetAttribute``) whether the address is device memory, per tensor and launch. That check
    guards against CPU tensors; the launchers here only ever receive tensors on the launch's CUDA device (the
    public layer checks devices before any launcher runs).
    """
    if constexpr:
        return "constexpr", f"type({name}) is T{name}", name
    if isinstance(arg, torch.Tensor):
        return "tensor", f"isinstance({name}, Tensor)", f"p{name}"
    if type(arg) is int:
        return "int", f"type({name}) is int", name
    if type(arg) in (float, bool):
        return "scalar", f"type({name}) is T{name}", name
    raise TypeError(f"unsupported argument type {type(arg).__name__}")


def _key_terms(kinds: Sequence[str], names: Sequence[str]) -> str:
    """The key's terms after (device, num_warps), as source text. The usual launch -- every pointer aligned, every
    int in [0, 2**31) -- is keyed by one term for all pointers and one for all ints' ranges (a bitwise or of them
    is in range exactly when each one is); any other launch by the per-argument terms, a tuple where the usual one
    has True, so no key of one form equals one of the other."""
    ptrs = [f"p{n}" for n, k in zip(names, kinds) if k == "tensor"]
    ints = [n for n, k in zip(names, kinds) if k == "int"]
    terms = [f"{n}.dtype" if k == "tensor" else n for n, k in zip(names, kinds) if k in ("tensor", "constexpr")]
    if ptrs:
        terms.append(f"(not ({' | '.join(ptrs)}) & 15 or ({''.join(f'{p} % 16 == 0, ' for p in ptrs)}))")
    # per int one term of three values: True (divisible by 16), 2 (== 1), False (neither)
    terms += [f"(not {n} & 15 or {n} == 1 and 2)" for n in ints]
    if ints:
        each = "".join(f"-2147483648 <= {n} <= 2147483647, {n} <= 9223372036854775807, " for n in ints)
        terms.append(f"(0 <= ({' | '.join(ints)}) <= 2147483647 or ({each}))")
    return ", ".join(terms)


def _make_key_fn(constexpr: Sequence[bool], args: Sequence):
    """A function ``(device, num_warps, *args) -> (key, launcher arguments)``, generated for the argument types of
    this call: one Python frame and no per-argument calls, since the key is computed on every launch. It returns
    None when a later call's argument types differ from these (the caller then takes Triton's own path)."""
    names = [f"a{i}" for i in range(len(args))]
    kinds, checks, passed = zip(*(_arg_key(n, a, c) for n, a, c in zip(names, args, constexpr)))
    pointers = "".join(f"    p{n} = {n}.data_ptr()\n" for n, k in zip(names, kinds) if k == "tensor")
    src = (f"def key(device, num_warps, {', '.join(names)}):\n"
           f"    if not ({' and '.join(checks)}):\n"
           f"        return None\n"
           f"{pointers}"
           f"    return (device, num_warps, {_key_terms(kinds, names)}), ({', '.join(passed)},)\n")
    namespace = {"Tensor": torch.Tensor, **{f"T{n}": type(a) for n, a in zip(names, args)}}
    exec(src, namespace)  # noqa: S102 - source built above from argument kinds only
    return namespace["key"]


def _no_hooks(runtime) -> bool:
    # triton 3.6-3.8 keep a HookChain (never None) whose ``calls`` list is empty unless a profiler added hooks;
    # with none, the launcher calls nothing, exactly as when given None.
    enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
    return ((enter is None or (type(enter).__name__ == "HookChain" and not enter.calls))
            and (exit_ is None or (type(exit_).__name__ == "HookChain" and not exit_.calls)))


def _make_binder(kernel):
    """``bind(*args, **kwargs) -> every argument in signature order``, generated from the kernel's signature:
    Python's own argument binding (defaults applied, unknown names refused), one frame per launch."""
    params = list(kernel.signature.parameters.values())
    names = [p.name for p in params]
    decl = ", ".join(n if p.default is inspect.Parameter.empty else f"{n}=_d_{n}" for n, p in zip(names, params))
    src = f"def bind({decl}):\n    return ({', '.join(names)},)\n"
    namespace = {f"_d_{p.name}": p.default for p in params if p.default is not inspect.Parameter.empty}
    exec(src, namespace)  # noqa: S102 - source built from the kernel's parameter names only
    return namespace["bind"]


def _options(num_warps: int, num_stages: Optional[int], maxnreg: Optional[int]) -> dict:
    """Triton's launch options as ``kernel[grid]`` takes them: None leaves Triton's default."""
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    return options


_tracing = False  # while torch.compile traces a body whose launches Inductor takes over (_ops/inductor.py)


class launches_traced:
    """Within the block every FastKernel launch goes through ``torch.library.wrap_triton`` (``_traced_launch``): the
    launchers run as they do eagerly (same grids, arguments and options), and torch.compile records the launches."""

    def __enter__(self):
        global _tracing
        self.saved, _tracing = _tracing, True

    def __exit__(self, *exc):
        global _tracing
        _tracing = self.saved


def tracing() -> bool:
    """Whether the launches made now are traced for Inductor (inside ``launches_traced``)."""
    return _tracing


class FastKernel:
    """A Triton ``@jit`` kernel launched through a per-specialization cache (module docstring)."""

    __slots__ = ("kernel", "constexpr", "key_fn", "routes", "usable", "bind")

    def __init__(self, kernel):
        self.kernel = kernel
        params = getattr(kernel, "params", None)
        self.usable = (_ENABLED and isinstance(kernel, _JITFunction) and params is not None
                       and not any(getattr(p, "do_not_specialize", False)
                                   or getattr(p, "do_not_specialize_on_alignment", False) for p in params))
        self.constexpr = tuple(p.is_constexpr for p in params or ())
        self.key_fn = None  # generated on the first call, from its argument types
        self.routes: Dict[tuple, tuple] = {}
        self.bind = _make_binder(kernel) if self.usable else None

    def __getitem__(self, grid: Tuple[int, ...]):
        """``kernel[grid](*args, **kwargs)`` as Triton takes it (module docstring)."""
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid: Tuple[int, ...], args: Sequence, kwargs: dict) -> None:
        if _tracing:
            options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kwargs}
            _traced_launch(self.kernel, grid, (self.bind or _make_binder(self.kernel))(*args, **kwargs), options)
            return
        if self.usable:
            # kwargs is this call's own dict (from __getitem__'s lambda): the options can be taken out of it
            num_warps = kwargs.pop("num_warps", 4)
            num_stages, maxnreg = kwargs.pop("num_stages", None), kwargs.pop("maxnreg", None)
            try:
                bound = self.bind(*args, **kwargs)
            except TypeError:  # another launch option (the route does not key on it) or a wrong call
                kwargs.update(_options(num_warps, num_stages, maxnreg))
            else:
                self.run(grid, bound, num_warps, num_stages, maxnreg)
                return
        self.kernel[grid](*args, **kwargs)  # the interpreter too

    def __call__(self, grid: Tuple[int, ...], args: Sequence, num_warps: int, device: Optional[int] = None) -> None:
        if _tracing:
            _traced_launch(self.kernel, grid, args, {"num_warps": num_warps})
            return
        self.run(grid, args, num_warps, None, None, device)

    def run(self, grid: Tuple[int, ...], args: Sequence, num_warps: int, num_stages: Optional[int] = None,
            maxnreg: Optional[int] = None, device: Optional[int] = None) -> None:
        """Launches with every argument positional in signature order (constexprs included). ``device``: the
        current CUDA device, where the caller has just read it (a launcher's several launches then ask once);
        None: asked here."""
        if self.usable and len(args) == len(self.constexpr) and not self.kernel.pre_run_hooks:
            runtime = _knobs.runtime
            if _no_hooks(runtime):
                if self.key_fn is None:
                    try:
                        self.key_fn = _make_key_fn(self.constexpr, args)
                    except TypeError:  # an argument kind the key does not know (None for a pointer, ...)
                        self.usable = False
                        self.kernel[grid](*args, **_options(num_warps, num_stages, maxnreg))
                        return
                drv = _driver.active
                if device is None:
                    device = drv.get_current_device()
                # Triton's options (num_warps, num_stages, maxnreg, debug, instrumentation) are part of its key too.
                keyed = self.key_fn((device, runtime.debug, _knobs.compilation.instrumentation_mode, num_stages,
                                     maxnreg), num_warps, *args)
                key = None if keyed is None else keyed[0]
                route = None if key is None else self.routes.get(key)
                if route is not None:
                    run, function, metadata = route
                    run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                        drv.get_current_stream(device), function, metadata, None, None, None, *keyed[1])
                    return
                compiled = self.kernel[grid](*args, **_options(num_warps, num_stages, maxnreg))
                # Keep only a finished, loaded kernel (async compilation hands back a future; a kernel whose
                # handles failed to load raises inside Triton and is never kept).
                if key is not None and isinstance(compiled, _CompiledKernel) and compiled.function is not None:
                    self.routes[key] = (compiled.run, compiled.function, compiled.packed_metadata)
                return
        self.kernel[grid](*args, **_options(num_warps, num_stages, maxnreg))


_FAST: Dict[int, FastKernel] = {}  # by id: a JITFunction's own hash computes its cache key


def fast(kernel) -> FastKernel:
    """The FastKernel of ``kernel``, one per kernel for the process: ``fast(kernel)[grid](...)`` launches it."""
    launcher = _FAST.get(id(kernel))
    if launcher is None or launcher.kernel is not kernel:
        launcher = _FAST[id(kernel)] = FastKernel(kernel)
    return launcher


def _traced_launch(kernel, grid: Tuple[int, ...], args: Sequence, options: dict) -> None:
    """``torch.library.wrap_triton(kernel)[grid](...)``: in a graph being traced the launch becomes a node that
    Inductor compiles and launches from its own generated code. ``args``: every argument in signature order,
    defaults included (Inductor's analysis of which tensors the kernel writes takes them by name, applying no
    defaults)."""
    from torch.library import wrap_triton

    wrap_triton(kernel)[grid](**dict(zip(kernel.arg_names, args)), **options)
