"""Every python block of README.md runs, in order, as a user would paste it (on CPU here: "cuda" -> "cpu")."""
import re
from pathlib import Path

import pytest
import torch

from conftest import DEVICE

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
    source = BLOCKS[index] if DEVICE == "cuda" else BLOCKS[index].replace('"cuda"', '"cpu"')
    torch.manual_seed(index)
    exec(compile(source, f"README.md python block {index + 1}", "exec"), {"__name__": "readme"})
