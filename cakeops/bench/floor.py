"""``python -m cakeops.bench.floor``: how low mHC's cost in a training step can go, from its bytes alone.

Every mHC kernel of a layer streams [T, n, C] tensors and does little arithmetic per byte, so a layer's time is at
best its bytes at the device's copy bandwidth. This module counts those bytes per token, in *rows* (C elements of
the activations' dtype: X is n rows, U / B / dB / dU one), for three ways of building a layer:

- ``today``: the passes cakeops' kernels make (a pass per kernel, each tensor it touches once);
- ``per-op``: each of the four ops reads its inputs once and writes its outputs once (the minimal bytes that
  ``python -m cakeops bench`` rates each op against; forward_prepare and backward_finish cannot reach it, since a
  data dependence splits each into passes);
- ``every fusion``: today's passes with every cross-op fusion of docs/design.md §7 done and free: the projection
  computed on the previous layer's finish tile, backward_prepare computed on the next layer's dX tile (dY not read
  again), dfn folded into the dX pass. What is left are the passes that a data dependence forces: prepare reads X
  twice (the gates need the whole row's projection before U), the backward reads X before the branch's backward
  (dcomb) and twice after it (dpre, then dX once dlogits are known).

Against these, a plain residual layer costs ``PLAIN_RESIDUAL_ROWS`` (the add reads x and the branch's output and
writes the sum; its backward adds the residual's gradient, one more read), and an mHC model adds the stream
expansion and the mean head once (fwd + bwd, ``model_rows``). The floor of the step overhead is then
(layers x (rows - plain) + model) x T x C x itemsize / copy bandwidth, against the plain model's measured step.
The latency-bound per-token kernels (the gates' and dlogits' Sinkhorn, ~10 + 25 us a layer at T = 8192) and the
branch's own work are left out: the floor is a lower bound.
"""
import argparse
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

STRUCTURES = ("today", "per-op", "every fusion")
PLAIN_RESIDUAL_ROWS = 4


def passes(structure: str, n: int) -> List[Tuple[str, Dict[str, int]]]:
    """(pass, {tensor: rows read or written per token}) of one mHC layer with n streams, fwd + bwd."""
    x, one = n, 1
    if structure == "today":
        return [("forward_prepare: projection (_project_kernel)", {"X": x}),
                ("forward_prepare: collapse", {"X": x, "U": one}),
                ("forward_finish", {"X": x, "B": one, "Y": x}),
                ("backward_prepare", {"dY": x, "X": x, "B": one, "dB": one}),
                ("backward_finish: dpre (_dpre_kernel)", {"X": x, "dU": one}),
                ("backward_finish: dX (_dx_kernel)", {"X": x, "dY": x, "dU": one, "dX": x}),
                ("backward_finish: dfn (_dfn_kernel)", {"X": x})]
    if structure == "per-op":
        return [("forward_prepare", {"X": x, "U": one}),
                ("forward_finish", {"X": x, "B": one, "Y": x}),
                ("backward_prepare", {"dY": x, "X": x, "B": one, "dB": one}),
                ("backward_finish", {"X": x, "dY": x, "dU": one, "dX": x})]
    if structure == "every fusion":
        return [("forward_prepare: projection, on the previous finish's tile", {}),
                ("forward_prepare: collapse", {"X": x, "U": one}),
                ("forward_finish", {"X": x, "B": one, "Y": x}),
                ("backward_prepare, on the next layer's dX tile", {"X": x, "B": one, "dB": one}),
                ("backward_finish: dpre", {"X": x, "dU": one}),
                ("backward_finish: dX with dfn", {"X": x, "dY": x, "dU": one, "dX": x})]
    raise ValueError(f"structure: {structure!r}; known: {', '.join(STRUCTURES)}")


def layer_rows(structure: str, n: int) -> int:
    """Rows per token one mHC layer moves, forward + backward."""
    return sum(sum(touched.values()) for _, touched in passes(structure, n))


def model_rows(n: int) -> int:
    """Rows per token of the stream expansion (writes n rows from one; backward sums them) and the mean head
    (reads n, writes one; backward the reverse), once per model."""
    return 4 * (n + 1)


def overhead_ms(structure: str, n: int, layers: int, tokens: int, dim: int, itemsize: int, copy_gbps: float) -> float:
    """The step time mHC adds over plain residual if every pass ran at the copy bandwidth."""
    rows = layers * (layer_rows(structure, n) - PLAIN_RESIDUAL_ROWS) + model_rows(n)
    return rows * tokens * dim * itemsize / (copy_gbps * 1e6)


def rows_allowed(goal_pct: float, plain_ms: float, n: int, layers: int, tokens: int, dim: int, itemsize: int,
                 copy_gbps: float) -> float:
    """Rows per token an mHC layer may move, forward + backward, for the overhead to stay within ``goal_pct``
    at the copy bandwidth."""
    budget = goal_pct / 100.0 * plain_ms * copy_gbps * 1e6 / (tokens * dim * itemsize)
    return (budget - model_rows(n)) / layers + PLAIN_RESIDUAL_ROWS


def floors(plain_ms: float, n: int, layers: int, tokens: int, dim: int, itemsize: int, copy_gbps: float,
           goal_pct: Optional[float] = None) -> Dict[str, object]:
    """The overhead floor of each structure (ms and % of the plain step) and, with a goal, the rows it allows."""
    out: Dict[str, object] = {"plain_ms": plain_ms, "copy_gbps": copy_gbps, "layers": layers, "n": n}
    for s in STRUCTURES:
        ms = overhead_ms(s, n, layers, tokens, dim, itemsize, copy_gbps)
        out[s] = {"rows": layer_rows(s, n), "ms": ms, "pct": 100.0 * ms / plain_ms}
    if goal_pct is not None:
        out["goal_pct"] = goal_pct
        out["rows_allowed"] = rows_allowed(goal_pct, plain_ms, n, layers, tokens, dim, itemsize, copy_gbps)
    return out


# The step-cost goals of the model benchmark's two configs, % over plain residual.
GOALS = {"c2048": 10.0, "c4096": 5.0}


def for_config(config: Mapping[str, int], plain_ms: float, copy_gbps: float, itemsize: int,
               goal_pct: Optional[float] = None):
    """``floors`` for a bench model config (``model_zoo.Config.as_dict()``): two mHC layers a block, B x S tokens."""
    return floors(plain_ms, config["streams"], 2 * config["blocks"], config["batch"] * config["seq"], config["dim"],
                  itemsize, copy_gbps, goal_pct)


def table_rows(label: str, f: Dict[str, object], measured_pct: Optional[float] = None) -> List[str]:
    cells = [label, f"{f['plain_ms']:.2f}", f"{f['copy_gbps']:.0f}",
             "—" if measured_pct is None else f"{measured_pct:+.1f} %"]
    cells += [f"{f[s]['rows']}: {f[s]['pct']:+.1f} %" for s in STRUCTURES]
    cells.append(f"{f['goal_pct']:.0f} % → {f['rows_allowed']:.1f}" if "goal_pct" in f else "—")
    return cells


HEADER = ["config", "plain ms", "copy GB/s", "measured"] + [f"{s} (rows: floor)" for s in STRUCTURES] + \
    ["goal → rows allowed"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cakeops.bench.floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="c2048,c4096", help="model configs of bench model (default c2048,c4096)")
    p.add_argument("--plain-ms", required=True,
                   help="the plain residual model's measured step, ms, one per preset (comma-separated)")
    p.add_argument("--copy-gbps", type=float, default=None,
                   help="the copy bandwidth (read + write bytes); measured on the GPU when not given")
    p.add_argument("--goal", default=None, help="overhead goals, %%, one per preset (default: c2048 10, c4096 5)")
    p.add_argument("--measured", default=None, help="measured overheads, %%, one per preset (optional)")
    p.add_argument("--itemsize", type=int, default=2, help="bytes per element of the activations (default 2: bf16)")
    return p


def _floats(text: Optional[str], count: int, name: str, parser) -> List[Optional[float]]:
    if text is None:
        return [None] * count
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        parser.error(f"{name}: expected comma-separated numbers, got {text!r}")
    if len(values) != count:
        parser.error(f"{name}: {len(values)} values for {count} presets")
    return values


def main(argv: Optional[Sequence[str]] = None) -> int:
    from .model_zoo import PRESETS
    from . import report

    parser = _parser()
    opts = parser.parse_args(argv)
    names = [s.strip() for s in opts.preset.split(",") if s.strip()]
    unknown = [s for s in names if s not in PRESETS]
    if unknown:
        parser.error(f"--preset: unknown {', '.join(unknown)}; known: {', '.join(PRESETS)}")
    plain = _floats(opts.plain_ms, len(names), "--plain-ms", parser)
    goals = _floats(opts.goal, len(names), "--goal", parser) if opts.goal else [GOALS.get(s) for s in names]
    measured = _floats(opts.measured, len(names), "--measured", parser)
    copy = opts.copy_gbps
    if copy is None:
        import torch

        if not torch.cuda.is_available():
            parser.error("--copy-gbps: needed without a GPU (on one it is measured)")
        from .core import copy_gbps
        copy = copy_gbps(torch.device("cuda"))
    cells = []
    for name, p_ms, goal, meas in zip(names, plain, goals, measured):
        cfg = PRESETS[name]
        cells.append(table_rows(f"{name} ({cfg.label})", for_config(cfg.as_dict(), p_ms, copy, opts.itemsize, goal),
                                meas))
    print(report.text((HEADER, cells)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
