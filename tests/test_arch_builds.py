"""Every kernel at the config its launcher resolves for sm_80, sm_90, sm_100 and sm_120 (cakeops._triton.arch), built
by Triton's own compiler for that GPU without one: it fits the GPU's shared memory per block and its software
pipeline refills no buffer an asynchronous MMA still reads (build_check.pipeline_races); on sm_90 the configs are
the ones measured on the H200.

The launchers run on meta tensors as build_check runs them, resolving their configs for each target as they
would on the device; each distinct launch is built once (the mHC layer, the gated head, RMSNorm and the plain
head at n = 2, 4, 8, bf16 and fp32) in two subprocesses, two archs each (under TRITON_INTERPRET ``triton.jit``
compiles nothing), whose builds the tests below read. fp16 builds lie between the two (none over a limit either,
triton 3.8, 2026-12-04).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton

from cakeops._triton import arch, mhc_prepare
from cakeops._triton.mhc_prepare import PrepareConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_PTXAS = os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))
ARCHS = (80, 90, 100, 120)
T, C = 8192, 1024  # tests/test_build_races.py's sizes: the sm_90 bf16 builds come from the same cache entries

_SCRIPT = """
    import json, sys, torch
    from cakeops.bench import build_check as bc

    for sm in {archs}:
        for launches in (bc.mhc_layer_launches, bc.gated_head_launches, bc.norm_and_head_launches):
            for n in (2, 4, 8):
                for dtype in ("bfloat16", "float32"):
                    for b in bc.compile_launches(launches({T}, n, {C}, getattr(torch, dtype)), sm=sm, ptxas=False):
                        print(json.dumps(dict(
                            sm=sm, ops=launches.__name__, n=n, dtype=dtype, kernel=b.kernel, warps=b.num_warps,
                            stages=b.num_stages, shared=b.shared, races=list(b.races),
                            reduced=[list(r) for r in b.reduce_layouts],
                            constexprs={{k: v for k, v in b.constexprs.items() if isinstance(v, (bool, int, str))}})))

    # what a launcher traced by torch.compile measures (fake tensors): the same build
    from torch._subclasses.fake_tensor import FakeTensorMode
    from cakeops._triton import arch, mhc_prepare

    cfg = mhc_prepare.PrepareConfig().resolve_for({T}, {C}, torch.device("meta"), True, n=4)
    launch = mhc_prepare._project_build(cfg, 4, torch.bfloat16)
    target = arch.Target({archs}[0], 232448)
    with FakeTensorMode():
        traced = arch.built_shared_memory(target, *launch)
    arch._built.cache_clear()
    print(json.dumps(dict(sm={archs}[0], traced=traced, plain=arch.built_shared_memory(target, *launch))))
"""


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """The builds of every arch, made once per test session: under pytest-xdist the first worker to need them
    makes them while the other waits on a lock, then reads its file (each worker would otherwise build them all)."""
    if not HAS_PTXAS:
        pytest.skip("triton without its NVIDIA backend (no CUDA builds)")
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return _make_builds(tmp_path_factory)
    import fcntl

    shared = tmp_path_factory.getbasetemp().parent  # this session's folder, above each worker's own
    with open(shared / "arch_builds.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        made = shared / "arch_builds.json"
        if not made.exists():
            made.write_text(json.dumps(_make_builds(tmp_path_factory)))
        return json.loads(made.read_text())


def _make_builds(tmp_path_factory):
    """The builds of every arch, two subprocesses side by side (a cold Triton cache: ~3 minutes on 2 cores)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    folder = tmp_path_factory.mktemp("arch")
    runs = []
    for i, archs in enumerate((ARCHS[0::2], ARCHS[1::2])):
        script, out = folder / f"builds{i}.py", folder / f"builds{i}.out"
        script.write_text(textwrap.dedent(_SCRIPT.format(archs=archs, T=T, C=C)))
        with open(out, "w") as sink:  # a file, not a pipe: neither waits for the other to be read
            runs.append((subprocess.Popen([sys.executable, str(script)], stdout=sink, stderr=subprocess.STDOUT,
                                          env=env), out))
    rows = []
    for run, out in runs:
        run.wait(timeout=1500)
        text = out.read_text()
        assert run.returncode == 0, text[-5000:]
        rows += [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return rows


def test_a_launcher_traced_by_torch_compile_measures_the_same_build(builds):
    measured = [b for b in builds if "traced" in b]
    assert len(measured) == 2 and all(b["traced"] == b["plain"] and b["plain"] > 0 for b in measured), measured


def _row(b) -> str:
    tiles = " ".join(f"{k}={v}" for k, v in b["constexprs"].items() if k.startswith(("BLOCK", "STREAM", "LOOP")))
    return (f"sm_{b['sm']} {b['ops']} n={b['n']} {b['dtype']} {b['kernel']}: {tiles} warps={b['warps']} "
            f"stages={b['stages']} shared={b['shared']}")


@pytest.mark.parametrize("sm", ARCHS)
def test_every_kernel_fits_the_gpu_and_races_nothing(builds, sm):
    limit = arch.TARGETS[sm].shared_memory
    mine = [b for b in builds if b["sm"] == sm and "kernel" in b]
    kernels = {b["kernel"] for b in mine}
    assert len(kernels) >= 20, kernels  # every kernel of the ops: the launch sets reached them all
    too_big = [_row(b) for b in mine if b["shared"] > limit]
    assert not too_big, f"over sm_{sm}'s {limit} bytes:\n" + "\n".join(too_big)
    racing = [_row(b) + f" {b['races']}" for b in mine if b["races"]]
    assert not racing, "\n".join(racing)


# The configs measured on the H200 (sm_90), as the launchers chose them before they resolved configs per GPU:
# (BLOCK_T, BLOCK_C, warps, stages) of the projections and kernel C, the one-pass head kernel's LOOP_STAGES.
SM90 = {
    ("_project_kernel", "bfloat16"): {2: (128, 64, 8, 3), 4: (128, 64, 8, 3), 8: (128, 64, 8, 3)},
    ("_project_kernel", "float32"): {2: (128, 64, 8, 2), 4: (128, 64, 8, 2), 8: (128, 32, 8, 2)},
    ("_head_project_kernel", "bfloat16"): {2: (128, 128, 8, 3), 4: (128, 64, 8, 3), 8: (128, 128, 8, 3)},
    ("_head_project_kernel", "float32"): {2: (128, 128, 8, 2), 4: (128, 64, 8, 2), 8: (64, 32, 4, 2)},
    ("_dfn_kernel", "bfloat16"): {2: (64, 256, 4, 3), 4: (64, 256, 4, 3), 8: (64, 256, 8, 3)},
    ("_dfn_kernel", "float32"): {2: (64, 256, 4, 3), 4: (64, 256, 4, 3), 8: (64, 128, 8, 3)},
    ("_head_dx_columns_kernel", "bfloat16"): {2: 4, 4: 4, 8: 4},
    ("_head_dx_columns_kernel", "float32"): {2: 4, 4: 4, 8: 4},
}


def test_sm90_keeps_the_configs_measured_on_the_h200(builds):
    got = {}
    for b in builds:
        if b["sm"] == 90 and (b.get("kernel"), b.get("dtype")) in SM90:
            k = b["constexprs"]
            shape = k["LOOP_STAGES"] if "LOOP_STAGES" in k else (k["BLOCK_T"], k["BLOCK_C"], b["warps"], b["stages"])
            got.setdefault((b["kernel"], b["dtype"]), {})[b["n"]] = shape
    assert got == SM90


def test_other_gpus_fall_back_where_the_measured_config_does_not_fit(builds):
    """sm_100 builds forward_prepare's n = 4 projection at 128 x 64 tiles into 352-360 KB (sm_90: 224 KB), sm_120
    has 99 KB: both run it on smaller tiles or fewer stages than sm_90."""
    def projection(sm):
        return next((b["constexprs"]["BLOCK_T"], b["constexprs"]["BLOCK_C"], b["stages"]) for b in builds
                    if b["sm"] == sm and b.get("kernel") == "_project_kernel" and b["n"] == 4 and b["dtype"] == "bfloat16")

    assert projection(90) == (128, 64, 3)
    assert projection(100) != (128, 64, 3) and projection(120) != (128, 64, 3)


# ------------------------------------------------------------------------------------------------
# the resolution itself, without builds (the interpreter's kernels build nothing: a stand-in build size)
# ------------------------------------------------------------------------------------------------

def test_first_fit_takes_the_first_candidate_that_fits(monkeypatch):
    sizes = {3: 300_000, 2: 200_000, 1: 100_000}
    monkeypatch.setattr(arch, "built_shared_memory", lambda target, kernel, args, kwargs: sizes[kwargs["stages"]])
    build = lambda stages: (None, (), {"stages": stages})  # noqa: E731
    assert arch.first_fit(arch.TARGETS[90], arch.fewer_stages(3), build) == 2
    assert arch.first_fit(arch.TARGETS[120], arch.fewer_stages(3), build) == 1
    assert arch.first_fit(arch.Target(90, 10), arch.fewer_stages(3), build) == 1  # none fits: the last
    assert arch.first_fit(None, arch.fewer_stages(3), build) == 3  # no CUDA target (an AMD GPU): as measured
    monkeypatch.setattr(arch, "built_shared_memory", lambda *a: None)  # nothing can be built here
    assert arch.first_fit(arch.TARGETS[120], arch.fewer_stages(3), build) == 3


def test_projection_falls_back_on_stages_then_columns_then_tokens_in_the_fields_left_free():
    cfg = PrepareConfig().resolve_for(8192, 1024, torch.device("meta"), True, n=4)
    tried = [(c.block_t, c.block_c, c.num_warps, c.num_stages) for c in cfg.fallbacks(frozenset(
        ("block_t", "block_c", "num_warps", "num_stages")))]
    assert tried[:6] == [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (128, 32, 8, 2), (128, 16, 8, 3),
                         (128, 16, 8, 2)]
    assert tried[6:8] == [(64, 64, 4, 3), (64, 64, 4, 2)] and tried[-1] == (16, 16, 4, 2)
    # a field the caller gave stays as given
    given = list(cfg.fallbacks(frozenset(("num_stages",))))
    assert [(c.block_t, c.block_c, c.num_stages) for c in given] == [(128, 64, 3), (128, 64, 2)]


def test_launchers_resolve_for_the_assumed_gpu_on_tensors_on_none(monkeypatch):
    """Meta tensors (build_check): the target ``assume`` names, else sm_90's; the fit reads its shared memory."""
    assert arch.target_of(torch.device("meta")) == arch.REFERENCE
    with arch.assume(arch.TARGETS[120]):
        assert arch.target_of(torch.device("meta")) == arch.TARGETS[120]
        # a stand-in build: 96 KB per stage of the 128 x 64 tile, half that at 32 columns
        monkeypatch.setattr(arch, "built_shared_memory",
                            lambda target, kernel, args, kw: kw["num_stages"] * kw["BLOCK_C"] * 1536)
        monkeypatch.setattr(mhc_prepare, "_fit", mhc_prepare._fit.__wrapped__)  # no cached fits of the stand-in
        cfg = PrepareConfig().resolve_for(8192, 1024, torch.device("meta"), True, n=4)
        assert (cfg.block_t, cfg.block_c, cfg.num_stages) == (128, 32, 2)
    assert arch.target_of(torch.device("meta")) == arch.REFERENCE


def test_the_sinkhorn_replay_reduces_on_the_forward_gates_layout(builds):
    """Kernel A of backward_finish replays forward_prepare's Sinkhorn (mhc_math) and is only exact if every n-element
    sum runs in the forward's order, which follows the [BLOCK_T, n, n] tile's register layout. Same code is not
    enough: when the stats record took FlashInfer's column order, the gates kernel's unaligned stores moved its tile
    to another layout and the replay missed the forward's bits on an H100 (n = 4, 8). Every reduction of the tile
    in the gates kernel, in every build, on a layout kernel A reduces the tile on (kernel A has the backward's
    own sums besides)."""
    checked = 0
    for sm in ARCHS:
        for n in (2, 4, 8):
            for dtype in ("bfloat16", "float32"):
                def tiles(kernel):
                    rows = [b for b in builds if b.get("sm") == sm and b.get("n") == n and b.get("dtype") == dtype
                            and b.get("ops") == "mhc_layer_launches" and b.get("kernel") == kernel]
                    assert rows, (sm, n, dtype, kernel)
                    return {tuple(r) for b in rows for r in b["reduced"] if r[0].endswith(f"x{n}x{n}")}
                gates, replay = tiles("_gates_kernel"), tiles("_dlogits_kernel")
                assert gates and gates <= replay, (sm, n, dtype, gates, replay)
                checked += 1
    assert checked == len(ARCHS) * 6
