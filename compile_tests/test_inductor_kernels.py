"""On a GPU torch.compile traces the RMSNorm ops as their kernels (cakeops/_ops/inductor.py,
``register_visible_kernels``): Inductor launches them itself. What must hold: the traced bodies launch exactly what
the eager path launches (same kernels, grids, arguments and compile options: the same bits), the ops stay ops where
the launch is not static (CPU, the interpreter, symbolic sizes, torch.export, ``CAKEOPS_INDUCTOR_KERNELS=0``), and
on a GPU Inductor's code calls no cakeops op and gives eager's bits. On by default only on the torch versions a GPU
checked (``inductor.GPU_CHECKED_TORCH``).

Without a GPU the launches are compared under a stand-in CUDA driver (triton's JIT, no interpreter: a subprocess),
with the rule's device check opened to CPU tensors."""
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from cakeops.cake_rmsnorm_train import cake_rmsnorm
from conftest import ON_GPU
from graph_tools import aot_graph_codes

ROOT = Path(__file__).resolve().parent.parent

_LAUNCH_SCRIPT = textwrap.dedent('''
    import collections, torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from triton.runtime.jit import JITFunction
    from cakeops.bench.host_rmsnorm import fake_driver
    from cakeops.cake_rmsnorm_train import cake_rmsnorm
    from cakeops._ops import inductor

    inductor._compiled_triton = lambda x: True  # the stand-in driver's kernels stand for CUDA ones
    inductor._TRACE = "checked"  # the GPU-checked ops on every torch here (by default only where a GPU ran them)
    launches = collections.defaultdict(list)
    compiles = []

    def launcher(name, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit, *args):
        launches[name].append((gx, gy, gz, tuple(
            (a.dtype, tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else (type(a), a) for a in args)))

    def diff(got, want):
        return {k: [(i, a, b) for i, (a, b) in enumerate(zip(got.get(k, [None])[0][3], v[0][3])) if a != b]
                + [len(got.get(k, [])), len(v)] for k, v in want.items()}

    def compiled(fn, graphs, dynamic=False):
        def capture(gm, example_inputs):
            graphs.append(gm.code)
            return make_boxed_func(gm.forward)
        torch._dynamo.reset()
        return torch.compile(fn, fullgraph=True, dynamic=dynamic,
                             backend=aot_autograd(fw_compiler=capture, bw_compiler=capture))

    with fake_driver(launcher):
        stub = JITFunction._do_compile

        def recording(self, key, signature, device, constexprs, options, attrs, warmup):
            # what decides the binary: the kernel, its specialization and constexprs, the backend options
            compiles.append(repr((self.fn.__name__, signature, constexprs, attrs, options)))
            return stub(self, key, signature, device, constexprs, options, attrs, warmup)

        JITFunction._do_compile = recording
        g = torch.Generator().manual_seed(5)
        for residual in (False, True):
            for T, H in ((6, 40), (3, 20000)):  # one block per row; rows wider than a block (two passes, zeroed dw)
                x = torch.randn(T, H, generator=g).bfloat16().requires_grad_()
                w = torch.randn(H, generator=g).bfloat16().requires_grad_()
                r = torch.randn(T, H, generator=g).bfloat16() if residual else None
                dy = torch.randn(T, H, generator=g).bfloat16()
                fn = lambda x, w, r: cake_rmsnorm(x, w, 1e-6, r)[0] if r is not None else cake_rmsnorm(x, w, 1e-6)
                launches.clear()
                fn(x, w, r).backward(dy)
                eager, n_compiles = dict(launches), len(compiles)
                launches.clear()
                graphs = []
                compiled(fn, graphs)(x, w, r).backward(dy)
                assert dict(launches) == eager, (residual, T, H, diff(dict(launches), eager))
                # every binary the traced launches asked for is one the eager path built: same specializations,
                # constexprs and options (num_warps, num_stages), so the same code runs
                assert set(compiles[n_compiles:]) <= set(compiles[:n_compiles]), compiles[n_compiles:]
                del compiles[n_compiles:]
                code = "\\n".join(graphs)
                assert "triton_kernel_wrapper_functional" in code and "cakeops" not in code, code
                assert "aten.clone" not in code and "aten.copy" not in code, code
        names = sorted({c.split("'")[1] for c in compiles})
        assert names == ["_rmsnorm_bwd_kernel", "_rmsnorm_fwd_kernel", "_sum_partials_kernel"], names

        x = torch.randn(6, 40).bfloat16().requires_grad_()
        w = torch.randn(40).bfloat16().requires_grad_()
        # symbolic sizes: the op is kept (the fallback serves it)
        graphs = []
        torch._dynamo.reset()
        xd = x.detach().clone().requires_grad_()
        torch._dynamo.mark_dynamic(xd, 0)
        compiled(lambda x, w: cake_rmsnorm(x, w, 1e-6), graphs)(xd, w).backward(torch.randn_like(xd))
        assert "torch.ops.cakeops.rmsnorm_fwd" in graphs[0] and "triton_kernel_wrapper" not in graphs[0], graphs
        # switched off
        inductor._TRACE = "none"
        graphs = []
        compiled(lambda x, w: cake_rmsnorm(x, w, 1e-6), graphs)(x, w).backward(torch.randn_like(x))
        assert "torch.ops.cakeops.rmsnorm_fwd" in graphs[0] and "torch.ops.cakeops.rmsnorm_bwd" in graphs[1], graphs
        inductor._TRACE = "checked"
        # torch.export keeps the op: exported programs stay high-level and free of kernel sources

        class Norm(torch.nn.Module):
            def forward(self, x, w):
                return cake_rmsnorm(x, w, 1e-6)

        exported = torch.export.export(Norm(), (x.detach(), w.detach()), strict=False)
        assert "cakeops.rmsnorm_fwd" in str(exported.graph) and "triton_kernel" not in str(exported.graph)
    print("launches ok")
''')


_MHC_LAUNCH_SCRIPT = textwrap.dedent('''
    import collections, torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from cakeops.bench.host_rmsnorm import fake_driver
    from cakeops.cake_mhc_train import cake_mhc_train_finish, cake_mhc_train_gated_head, cake_mhc_train_prepare
    from cakeops.cake_rmsnorm_train import cake_rmsnorm
    from cakeops._ops import inductor

    inductor._compiled_triton = lambda x: True  # the stand-in driver's kernels stand for CUDA ones
    inductor._TRACE = "all"  # every op, as CAKEOPS_INDUCTOR_KERNELS=1 asks
    launches = collections.defaultdict(list)

    def launcher(name, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit, *args):
        # with each tensor's 16-byte alignment: Triton specializes on it (a reduction's layout can follow)
        launches[name].append((gx, gy, gz, tuple(
            (a.dtype, tuple(a.shape), a.stride(), a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor)
            else (type(a), a) for a in args)))

    def layer(X, fn, scale, base, w, gfn, gscale, gbase):
        U, handle = cake_mhc_train_prepare(X, fn, scale, base, rms_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=6)
        Y = cake_mhc_train_finish(X, cake_rmsnorm(U, w, 1e-6), handle)
        return cake_mhc_train_gated_head(Y, gfn, gscale, gbase, rms_eps=1e-6, hc_eps=1e-6)

    with fake_driver(launcher):
        for n in (4, 8):
            g = torch.Generator().manual_seed(n)
            T, C, M = 24, 64, 2 * n + n * n
            leaves = [t.requires_grad_() for t in (
                torch.randn(T, n, C, generator=g).bfloat16(), torch.randn(M, n * C, generator=g) / (n * C) ** 0.5,
                torch.tensor([0.5, 0.7, 1.3]), torch.randn(M, generator=g), 1 + 0.1 * torch.randn(C, generator=g),
                torch.randn(n, n * C, generator=g) / (n * C) ** 0.5, torch.tensor([0.8]), torch.randn(n, generator=g))]
            dY = torch.randn(T, C, generator=g).bfloat16()
            launches.clear()
            layer(*leaves).backward(dY)
            eager = dict(launches)
            launches.clear()
            graphs = []

            def capture(gm, example_inputs):
                graphs.append(gm.code)
                return make_boxed_func(gm.forward)

            torch._dynamo.reset()
            backend = aot_autograd(fw_compiler=capture, bw_compiler=capture)
            torch.compile(layer, fullgraph=True, backend=backend)(*leaves).backward(dY)
            assert dict(launches) == eager, (n, sorted(launches), sorted(eager))
            code = "\\n".join(graphs)
            assert code.count("triton_kernel_wrapper_functional(") == sum(map(len, eager.values())), code
            assert "torch.ops.cakeops" not in code and "aten.copy" not in code and "aten.clone" not in code, code
    print("launches ok")
''')


_COMPILED_AUTOGRAD_SCRIPT = textwrap.dedent('''
    import re, torch
    from torch._dynamo import compiled_autograd
    from cakeops.bench.host_rmsnorm import fake_driver
    from cakeops._ops import inductor
    from cakeops.tiny_lm import TinyLM

    inductor._compiled_triton = lambda x: True  # the stand-in driver's kernels stand for CUDA ones
    inductor._TRACE = "all"
    with fake_driver():
        torch.manual_seed(8)
        model = TinyLM(48, 32, layers=2, heads=4)
        tokens = torch.randint(0, 48, (2, 9))
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm.code)
            return gm.forward

        with compiled_autograd._enable(torch.compile(backend=backend)):
            torch.compile(model.loss, fullgraph=True, backend="aot_eager")(tokens).backward()
        ops = sorted(set(re.findall(r"torch\\.ops\\.cakeops\\.\\w+|triton_kernel_wrapper", graphs[0])))
        assert len(graphs) == 1, len(graphs)
        assert ops == ["torch.ops.cakeops.mhc_backward_finish", "torch.ops.cakeops.mhc_backward_prepare",
                       "torch.ops.cakeops.mhc_head_bwd", "torch.ops.cakeops.rmsnorm_bwd"], ops
    print("one graph")
''')


_ANALYSIS_CACHE_SCRIPT = textwrap.dedent('''
    import collections, torch, warnings
    from torch._higher_order_ops import triton_kernel_wrap as wrap
    from cakeops.bench.host_rmsnorm import fake_driver
    from cakeops._ops import inductor
    from cakeops.tiny_lm import TinyLM

    inductor._compiled_triton = lambda x: True  # the stand-in driver's kernels stand for CUDA ones
    inductor._TRACE = "all"
    passes = collections.Counter()
    front_end = wrap.generate_ttir

    def counting(kernel, *args, **kwargs):
        passes[getattr(kernel, "fn", kernel).__name__] += 1
        return front_end(kernel, *args, **kwargs)

    wrap.generate_ttir = counting
    with fake_driver(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        seen = []
        for layers in (1, 3):
            torch._dynamo.reset()
            torch.manual_seed(layers)
            model = TinyLM(48, 32, layers=layers, heads=4)
            torch.compile(model.loss, fullgraph=True, backend="aot_eager")(torch.randint(0, 48, (2, 9))).backward()
            seen.append(sum(passes.values()))
    # the opt-in mode says once that no GPU ran it on this torch (and nothing where one did)
    unchecked = inductor._torch_version() not in inductor.GPU_CHECKED_TORCH
    assert sum("CAKEOPS_INDUCTOR_KERNELS=1" in str(w.message) for w in caught) == unchecked, [
        str(w.message) for w in caught]
    # one front-end pass per distinct launch of the first model; a deeper model of the same sizes adds none
    assert seen[0] >= 10 and seen[1] == seen[0], (seen, passes)
    assert all(name.startswith("_") for name in passes), passes
    print("analysed once", seen)
''')


_INDUCTOR_CODE_SCRIPT = textwrap.dedent('''
    import os, re
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = os.environ["TORCHINDUCTOR_AUTOGRAD_CACHE"] = "0"  # this code's own
    import torch
    from torch._inductor.runtime import triton_heuristics
    from torch._inductor.utils import run_and_get_code
    from cakeops.bench.host_rmsnorm import fake_driver
    from cakeops._ops import inductor
    from cakeops.tiny_lm import TinyLM

    inductor._compiled_triton = lambda x: True  # the stand-in driver's kernels stand for CUDA ones
    inductor._TRACE = "all"
    # Inductor's code for CPU tensors: its own kernels are C++, the traced Triton launches neither built nor run
    # (torch 2.14 asks a Triton CPU backend for the launch options: the stand-in driver's sm_90 answers instead)
    from torch._dynamo import device_interface
    from torch._inductor.runtime import triton_helpers
    from triton.backends.compiler import GPUTarget
    device_interface.CpuInterface.raise_if_triton_unavailable = staticmethod(lambda device=None: None)
    if hasattr(triton_helpers, "get_backend_options_for_target"):
        options_for = triton_helpers.get_backend_options_for_target
        triton_helpers.get_backend_options_for_target = lambda target, options=None: options_for(
            GPUTarget("cuda", 90, 32), options)
    torch._inductor.config.compile_threads = 1
    triton_heuristics.CachingAutotuner.precompile = lambda self, *args, **kwargs: None
    triton_heuristics.CachingAutotuner.run = lambda self, *args, **kwargs: None
    with fake_driver():
        torch.manual_seed(3)
        model = TinyLM(48, 32, layers=2, heads=4)
        compiled = torch.compile(model.loss, fullgraph=True)
        _, codes = run_and_get_code(lambda: compiled(torch.randint(0, 48, (2, 16))).backward())
    code = "\\n".join(codes)
    assert len(codes) == 2 and len(re.findall(r"\\b_\\w+_kernel_\\d+\\.run\\(", code)) >= 40, code
    views = [nodes for nodes in re.findall(r"Source Nodes: \\[([^]]*)\\]", code)
             if "triton_kernel_wrapper" in nodes and re.search("as_strided|split_with_sizes|slice", nodes)]
    assert not views, views
    print("no views")
''')


def _run_without_interpreter(script: str, expect: str, fast_launch: str = "0"):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["CAKEOPS_FAST_LAUNCH"] = fast_launch  # eager launches through Triton's path too: the launcher sees tensors
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert expect in done.stdout


def test_traced_bodies_launch_what_eager_launches():
    _run_without_interpreter(_LAUNCH_SCRIPT, "launches ok")


def test_traced_mhc_bodies_launch_what_eager_launches():
    """CAKEOPS_INDUCTOR_KERNELS=1: an mHC layer, its RMSNorm branch and the gated head traced as their kernels, each
    launch as eager's (no GPU has run these through Inductor yet: they are not traced by default)."""
    _run_without_interpreter(_MHC_LAUNCH_SCRIPT, "launches ok")


def test_compiled_autograd_sees_backward_ops():
    """With compiled autograd on, backward ops stay ops (its Dynamo cannot trace Inductor's kernel-launch operator:
    a graph break per kernel): a 2-block mHC TinyLM's backward is one graph of the cakeops backward ops."""
    _run_without_interpreter(_COMPILED_AUTOGRAD_SCRIPT, "one graph")


def test_identical_launches_are_analysed_once():
    """Inductor's front-end pass over a traced launch (which tensors it writes) runs once per distinct cakeops
    launch: a 3-block model after a 1-block one of the same sizes adds no pass (each ~60 ms on the H200's host, three
    per launch there: a 16-block model did not finish compiling in 150 s before the cache)."""
    _run_without_interpreter(_ANALYSIS_CACHE_SCRIPT, "analysed once")


def test_inductor_hands_traced_kernels_whole_buffers():
    """Inductor's code (CPU tensors, its own kernels as C++) for a 2-block mHC TinyLM with every op traced: no
    traced kernel writes a view Inductor made of a scratch buffer. With one workspace split into pieces, Inductor
    (torch 2.11, H200) copied a 4.3 M-element view out of a 1.6 M-element buffer in a 16-block model's backward:
    an illegal memory access (``_workspace.fp32_scratch``)."""
    _run_without_interpreter(_INDUCTOR_CODE_SCRIPT, "no views")


def test_cpu_graphs_keep_the_ops():
    """Where Inductor cannot launch the kernels (CPU tensors here; the interpreter too) the graphs hold the ops."""
    x = torch.randn(5, 24, requires_grad=True)
    w = torch.randn(24, requires_grad=True)
    graphs = aot_graph_codes(lambda x, w: cake_rmsnorm(x, w, 1e-6), x, w)
    assert "torch.ops.cakeops.rmsnorm_fwd" in graphs["forward"]
    assert "torch.ops.cakeops.rmsnorm_bwd" in graphs["backward"]
    assert "triton_kernel_wrapper" not in graphs["forward"] + graphs["backward"]


@pytest.mark.skipif(not ON_GPU, reason="Inductor launches the RMSNorm kernels itself only for CUDA tensors")
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("H", [1000, 20000])
def test_inductor_launches_the_kernels_with_eager_bits(residual, H, monkeypatch):
    from torch._inductor.utils import run_and_get_code

    from cakeops._ops import inductor

    monkeypatch.setattr(inductor, "_TRACE", "checked")  # on this torch whether or not it is on by default

    g = torch.Generator(device="cuda").manual_seed(H + residual)
    T = 300
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (1 + 0.1 * torch.randn(H, device="cuda", generator=g)).bfloat16().requires_grad_()
    r = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_() if residual else None
    dy = torch.randn(T, H, device="cuda", generator=g).bfloat16()

    def fn(x, w, r):
        return cake_rmsnorm(x, w, 1e-6, r)[0] if r is not None else cake_rmsnorm(x, w, 1e-6)

    def step(f):
        for t in (x, w, r):
            if t is not None:
                t.grad = None
        y = f(x, w, r)
        y.backward(dy)
        return [y] + [t.grad for t in (x, w, r) if t is not None]

    eager = step(fn)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    got, codes = run_and_get_code(step, compiled)
    for a, b in zip(got, eager):
        assert torch.equal(a, b)
    code = "\n".join(codes)
    assert "_rmsnorm_fwd_kernel" in code and "_rmsnorm_bwd_kernel" in code and "_sum_partials_kernel" in code
    assert "torch.ops.cakeops" not in code, "a cakeops op left in the compiled code"


_BUILD_SCRIPT = textwrap.dedent('''
    import torch
    from cakeops.bench import build_check as bc
    from cakeops._triton import rmsnorm

    def rmsnorm_call():
        m = torch.device("meta")
        x, w = torch.empty(64, 4096, dtype=torch.bfloat16, device=m), torch.empty(4096, dtype=torch.bfloat16, device=m)
        rstd = torch.empty(64, device=m)
        rmsnorm.forward(x, w, 1e-6, torch.empty_like(x), rstd)
        rmsnorm.backward(torch.empty_like(x), x, w, rstd, torch.empty_like(x), torch.empty(4096, device=m))

    calls = [rmsnorm_call] + [f(64, n, 256, torch.bfloat16) for n in (2, 4, 8)
                              for f in (bc.mhc_layer_launches, bc.gated_head_launches)]
    names = set()
    for call in calls:
        names |= {b.kernel for b in bc.compile_launches(call)}
        traced = bc.compile_launches(call, inductor_scalars=True)
        copied = bc.compile_launches(call, inductor_scalars=True, inductor_source=True)
        assert [(b.kernel, b.ptx_sha) for b in copied] == [(b.kernel, b.ptx_sha) for b in traced]
        names |= {b.kernel for b in traced}
    assert {"_rmsnorm_fwd_kernel", "_rmsnorm_bwd_kernel", "_gates_kernel", "_head_gates_kernel",
            "_dlogits_kernel", "_dx_kernel", "_dx_stream_kernel", "_head_dx_columns_kernel"} <= names, names
    print("builds ok", len(names))
''')


def test_kernels_build_as_inductor_copies_and_launches_them():
    """What Inductor's generated code builds from a traced launch, for every kernel of the RMSNorm ops, an mHC
    layer and the gated head at n = 2, 4, 8 (sm_90 builds, no GPU needed):
    - a Python float argument is typed FP64 there (Triton's own launcher passes FP32): every kernel with float
      arguments (eps values) builds for both;
    - the kernel comes from Inductor's copy of its source (``build_check.inductor_copy``), which carries the Triton
      functions it calls but not the module globals they read: the copy builds to the same PTX."""
    _run_without_interpreter(_BUILD_SCRIPT, "builds ok", fast_launch="1")


def test_on_by_default_only_where_a_gpu_checked_it(monkeypatch):
    from cakeops._ops import inductor

    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    monkeypatch.delenv("CAKEOPS_INDUCTOR_KERNELS", raising=False)
    assert inductor._trace_mode() == ("checked" if version in inductor.GPU_CHECKED_TORCH else "none")
    for chosen, expected in (("1", "all"), ("0", "none")):
        monkeypatch.setenv("CAKEOPS_INDUCTOR_KERNELS", chosen)
        assert inductor._trace_mode() == expected


def _cache_tag(root: Path, kernels: str, user_tag: str = "") -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TORCH_COMPILE_CACHE_KEY_TAG")}
    env.update(PYTHONPATH=str(root), CAKEOPS_INDUCTOR_KERNELS=kernels)
    if user_tag:
        env["TORCH_COMPILE_CACHE_KEY_TAG"] = user_tag
    script = "import cakeops, torch; print(repr(torch.compiler.config.cache_key_tag))"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300,
                          cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    return eval(done.stdout.strip().splitlines()[-1])


def test_compile_caches_are_keyed_on_the_cakeops_sources(tmp_path):
    """torch.compile's cache key tag names a digest of the cakeops sources: a launcher edited after an upgrade
    misses the caches made by the old one (AOTAutograd's key sees only the op's name). The user's own tag is
    kept."""
    import shutil

    for name in ("cakeops", "meta"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    before = _cache_tag(tmp_path, "1")
    assert re.fullmatch(r"cakeops-[0-9a-f]{16}", before), before
    assert _cache_tag(tmp_path, "1", user_tag="mine") == "mine|" + before
    assert _cache_tag(tmp_path, "0") == before
    launcher = tmp_path / "cakeops" / "_triton" / "mhc_backward_finish.py"
    launcher.write_text(launcher.read_text() + "\n# edited\n")
    after = _cache_tag(tmp_path, "1")
    assert re.fullmatch(r"cakeops-[0-9a-f]{16}", after) and after != before, (before, after)
