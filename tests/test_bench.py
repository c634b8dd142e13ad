"""The bench harness on CPU: the check path, the declared bytes, the reports, and `bench` end to end."""
import ast
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from cakeops.bench import cli, core, report
from cakeops.bench import rmsnorm_cases

ROOT = Path(__file__).resolve().parent.parent
RMSNORM_OPS = ["rmsnorm fwd", "add+rmsnorm fwd", "rmsnorm bwd", "rmsnorm bwd (fast dw)"]


def _rmsnorm_cases(quick=True):
    core.load_families()
    return core.cases(["rmsnorm"], quick=quick)


def test_registry_quick_takes_the_first_shape_only():
    quick, full = _rmsnorm_cases(quick=True), _rmsnorm_cases(quick=False)
    assert [c.name for c in quick] == RMSNORM_OPS
    assert {c.shape_label for c in quick} == {"T=32768 H=4096"}
    assert {c.shape_label for c in full} == {"T=32768 H=4096", "T=16384 H=8192"}
    assert len(full) == 8 and "rmsnorm" in core.families()


@pytest.mark.parametrize("name", RMSNORM_OPS)
def test_cpu_check_reports_small_errors(backend, name):
    case = next(c for c in _rmsnorm_cases() if c.name == name)
    row = core.cpu_check(case, backend, tol_scale=2.0 if backend == "triton" else 1.0)
    outputs = {"rmsnorm fwd": {"y", "rstd"}, "add+rmsnorm fwd": {"y", "rstd", "h_new"}}.get(name, {"dx", "dw"})
    assert set(row["rel_err"]) == outputs
    assert row["ok"], row
    # bf16 outputs against an fp64 oracle carry rounding error: an error of exactly 0 would mean the
    # check compared the op with itself.
    bf16_out = "y" if "fwd" in name else "dx"
    assert 0.0 < row["rel_err"][bf16_out] < 8e-3


def test_cpu_check_catches_a_wrong_op(monkeypatch):
    true_fwd = rmsnorm_cases.cake_rmsnorm_train_forward

    def off_by_one_percent(*args, **kwargs):
        y, *rest = true_fwd(*args, **kwargs)
        return (y * 1.01, *rest)

    monkeypatch.setattr(rmsnorm_cases, "cake_rmsnorm_train_forward", off_by_one_percent)
    row = core.cpu_check(_rmsnorm_cases()[0], "reference")
    assert not row["ok"] and row["rel_err"]["y"] > 5e-3


@pytest.mark.parametrize("seed", [3, 17])
def test_declared_bytes_are_the_minimal_bytes(seed):
    T, H = 8 + seed, 16 * seed  # elements: x, residual, y, h_new, g, dx are bf16; w bf16; rstd and dw FP32
    expect = {
        "rmsnorm fwd": (2 * T * H) * 2 + H * 2 + T * 4,
        "add+rmsnorm fwd": (4 * T * H) * 2 + H * 2 + T * 4,
        "rmsnorm bwd": (3 * T * H) * 2 + H * 2 + T * 4 + H * 4,
        "rmsnorm bwd (fast dw)": (3 * T * H) * 2 + H * 2 + T * 4 + H * 4,
    }
    for case in _rmsnorm_cases():
        state = case.make(torch.device("cpu"), case.dtype, {"T": T, "H": H})
        assert case.nbytes(state) == expect[case.name], case.name


def _row(op, ms, peers, errors, ok=True):
    return {"family": "toy", "op": op, "shape": "T=4 H=8", "dtype": "bfloat16", "bytes": 4_000_000, "ms": ms,
            "gbps": 4_000_000 / ms / 1e6, "pct_copy": 50.0, "peers_ms": peers, "rel_err": errors,
            "tol": {k: 1e-2 for k in errors}, "ok": ok}


def test_markdown_and_json_writers(tmp_path):
    rows = [_row("a fwd", 0.5, {"torch eager": 2.0, "torch.compile": 1.0}, {"y": 1e-3}),
            _row("a bwd", 0.25, {"torch eager": 1.5, "torch.compile": None}, {"dx": float("nan")}, ok=False)]
    table = report.bench_table(rows)
    expected = ["op", "shape", "dtype", "cakeops ms", "GB/s", "% of copy", "torch eager ms", "torch.compile ms",
                "speedup vs torch.compile", "max rel err"]
    assert table[0] == expected
    md = report.write_markdown(tmp_path / "bench.md", table, ["# title"]).read_text().splitlines()
    assert md[0] == "# title"
    head = md.index("| " + " | ".join(expected) + " |")
    assert md[head + 1] == "|" + "|".join(["---"] * len(expected)) + "|"
    body = [line.strip("| ").split(" | ") for line in md[head + 2:]]
    assert [b[0] for b in body] == ["a fwd", "a bwd"]
    assert body[0][3:9] == ["0.500", "8", "50.0", "2.000", "1.000", "2.00x"]
    assert body[1][7:9] == ["-", "-"] and body[1][9].endswith("FAIL")

    payload = json.loads(report.write_json(tmp_path / "bench.json", {"copy_gbps": 16.0}, rows).read_text())
    assert payload["copy_gbps"] == 16.0 and len(payload["rows"]) == 2
    assert payload["rows"][1]["rel_err"]["dx"] is None  # NaN written as null: the file stays valid json
    assert set(payload["rows"][0]) >= {"op", "shape", "dtype", "bytes", "ms", "gbps", "pct_copy", "peers_ms"}


def test_no_peers_table_has_no_peer_columns():
    columns, cells = report.bench_table([_row("a fwd", 0.5, {}, {"y": 1e-3})])
    assert columns == ["op", "shape", "dtype", "cakeops ms", "GB/s", "% of copy", "max rel err"]
    assert len(cells[0]) == len(columns)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the command; the GPU runs the real bench")
def test_main_quick_on_cpu_exits_0(tmp_path, capsys):
    assert cli.main(["--quick", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "No CUDA device" in printed
    rows = json.loads((tmp_path / "check.json").read_text())["rows"]
    ops = [r["op"] for r in rows]
    assert [op for op in ops if op.startswith("rmsnorm") or op.startswith("add+")] == RMSNORM_OPS
    assert any(op.startswith("mhc ") for op in ops) and all(r["ok"] for r in rows)
    assert "| op | shape | dtype | path |" in (tmp_path / "check.md").read_text()


def test_main_rejects_an_unknown_family(tmp_path):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--ops", "rmsnorm,nosuchop", "--out", str(tmp_path)])
    assert exc.value.code == 2


def _wall_median_ms(fn, reps=3):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def test_bench_path_with_a_stand_in_timer(tmp_path, monkeypatch):
    """The GPU path's plumbing on CPU: do_bench and the copy ceiling replaced, tiny shapes, eager peers only."""
    monkeypatch.setattr(core, "median_ms", _wall_median_ms)
    monkeypatch.setattr(core, "copy_gbps", lambda device: 1.0)
    selected = [dataclasses.replace(c, size=c.tiny, peers={"torch eager": c.peers["torch eager"]})
                for c in _rmsnorm_cases()]
    assert cli._bench(selected, tmp_path, with_peers=True, device="cpu")
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["op"] for r in rows] == RMSNORM_OPS
    for r in rows:
        assert r["ms"] > 0 and r["peers_ms"]["torch eager"] > 0
        assert r["gbps"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)
        assert r["pct_copy"] == pytest.approx(100 * r["gbps"])
    assert "| op | shape | dtype | cakeops ms | GB/s | % of copy | torch eager ms |" in (tmp_path / "bench.md").read_text()
    assert (tmp_path / "bench.png").exists() == cli.plot.available()


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    from cakeops.bench import plot

    rows = [_row("a fwd", 0.5, {"torch eager": 2.0, "torch.compile": None}, {"y": 1e-3})]
    png = plot.bandwidth_plot(tmp_path / "bench.png", rows, 16.0)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_layer_profile_lists_the_layer_ops_and_writes_a_trace(tmp_path, capsys):
    from cakeops.bench import plot, profile

    assert profile.main(["--T", "5", "--C", "8", "--steps", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    data = json.loads((tmp_path / "layer_profile.json").read_text())
    names = [r["name"] for r in data["rows"]]
    # on a CPU the eager Functions of both nodes ran, forward and backward, once per step; on a GPU the rows
    # are kernels: the projection (forward) and kernel B (backward), once per step
    expected = (("_project_kernel", "_dx_kernel") if torch.cuda.is_available()
                else ("CakeMHCTrainPrepareFunction", "CakeMHCTrainFinishFunctionBackward"))
    for node in expected:
        assert node in names and node in out
        assert next(r for r in data["rows"] if r["name"] == node)["calls_per_step"] == 1
    assert data["wall_us_per_step"] > 0 and data["listed_us_per_step"] > 0
    assert json.loads((tmp_path / "layer_trace.json").read_text())["traceEvents"]
    with pytest.raises(SystemExit):
        profile.main(["--steps", "0", "--out", str(tmp_path)])
    if plot.available():
        assert (tmp_path / "layer_profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        # --replot draws the same picture from the JSON alone (a GPU run's, fetched elsewhere)
        again = tmp_path / "again"
        assert profile.main(["--replot", str(tmp_path / "layer_profile.json"), "--out", str(again)]) == 0
        assert (again / "layer_profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit):
        profile.main(["--replot", str(tmp_path / "missing.json"), "--out", str(tmp_path)])


def test_ncu_step_runs_one_step_inside_the_profiler_range(monkeypatch, capsys):
    from cakeops.bench import profile

    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):  # hardware counters need a GPU
            profile.main(["--ncu-step"])
        return
    seen = []
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: seen.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: seen.append("stop"))
    steps = []
    real_step = profile._layer_step
    monkeypatch.setattr(profile, "_layer_step", lambda *a: steps.append(list(seen)) or real_step(*a))
    assert profile.main(["--ncu-step", "--T", "64", "--C", "64"]) == 0
    assert seen == ["start", "stop"] and steps == [[], [], ["start"]]  # two warm-up steps outside, one inside


def test_tune_match_keeps_the_default_and_the_matching_variants():
    from cakeops._triton.mhc_backward_finish import FinishConfig
    from cakeops.bench.tune import _label, _variants, selected
    every = list(_variants(FinishConfig))
    picked = list(selected(every, "per_sm=3"))
    assert picked[0][1] == "default"
    assert len(picked) >= 2 and all("per_sm=3" in _label(cfg) for cfg, _ in picked[1:])
    assert len(picked) < len(every)
    assert list(selected(every, "")) == every


def test_tune_labels_n8_candidates_by_what_differs_from_n8s_default():
    from cakeops._triton.mhc_backward_finish import FinishConfig
    from cakeops._triton.mhc_prepare import PrepareConfig
    from cakeops.bench.tune import _label, _variants
    for cls in (FinishConfig, PrepareConfig):
        labels = [_label(cfg, 8) for cfg, name in _variants(cls, 8) if name != "default"]
        assert len(set(labels)) == len(labels)
        assert not any("streams" in label or "default config" in label for label in labels)


def test_host_tool_measures_both_paths_without_kernels(capsys):
    from cakeops._triton import mhc_backward, mhc_forward
    from cakeops.bench import host
    from cakeops import _backend
    launchers = (mhc_forward.prepare, mhc_forward.finish, mhc_backward.backward_prepare, mhc_backward.backward_finish)
    cpu_path = _backend.use_triton(torch.zeros(1))
    assert host.main(["--no-kernels", "--calls", "2", "--reps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "launchers replaced by no-ops" in lines[0]
    for path, line in zip(("eager", "compiled"), lines[1:]):
        assert line.split()[0] == path
        values = [float(v) for v in line.split("reps")[1].split()]
        assert len(values) == 2 and all(v > 0 for v in values)
    # the launchers are back, and CPU tensors take the path they took before
    assert (mhc_forward.prepare, mhc_forward.finish, mhc_backward.backward_prepare,
            mhc_backward.backward_finish) == launchers
    assert _backend.use_triton(torch.zeros(1)) == cpu_path


_FAKE_DRIVER_SCRIPT = textwrap.dedent('''
    import collections, contextlib
    from cakeops.bench import host, host_rmsnorm
    from cakeops._triton import mhc_backward, mhc_forward
    launches = collections.Counter()
    stand_in = host_rmsnorm.fake_driver
    host_rmsnorm.fake_driver = lambda: stand_in(lambda name, *args: launches.update([name]))
    launchers = (mhc_forward.prepare, mhc_forward.finish, mhc_backward.backward_prepare, mhc_backward.backward_finish)
    assert host.main(["--fake-driver", "--calls", "2", "--reps", "1"]) == 0
    assert launchers == (mhc_forward.prepare, mhc_forward.finish, mhc_backward.backward_prepare,
                         mhc_backward.backward_finish)
    print("launches", dict(launches))
''')


def test_host_tool_fake_driver_runs_the_mhc_launchers():
    """``--fake-driver``: the real launchers run (Triton's launch path too), each kernel's compiled stand-in is
    called once per layer fwd+bwd: 2 paths x (3 warm-up + 2 timed) calls."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the stand-in needs Triton's JIT
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", _FAKE_DRIVER_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert "stand-in driver" in lines[0]
    for path, line in zip(("eager", "compiled"), lines[1:3]):
        assert line.split()[0] == path and float(line.split("reps")[1]) > 0
    launches = ast.literal_eval(lines[3].split("launches ", 1)[1])
    assert launches == dict.fromkeys(
        ("_split_fn_kernel", "_project_kernel", "_gates_kernel", "_collapse_kernel", "_finish_kernel",
         "_backward_prepare_kernel", "_dpre_kernel", "_dlogits_kernel", "_params_reduce_kernel", "_dx_kernel",
         "_dfn_kernel", "_sum_partials_kernel"), 10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="kernel times come from the GPU profiler")
def test_kernel_times_are_per_call_and_named_by_kernel():
    from cakeops.bench.core import kernel_times_us

    x = torch.randn(1 << 24, device="cuda")
    once = kernel_times_us(lambda: x.mul_(1.0), reps=4)
    twice = kernel_times_us(lambda: (x.mul_(1.0), x.mul_(1.0)), reps=4)
    assert len(once) == 1 and all(us > 0 for us in once.values())
    (name, us), = once.items()
    assert twice[name] == pytest.approx(2 * us, rel=0.5)  # per call: two launches take about twice one


def test_build_check_hash_ignores_debug_info_only():
    """``build_check --sha`` compares builds before / after a change: source locations, the debug labels they
    refer to and the debug sections must not count, an instruction must."""
    from cakeops.bench.build_check import _code_sha

    code = ["\tld.global.b32 %r1, [%rd1];", "\tfma.rn.f32 %r3, %r1, %r1, %r2;", "\tret;"]
    a = "\n".join(["\t.loc 1 10 0", "$L__tmp3:", code[0], "\t.loc 1 11 5", code[1], code[2],
                   ".section .debug_info", ".b64 $L__tmp3"])
    b = "\n".join(["\t.file 2 \"other.py\"", code[0], "$L__tmp99:", "\t.loc 1 42 0", code[1], code[2],
                   ".section .debug_info", ".b64 $L__tmp99", ".b64 $L__tmp7"])
    assert _code_sha(a) == _code_sha(b)
    assert _code_sha(a) != _code_sha(a.replace("fma.rn.f32", "mul.rn.f32"))
    assert _code_sha(a) != _code_sha(a.replace("$L__tmp3:", "$L__BB0_2:"))  # a branch target is code
