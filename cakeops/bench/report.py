"""Rows of measurements as tables: cells for the terminal and markdown, raw numbers as json."""
import json
import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

COMPILE_PEER = "torch.compile"

Table = Tuple[List[str], List[List[str]]]  # (column names, rows of cells)


def _fmt(v: Optional[float], spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _errors(row: Mapping[str, Any]) -> str:
    # The worst output decides; a failing row is marked so it cannot be missed in a long table.
    worst = max(row["rel_err"].values()) if row["rel_err"] else float("nan")
    return _fmt(worst, ".1e") + ("" if row["ok"] else " FAIL")


def peer_names(rows: Sequence[Mapping[str, Any]]) -> List[str]:
    return list(dict.fromkeys(name for row in rows for name in row["peers_ms"]))


def bench_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    peers = peer_names(rows)
    columns = ["op", "shape", "dtype", "cakeops ms", "GB/s", "% of copy"] + [f"{p} ms" for p in peers]
    if COMPILE_PEER in peers:
        columns.append(f"speedup vs {COMPILE_PEER}")
    columns.append("max rel err")
    cells = []
    for row in rows:
        line = [row["op"], row["shape"], row["dtype"], _fmt(row["ms"], ".3f"), _fmt(row["gbps"], ".0f"),
                _fmt(row["pct_copy"], ".1f")]
        line += [_fmt(row["peers_ms"].get(p), ".3f") for p in peers]
        if COMPILE_PEER in peers:
            compiled = row["peers_ms"].get(COMPILE_PEER)
            line.append("-" if compiled is None else f"{compiled / row['ms']:.2f}x")
        line.append(_errors(row))
        cells.append(line)
    return columns, cells


def check_table(rows: Sequence[Mapping[str, Any]]) -> Table:
    columns = ["op", "shape", "dtype", "path", "rel err per output", "ok"]
    cells = [[row["op"], row["shape"], row["dtype"], row["path"],
              ", ".join(f"{k} {v:.1e} (tol {row['tol'][k]:.0e})" for k, v in row["rel_err"].items()),
              "ok" if row["ok"] else "FAIL"] for row in rows]
    return columns, cells


def text(table: Table) -> str:
    columns, cells = table
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(line.rstrip() for line in lines)


def markdown(table: Table, header: Sequence[str] = ()) -> str:
    columns, cells = table
    lines = list(header) + ([""] if header else [])
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "|".join("---" for _ in columns) + "|")
    lines += ["| " + " | ".join(r) + " |" for r in cells]
    return "\n".join(lines) + "\n"


def write_markdown(path: Path, table: Table, header: Sequence[str] = ()) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(markdown(table, header))
    return path


def write_json(path: Path, meta: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload: Dict[str, Any] = dict(meta)
    payload["rows"] = list(rows)
    # NaN is not json: a NaN error (a broken op) is written as null.
    path.write_text(json.dumps(_nulls(payload), indent=2, default=str, allow_nan=False))
    return path


def _nulls(v: Any) -> Any:
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, Mapping):
        return {k: _nulls(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_nulls(x) for x in v]
    return v
