"""Importing cakeops: every op registered, no GPU needed, no kernel compiled, little time added to torch's."""
import os
import subprocess
import sys
import textwrap


def test_import_registers_ops_without_triton_and_quickly():
    code = textwrap.dedent("""
        import sys, time
        t0 = time.perf_counter(); import torch; t1 = time.perf_counter()
        import cakeops; t2 = time.perf_counter()
        names = ["rmsnorm_fwd", "add_rmsnorm_fwd", "rmsnorm_bwd", "mhc_prepare", "mhc_stats", "mhc_finish",
                 "mhc_head_fwd", "mhc_head_bwd", "mhc_backward_prepare", "mhc_backward_finish",
                 "mhc_gated_head_fwd", "mhc_gated_head_bwd"]
        missing = [n for n in names if not hasattr(torch.ops.cakeops, n)]
        print(repr((missing, "triton" in sys.modules, t2 - t1)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}).stdout
    missing, triton_imported, seconds = eval(out.strip().splitlines()[-1])
    assert missing == []
    assert not triton_imported  # kernels (and triton itself) load on first launch only
    assert seconds < 2.0
