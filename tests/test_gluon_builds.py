"""The Gluon kernels (cakeops/_gluon) built for sm_90 on this CPU, as their launchers pick them on an H200: Gluon has
no interpreter, so this is what CI can check of them (their numbers: tests/test_gluon_kernels.py, on the GPU).

The launchers run on meta tensors with Triton's launch recorded instead of run (``build_check.gluon_launches``:
the grid sized for 132 SMs, the tile shapes the launcher resolves for each C), and each distinct launch is compiled
through Gluon's AST source for ``GPUTarget("cuda", 90, 32)``. Every build must fit sm_90's shared memory per block
(227 KB), spill no register (ptxas on its PTX), and run its projection on the tensor-core instruction Triton's
kernel B uses at that n, with no explicit TF32 rounding in either: the precondition of their bitwise equality.
Builds are made once per session (a module fixture; ~30 s on 2 cores with a cold Triton cache).
"""
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import triton

from cakeops import _gluon
from cakeops._triton import arch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_PTXAS = os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas"))
pytestmark = [
    pytest.mark.skipif(not _gluon.importable(), reason=f"triton {triton.__version__}: its Gluon does not import, or "
                       f"is outside the supported {_gluon.SUPPORTED_TRITON} (the Triton kernels serve)"),
    pytest.mark.skipif(not HAS_PTXAS, reason="triton without its NVIDIA backend (no CUDA builds)"),
]

STREAMS = (2, 4, 8)
DTYPES = (torch.bfloat16, torch.float16)
# (T, C): the bench's shape; a ragged T at a C that is no power of two; small C, where the launcher narrows the
# column tiles (64 -> 32 -> 16: every tile width it can pick)
SHAPES = ((16384, 4096), (1000, 1536), (13, 40), (64, 24), (16, 8))
SMS = 132  # the H200's multiprocessors: the persistent grid's width


def _dtype_id(dtype):
    return str(dtype).replace("torch.", "")


@pytest.fixture(scope="module")
def builds():
    """{(dtype, n): [Built]}: every distinct launch of kernel B over SHAPES, compiled for sm_90."""
    from cakeops.bench import build_check as bc

    made = {}
    for dtype in DTYPES:
        for n in STREAMS:
            def every_shape():
                for T, C in SHAPES:
                    bc.gluon_launches(T, n, C, dtype)()
            made[(dtype, n)] = bc.compile_launches(every_shape, sm=90, sms=SMS)
    return made


def _check_fits(made, n, persistent=True):
    limit = arch.TARGETS[90].shared_memory
    assert made, "no launch recorded"
    for b in made:
        assert b.kernel == "_dx_gluon_kernel" and b.constexprs["N"] == n
        assert b.shared <= limit, f"{b.shared} bytes of shared memory > sm_90's {limit}: {b}"
        assert b.spill == 0, f"{b.spill} bytes spilled: {b}"
        assert not persistent or b.grid[0] <= SMS, f"not a persistent grid: {b.grid}"


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("n", STREAMS)
def test_gluon_dx_fits_sm90_without_spills(builds, n, dtype):
    _check_fits(builds[(dtype, n)], n)


@pytest.mark.parametrize("n", STREAMS)
def test_gluon_dx_tuning_candidates_fit_sm90_without_spills(n):
    """The launch shapes python -m cakeops.bench.gluon_dx --sweep times besides the default (bf16, T = 16384,
    C = 4096; a program owns one column tile, so 16-column tiles at C = 4096 are 256 programs, two waves)."""
    from cakeops._gluon.mhc_backward_dx import DxConfig
    from cakeops.bench import build_check as bc

    for cfg in DxConfig.candidates(n):
        made = bc.compile_launches(bc.gluon_launches(16384, n, 4096, torch.bfloat16, cfg), sm=90, sms=SMS)
        _check_fits(made, n, persistent=False)


# Triton's kernel B built for sm_90 (a subprocess: under TRITON_INTERPRET, which conftest sets on a CPU, triton.jit
# kernels compile to nothing): {n: its tensor-core instructions}, and whether its PTX rounds to TF32 explicitly
_TRITON_B = """
import json, torch
from cakeops.bench import build_check as bc
for n in (2, 4, 8):
    built = bc.compile_launches(bc.mhc_layer_launches(1024, n, 256, torch.bfloat16), sm=90, sms=132,
                                kernels={"_dx_kernel", "_dx_stream_kernel"}, ptxas=False)
    print(json.dumps({"n": n, "mma": sorted({i for b in built for i in b.tensor_core})}))
"""


@pytest.fixture(scope="module")
def triton_kernel_b():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", _TRITON_B], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {row["n"]: set(row["mma"]) for row in rows}


def _kind(instructions):
    """Tensor-core instructions up to the wgmma's N: each output element's value does not depend on it."""
    return {re.sub(r"m64n\d+k8", "m64nNk8", i) for i in instructions}


@pytest.mark.parametrize("n", STREAMS)
def test_gluon_dx_uses_the_tensor_core_instruction_of_triton_kernel_b(builds, triton_kernel_b, n):
    """TF32 mma.sync m16n8k8 at n = 2, 4 and TF32 wgmma at n = 8, as Triton builds _dx_kernel / _dx_stream_kernel
    for sm_90; the Gluon builds' PTX rounds nothing to TF32 explicitly (neither does Triton's)."""
    expected = _kind(triton_kernel_b[n])
    assert expected == ({"wgmma.mma_async.sync.aligned.m64nNk8.f32.tf32.tf32"} if n > 4 else
                        {"mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"}), expected
    for dtype in DTYPES:
        for b in builds[(dtype, n)]:
            assert _kind(b.tensor_core) == expected, (dtype, b.tensor_core)


def test_gluon_builds_report(builds, capsys):
    """The builds as a table (pytest -s shows it): shared memory, registers per thread at launch (the compute warps
    raise theirs to 240 with setmaxnreg, the load and store warps drop to 24), the grid."""
    with capsys.disabled():
        print(f"\ntriton {triton.__version__}: Gluon kernel B for sm_90")
        for (dtype, n), made in sorted(builds.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
            for b in made:
                print(f"  {_dtype_id(dtype):8s} n={n} warps={b.num_warps} shared={b.shared:6d} regs={b.regs} "
                      f"spill={b.spill} grid={b.grid} {' '.join(b.tensor_core)}")


def test_gluon_available_only_on_sm90_with_16_bit_data(monkeypatch):
    """The dispatch rule (no GPU needed): CPU / meta tensors, fp32 data, an unsupported n, or CAKEOPS_GLUON=0 never
    take the Gluon kernels."""
    assert not _gluon.available(torch.device("cpu"), torch.bfloat16, 4)
    assert not _gluon.available(torch.device("meta"), torch.bfloat16, 4)
    if torch.cuda.is_available():
        monkeypatch.setenv("CAKEOPS_GLUON", "0")
        assert not _gluon.available(torch.device("cuda"), torch.bfloat16, 4)
        monkeypatch.setenv("CAKEOPS_GLUON", "1")
        assert not _gluon.available(torch.device("cuda"), torch.float32, 4)
        assert not _gluon.available(torch.device("cuda"), torch.bfloat16, 3)
        assert _gluon.available(torch.device("cuda"), torch.bfloat16, 4) == (
            torch.cuda.get_device_capability() == (9, 0) and torch.version.hip is None)
