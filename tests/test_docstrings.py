"""The examples in the public docstrings run and print what they say (CPU; doctest): every public function of
cake_mhc_train and cake_rmsnorm_train has one."""
import doctest
import inspect

import pytest
import torch

from cakeops import cake_mhc_det_train, cake_mhc_train, cake_rmsnorm_det_train, cake_rmsnorm_train

# The public modules, not where each function is defined (cake_mhc_train re-exports cakeops/_mhc/): the examples
# run in the namespace a user imports (the first module with the function: the det modules' aliases run theirs in
# the module they come from).
MODULES = (cake_rmsnorm_train, cake_mhc_train, cake_rmsnorm_det_train, cake_mhc_det_train)
PUBLIC = list({id(f): f for f in (getattr(module, name) for module in MODULES for name in module.__all__)
               if inspect.isfunction(f)}.values())


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__name__)
def test_docstring_example_runs(fn):
    module = next(m for m in MODULES if any(getattr(m, name) is fn for name in m.__all__))
    globs = dict(vars(module), torch=torch)
    finder = doctest.DocTestFinder()
    tests = [t for t in finder.find(fn, fn.__name__, globs=globs) if t.examples]
    assert tests, f"{fn.__name__} has no example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f.__name__)
def test_docstring_documents_every_argument(fn):
    """help() teaches: each parameter is named in the docstring (shapes, dtypes, ranges, defaults go with it)."""
    doc = inspect.getdoc(fn) or ""
    missing = [p for p in inspect.signature(fn).parameters if p not in doc]
    assert not missing, f"{fn.__name__}: the docstring does not mention {missing}"
