"""`python -m cakeops bench [--quick] [--ops rmsnorm,mhc] [--out DIR] [--no-peers]`; `python -m cakeops bench model ...`.

On a CUDA device: times every selected case and its peers, prints the table and writes OUT/bench.md,
OUT/bench.json and (with matplotlib) OUT/bench.png. Without one: checks every case at a tiny size on
CPU against its fp64 oracle -- through the Triton interpreter when TRITON_INTERPRET=1 was set before
triton was imported, else through the CPU (reference) path -- and writes OUT/check.md, OUT/check.json.
Exits 1 when any op is outside its error tolerance.

`python -m cakeops bench model [--preset c2048,c4096|issue] ...` (``bench/model.py``; its ``--help`` lists the
flags): one training step of a Llama-like decoder, plain residual against the mHC variants.

`python -m cakeops bench deepseek-v4 [--hidden 2048,4096] [--layers N] [--seq S] [--steps N] [--rows ...] [--out
DIR]` (``bench/deepseek_v4.py``): one training step of Hugging Face's DeepSeek-V4, HF eager / compiled / + Liger
against the model patched with cakeops (and + stream recompute).
"""
import argparse
import datetime
import platform
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch

from .. import _backend
from . import core, plot, report
from .console import progress, say


def _parser(known: Sequence[str]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cakeops bench", description=__doc__.split("\n\n")[1],
                                epilog="python -m cakeops bench model --help: the model benchmark (a decoder's "
                                       "training step, plain residual vs mHC); python -m cakeops bench deepseek-v4 "
                                       "--help: Hugging Face's DeepSeek-V4, HF vs Liger vs cakeops")
    p.add_argument("--quick", action="store_true", help="only the first shape of each op")
    p.add_argument("--ops", default=",".join(known), help=f"comma-separated op families (default: {','.join(known)})")
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="directory for the reports (default bench_out)")
    p.add_argument("--no-peers", action="store_true", help="time cakeops only (no torch eager/compile/Liger)")
    return p


def _environment() -> Dict[str, Any]:
    import triton

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version()}


def _bench(selected: List[core.Case], out: Path, with_peers: bool, device=torch.device("cuda")) -> bool:
    device = torch.device(device)
    env = dict(_environment(), device=torch.cuda.get_device_name(device) if device.type == "cuda" else str(device))
    print(f"{env['device']}: measuring the copy ceiling (2 GiB bf16 device-to-device copy)...", flush=True)
    ceiling = core.copy_gbps(device)
    print(f"copy ceiling: {ceiling:.0f} GB/s", flush=True)
    rows = [core.measure(case, device, ceiling, with_peers, warn=say)
            for case in progress(selected, lambda c: f"{c.name} [{c.shape_label}]")]
    table = report.bench_table(rows)
    header = [f"# cakeops bench -- {env['device']}", "",
              f"{env['date']}, torch {env['torch']}, triton {env['triton']}; copy ceiling {ceiling:.0f} GB/s. "
              "Times: median of triton.testing.do_bench; GB/s: minimal bytes (every input read once, "
              "every output written once) / time."]
    print(report.text(table))
    written = [report.write_markdown(out / "bench.md", table, header),
               report.write_json(out / "bench.json", dict(env, copy_gbps=ceiling), rows)]
    notes = [f"- {row['op']} [{row['shape']}]: {name}: {value}"
             for row in rows for name, value in row.get("notes", {}).items()]
    if notes:
        print("\n".join(notes))
        with open(out / "bench.md", "a") as f:
            f.write("\n## Notes\n\n" + "\n".join(notes) + "\n")
    if plot.available():
        written.append(plot.bandwidth_plot(out / "bench.png", rows, ceiling))
    print("wrote " + ", ".join(str(p) for p in written))
    return all(row["ok"] for row in rows)


def _check(selected: List[core.Case], out: Path) -> bool:
    interpreting = _backend.interpreting()
    path = "triton interpreter" if interpreting else "reference (CPU path)"
    print(f"No CUDA device present: checking each op at a tiny size on CPU ({path}) against its fp64 oracle.")
    if not interpreting:
        print("(Set TRITON_INTERPRET=1 before starting to run the Triton kernels themselves through the interpreter.)")
    # The tiny size is the same for every shape of an op: check each op once.
    unique: Dict[Any, core.Case] = {}
    for case in selected:
        unique.setdefault((case.family, case.name), case)
    kernels = "triton" if interpreting else "reference"
    with _backend.cpu_kernels(kernels):
        rows = [core.cpu_check(case, path, tol_scale=2.0 if interpreting else 1.0)
                for case in progress(list(unique.values()), lambda c: c.name)]
    table = report.check_table(rows)
    print(report.text(table))
    env = dict(_environment(), device="cpu")
    written = [report.write_markdown(out / "check.md", table, [f"# cakeops CPU check -- {env['date']}"]),
               report.write_json(out / "check.json", env, rows)]
    print("wrote " + ", ".join(str(p) for p in written))
    return all(row["ok"] for row in rows)


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is not None and list(argv[:1]) == ["model"]:
        from .model import main as model_main

        return model_main(list(argv[1:]))
    if argv is not None and list(argv[:1]) == ["deepseek-v4"]:
        from .deepseek_v4 import main as deepseek_v4_main

        return deepseek_v4_main(list(argv[1:]))
    core.load_families()
    known = core.families()
    parser = _parser(known)
    args = parser.parse_args(argv)
    wanted = [f.strip() for f in args.ops.split(",") if f.strip()]
    unknown = [f for f in wanted if f not in known]
    if unknown or not wanted:
        parser.error(f"--ops: unknown family {', '.join(unknown) or '(none given)'}; registered: {', '.join(known)}")
    selected = core.cases(wanted, quick=args.quick)
    if torch.cuda.is_available():
        ok = _bench(selected, args.out, with_peers=not args.no_peers)
    else:
        ok = _check(selected, args.out)
    if not ok:
        print("FAIL: some op is outside its error tolerance (see the rel err column).")
    return 0 if ok else 1
