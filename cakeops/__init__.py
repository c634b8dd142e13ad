"""cakeops: Triton training kernels for PyTorch, shipped as torch.compile-clean custom ops.

Importing registers every ``torch.ops.cakeops.*`` op; no kernel is compiled here (Triton compiles
on first launch), and nothing here needs a GPU.
"""
import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path


def _bind_meta() -> None:
    # Installed distributions map meta/ to cakeops.meta (pyproject package-dir). A bare source
    # checkout on PYTHONPATH has no such mapping: bind meta/ beside this folder under that name.
    if _ilu.find_spec("cakeops.meta") is not None:
        return
    root = _Path(__file__).resolve().parent.parent / "meta"
    spec = _ilu.spec_from_file_location(
        "cakeops.meta", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    module = _ilu.module_from_spec(spec)
    _sys.modules["cakeops.meta"] = module
    spec.loader.exec_module(module)


_bind_meta()

from . import _ops  # noqa: E402,F401  (registers torch.ops.cakeops.*)
from . import cake_mhc_det_train, cake_mhc_train, cake_rmsnorm_det_train, cake_rmsnorm_train  # noqa: E402,F401
from . import nn  # noqa: E402,F401

# Every public name of the op modules at the top as well, as FlashInfer has them
# (``flashinfer.cake_rmsnorm_train_forward``, ``flashinfer.cake_mhc_det_train_prepare``): each module's ``__all__``
# is the one list of what is public. The per-module queries (the same names with other meanings in each module,
# FlashInfer keeps them off its top level too) stay in their modules.
_MODULE_ONLY = frozenset(("ARCHES", "SUPPORTED_COMPUTE_CAPABILITIES", "route_key", "program_windows",
                          "weight_dtypes"))
_OP_MODULES = (cake_rmsnorm_train, cake_rmsnorm_det_train, cake_mhc_train, cake_mhc_det_train)
globals().update({name: getattr(m, name) for m in _OP_MODULES for name in m.__all__ if name not in _MODULE_ONLY})

__all__ = ["cake_mhc_train", "cake_mhc_det_train", "cake_rmsnorm_train", "cake_rmsnorm_det_train", "nn",
           *(name for m in _OP_MODULES for name in m.__all__ if name not in _MODULE_ONLY)]
__version__ = "0.1.0"
