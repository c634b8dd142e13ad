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


def test_every_public_name_of_the_op_modules_is_at_the_top():
    """FlashInfer callers write ``flashinfer.cake_rmsnorm_train_forward(...)``: each name of the op modules'
    ``__all__`` (the one list of what they make public) is ``cakeops.<name>``, the same object, and in
    ``cakeops.__all__``; each module's ``__all__`` lists every public function and class it defines."""
    import importlib
    import inspect
    import pkgutil

    import cakeops
    import cakeops._mhc
    from cakeops import cake_mhc_det_train, cake_mhc_train, cake_rmsnorm_det_train, cake_rmsnorm_train

    for module in (cake_rmsnorm_train, cake_mhc_train, cake_rmsnorm_det_train, cake_mhc_det_train):
        for name in module.__all__:
            if name in cakeops._MODULE_ONLY:  # a per-module query (route_key, ARCHES, ...): not at the top
                assert not hasattr(cakeops, name) and name not in cakeops.__all__, name
                continue
            assert getattr(cakeops, name, None) is getattr(module, name), f"cakeops.{name}"
            assert name in cakeops.__all__, name
        # cake_mhc_train is a facade: its code lives in cakeops/_mhc/, whose public names it must all export
        sources = [module] + ([importlib.import_module(f"cakeops._mhc.{info.name}")
                               for info in pkgutil.iter_modules(cakeops._mhc.__path__)]
                              if module is cake_mhc_train else [])
        if module in (cake_rmsnorm_det_train, cake_mhc_det_train):
            sources = [module]
        for source in sources:
            defined = {name for name, value in vars(source).items() if not name.startswith("_")
                       and (inspect.isfunction(value) or inspect.isclass(value))
                       and value.__module__ == source.__name__ and value.__name__ == name}  # not an alias
            assert defined <= set(module.__all__), \
                f"{module.__name__}.__all__ lacks {sorted(defined - set(module.__all__))} (from {source.__name__})"
    assert len(set(cakeops.__all__)) == len(cakeops.__all__)
