"""A deep model compiles with Inductor in bounded time and trains as eager does.

16 blocks = 32 ``nn.MHC`` layers (attention and MLP branches, cakeops RMSNorm pre-norms, ``MHCHead``), compiled
with ``fullgraph=True`` on CPU. On torch 2.11 and 2.12 Inductor's implicit fallback for an op first met deep in
a graph took time exponential in depth (cakeops/_ops/inductor.py); the run happens in a child process so that a
regression fails this test at the bound instead of hanging the suite.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from cakeops._ops import inductor
from cakeops.tiny_lm import TinyLM
from conftest import ON_GPU

COMPILE_BOUND_S = 180  # a hang detector: 78 s measured on a 2-core CPU with torch 2.11
CHILD_BOUND_S = COMPILE_BOUND_S + 120


def _compile_deep_model(tmp_path, recompute_group: int) -> dict:
    """The record of ``cakeops.bench.depth`` (16 blocks, 2 steps, CPU) in a child process, caches off."""
    out = tmp_path / f"depth-{recompute_group}.json"
    cmd = [sys.executable, "-m", "cakeops.bench.depth", "--blocks", "16", "--steps", "2", "--device", "cpu",
           "--recompute-group", str(recompute_group), "--json", str(out)]
    what = "16-block model" + (" with stream recompute" if recompute_group != 1 else "")
    try:
        # caches off: a cold compile is what is bounded, and a cache hit would lower nothing
        env = dict(os.environ, TORCHINDUCTOR_FORCE_DISABLE_CACHES="1")
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=CHILD_BOUND_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{what}: compile + 2 steps did not finish in {CHILD_BOUND_S} s on torch "
                    f"{torch.__version__} (Inductor compile time growing with depth?)")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    record = json.loads(out.read_text())
    assert record["mhc_layers"] == 32
    assert record["compile_s"] < COMPILE_BOUND_S, record
    # every cakeops op goes through the explicit fallback, never Inductor's implicit one
    assert sorted(record["inductor_fallbacks"]) == sorted(op.name() for op in inductor._OPS)
    assert record["grad_names"] == len(list(TinyLM(48, 32, layers=16).parameters()))
    assert record["grad_max_rel_err"] < 1e-3, record
    assert record["loss_max_abs_diff"] < 1e-4, record
    return record


@pytest.mark.skipif(ON_GPU, reason="the GPU runs `python -m cakeops.bench.depth` at real sizes instead")
def test_sixteen_block_model_compiles_and_matches_eager_with_and_without_stream_recompute(tmp_path):
    """Compiled and eager alike, with stream recompute (recompute_mhc's default groups: eager rebuilds through
    _recompute.StreamGroup, compiled through the ops' own groups) and without; with it, compiling takes at most
    1.5x as long (measured 30.5 s against 29.4 s, 2 cores, torch 2.13)."""
    without = _compile_deep_model(tmp_path, 1)
    with_recompute = _compile_deep_model(tmp_path, 0)
    assert without["recompute_group"] == 1 and with_recompute["recompute_group"] == 6
    assert with_recompute["compile_s"] <= 1.5 * without["compile_s"], (with_recompute["compile_s"],
                                                                       without["compile_s"])


@pytest.mark.skipif(ON_GPU, reason="the GPU runs `python -m cakeops.bench.depth --dtype bfloat16` at real sizes")
def test_bf16_compiled_gradients_as_close_to_float32_as_eager():
    """bf16 eager and compiled differ by rounding (up to ~15 % on the cancelling mHC base / scale sums); what
    must hold is that the compiled graph is no farther from a float32 copy of the same weights than eager is."""
    from cakeops.bench import depth

    record = depth.run(blocks=4, steps=1, dtype=torch.bfloat16, device="cpu")
    f32 = record["vs_float32"]
    assert len(f32["compiled"]) == record["grad_names"] == len(list(TinyLM(48, 32, layers=4).parameters()))
    assert 0.5 < f32["ratio_geomean"] < 2.0, f32
    assert f32["compiled_max"] < max(3 * f32["eager_max"], 0.05), f32
    # the mHC gradients themselves: per parameter at most 4x eager's distance (or both within bf16's noise)
    for name, err in f32["compiled"].items():
        assert err < max(4 * f32["eager"][name], 0.02), (name, err, f32["eager"][name])
