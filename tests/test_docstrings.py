"""The examples in the public docstrings run and print what they say (CPU; doctest)."""
import doctest

import pytest
import torch

from cakeops import cake_mhc_train, cake_rmsnorm_train


@pytest.mark.parametrize("fn", [cake_rmsnorm_train.cake_rmsnorm, cake_mhc_train.cake_mhc_train_prepare,
                                cake_mhc_train.cake_mhc_train_gated_head,
                                cake_mhc_train.cake_mhc_train_gated_head_forward,
                                cake_mhc_train.cake_mhc_train_gated_head_backward],
                         ids=lambda f: f.__name__)
def test_docstring_example_runs(fn):
    module = cake_mhc_train if fn.__module__.endswith("mhc_train") else cake_rmsnorm_train
    globs = dict(vars(module), torch=torch)
    finder = doctest.DocTestFinder()
    tests = [t for t in finder.find(fn, fn.__name__, globs=globs) if t.examples]
    assert tests, f"{fn.__name__} has no example"
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in tests:
        runner.run(test)
    assert runner.failures == 0
