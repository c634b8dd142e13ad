"""The bench as PNGs: minimal-bytes bandwidth per op and shape (cakeops beside its peers, under the copy ceiling),
and where one mHC layer's step spends its time (bench.profile)."""
import importlib.util
from pathlib import Path
from typing import Any, Mapping, Sequence

from .core import gbps
from .report import peer_names


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a GPU host
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> Path:
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    fig.clf()
    _pyplot().close(fig)
    return path


def bandwidth_plot(path: Path, rows: Sequence[Mapping[str, Any]], ceiling_gbps: float) -> Path:
    plt = _pyplot()
    # A peer's bandwidth counts the same minimal bytes as the op, so the bars compare times directly.
    series = {"cakeops": [row["gbps"] for row in rows]}
    for peer in peer_names(rows):
        series[peer] = [0.0 if row["peers_ms"].get(peer) is None else gbps(row["bytes"], row["peers_ms"][peer])
                        for row in rows]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 2), 4.5))
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(rows))], values, width, label=label)
    ax.axhline(ceiling_gbps, color="black", linestyle="--", linewidth=1, label=f"copy {ceiling_gbps:.0f} GB/s")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"{row['op']}\n{row['shape']}" for row in rows], fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("minimal-bytes bandwidth (GB/s)")
    # Head room above the ceiling line for the legend, so neither hides the other.
    ax.set_ylim(0, 1.25 * max([ceiling_gbps] + [v for values in series.values() for v in values]))
    ax.legend(fontsize=8, loc="upper center", ncol=len(series) + 1)
    return _save(fig, path)


def profile_plot(path: Path, result: Mapping[str, Any], top: int = 14) -> Path:
    """Horizontal bars: time per step of each kernel (or CPU op) of bench.profile's result, the largest on top,
    and on a GPU the rest of the step's wall time as one more bar."""
    plt = _pyplot()
    rows = list(result["rows"][:top])
    names = [r["name"] if len(r["name"]) <= 40 else r["name"][:37] + "..." for r in rows]
    times = [r["us_per_step"] for r in rows]
    on_gpu = str(result["device"]).startswith("cuda")
    rest = result["wall_us_per_step"] - result["listed_us_per_step"]
    if on_gpu and rest > 0:
        names.append("(not kernel time)")
        times.append(rest)
    fig, ax = plt.subplots(figsize=(8.0, 0.35 * len(names) + 1.6))
    bars = ax.barh(range(len(names)), times, color=["C0"] * len(rows) + ["C7"] * (len(names) - len(rows)))
    ax.bar_label(bars, labels=[f"{t:.0f}" for t in times], fontsize=7, padding=2)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("us per step" + (" (GPU time)" if on_gpu else " (self CPU time)"))
    ax.set_title(f"mHC layer fwd+bwd, T={result['T']} C={result['C']}: {result['wall_us_per_step']:.0f} us per step"
                 f" ({result['device']})", fontsize=9)
    ax.set_xlim(0, 1.12 * max(times))
    return _save(fig, path)
