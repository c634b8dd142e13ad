"""`python -m cakeops bench deepseek-v4` on CPU: the smoke run end to end (tiny config, aot_eager, one step a row)."""
import json
import math

import pytest
import torch

pytest.importorskip("transformers", minversion="5.23", reason="the DeepSeek-V4 bench needs transformers >= 5.23: "
                    "pip install -e \".[transformers]\"")

from cakeops.bench import cli  # noqa: E402
from cakeops.bench import deepseek_v4  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run (on a GPU the command benchmarks)")
def test_cpu_smoke_run_end_to_end(tmp_path, capsys):
    torch._dynamo.reset()
    rc = cli.main(["deepseek-v4", "--rows", "hf-eager,hf-liger,cakeops,cakeops-recompute,cakeops-eager",
                   "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "not performance numbers" in out
    record = json.loads((tmp_path / "deepseek_v4.json").read_text())
    assert {"date", "torch", "transformers", "device"} <= set(record)
    rows = {r["row"]: r for r in record["rows"]}
    assert rows["hf-liger"].get("skipped"), rows["hf-liger"]
    for name in ("hf-eager", "cakeops", "cakeops-recompute", "cakeops-eager"):
        r = rows[name]
        assert r["status"] == "ok", r
        assert math.isfinite(r["loss"]) and r["step_ms"] > 0 and len(r["step_ms_all"]) == 1
    assert rows["cakeops"]["compile_s"] is not None and rows["hf-eager"]["compile_s"] is None
    # the same weights: the same first loss to bf16 rounding; recompute changes no bit
    assert rows["cakeops"]["loss"] == pytest.approx(rows["hf-eager"]["loss"], rel=1e-2)
    assert rows["cakeops-recompute"]["loss"] == rows["cakeops"]["loss"]
    md = (tmp_path / "deepseek_v4.md").read_text()
    assert "HF + cakeops + recompute" in md


def test_rows_are_checked(capsys):
    with pytest.raises(SystemExit):
        deepseek_v4.main(["--rows", "hf-eager,nope"])
    assert "unknown nope" in capsys.readouterr().err


def test_v4_shaped_config_at_width():
    cfg = deepseek_v4.config(4096, 2)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.hc_mult) == (4096, 2, 512, 4)
    assert cfg.layer_types == ["compressed_sparse_attention", "heavily_compressed_attention"]
    assert cfg.mlp_layer_types == ["hash_moe", "moe"]
