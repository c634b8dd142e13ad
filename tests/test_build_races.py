"""Races of Triton's software pipeline in the sm_90 builds: no shared-memory buffer is refilled while an asynchronous
wgmma may still read it (cakeops.bench.build_check.pipeline_races on the TTGIR of each build).

triton 3.6 builds a loop whose tile feeds both a wgmma and a register computation with one buffer slot fewer than
the stages, yet leaves the step's last wgmma running across the loop edge: every bf16 projection (forward_prepare's
and the gated head's) was built so until 2026-12-03 and, on an H200, gave records a few roundings apart from run to
run with the 64 + 16 logit split. No GPU is needed: the kernels are compiled for sm_90 by Triton's own compiler, in
a subprocess (under TRITON_INTERPRET ``triton.jit`` compiles nothing).
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import triton

from conftest import ON_GPU

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_PTXAS = os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))
needs_ptxas = pytest.mark.skipif(not HAS_PTXAS, reason="triton without its NVIDIA backend (no sm_90 builds)")


def _run(code: str, tmp_path, timeout: int = 600) -> subprocess.CompletedProcess:
    script = tmp_path / "build.py"
    script.write_text(textwrap.dedent(code))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=timeout)


@needs_ptxas
def test_no_kernel_refills_a_buffer_an_asynchronous_mma_reads(tmp_path):
    """Every kernel of an mHC layer (forward and backward) and of the gated head at n = 2, 4, 8, bf16 (the dtype
    whose tiles reach the tensor cores from shared memory), at the launch shapes chosen for a 132-SM GPU."""
    out = _run("""
        import sys, torch
        from cakeops.bench import build_check as bc
        ok, asynchronous = True, 0
        for launches in (bc.mhc_layer_launches, bc.gated_head_launches):
            for n in (2, 4, 8):
                for b in bc.compile_launches(launches(8192, n, 1024, torch.bfloat16)):
                    asynchronous += b.async_mma
                    if b.kernel.endswith("project_kernel"):
                        k = b.constexprs
                        print("shape", launches.__name__, n, k["BLOCK_T"], k["BLOCK_C"], k.get("STREAM_STEPS"),
                              k.get("M_HI", 0))
                    for race in b.races:
                        ok = False
                        print(f"{launches.__name__} n={n} {b.kernel}: {race}")
        print("asynchronous wgmma builds:", asynchronous)
        sys.exit(0 if ok else 1)
    """, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    # the check has something to look at: the projections' MMAs run asynchronously (every n, layer and head)
    assert int(out.stdout.rsplit(":", 1)[1]) >= 6, out.stdout
    # at the shapes a GPU runs: n = 8's layer on split logits, its head one stream a step on 128 x 128 tiles
    shapes = {tuple(line.split()[1:3]): line.split()[3:] for line in out.stdout.splitlines() if line.startswith("shape")}
    assert shapes[("mhc_layer_launches", "8")] == ["128", "64", "True", "64"], shapes
    assert shapes[("gated_head_launches", "8")] == ["128", "128", "True", "0"], shapes


@needs_ptxas
@pytest.mark.skipif(not triton.__version__.startswith("3.6"), reason="the racy build is triton 3.6's (the oldest "
                    "supported); other versions may give the tile its slot per stage")
def test_the_check_finds_the_race_triton_3_6_builds(tmp_path):
    """The form the projections had before mhc_prepare._await_mma (a tile read by two MMAs and, in registers, by a
    sum of squares, 3 stages) is reported; with the wait it is not."""
    out = _run("""
        import sys, torch, triton
        import triton.language as tl
        from cakeops.bench import build_check as bc

        @triton.jit
        def tile_loop(X, W, OUT, SQ, K, WAIT: tl.constexpr):
            r = tl.arange(0, 64)
            acc = tl.zeros([64, 64], dtype=tl.float32)
            sq = tl.zeros([64, 64], dtype=tl.float32)
            for k in range(0, K, 64):
                x = tl.load(X + r[:, None] * K + k + r[None, :])
                sq += x.to(tl.float32) * x.to(tl.float32)
                acc = tl.dot(x, tl.load(W + (k + r[:, None]) * 64 + r[None, :]), acc)
                acc = tl.dot(x, tl.load(W + 64 * K + (k + r[:, None]) * 64 + r[None, :]), acc)
                if WAIT:
                    acc = acc + 0.0
            tl.store(OUT + r[:, None] * 64 + r[None, :], acc)
            tl.store(SQ + r, tl.sum(sq, axis=1))

        m = torch.device("meta")
        args = (torch.empty(64, 4096, dtype=torch.bfloat16, device=m), torch.empty(2, 4096, 64, dtype=torch.bfloat16,
                device=m), torch.empty(64, 64, device=m), torch.empty(64, device=m), 4096)
        for wait in (False, True):
            built = bc.compile_launches(lambda: tile_loop[(1,)](*args, WAIT=wait, num_warps=4, num_stages=3))
            print(wait, len(built[0].races), built[0].async_mma)
    """, tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    races = {line.split()[0]: int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith(("True", "False"))}
    assert races == {"False": 1, "True": 0}, out.stdout


@pytest.mark.skipif(not ON_GPU, reason="a race shows only on a GPU (the builds are checked above without one)")
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("op", ["forward_prepare", "gated_head_forward"])
def test_bf16_projection_gives_the_same_bits_run_after_run(op, n):
    """The public forwards on one bf16 input, 8 times: the records (and outputs) bitwise equal. Before
    _await_mma, n = 8's split projection gave 10 distinct records in 10 runs on an H200 at every size tried."""
    from cakeops import cake_mhc_train as mhc

    gen = torch.Generator(device="cuda").manual_seed(int.from_bytes(os.urandom(4), "little"))
    T, C = 4096, 2048
    X = torch.randn(T, n, C, device="cuda", generator=gen).to(torch.bfloat16)
    M = n if op == "gated_head_forward" else 2 * n + n * n
    fn = torch.randn(M, n * C, device="cuda", generator=gen) * 0.02
    scale = torch.tensor([0.7, 0.9, 1.3] if M > n else [0.8], device="cuda")
    base = torch.randn(M, device="cuda", generator=gen)
    call = getattr(mhc, f"cake_mhc_train_{op}")
    first = call(X, fn, scale, base)
    for _ in range(7):
        again = call(X, fn, scale, base)
        for a, b in zip(again, first):
            assert torch.equal(a, b)
