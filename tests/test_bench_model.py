"""`python -m cakeops bench model` on CPU: the run end to end, the cakeops/math agreement, presets, flags."""
import json
import math

import pytest
import torch

from cakeops import __main__ as cakeops_main
from cakeops.bench import model as bench_model
from cakeops.bench import model_zoo


def test_cpu_run_end_to_end(tmp_path, capsys):
    torch._dynamo.reset()
    threads = torch.get_num_threads()
    rc = bench_model.main(["--device", "cpu", "--preset", "tiny", "--blocks", "1", "--steps", "2", "--warmup", "1",
                           "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert torch.get_num_threads() == threads
    assert "not performance numbers" in out
    record = json.loads((tmp_path / "model.json").read_text())
    assert {"date", "torch", "triton", "device", "transformer_engine"} <= set(record)
    rows = {r["variant"]: r for r in record["rows"]}
    assert list(rows) == list(model_zoo.VARIANTS)
    for v in ("plain", "cakeops", "cakeops-recompute", "math"):
        r = rows[v]
        assert r["status"] == "ok", r
        assert r["fullgraph"] is True and len(r["step_ms_all"]) == 2 and r["step_ms"] > 0
        assert math.isfinite(r["loss"]) and r["compile_s"] >= 0 and r["config"]["blocks"] == 1
    if not model_zoo.te_status()[0]:
        assert rows["te"]["status"] == "not installed" and rows["te"]["skipped"]
    # the same weights, the same model: the first step's losses of the compiled cakeops and math models agree
    assert rows["cakeops"]["loss"] == pytest.approx(rows["math"]["loss"], rel=1e-5)
    assert rows["cakeops-recompute"]["loss"] == rows["cakeops"]["loss"]  # the same weights and math
    # the default group in effect is recorded and shown: one block's two mHC layers make one group of 2
    assert rows["cakeops-recompute"]["recompute_group"] == 2 and "recompute_group" not in rows["cakeops"]
    assert rows["plain"]["overhead_pct"] == 0.0
    assert rows["cakeops"]["overhead_pct"] == pytest.approx(
        100 * (rows["cakeops"]["step_ms"] / rows["plain"]["step_ms"] - 1))
    check = record["check"]
    assert check["ok"] and check["loss_abs_diff"] <= 1e-4 and check["logits_rel_err"] <= 1e-3
    assert 0 < check["grad_max_rel_err"] <= 1e-2  # not 0: two different codes compute the gradients
    md = (tmp_path / "model.md").read_text()
    assert ("| config | plain residual | cakeops mHC | cakeops mHC + recompute | mHC as torch.compile'd math | "
            "TE Triton mHC |") in md
    assert "Agreement check: cakeops vs math" in md and "not performance numbers" in md
    assert md.count("groups of 2") >= 1
    assert (tmp_path / "model.png").exists() == bench_model.plot.available()


def test_agreement_check_catches_a_different_math_model(monkeypatch):
    true_layer = model_zoo.reference_mhc.layer
    monkeypatch.setattr(model_zoo.reference_mhc, "layer", lambda *a, **k: true_layer(*a, **k) * 1.01)
    check = bench_model.agreement_check(torch.device("cpu"), "cakeops", seed=0, with_te=False)
    assert not check["ok"] and check["logits_rel_err"] > 1e-3


def test_a_failing_variant_is_reported_not_raised(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel\nsecond line")

    monkeypatch.setattr(bench_model, "build", broken)
    opts = bench_model._parser().parse_args(["--no-compile", "--steps", "1", "--warmup", "0"])
    row = bench_model.run_variant(model_zoo.PRESETS["tiny"], "cakeops", opts, torch.device("cpu"), torch.float32)
    assert row["status"] == "error: RuntimeError: no such kernel"


def test_presets_match_the_issue_and_flags_override_them():
    p = model_zoo.PRESETS
    assert (p["c2048"].dim, p["c2048"].blocks, p["c2048"].ffn, p["c2048"].heads) == (2048, 4, 5632, 16)
    assert (p["c4096"].dim, p["c4096"].blocks, p["c4096"].ffn, p["c4096"].heads) == (4096, 2, 11008, 32)
    assert all((c.batch, c.seq, c.streams) == (2, 4096, 4) for c in (p["c2048"], p["c4096"]))
    parser = bench_model._parser()
    configs = bench_model._configs(parser.parse_args(["--preset", "issue"]), parser, cuda=True, explicit_cpu=False)
    assert [name for name, _ in configs] == ["c2048", "c4096"]
    configs = bench_model._configs(parser.parse_args(["--preset", "issue", "--seq", "1024"]), parser, True, False)
    assert [(n, c.seq, c.dim) for n, c in configs] == [("c2048*", 1024, 2048), ("c4096*", 1024, 4096)]
    # without CUDA a GPU preset becomes the tiny one, unless the CPU was asked for
    configs = bench_model._configs(parser.parse_args(["--preset", "c4096"]), parser, cuda=False, explicit_cpu=False)
    assert [name for name, _ in configs] == ["tiny"]
    for bad in (["--preset", "c1024"], ["--preset", "tiny", "--heads", "5"], ["--preset", "tiny", "--dim", "0"]):
        with pytest.raises(SystemExit):
            bench_model._configs(parser.parse_args(bad), parser, True, False)
    with pytest.raises(SystemExit):
        bench_model.main(["--variants", "plain,nosuch"])


def test_recompute_group_sweep_gives_a_row_per_size_against_cakeops(tmp_path, capsys):
    """--recompute-group 1,2: cakeops-recompute once per group size (1 keeps every layer's streams), each row with
    its step time against cakeops in the same run; the same weights and bits: the same first loss."""
    torch._dynamo.reset()
    rc = bench_model.main(["--device", "cpu", "--preset", "tiny", "--blocks", "1", "--steps", "1", "--warmup", "0",
                           "--no-check", "--variants", "cakeops,cakeops-recompute", "--recompute-group", "2,1",
                           "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = {r["variant"]: r for r in json.loads((tmp_path / "model.json").read_text())["rows"]}
    assert list(rows) == ["cakeops", "cakeops-recompute:2", "cakeops-recompute:1"]
    assert rows["cakeops"]["vs_cakeops_pct"] is None
    for g in (1, 2):
        r = rows[f"cakeops-recompute:{g}"]
        assert r["status"] == "ok" and r["recompute_group"] == g and r["loss"] == rows["cakeops"]["loss"]
        assert r["vs_cakeops_pct"] == pytest.approx(100 * (r["step_ms"] / rows["cakeops"]["step_ms"] - 1))
    md = (tmp_path / "model.md").read_text()
    assert ("| config | cakeops mHC | cakeops mHC + recompute (groups of 2) | cakeops mHC + recompute (groups of 1) |"
            in md)
    assert "| vs cakeops |" in md
    parser = bench_model._parser()
    for bad in ("0", "4,x", ""):
        with pytest.raises(SystemExit):
            bench_model._recompute_variants(["cakeops-recompute"], bad, parser)
    with pytest.raises(SystemExit):  # the groups of a variant that does not run
        bench_model._recompute_variants(["plain", "cakeops"], "4", parser)
    assert "group sizes >= 1" in capsys.readouterr().err


def test_te_layout_puts_the_streams_last():
    n, C = 4, 3
    fn = torch.arange(2 * n * C, dtype=torch.float32).reshape(2, n * C)  # column i*C + c: stream i, channel c
    te_fn = model_zoo.te_state_dict({"layers.0.fn": fn, "embed.weight": fn}, n)
    X = torch.randn(5, n, C)
    # the same projection: TE flattens X [.., C, n] as c*n + i
    torch.testing.assert_close(X.reshape(5, -1) @ fn.T, X.transpose(1, 2).reshape(5, -1) @ te_fn["layers.0.fn"].T)
    assert te_fn["embed.weight"] is fn


def test_help_documents_every_flag(capsys):
    parser = bench_model._parser()
    text = parser.format_help()
    for action in parser._actions:
        assert action.help and action.help.strip(), action.option_strings
        for flag in action.option_strings:
            assert flag in text
    for flag in ("--preset", "--dim", "--blocks", "--ffn", "--heads", "--batch", "--seq", "--streams", "--dtype",
                 "--variants", "--compile", "--no-compile", "--steps", "--warmup", "--out", "--optimizer"):
        assert flag in text
    with pytest.raises(SystemExit) as exit_info:
        cakeops_main.main(["bench", "model", "--help"])
    assert exit_info.value.code == 0
    assert "python -m cakeops bench model" in capsys.readouterr().out


class _FakeTE:
    """TransformerEngine's five mHC functions as documented (shapes, streams last), in torch: checks the adapter
    (``TEMHC``) and the layout conversion (``te_state_dict``) without TE."""

    @staticmethod
    def mhc_fused_projection(x, phi):  # x [M, C*n], phi [N, C*n] -> H [M, 32] (N valid), ms [M]
        H = torch.zeros(x.shape[0], 32)
        H[:, :phi.shape[0]] = x.float() @ phi.float().T
        return H, x.float().square().mean(-1)

    @staticmethod
    def mhc_fused_scale(H, alpha, beta, ms, n):
        group = torch.tensor([0] * n + [1] * n + [2] * n * n)
        z = H[:, :2 * n + n * n] * alpha[group] / (ms[:, None] + 1e-5).sqrt() + beta
        return torch.sigmoid(z[:, :n]), 2 * torch.sigmoid(z[:, n:2 * n]), z[:, 2 * n:]

    @staticmethod
    def mhc_fused_sinkhorn(H_res, n, iters=20):
        return model_zoo.reference_mhc.sinkhorn(H_res, 1e-6, iters)

    @staticmethod
    def mhc_fused_aggregate(x, H_pre, n):  # (s, b, C, n) @ (s, b, n) -> (s, b, C)
        return (x.float() @ H_pre[..., None]).squeeze(-1).to(x.dtype)

    @staticmethod
    def mhc_fused_expand_combine(f, bias, H_post, x, H_res, n):  # the first release's signature, with n
        return (f.float()[..., None] * H_post[..., None, :] + x.float() @ H_res).to(x.dtype)


def test_te_adapter_on_a_stand_in_computes_the_cakeops_model(monkeypatch):
    monkeypatch.setattr(model_zoo, "_te", lambda: _FakeTE)
    check = bench_model.agreement_check(torch.device("cpu"), "cakeops", seed=0, with_te=True)
    assert check["ok"] and "te_error" not in check, check
    # the same function up to the stand-in's gates without hc_eps: a wrong layout would be off by O(1)
    assert check["te_logits_rel_err"] < 1e-4


def test_a_graph_break_is_retried_without_fullgraph_and_reported(monkeypatch):
    real_build = bench_model.build

    def build_with_a_break(*args, **kwargs):
        model = real_build(*args, **kwargs)
        forward = model.forward

        def broken_forward(tokens):
            torch._dynamo.graph_break()
            return forward(tokens)

        model.forward = broken_forward
        return model

    monkeypatch.setattr(bench_model, "build", build_with_a_break)
    opts = bench_model._parser().parse_args(["--steps", "1", "--warmup", "0", "--backend", "eager", "--blocks", "1"])
    cfg = model_zoo.Config(**dict(model_zoo.PRESETS["tiny"].as_dict(), blocks=1))
    row = bench_model.run_variant(cfg, "plain", opts, torch.device("cpu"), torch.float32)
    assert row["status"] == "ok" and row["fullgraph"] is False, row
    assert "graph_break" in row and math.isfinite(row["loss"])


def test_kernel_kinds_name_cakeops_kernels_and_sort_the_rest():
    from cakeops.bench import kernel_breakdown as kb

    ours = kb.cakeops_kernels()
    # the kernels of both families are found by their triton.jit functions, not by a list kept by hand
    assert ours["_rmsnorm_fwd_kernel"] == "cakeops RMSNorm" and ours["_project_kernel"] == "cakeops mHC"
    assert ours["_dx_kernel"] == "cakeops mHC" and ours["_head_dgate_kernel"] == "cakeops mHC"
    assert ours["_sum_partials_kernel"] == "cakeops partial sums"
    assert kb.kind_of("triton_per_fused_add_mul_0", ours) == "Inductor (fused torch ops)"
    assert kb.kind_of("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_TNT", ours) == "GEMM"
    assert kb.kind_of("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", ours) == "GEMM"
    assert kb.kind_of("pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>", ours) == "attention"
    assert kb.kind_of("void at::native::vectorized_elementwise_kernel<4, ...>", ours) == "other"


def test_kind_table_shows_where_the_overhead_goes():
    from cakeops.bench import kernel_breakdown as kb

    def ms(**kw):
        row = dict.fromkeys(kb.KINDS, 0.0)
        row.update({k.replace("_", " "): v for k, v in kw.items()})
        row["kernels"] = sum(row[k] for k in kb.KINDS)
        row["wall"] = row["kernels"] + 1.0
        row["idle"] = 1.0
        return row

    plain = ms(GEMM=10.0, attention=5.0)
    mhc = ms(GEMM=10.0, attention=5.0, **{"cakeops mHC": 3.0})
    results = [{"preset": "c2048", "rows": [{"variant": "plain", "gpu_ms_by_kind": plain},
                                            {"variant": "cakeops", "gpu_ms_by_kind": mhc}]}]
    columns, cells = bench_model.kind_table(results)
    assert columns[:3] == ["config", "variant", "cakeops mHC"]
    assert [c[1] for c in cells] == ["plain", "cakeops", "cakeops - plain"]
    diff = dict(zip(columns, cells[2]))
    assert diff["cakeops mHC"] == "+3.00" and diff["GEMM"] == "+0.00" and diff["kernels"] == "+3.00"
