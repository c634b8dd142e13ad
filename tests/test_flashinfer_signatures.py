"""Every public function and autograd Function of FlashInfer 0.7.4's Cake RMSNorm and mHC modules exists in cakeops
with a signature a FlashInfer call fits: FlashInfer's parameters first, in its order, of its kinds (positional /
keyword-only) and with its defaults; cakeops' own extensions only after them, keyword-only, with defaults.

FlashInfer cannot be imported here (it needs its CUDA builds), so its signatures are a table,
tests/data/flashinfer_074_signatures.json, produced once from the 0.7.4 wheel's sources with ``ast`` by
tests/data/flashinfer_signatures.py (its docstring has the command). Autograd Functions are compared by their
``forward`` (what ``apply`` takes); their ``backward`` receives one gradient per forward output and is autograd's
business, not the caller's.
"""
import ast
import importlib
import inspect
import json
from pathlib import Path

import pytest

TABLE = json.loads((Path(__file__).parent / "data" / "flashinfer_074_signatures.json").read_text())

# FlashInfer module -> the cakeops module that stands in for it. FlashInfer's experimental namespace has the same
# functions with ``deterministic=``; cakeops' cake_mhc_train functions take it directly.
MODULES = {
    "cake_mhc_det_train": "cakeops.cake_mhc_det_train",
    "cake_mhc_train": "cakeops.cake_mhc_train",
    "experimental.cake.cake_mhc_train": "cakeops.cake_mhc_train",
    "cake_rmsnorm_train": "cakeops.cake_rmsnorm_train",
    "cake_rmsnorm_det_train": "cakeops.cake_rmsnorm_det_train",
}
# FlashInfer's symbolic defaults (module constants), by their values
SYMBOLS = {"HIDDEN": 4096, "_det_jit.HIDDEN": 4096}
_EMPTY = inspect.Parameter.empty


def _default(text):
    if text is None:
        return _EMPTY
    return SYMBOLS[text] if text in SYMBOLS else ast.literal_eval(text)


def _cases():
    for fi_module, entry in TABLE.items():
        for section in ("all", "lazy"):
            for name, spec in entry[section].items():
                yield pytest.param(fi_module, section, name, spec, id=f"{fi_module}.{name}")


def _check_params(where: str, ours, theirs):
    ours = list(ours)
    assert len(ours) >= len(theirs), f"{where}: cakeops has {[p.name for p in ours]}, FlashInfer {theirs}"
    for p, (name, kind, default) in zip(ours, theirs):
        assert (p.name, p.kind.name) == (name, kind), f"{where}: {p.name} ({p.kind.name}) where FlashInfer has " \
                                                      f"{name} ({kind})"
        want = _default(default)
        assert p.default is want or p.default == want, f"{where}: {name} defaults to {p.default!r}, not {want!r}"
    for p in ours[len(theirs):]:  # cakeops' extensions: after FlashInfer's, keyword-only, optional
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not _EMPTY, \
            f"{where}: cakeops' extra parameter {p.name} must be keyword-only with a default"


@pytest.mark.parametrize("fi_module, section, name, spec", _cases())
def test_signature_fits_flashinfers(fi_module, section, name, spec):
    module = importlib.import_module(MODULES[fi_module])
    where = f"{module.__name__}.{name}"
    assert hasattr(module, name), f"{where} is missing (flashinfer.{fi_module} has it)"
    if section == "all" and fi_module != "experimental.cake.cake_mhc_train":
        assert name in module.__all__, f"{where} is not in __all__"
    obj = getattr(module, name)
    if spec["kind"] == "function":
        assert callable(obj) and not inspect.isclass(obj), where
        _check_params(where, inspect.signature(obj).parameters.values(), spec["params"])
    elif spec["kind"] == "class":
        assert inspect.isclass(obj), where
        _check_params(f"{where}.forward", inspect.signature(obj.forward).parameters.values(), spec["forward"])
    else:  # ARCHES, SUPPORTED_COMPUTE_CAPABILITIES: cakeops' own values, FlashInfer's types
        if name == "ARCHES":
            assert obj and all(isinstance(a, str) for a in obj) and "sm_90" in obj and "cpu" in obj
        else:
            assert obj and all(isinstance(c, tuple) and len(c) == 2 for c in obj) and (9, 0) in obj


def test_the_table_covers_flashinfers_modules():
    """The table is whole: every module, and the names a reader would look for first."""
    assert set(TABLE) == set(MODULES)
    assert len(TABLE["cake_mhc_det_train"]["all"]) == 23 and len(TABLE["experimental.cake.cake_mhc_train"]["all"]) == 18
    assert TABLE["experimental.cake.cake_mhc_train"]["all"]["is_cake_mhc_train_supported"]["params"][-1] == \
        ["deterministic", "KEYWORD_ONLY", "True"]
    assert set(TABLE["cake_rmsnorm_train"]["lazy"]) >= {"cake_rmsnorm_det", "CakeRMSNormDetFunction"}
