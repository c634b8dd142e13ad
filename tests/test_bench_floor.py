"""`python -m cakeops.bench.floor`: the byte floors of mHC's step cost, and their table in `bench model`."""
import random

import pytest
import torch

from cakeops.bench import floor
from cakeops.bench import model as bench_model
from cakeops.bench.model_zoo import PRESETS


@pytest.mark.parametrize("n", [2, 4, 8])
def test_layer_rows_count_each_pass_by_hand(n):
    # today: projection X; collapse X + U; finish X + B + Y; backward_prepare dY + X + B + dB; dpre X + dU;
    # dX X + dY + dU + dX; dfn X
    assert floor.layer_rows("today", n) == n + (n + 1) + (2 * n + 1) + (2 * n + 2) + (n + 1) + (3 * n + 1) + n
    # each op once: prepare X + U, finish X + B + Y, backward_prepare dY + X + B + dB, backward_finish X + dY + dU + dX
    assert floor.layer_rows("per-op", n) == 8 * n + 5
    # every fusion: the projection and backward_prepare's dY read gone, dfn inside the dX pass; dpre's pass stays
    assert floor.layer_rows("every fusion", n) == floor.layer_rows("today", n) - 3 * n
    with pytest.raises(ValueError, match="structure"):
        floor.layer_rows("fused", n)


def test_overhead_is_the_extra_rows_at_the_copy_bandwidth():
    rng = random.Random()
    n, layers, T, C, itemsize = 4, rng.randint(2, 40), rng.choice([4096, 8192]), rng.choice([1024, 2048]), 2
    gbps = rng.uniform(2000, 5000)
    rows = layers * (50 - 4) + 4 * (n + 1)  # today's 50 a layer less plain's 4, plus expansion and head
    expected_ms = rows * T * C * itemsize / gbps / 1e6
    assert floor.overhead_ms("today", n, layers, T, C, itemsize, gbps) == pytest.approx(expected_ms, rel=1e-12)


def test_rows_allowed_is_the_inverse_of_the_overhead():
    rng = random.Random()
    cfg = PRESETS["c2048"]
    plain_ms, gbps, goal = rng.uniform(15, 40), rng.uniform(2000, 5000), rng.uniform(3, 20)
    f = floor.for_config(cfg.as_dict(), plain_ms, gbps, 2, goal)
    layers, T = 2 * cfg.blocks, cfg.batch * cfg.seq
    # a layer moving exactly the allowed rows costs exactly the goal
    rows = layers * (f["rows_allowed"] - floor.PLAIN_RESIDUAL_ROWS) + floor.model_rows(cfg.streams)
    assert 100 * rows * T * cfg.dim * 2 / (gbps * 1e6) / plain_ms == pytest.approx(goal, rel=1e-9)
    for s in floor.STRUCTURES:
        assert f[s]["pct"] == pytest.approx(100 * f[s]["ms"] / plain_ms)
    assert f["today"]["pct"] > f["every fusion"]["pct"] > f["per-op"]["pct"] > 0


def test_cli_prints_a_row_per_preset(capsys):
    assert floor.main(["--preset", "c2048,c4096", "--plain-ms", "27.3,45.0", "--copy-gbps", "3000",
                       "--measured", "16.8,10.7"]) == 0
    out = capsys.readouterr().out
    assert "c2048 (C=2048" in out and "c4096 (C=4096" in out
    assert "50: +15.9 %" in out and "38: +12.0 %" in out and "10 % → 32.0" in out and "+16.8 %" in out


def test_cli_errors_in_the_users_terms(capsys):
    with pytest.raises(SystemExit):
        floor.main(["--preset", "c2048,c4096", "--plain-ms", "27.3", "--copy-gbps", "3000"])
    assert "--plain-ms: 1 values for 2 presets" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        floor.main(["--preset", "c9999", "--plain-ms", "1", "--copy-gbps", "3000"])
    assert "unknown c9999" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        floor.main(["--preset", "c2048", "--plain-ms", "27.3ms", "--copy-gbps", "3000"])
    assert "--plain-ms: expected comma-separated numbers, got '27.3ms'" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):
            floor.main(["--preset", "c2048", "--plain-ms", "27.3"])
        assert "needed without a GPU" in capsys.readouterr().err


def test_bench_model_floor_table_sits_beside_the_measured_overhead():
    cfg = PRESETS["c4096"]
    rows = [{"variant": "plain", "status": "ok", "step_ms": 45.0, "overhead_pct": 0.0},
            {"variant": "cakeops", "status": "ok", "step_ms": 49.8, "overhead_pct": 10.67}]
    results = [{"preset": "c4096", "rows": rows, "config": cfg.as_dict(),
                "floor": floor.for_config(cfg.as_dict(), 45.0, 3000.0, 2, floor.GOALS["c4096"])}]
    header, cells = bench_model.floor_table(results)
    assert header == floor.HEADER and len(cells) == 1
    assert cells[0][:4] == ["c4096", "45.00", "3000", "+10.7 %"] and cells[0][-1] == "5 % → 24.1"


def test_bench_model_adds_floors_at_the_copy_bandwidth_it_measures(monkeypatch):
    from cakeops.bench import core

    monkeypatch.setattr(core, "copy_gbps", lambda device: 3000.0)
    cfg = PRESETS["c2048"]
    with_plain = {"preset": "c2048", "config": cfg.as_dict(),
                  "rows": [{"variant": "plain", "status": "ok", "step_ms": 27.3}]}
    without = {"preset": "c4096", "config": PRESETS["c4096"].as_dict(), "rows": [{"variant": "plain", "status": "failed"}]}
    bench_model.add_floors([with_plain, without], torch.device("cpu"), torch.bfloat16)
    assert "floor" not in without
    f = with_plain["floor"]
    assert f["copy_gbps"] == 3000.0 and f["goal_pct"] == 10.0
    assert f["today"]["pct"] == pytest.approx(100 * floor.overhead_ms("today", 4, 8, 8192, 2048, 2, 3000.0) / 27.3)


def test_step_plot_marks_the_floors_on_the_cakeops_bar(tmp_path):
    pytest.importorskip("matplotlib")
    cfg = PRESETS["c2048"]
    rows = [{"variant": "plain", "status": "ok", "step_ms": 27.3, "overhead_pct": 0.0},
            {"variant": "cakeops", "status": "ok", "step_ms": 31.9, "overhead_pct": 16.8}]
    results = [{"preset": "c2048", "rows": rows, "config": dict(cfg.as_dict(), label=cfg.label),
                "floor": floor.for_config(cfg.as_dict(), 27.3, 3000.0, 2, 10.0)}]
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt
    drawn = []
    real = plt.Axes.hlines
    def spy(self, y, *args, **kwargs):
        drawn.append((round(float(y), 3), kwargs.get("label")))
        return real(self, y, *args, **kwargs)
    plt.Axes.hlines = spy
    try:
        path = bench_model.step_time_plot(tmp_path / "model.png", results, ["plain", "cakeops"], "t")
    finally:
        plt.Axes.hlines = real
    assert path.exists()
    f = results[0]["floor"]
    assert drawn == [(round(27.3 + f["today"]["ms"], 3), "byte floor, today's passes"),
                     (round(27.3 + f["every fusion"]["ms"], 3), "byte floor, every fusion"),
                     (round(27.3 * 1.1, 3), "goal")]
