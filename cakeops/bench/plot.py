"""The bench as a PNG: minimal-bytes bandwidth per op and shape, cakeops beside its peers, under the copy ceiling."""
import importlib.util
from pathlib import Path
from typing import Any, Mapping, Sequence

from .core import gbps
from .report import peer_names


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def bandwidth_plot(path: Path, rows: Sequence[Mapping[str, Any]], ceiling_gbps: float) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a GPU host
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
