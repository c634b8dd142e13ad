"""``python -m cakeops.bench.build_check [--n 2,4,8] [--T 16384] [--C 4096] [--sm 90] [--config EXPR]``: compile
every kernel the gated head's launchers launch (``--op mhc``: an mHC layer's), at the launch shapes they pick, for a
GPU that is not there.

No GPU needed (and none used): the launchers run on meta tensors with Triton's ``JITFunction.run`` replaced by a
recorder; each recorded launch is bound exactly as Triton binds it (types, constexprs, alignment attributes,
num_warps / num_stages / maxnreg) and compiled for ``GPUTarget("cuda", SM, 32)``. The multiprocessor count the
launchers size their grids by is the H200's (132; ``--sms``). The launchers see the GPU as they would on it: they
resolve their configs for that target (``cakeops._triton.arch``: its shared memory per block, ``arch.TARGETS``, and
Triton's builds for it), so a config that does not fit there falls back as it would on the device. Per kernel it
prints the shared memory the compiled kernel asks for (``metadata.shared``, checked against the target's limit:
232448 bytes on sm_90 and sm_100, 166912 on sm_80, 101376 on sm_86 / 89 / 120) and, from the bundled ptxas (``-v``
on the kernel's PTX), registers per thread, spill bytes and the programs per SM that registers / shared memory
allow.

Each build is also checked for a race of Triton's software pipeline (``pipeline_races``): a shared-memory buffer
refilled by an asynchronous copy while a wgmma (sm_90's asynchronous MMA) that reads it may still be running;
triton 3.6 built the bf16 projections so until 2026-12-03 (mhc_prepare._await_mma). sm_80 / sm_120 have no
asynchronous MMA (mma.sync); sm_100's (tcgen05) completion is tracked by barriers the check does not read.

``--config`` is a Python expression for the launchers' ``GatedHeadConfig`` (e.g.
``"GatedHeadConfig(dfn='separate')"``); ``--all-candidates`` checks the default and every candidate.
``--op mhc --candidates prepare,backward_prepare,backward_finish --n 8``: every config ``python -m
cakeops.bench.tune --n 8`` sweeps for those ops, each compiling its op's kernels. ``--sha``: each kernel's PTX
hash (a change meant to leave some builds alone compares them before / after).
Exit status 1 when a kernel does not fit or races. Run with TRITON_INTERPRET unset: under the interpreter ``triton.jit``
gives no compilable kernels (tests/test_mhc_gated_head.py runs this in a subprocess without it).
"""
import argparse
import atexit
import contextlib
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import List, Optional

REGS_PER_SM = 65536
MAX_THREADS_PER_SM = {80: 2048, 86: 1536, 89: 1536, 90: 2048, 100: 2048, 120: 1536}


def target(sm: int):
    """The GPU build_check models for sm_``sm``: arch.TARGETS' (its shared memory per block); another sm is given
    sm_90's limit."""
    from .._triton import arch

    return arch.TARGETS.get(sm, arch.Target(sm, arch.REFERENCE.shared_memory))


@dataclass
class Built:
    kernel: str
    constexprs: dict
    num_warps: int
    num_stages: int
    shared: int
    regs: Optional[int]
    spill: Optional[int]
    grid: tuple
    ptx_sha: str = ""  # sha256 of the PTX's code: an unchanged kernel is the same build
    races: tuple = ()  # pipeline_races of the build
    async_mma: bool = False  # the build has a wgmma that runs on while the warp goes on (what races need)
    tensor_core: tuple = ()  # the build's distinct MMA instructions (PTX opcodes: mma.sync..., wgmma.mma_async...)
    reduce_layouts: tuple = ()  # reduce_layouts of the build: (operand shape, register layout) of every reduction

    def per_sm(self, sm: int) -> int:
        threads = 32 * self.num_warps
        by_threads = MAX_THREADS_PER_SM.get(sm, 2048) // threads
        by_regs = REGS_PER_SM // (max(self.regs, 1) * threads) if self.regs else by_threads
        limit = target(sm).shared_memory
        by_smem = (limit + 1024) // (self.shared + 1024) if self.shared else by_threads  # 1 KiB reserved per CTA
        return min(by_threads, by_regs, by_smem)


def _code_sha(ptx: str) -> str:
    """sha256 of the PTX's instructions: without the source locations (.loc / .file, the debug sections, the
    $L__tmp labels only they refer to), which move when a line is added above the kernel in its file or the
    kernel's helpers are split differently."""
    code = [line for line in ptx.split(".section")[0].splitlines()
            if not line.lstrip().startswith((".loc", ".file", "$L__tmp"))]
    return hashlib.sha256("\n".join(code).encode()).hexdigest()[:16]


_SSA = r"%[\w.#]+"


def reduce_layouts(ttgir: str) -> tuple:
    """The distinct (shape, layout) pairs of the tensors reduced in a TTGIR listing (``tt.reduce`` operands), the
    layout spelled out (``#ttg.blocked<{...}>``, not its per-module alias). A sum's order follows its operand's
    register layout: two kernels meant to give the same bits from the same values (the Sinkhorn of forward_prepare's
    gates kernel and of backward_finish's replay, mhc_math) must reduce on the same layouts."""
    aliases = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<\{.*\}>)$", ttgir, flags=re.M))
    found = set()
    for start in (m.end() for m in re.finditer(r'"tt\.reduce"\(', ttgir)):
        # the op's type follows its combine region: "}) : (tensor<SHAPExf32, #layout>) -> ..."
        typed = re.compile(r"\}\) : \(tensor<([0-9x]+)x\w+, (#\w+)>").search(ttgir, start)
        if typed:
            found.add((typed.group(1), aliases.get(typed.group(2), typed.group(2))))
    return tuple(sorted(found))


def pipeline_races(ttgir: str, stages: int) -> List[str]:
    """Shared-memory buffers of a pipelined loop that an async copy refills while an asynchronous wgmma issued
    earlier in the same loop step, with no wait for all of them since, still reads them, where the buffer has fewer
    slots than ``stages`` (so the slot refilled is the one the step reads: Triton gives a load one slot per stage
    only when the MMA alone reads it). An empty list: no such buffer. Reads Triton's TTGIR (3.6's op names)."""
    slots = {m.group(1): int(m.group(2)) for m in
             re.finditer(rf"({_SSA}) = ttg\.local_alloc[^\n]*?!ttg\.memdesc<(\d+)x", ttgir)}
    buffer_of = {m.group(1): m.group(2) for m in re.finditer(rf"({_SSA}) = ttg\.memdesc_index ({_SSA})\[", ttgir)}
    found = []
    for body in re.split(r"scf\.for ", ttgir)[1:]:
        body = body.split("scf.yield")[0]
        read_by_pending = set()
        for m in re.finditer(r"(ttng\.warp_group_dot_wait|ttng\.warp_group_dot|ttg\.async_copy_global_to_local) "
                             r"([^{:]*)(\{[^}]*\})?", body):
            op, operands, attrs = m.group(1), [o.strip().split(" ")[0] for o in m.group(2).split(",")], m.group(3) or ""
            if op == "ttng.warp_group_dot_wait":
                if "pendings = 0" in attrs:
                    read_by_pending.clear()
            elif op == "ttng.warp_group_dot":
                if "isAsync = true" in attrs:
                    read_by_pending.update(buffer_of.get(o) for o in operands[:2])
            elif len(operands) > 1:
                buffer = buffer_of.get(operands[1])
                if buffer in read_by_pending and slots.get(buffer, stages) < stages:
                    found.append(f"{buffer} ({slots[buffer]} slots, {stages} stages) refilled while an asynchronous "
                                 f"wgmma still reads it")
    return found


def _ptxas_usage(ptx: str, sm: int):
    """(registers, spill stores + loads in bytes) from ptxas -v on the PTX, or (None, None)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        return None, None
    arch = f"sm_{sm}a" if sm >= 90 else f"sm_{sm}"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", src, "-o", os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return (int(regs.group(1)) if regs else None,
            int(spill.group(1)) + int(spill.group(2)) if spill else None)


@contextlib.contextmanager
def _as_gpu(sms: int, sm: int = 90):
    """Launchers on meta tensors size their grids for a GPU of ``sms`` multiprocessors and pick its configs, for
    sm_``sm`` (``target``) as they would on it."""
    import torch
    from .._triton import arch, launch, mhc_gated_head, mhc_prepare

    def persistent_programs(device, work_items, per_sm=2):
        return max(1, min(work_items, sms * per_sm))

    patched, original = [], launch.persistent_programs
    for name, mod in list(sys.modules.items()):
        ours = name.startswith("cakeops._triton")
        if ours and getattr(mod, "persistent_programs", None) is original:
            patched.append((mod, "persistent_programs", mod.persistent_programs))
            mod.persistent_programs = persistent_programs
    resolve, layer_config = mhc_prepare.PrepareConfig.resolve, mhc_prepare.layer_config
    head_projection = mhc_gated_head.projection_config
    mhc_prepare.PrepareConfig.resolve = lambda self, X, **kw: self.resolve_for(
        X.shape[0], X.shape[2], torch.device("meta"), True, n=X.shape[1], dtype=X.dtype, **kw)
    mhc_prepare.layer_config = lambda config, n, cuda: layer_config(config, n, True)
    mhc_gated_head.projection_config = lambda cfg, n, C, dtype, cuda: head_projection(cfg, n, C, dtype, True)
    try:
        with arch.assume(target(sm)):
            yield
    finally:
        mhc_prepare.PrepareConfig.resolve, mhc_prepare.layer_config = resolve, layer_config
        mhc_gated_head.projection_config = head_projection
        for mod, attr, value in patched:
            setattr(mod, attr, value)


_INDUCTOR_COPIES = {}


@functools.lru_cache(maxsize=None)
def _copies_folder() -> str:
    """One folder per process for the copies' files (Triton reads a kernel's source from its file), removed at
    exit: a test run makes hundreds of copies, which would otherwise pile up in the temp dir."""
    folder = tempfile.mkdtemp(prefix="cakeops-inductor-copy-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def inductor_copy(fn):
    """``fn`` as the module torch.compile generates to launch a traced kernel defines it: Inductor copies the
    kernel's source, the sources of the Triton functions it calls and the module constants it reads, under its own
    imports, into a file of its own. What that copy lacks (a global the kernel or a helper reads that Inductor
    does not copy) fails there, not in eager code."""
    if fn in _INDUCTOR_COPIES:
        return _INDUCTOR_COPIES[fn]
    import importlib.util

    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.codegen.wrapper import user_defined_triton_kernel_transitive_closure_source_code

    source = (TritonKernel.gen_common_triton_imports() + "\n@triton.jit\n"
              + user_defined_triton_kernel_transitive_closure_source_code(fn))
    path = os.path.join(_copies_folder(), f"{fn.__module__}.{fn.__name__}.py")
    with open(path, "w") as f:
        f.write(source)
    spec = importlib.util.spec_from_file_location(f"cakeops_inductor_copy_{fn.__name__}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _INDUCTOR_COPIES[fn] = getattr(module, fn.__name__)
    return _INDUCTOR_COPIES[fn]


def compile_launches(call, sm: int = 90, sms: int = 132, kernels=None, inductor_scalars: bool = False,
                     inductor_source: bool = False, ptxas: bool = True) -> List[Built]:
    """Runs ``call`` (launchers on meta tensors) recording every Triton launch instead of running it, then
    compiles each distinct one for sm_``sm`` (only those named in ``kernels`` when given). ``inductor_scalars``:
    float arguments typed FP64, as Inductor's launcher types them in a traced launch (Triton's: FP32).
    ``inductor_source``: each kernel compiled from Inductor's copy of its source (``inductor_copy``).
    ``ptxas=False``: no registers / spills (ptxas on every build is most of the time of an sm_80 check)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction

    from .._triton.arch import bind

    gpu = GPUTarget("cuda", sm, 32)
    backend = make_backend(gpu)
    launches = []
    run = JITFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, dict(kwargs), grid))

    from .._triton.fast_launch import FastKernel

    def triton_path(self, grid, args, num_warps, num_stages=None, maxnreg=None, device=None):
        # device: the caller's current device, which Triton's path reads itself
        options = {k: v for k, v in (("num_stages", num_stages), ("maxnreg", maxnreg)) if v is not None}
        self.kernel[grid](*args, num_warps=num_warps, **options)

    fast_run = FastKernel.run  # its cached route would skip JITFunction.run, the recorder
    JITFunction.run = record
    FastKernel.run = triton_path
    try:
        with _as_gpu(sms, sm):
            call()
    finally:
        JITFunction.run = run
        FastKernel.run = fast_run
    built, seen = [], set()
    for fn, args, kwargs, grid in launches:
        if kernels and fn.__name__ not in kernels:
            continue
        signature, constexprs, attrs, options = bind(fn, backend, args, kwargs)
        if inductor_scalars:
            signature = {k: "fp64" if v == "fp32" else v for k, v in signature.items()}
        named = {fn.arg_names[k[0]]: v for k, v in constexprs.items() if len(k) == 1}
        key = (fn.__name__, repr(sorted(named.items())), options.num_warps, options.num_stages, options.maxnreg,
               repr(signature))
        if key in seen:
            continue
        seen.add(key)
        source = inductor_copy(fn) if inductor_source else fn
        from triton.compiler import ASTSource

        compiled = triton.compile(ASTSource(source, signature, constexprs, attrs), target=gpu,
                                  options=options.__dict__)
        regs, spill = _ptxas_usage(compiled.asm["ptx"], sm) if ptxas else (None, None)
        ttgir = compiled.asm.get("ttgir", "")
        built.append(Built(fn.__name__, named, options.num_warps, options.num_stages, compiled.metadata.shared,
                           regs, spill, tuple(grid) if not callable(grid) else (),
                           _code_sha(compiled.asm["ptx"]), tuple(pipeline_races(ttgir, options.num_stages)),
                           "isAsync = true" in ttgir, tensor_core_instructions(compiled.asm["ptx"]),
                           reduce_layouts(ttgir)))
    return built


def tensor_core_instructions(ptx: str) -> tuple:
    """The distinct tensor-core instructions of a PTX listing, sorted (shape and types included), and its explicit
    roundings to TF32 if it has any (``cvt.rna.tf32.f32``: Triton's TF32 dots leave the truncation to the MMA)."""
    return tuple(sorted(set(re.findall(r"\b(mma\.sync\.aligned\.[\w.]+|wgmma\.mma_async\.[\w.]+|cvt\.rna\.tf32"
                                       r"\.f32)", ptx))))


def gated_head_launches(T: int, n: int, C: int, dtype, config=None, deterministic: bool = True):
    """A callable that runs the gated head's forward and backward launchers on meta tensors."""
    import torch
    from .._triton import mhc_gated_head as K
    from ..meta.mhc_head_layout import HEAD_STATS_WIDTH

    def call():
        m = torch.device("meta")
        X = torch.empty(T, n, C, dtype=dtype, device=m)
        fn = torch.empty(n, n * C, device=m)
        scale, base = torch.empty(1, device=m), torch.empty(n, device=m)
        stats = torch.empty(T, HEAD_STATS_WIDTH, device=m)
        K.forward(X, fn, scale, base, 1e-5, 1e-6, stats, torch.empty(T, C, dtype=dtype, device=m), config=config)
        K.backward(torch.empty(T, C, dtype=dtype, device=m), X, fn, scale, base, stats, torch.empty_like(X),
                   torch.empty_like(fn), torch.empty(1, device=m), torch.empty(n, device=m),
                   deterministic=deterministic, config=config)
    return call


# The kernels each mHC op launches: ``--candidates OP`` compiles only these, under each of OP's configs.
MHC_OP_KERNELS = {
    "prepare": ("_split_fn_kernel", "_project_kernel", "_gates_kernel", "_collapse_kernel"),
    "backward_prepare": ("_backward_prepare_kernel",),
    "backward_finish": ("_dpre_kernel", "_dlogits_kernel", "_params_reduce_kernel", "_dx_kernel", "_dx_stream_kernel",
                        "_dfn_kernel", "_sum_partials_kernel"),
}


def mhc_layer_launches(T: int, n: int, C: int, dtype, config=None, deterministic: bool = True):
    """A callable that runs an mHC layer's launchers (prepare, finish, backward_prepare, backward_finish) on meta
    tensors. ``config``: a PrepareConfig, BackwardPrepareConfig or FinishConfig, given to its op's launcher (the
    others take their defaults); None: every launcher its default."""
    import torch
    from .._triton import mhc_backward, mhc_forward
    from ..meta import mhc_layout

    from .tune import config_classes

    def cfg_for(op):
        return config if isinstance(config, config_classes()[op]) else None

    def call():
        m = torch.device("meta")
        M = mhc_layout.n_logits(n)
        X, B = torch.empty(T, n, C, dtype=dtype, device=m), torch.empty(T, C, dtype=dtype, device=m)
        fn, scale, base = torch.empty(M, n * C, device=m), torch.empty(3, device=m), torch.empty(M, device=m)
        stats = torch.empty(T, mhc_layout.stats_width(n), device=m)
        gs = torch.empty(T, mhc_layout.grad_stats_width(n), device=m)
        mhc_forward.prepare(X, fn, scale, base, 1e-5, 1e-6, 20, stats, torch.empty_like(B),
                            config=cfg_for("prepare"))
        mhc_forward.finish(X, B, stats, torch.empty_like(X))
        mhc_backward.backward_prepare(torch.empty_like(X), B, X, stats, torch.empty_like(B), gs,
                                      config=cfg_for("backward_prepare"))
        mhc_backward.backward_finish(X, torch.empty_like(X), B, fn, scale, base, stats, gs, 1e-5, 1e-6, 20,
                                     torch.empty_like(X), torch.empty_like(fn), torch.empty_like(scale),
                                     torch.empty_like(base), deterministic=deterministic,
                                     config=cfg_for("backward_finish"))
    return call


def norm_and_head_launches(T: int, n: int, C: int, dtype, config=None, deterministic: bool = True):
    """A callable that runs the RMSNorm launchers at [T, C] (forward and backward, with and without the residual)
    and the plain head's (the mean over n streams, its backward) on meta tensors: the kernels the other two
    launch sets do not reach. ``config`` is not read (their defaults)."""
    import torch
    from .._triton import mhc_streams, rmsnorm

    def call():
        m = torch.device("meta")
        x, w, rstd = torch.empty(T, C, dtype=dtype, device=m), torch.empty(C, dtype=dtype, device=m), \
            torch.empty(T, device=m)
        for residual in (None, torch.empty_like(x)):
            h_out = None if residual is None else torch.empty_like(x)
            rmsnorm.forward(x, w, 1e-6, torch.empty_like(x), rstd, residual, h_out)
            rmsnorm.backward(torch.empty_like(x), x, w, rstd, torch.empty_like(x), torch.empty(C, device=m),
                             residual, deterministic)
        X = torch.empty(T, n, C, dtype=dtype, device=m)
        mhc_streams.head_forward(X, torch.empty_like(x))
        mhc_streams.head_backward(torch.empty_like(x), torch.empty_like(X), False)
    return call


def check(shapes, dtype_name: str = "bfloat16", sm: int = 90, sms: int = 132, configs=(None,),
          deterministic: bool = True, out=print, kernels=None, launches=None, sha: bool = False) -> bool:
    """Compiles every launch of every (T, n, C) in ``shapes`` under every config; prints one line per kernel;
    True when all fit the target's shared memory and none has a pipeline race (``pipeline_races``)."""
    import torch

    dtype = getattr(torch, dtype_name)
    limit = target(sm).shared_memory
    ok = True
    for cfg in configs:
        if cfg is not None:
            out(f"config: {cfg}")
        for T, n, C in shapes:
            call = (launches or gated_head_launches)(T, n, C, dtype, cfg, deterministic)
            for b in compile_launches(call, sm, sms, kernels):
                fits = b.shared <= limit
                ok &= fits and not b.races
                shape = " ".join(f"{k}={v}" for k, v in b.constexprs.items()
                                 if k.startswith(("BLOCK", "N", "DFN", "FUSED", "PRESPLIT", "X_PER")))
                out(f"T={T:<6d} n={n} C={C:<5d} {b.kernel:22s} warps={b.num_warps} stages={b.num_stages} "
                    f"smem={b.shared:7d} {'ok ' if fits else 'TOO BIG'} regs={b.regs} spill={b.spill} "
                    f"per_sm={b.per_sm(sm)} grid={b.grid}  {shape}" + (f"  ptx={b.ptx_sha}" if sha else "")
                    + "".join(f"\n    RACE: {r}" for r in b.races))
    return ok


def check_candidates(ops, ns, T: int = 16384, C: int = 4096, dtype_name: str = "bfloat16", sm: int = 90,
                     sms: int = 132, out=print, sha: bool = False) -> bool:
    """Every config the tuner sweeps for these mHC ops at these n (the default and ``candidates(n)``), each
    compiling only its op's kernels; True when every one fits the target's shared memory."""
    from .tune import config_classes

    ok = True
    for op in ops:
        cls = config_classes()[op]
        for n in ns:
            for cfg in [None] + list(cls.candidates(n)):
                out(f"{op} n={n}: {cfg if cfg is not None else 'default'}")
                ok &= check([(T, n, C)], dtype_name, sm, sms, (cfg,), out=out, kernels=set(MHC_OP_KERNELS[op]),
                            launches=mhc_layer_launches, sha=sha)
    return ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cakeops.bench.build_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=("gated_head", "mhc"), default="gated_head",
                   help="the gated head's kernels (default) or an mHC layer's (prepare ... backward_finish)")
    p.add_argument("--n", default="2,4,8")
    p.add_argument("--T", type=int, default=16384)
    p.add_argument("--C", type=int, default=4096)
    p.add_argument("--test-sizes", action="store_true",
                   help="also tests/test_mhc_gated_head.py::test_real_size_on_gpu's sizes (T=4096, C=8192/n)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sm", type=int, default=90,
                   help="the GPU to build for (80, 86, 89, 90, 100, 120: cakeops._triton.arch.TARGETS' shared memory; "
                        "the launchers resolve their configs for it as on the device)")
    p.add_argument("--sms", type=int, default=132, help="multiprocessors the grids are sized for (H200: 132)")
    p.add_argument("--config", default=None,
                   help="a GatedHeadConfig(...) expression; with --op mhc a PrepareConfig, BackwardPrepareConfig or "
                        "FinishConfig (...) one")
    p.add_argument("--all-candidates", action="store_true", help="the default and every GatedHeadConfig candidate")
    p.add_argument("--atomic", action="store_true", help="the non-deterministic backward")
    p.add_argument("--kernels", default="", help="only these kernels (comma-separated names)")
    p.add_argument("--candidates", default="",
                   help="mHC ops (prepare,backward_prepare,backward_finish): compile each op's kernels under its "
                        "default and every candidates(n) config, at every --n (what the tuner sweeps)")
    p.add_argument("--sha", action="store_true",
                   help="print each kernel's PTX hash (a change that must leave a build alone: compare before/after)")
    args = p.parse_args(argv)
    from .._triton.mhc_gated_head import GatedHeadConfig
    from .tune import config_classes

    ns = [int(v) for v in args.n.split(",")]
    shapes = [(args.T, n, args.C) for n in ns]
    if args.test_sizes:
        shapes += [(4096, n, 4096 // n * 2) for n in ns]
    configs = [None]
    if args.config:
        names = {cls.__name__: cls for cls in (GatedHeadConfig, *config_classes().values())}
        configs = [eval(args.config, names)]
    if args.all_candidates:
        configs = [None] + list(GatedHeadConfig.candidates())
    kernels = {k.strip() for k in args.kernels.split(",") if k.strip()} or None
    if args.candidates:
        ok = check_candidates([op.strip() for op in args.candidates.split(",") if op.strip()], ns, args.T, args.C,
                              args.dtype, args.sm, args.sms, sha=args.sha)
        print("every candidate fits" if ok else "SOME CANDIDATES DO NOT FIT sm_%d" % args.sm)
        return 0 if ok else 1
    ok = check(shapes, args.dtype, args.sm, args.sms, configs, deterministic=not args.atomic, kernels=kernels,
               launches={"mhc": mhc_layer_launches}.get(args.op), sha=args.sha)
    print("all kernels fit, no pipeline races" if ok else
          "SOME KERNELS DO NOT FIT the shared memory of sm_%d or race (RACE lines)" % args.sm)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
