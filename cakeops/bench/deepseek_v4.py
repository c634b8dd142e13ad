"""``python -m cakeops bench deepseek-v4``: one training step of Hugging Face's DeepSeek-V4, HF's own against
cakeops (``cakeops.transformers.apply_cakeops_to_deepseek_v4``) and Liger-Kernel's V4 patch.

The model: a random ``DeepseekV4ForCausalLM`` (no download) at a realistic width (``--hidden``, 2048 and 4096 by
default) with a few decoder layers (``--layers``, a CSA and an HCA layer, the first MoE hash-routed), sequence
``--seq`` 4096, batch 1, in HF's ``from_pretrained(dtype=bfloat16)`` layout (hyper-connection and norm weights
FP32, the rest bf16). The MoE (16 experts, top 4) and vocabulary (32000) are smaller than the released model's so
that every row fits one 80 GB GPU; attention, compressors and indexer have V4's shapes (head_dim 512, sliding
window 128, compress rates 4 / 128).

Rows (``--rows``; run one after the other in this process, each built, timed and freed on its own):
``hf-eager``, ``hf-compile`` (``torch.compile(model, fullgraph=True)``), ``hf-liger`` (Liger's
``apply_liger_kernel_to_deepseek_v4``: fused linear cross-entropy and layer norms, eager; skipped with a note when
liger-kernel is not importable), ``cakeops`` (patched, compiled), ``cakeops-recompute`` (+ ``recompute=True``) and,
on request, ``cakeops-eager``. Per row: the step time (median of ``--steps`` steps after a warmup step), the
first step's time less one step (the cold compile time of compiled rows), and the peak memory above the weights
(``torch.cuda.max_memory_allocated`` over the timed steps, less what was allocated before them).

Without CUDA: a quick smoke run on CPU (the tiny config, ``aot_eager``, one step per row) that checks every row
runs forward and backward with a finite loss; CPU timings are not performance numbers.
Writes OUT/deepseek_v4.md and OUT/deepseek_v4.json. Exits 1 when a row fails.
"""
import argparse
import datetime
import gc
import math
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

import torch

from . import report
from .console import say
from .model import _first_line, _heartbeat, _steps_progress

ROWS = {"hf-eager": "HF eager", "hf-compile": "HF torch.compile", "hf-liger": "HF + Liger V4 patch (eager)",
        "cakeops": "HF + cakeops, torch.compile", "cakeops-recompute": "HF + cakeops + recompute, torch.compile",
        "cakeops-eager": "HF + cakeops, eager"}
DEFAULT_ROWS = ["hf-eager", "hf-compile", "hf-liger", "cakeops", "cakeops-recompute"]


def config(hidden: int, layers: int, tiny: bool = False):
    """A V4-shaped config: V4's attention shapes, a reduced MoE and vocabulary (module docstring)."""
    from transformers import DeepseekV4Config

    kinds = ["compressed_sparse_attention", "heavily_compressed_attention"]
    layer_types = [kinds[i % 2] for i in range(layers)]
    mlp_types = ["hash_moe"] + ["moe"] * (layers - 1)
    if tiny:  # research/hf_deepseek_v4.md's tiny CPU config
        return DeepseekV4Config(
            vocab_size=256, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=1,
            head_dim=32, q_lora_rank=32, o_groups=2, o_lora_rank=16, moe_intermediate_size=32, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, index_n_heads=2, index_head_dim=16, index_topk=4,
            sliding_window=16, compress_rates={kinds[0]: 4, kinds[1]: 8}, layer_types=layer_types,
            mlp_layer_types=mlp_types, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, use_cache=False)
    return DeepseekV4Config(
        vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
        num_key_value_heads=1, head_dim=512, q_lora_rank=hidden // 4, o_groups=8, o_lora_rank=hidden // 4,
        moe_intermediate_size=hidden // 2, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
        index_n_heads=16, index_head_dim=128, index_topk=512, sliding_window=128,
        compress_rates={kinds[0]: 4, kinds[1]: 128}, layer_types=layer_types, mlp_layer_types=mlp_types,
        max_position_embeddings=max(8192, 2 * hidden), bos_token_id=0, eos_token_id=1, use_cache=False)


def build(cfg, device: torch.device, dtype: torch.dtype, seed: int):
    """The random model in HF's from_pretrained(dtype=...) layout: ``_keep_in_fp32_modules_strict`` FP32."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = DeepseekV4ForCausalLM(cfg)
    model.to(dtype)
    if dtype != torch.float32:
        keep = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
        with torch.no_grad():
            for name, p in model.named_parameters():
                if any(k in name.split(".") for k in keep):
                    p.data = p.data.float()
    return model.train()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _patch(row: str, model) -> Optional[str]:
    """Applies the row's patch to ``model``; returns a reason to skip the row, else None."""
    if row == "hf-liger":
        try:
            from liger_kernel.transformers import apply_liger_kernel_to_deepseek_v4
        except ImportError as exc:
            return f"liger-kernel not importable ({_first_line(exc)})"
        if next(model.parameters()).device.type != "cuda":
            return "Liger's kernels need CUDA"
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as modeling

        norm = modeling.DeepseekV4RMSNorm
        try:
            apply_liger_kernel_to_deepseek_v4(model=model)
        finally:
            modeling.DeepseekV4RMSNorm = norm  # its class-level norm swap would leak into the next rows' models
    elif row.startswith("cakeops"):
        from ..transformers import apply_cakeops_to_deepseek_v4

        apply_cakeops_to_deepseek_v4(model, recompute=row == "cakeops-recompute")
    return None


def run_row(row: str, cfg, opts, device: torch.device, dtype: torch.dtype) -> Dict[str, Any]:
    out: Dict[str, Any] = {"row": row, "title": ROWS[row], "status": "ok"}
    model = fn = None
    try:
        say(f"  {row}: building the model")
        model = build(cfg, device, dtype, opts.seed)
        skip = _patch(row, model)
        if skip:
            out.update(status=skip, skipped=True)
            return out
        compiled = row in ("hf-compile", "cakeops", "cakeops-recompute")
        torch._dynamo.reset()
        fn = torch.compile(model, fullgraph=True, backend=opts.backend) if compiled else model
        gen = torch.Generator().manual_seed(opts.seed)
        ids = torch.randint(0, cfg.vocab_size, (opts.batch, opts.seq), generator=gen).to(device)

        def step():
            model.zero_grad(set_to_none=True)
            loss = fn(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            return loss

        _sync(device)
        weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        say(f"  {row}: first step" + (f" (compiling with {opts.backend})" if compiled else ""))
        t0 = time.perf_counter()
        with _heartbeat(row):
            loss = step()
            _sync(device)
        first_s = time.perf_counter() - t0
        out["loss"] = loss.item()
        del loss
        if not math.isfinite(out["loss"]):
            raise FloatingPointError(f"the first step's loss is {out['loss']}")
        for _ in range(opts.warmup):
            step()
        if device.type == "cuda":
            model.zero_grad(set_to_none=True)
            _sync(device)
            weights = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in _steps_progress(opts.steps, f"{row} timed"):
            _sync(device)
            t = time.perf_counter()
            step()
            _sync(device)
            times.append(1e3 * (time.perf_counter() - t))
        out["step_ms"] = statistics.median(times)
        out["step_ms_all"] = times
        out["tokens_per_s"] = opts.batch * opts.seq / (out["step_ms"] / 1e3)
        out["first_step_s"] = first_s
        out["compile_s"] = max(0.0, first_s - out["step_ms"] / 1e3) if compiled else None
        out["params"] = sum(p.numel() for p in model.parameters())
        if device.type == "cuda":
            out["weights_gib"] = weights / 2 ** 30
            out["peak_above_weights_gib"] = (torch.cuda.max_memory_allocated(device) - weights) / 2 ** 30
    except torch.cuda.OutOfMemoryError as exc:
        out["status"] = f"out of memory ({_first_line(exc)[:120]})"
    except Exception as exc:  # one row failing must not take the others down
        out["status"] = f"error: {_first_line(exc)}"
    finally:
        del model, fn
        gc.collect()
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def table(results: Sequence[Dict[str, Any]]) -> report.Table:
    columns = ["hidden", "row", "step ms", "vs HF compile", "compile s", "peak above weights GiB",
               "vs HF compile (mem)", "first loss", "status"]
    cells = []
    for res in results:
        ref = next((r for r in res["rows"] if r["row"] == "hf-compile" and r["status"] == "ok"), None)
        for r in res["rows"]:
            ok = r["status"] == "ok"
            speed = (f"{ref['step_ms'] / r['step_ms']:.2f}x" if ok and ref else "-")
            mem = r.get("peak_above_weights_gib")
            mem_ref = ref.get("peak_above_weights_gib") if ref else None
            cells.append([str(res["hidden"]), r["title"], _fmt(r.get("step_ms"), ".1f"), speed,
                          _fmt(r.get("compile_s"), ".1f"), _fmt(mem, ".2f"),
                          f"{100 * (mem / mem_ref - 1):+.0f} %" if mem is not None and mem_ref else "-",
                          _fmt(r.get("loss"), ".4f"), r["status"]])
    return columns, cells


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cakeops bench deepseek-v4", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", default="2048,4096", help="comma-separated hidden sizes (default 2048,4096)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default 2: one CSA, one HCA)")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per row, after the first and --warmup (5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (default 1)")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated rows, of {', '.join(ROWS)}")
    p.add_argument("--backend", default=None, help="torch.compile backend (default inductor; aot_eager on CPU)")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu (the smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="directory for the reports (bench_out)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = _parser()
    opts = parser.parse_args(argv)
    rows = list(dict.fromkeys(r.strip() for r in opts.rows.split(",") if r.strip()))
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        parser.error(f"--rows: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(ROWS)}")
    if opts.steps < 1 or opts.warmup < 0 or opts.layers < 1:
        parser.error("--steps and --layers: expected >= 1; --warmup: expected >= 0")
    try:
        hidden = [int(h) for h in opts.hidden.split(",") if h.strip()]
    except ValueError:
        parser.error(f"--hidden: expected comma-separated ints, got {opts.hidden!r}")
    try:
        import transformers  # noqa: F401
        from transformers import DeepseekV4Config  # noqa: F401
    except ImportError as exc:
        print(f"python -m cakeops bench deepseek-v4 needs transformers >= 5.23 ({_first_line(exc)}): "
              f"pip install -e \".[transformers]\"")
        return 1
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    tiny = not cuda
    if tiny:  # the smoke run: the tiny config, one step per row
        hidden, opts.seq, opts.batch = [64], 32, 2
        opts.steps, opts.warmup = 1, 0
        print("No CUDA device: a quick CPU smoke run (the tiny config, aot_eager, one step per row) that checks "
              "every row trains. CPU timings are not performance numbers.", flush=True)
    opts.backend = opts.backend or ("inductor" if cuda else "aot_eager")
    dtype = torch.bfloat16
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name(device) if cuda else f"CPU ({platform.machine()})"}
    print(f"cakeops bench deepseek-v4 on {env['device']}: torch {env['torch']}, transformers "
          f"{env['transformers']}; bf16 (HF's mixed layout), batch {opts.batch}, seq {opts.seq}, "
          f"{opts.layers} layers; compiled rows: torch.compile({opts.backend}, fullgraph=True)", flush=True)
    results = []
    for h in hidden:
        cfg = config(h, opts.layers, tiny=tiny)
        print(f"== hidden {h} ==", flush=True)
        res = {"hidden": h, "config": {k: getattr(cfg, k) for k in ("hidden_size", "num_hidden_layers",
                                                                    "num_attention_heads", "head_dim",
                                                                    "n_routed_experts", "vocab_size", "hc_mult")},
               "rows": []}
        for i, row in enumerate(rows, 1):
            say(f"[{i}/{len(rows)}] {ROWS[row]}")
            r = run_row(row, cfg, opts, device, dtype)
            res["rows"].append(r)
            say(f"  {row}: " + (f"{r['step_ms']:.1f} ms/step, first step {r['first_step_s']:.1f} s, loss "
                                f"{r['loss']:.4f}" + (f", peak above weights {r['peak_above_weights_gib']:.2f} GiB"
                                                      if r.get("peak_above_weights_gib") is not None else "")
                                if r["status"] == "ok" else r["status"]))
        results.append(res)
    tab = table(results)
    print(report.text(tab))
    header = [f"# cakeops bench deepseek-v4 -- {env['device']}", "",
              f"{env['date']}, torch {env['torch']}, transformers {env['transformers']}. One training step "
              f"(forward + backward, HF's loss) of a random DeepSeek-V4, bf16 in HF's mixed layout, batch "
              f"{opts.batch}, seq {opts.seq}, {opts.layers} layers; median of {opts.steps} steps; compile s = the "
              f"first step less one step; peak = torch.cuda.max_memory_allocated over the timed steps less the "
              f"weights.", ""]
    out = opts.out
    written = [report.write_markdown(out / "deepseek_v4.md", tab, header),
               report.write_json(out / "deepseek_v4.json", dict(env, options=vars(opts) | {"out": str(out)}),
                                 [dict(r, hidden=res["hidden"]) for res in results for r in res["rows"]])]
    print("wrote " + ", ".join(str(p) for p in written))
    return 0 if all(r["status"] == "ok" or r.get("skipped") for res in results for r in res["rows"]) else 1
