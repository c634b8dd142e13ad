"""The demo end to end at a few steps: both models train under torch.compile and the loss falls."""
import json

import torch

from cakeops import demo


def test_corpus_is_valid_arithmetic():
    for line in demo.corpus(50, seed=3).splitlines():
        lhs, rhs = line.split("=")
        a, b = lhs.split("+")
        assert int(a) + int(b) == int(rhs)
    assert demo.encode("12+3=15\n").max() < len(demo.ALPHABET)


def test_demo_runs_and_the_loss_falls(tmp_path):
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    assert demo.main(["--steps", "25", "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads  # the demo's one thread does not leak into the caller
    record = json.loads((tmp_path / "demo.json").read_text())
    assert [r["model"] for r in record["results"]] == ["mHC (4 streams)", "plain residual"]
    for r in record["results"]:
        assert len(r["losses"]) == 25 and r["tokens_per_s"] > 0
        assert sum(r["losses"][-5:]) / 5 < sum(r["losses"][:5]) / 5


def test_demo_help_documents_every_flag(capsys):
    """``python -m cakeops demo --help`` gives each flag a help text that states its default."""
    import re

    import pytest

    from cakeops.__main__ import main

    with pytest.raises(SystemExit) as done:
        main(["demo", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    entries = dict(re.findall(r"^  (--[a-z-]+) [A-Z_]+\s+(.*?)(?=^  -|\Z)", text, flags=re.M | re.S))
    assert set(entries) == {"--steps", "--batch", "--length", "--dim", "--layers", "--lr", "--seed", "--device",
                            "--out", "--threads"}
    for flag, help_text in entries.items():
        assert re.search(r"\(.*\S.*\)", help_text, flags=re.S), f"{flag}: no default in {help_text!r}"
