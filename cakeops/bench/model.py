"""``python -m cakeops bench model``: one training step of a Llama-like decoder, plain residual vs mHC variants.

Per config and variant: the step time (forward + backward; ``--optimizer`` adds an AdamW step), the peak memory,
the mHC overhead against the plain-residual model, and the compile time. The model (``model_zoo``): token
embedding, N blocks of (RMSNorm -> causal SDPA attention -> residual; RMSNorm -> SwiGLU MLP -> residual), final
RMSNorm, LM head, cross entropy on random tokens; no RoPE. Variants: ``plain`` (plain residual), ``cakeops``
(``StreamExpand`` -> ``nn.MHC`` per attention and MLP branch -> ``MHCHead``), ``math`` (the same mHC layer in
plain torch ops, the SPEC math with its Sinkhorn, fused by torch.compile), ``te`` (TransformerEngine's Triton
mHC, when installed), ``cakeops-recompute`` (``cakeops`` under ``recompute_mhc``; ``--recompute-group 4,6,8``
gives a row per group size, each with its step time against ``cakeops``: recompute's memory against its time).
Every variant uses the same norm module in its branches (``--norm``) and the whole model,
loss included, runs under ``torch.compile(fullgraph=True)`` (a variant that cannot trace whole is retried with
graph breaks allowed, and the report says so).

Timing (CUDA): the first step compiles (its time, less one steady step, is the compile time), ``--warmup``
more steps, then ``--steps`` steps, each between two ``torch.cuda.synchronize()`` calls, wall clock; the median
is reported. Peak memory: ``torch.cuda.max_memory_allocated`` over the timed steps, reset per variant (weights,
gradients and activations; optimizer state with ``--optimizer``), that peak less what was allocated before the
step ("above weights"), and the peak of one more step above everything before it with the gradients already
allocated ("activations": what the residual schemes differ in). Each variant is built, run and freed on its own.

Before timing, an agreement check on the tiny config in FP32: the cakeops and the math model on the same weights
must give the same logits, loss and gradients (and TE's, when installed, nearly the same logits: informational).

Without CUDA: the tiny config on CPU (``aot_eager`` backend, no C++ code generation), a check that every variant
runs forward and backward with a finite loss; CPU timings are not performance numbers.
Writes OUT/model.md, OUT/model.json and (with matplotlib) OUT/model.png. Exits 1 on a failed check or variant.
"""
import argparse
import contextlib
import datetime
import gc
import math
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from . import floor, kernel_breakdown, plot, report
from ..nn import MHC
from .console import say
from .model_zoo import PRESETS, VARIANTS, Config, build, te_status

VARIANT_TITLES = {"plain": "plain residual", "cakeops": "cakeops mHC", "cakeops-recompute": "cakeops mHC + recompute",
                  "te": "TE Triton mHC",
                  "math": "mHC as torch.compile'd math"}
PRESET_GROUPS = {"issue": ["c2048", "c4096"], "memory": ["c2048", "c4096", "deep"]}
RECOMPUTE = "cakeops-recompute"  # with --recompute-group G: one row per G, named "cakeops-recompute:G"
SIZE_FLAGS = ("dim", "blocks", "ffn", "heads", "batch", "seq", "vocab", "streams", "sinkhorn_iters")
# The agreement check (FP32, tiny config): cakeops vs math. On CPU both run the reference math; on a GPU the
# cakeops side runs the Triton kernels (TF32x3 projections in FP32).
CHECK_TOL = {"logits": 1e-3, "loss": 1e-4, "grads": 1e-2}
TE_CHECK_TOL = 1e-2  # informational: TE's TF32 projection, eps-free gates and log-space Sinkhorn differ slightly


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m cakeops bench model", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Example (both configs of the issue on a GPU): python -m cakeops bench model "
                                       "--preset issue --out bench_model")
    presets = ", ".join(f"{k} ({PRESETS[k].label}, {PRESETS[k].heads} heads)" for k in PRESETS)
    p.add_argument("--preset", default=None,
                   help=f"comma-separated configs, or 'issue' for c2048,c4096: {presets}. Default: c2048 on CUDA, "
                        "tiny without CUDA (where a GPU preset is replaced by tiny unless --device cpu is given)")
    p.add_argument("--dim", type=int, help="hidden size C (overrides the preset's, for every preset run)")
    p.add_argument("--blocks", type=int, help="transformer blocks, each an attention and an MLP branch")
    p.add_argument("--ffn", type=int, help="SwiGLU inner size")
    p.add_argument("--heads", type=int, help="attention heads (must divide --dim)")
    p.add_argument("--batch", type=int, help="sequences per step")
    p.add_argument("--seq", type=int, help="tokens per sequence")
    p.add_argument("--vocab", type=int, help="vocabulary size (presets: 32000; tiny 256)")
    p.add_argument("--streams", type=int, choices=[2, 4, 8],
                   help="mHC streams n (presets: 4)")
    p.add_argument("--sinkhorn-iters", dest="sinkhorn_iters", type=int, help="Sinkhorn iterations (20)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                   help="activations and weights; mHC mappings stay FP32 (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--variants", default=",".join(VARIANTS),
                   help=f"comma-separated residual schemes to time (default: {','.join(VARIANTS)})")
    p.add_argument("--recompute-group", default=None,
                   help="cakeops-recompute's group size, or several comma-separated (a row each, e.g. 4,6,8: "
                        "memory against step time; default: recompute_mhc's own)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="torch.compile the whole model and loss, fullgraph=True (default); --no-compile: eager")
    p.add_argument("--backend", default=None,
                   help="torch.compile backend (default: inductor on CUDA, aot_eager on CPU)")
    p.add_argument("--mode", default=None,
                   help="torch.compile mode, e.g. max-autotune-no-cudagraphs or reduce-overhead (CUDA graphs; "
                        "default: torch's default mode)")
    p.add_argument("--steps", type=int, default=10, help="timed steps; the median is reported (10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps after the compiling first step (3)")
    p.add_argument("--optimizer", action="store_true",
                   help="a step includes AdamW's update (default off: forward + backward only)")
    p.add_argument("--norm", choices=["cakeops", "torch"], default="cakeops",
                   help="the RMSNorm of every variant's pre-norms and final norm: cakeops.nn.RMSNorm (default) "
                        "or torch.nn.RMSNorm")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the tokens (0)")
    p.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                   help="run the cakeops-vs-math agreement check first (default); --no-check skips it")
    p.add_argument("--profile", action="store_true",
                   help="CUDA: after timing, one more step under torch.profiler, its GPU time split by kind of kernel "
                        "(cakeops mHC / RMSNorm, Inductor's glue, GEMM, attention, other) and idle time")
    p.add_argument("--out", type=Path, default=Path("bench_model_out"),
                   help="directory for model.md, model.json, model.png (default bench_model_out)")
    return p


# ---------------------------------------------------------------------------------------------------------------
# Steps and their timing
# ---------------------------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tokens(cfg: Config, device, seed: int):
    gen = torch.Generator().manual_seed(seed + 1)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
    targets = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=gen)
    return tokens.to(device), targets.to(device)


@contextlib.contextmanager
def _heartbeat(label: str, every: float = 10.0):
    """A line every ``every`` seconds while the block runs: compiles take tens of seconds and print nothing."""
    stop, t0 = threading.Event(), time.perf_counter()

    def beat():
        while not stop.wait(every):
            say(f"  {label}: compiling, {time.perf_counter() - t0:.0f} s")

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def _steps_progress(n: int, label: str):
    try:
        from tqdm import tqdm
    except ImportError:
        say(f"  {label}: {n} steps...")
        return range(n)
    return tqdm(range(n), desc=f"  {label}", unit="step", leave=False)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:200] if text else ''}"


def _base(variant: str) -> str:
    """The residual scheme of a row: "cakeops-recompute:6" is cakeops-recompute in groups of 6."""
    return variant.split(":")[0]


def _group(variant: str) -> Optional[int]:
    return int(variant.split(":")[1]) if ":" in variant else None


def _title(variant: str) -> str:
    group = _group(variant)
    return VARIANT_TITLES[_base(variant)] + ("" if group is None else f" (groups of {group})")


def _color(variant: str, variants: Sequence[str]) -> str:
    """Each scheme its color; the group sizes of a sweep the colors after all the schemes'."""
    sweep = [v for v in variants if _group(v) is not None]
    return f"C{len(VARIANTS) + sweep.index(variant) if variant in sweep else VARIANTS.index(_base(variant))}"


def _recompute_variants(variants: List[str], groups: Optional[str], parser: argparse.ArgumentParser) -> List[str]:
    """cakeops-recompute replaced by a row per group size of ``--recompute-group``."""
    if groups is None:
        return variants
    try:
        sizes = list(dict.fromkeys(int(g) for g in groups.split(",") if g.strip()))
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        parser.error(f"--recompute-group: expected group sizes >= 1, comma-separated (e.g. 4 or 4,6,8), "
                     f"got {groups!r}")
    if RECOMPUTE not in variants:
        parser.error(f"--recompute-group: sets the group sizes of the {RECOMPUTE} variant, which --variants leaves out")
    at = variants.index(RECOMPUTE)
    return variants[:at] + [f"{RECOMPUTE}:{g}" for g in sizes] + variants[at + 1:]


def run_variant(cfg: Config, variant: str, opts: argparse.Namespace, device: torch.device,
                dtype: torch.dtype) -> Dict[str, Any]:
    """One variant at one config: build, compile (first step), warm up, time; then free everything."""
    row: Dict[str, Any] = {"variant": variant, "title": _title(variant), "status": "ok"}
    group = _group(variant)
    if group is not None:
        row["recompute_group"] = group
    if variant == "te":
        usable, why = te_status()
        row["te"] = why
        if not usable or device.type != "cuda":
            row["status"], row["skipped"] = (why if not usable else "needs CUDA"), True
            return row
    model = opt = fn = None
    try:
        say(f"  {variant}: building the model")
        model = build(cfg, _base(variant), device, dtype, opts.norm, opts.seed, recompute_group=group)
        row["params"] = sum(p.numel() for p in model.parameters())
        if _base(variant) == RECOMPUTE:  # the group size in effect, recompute_mhc's default included
            row["recompute_group"] = next(m.recompute_group for m in model.modules() if isinstance(m, MHC))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5) if opts.optimizer else None
        tokens, targets = _tokens(cfg, device, opts.seed)
        fullgraph = opts.compile

        def compiled(full: bool):
            torch._dynamo.reset()
            if not opts.compile:
                return model.loss
            return torch.compile(model.loss, fullgraph=full, backend=opts.backend, mode=opts.mode)

        def step(keep_grads: bool = False):
            model.zero_grad(set_to_none=not keep_grads)
            loss = fn(tokens, targets)
            loss.backward()
            if opt is not None:
                opt.step()
            return loss

        fn = compiled(fullgraph)
        what = f"compiling with {opts.backend} (first forward + backward)" if opts.compile else "first step (eager)"
        say(f"  {variant}: {what}")
        t0 = time.perf_counter()
        loss = None
        try:
            with _heartbeat(variant):
                loss = step()
                _sync(device)
        except Exception as exc:
            if not (opts.compile and fullgraph) or isinstance(exc, torch.cuda.OutOfMemoryError):
                raise
            row["graph_break"] = _first_line(exc)
        if loss is None:  # retried outside the except block: its traceback no longer holds the first try's tensors
            say(f"  {variant}: fullgraph=True failed ({row['graph_break']}); compiling again with graph breaks")
            fullgraph = False
            fn = compiled(False)
            t0 = time.perf_counter()
            with _heartbeat(variant):
                loss = step()
                _sync(device)
        first_s = time.perf_counter() - t0
        row["fullgraph"] = fullgraph if opts.compile else None
        row["loss"] = loss.item()
        if not math.isfinite(row["loss"]):
            raise FloatingPointError(f"the first step's loss is {row['loss']}")
        del loss
        for _ in _steps_progress(opts.warmup, f"{variant} warmup"):
            step()
        _sync(device)
        if device.type == "cuda":
            model.zero_grad(set_to_none=True)
            _sync(device)
            row["weights_gib"] = torch.cuda.memory_allocated(device) / 2 ** 30  # (and optimizer state)
            torch.cuda.reset_peak_memory_stats(device)
        times, host = [], []
        for _ in _steps_progress(opts.steps, f"{variant} timed"):
            _sync(device)
            t = time.perf_counter()
            step()
            host.append(1e3 * (time.perf_counter() - t))  # the host has queued the step's work
            _sync(device)
            times.append(1e3 * (time.perf_counter() - t))
        row["step_ms"] = statistics.median(times)
        row["step_ms_all"] = times
        row["host_ms"] = statistics.median(host)
        row["tokens_per_s"] = cfg.batch * cfg.seq / (row["step_ms"] / 1e3)
        row["first_step_s"] = first_s
        row["compile_s"] = max(0.0, first_s - row["step_ms"] / 1e3)
        row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30 if device.type == "cuda" else None
        if row["peak_gib"] is not None:  # activations, gradients and the step's transients
            row["peak_above_weights_gib"] = row["peak_gib"] - row["weights_gib"]
            row["activation_peak_gib"] = _activation_peak(step, device)
        if opts.profile and device.type == "cuda":
            say(f"  {variant}: one step under the profiler")
            row["gpu_ms_by_kind"], row["cakeops_kernel_ms"] = kernel_breakdown.breakdown(step, device)
    except torch.cuda.OutOfMemoryError as exc:
        row["status"] = f"out of memory ({_first_line(exc)[:120]})"
    except Exception as exc:  # one variant failing must not take the others down
        row["status"] = f"error: {_first_line(exc)}"
    finally:
        del model, opt, fn
        gc.collect()
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def _activation_peak(step, device) -> float:
    """GiB at the peak of one step above everything alive before it, the parameters' gradients already allocated
    (zeroed, not freed): what the forward keeps for the backward and the backward's transients, the loss's included
    -- the activation memory that residual schemes differ in."""
    step(keep_grads=True)  # the gradients exist from here on
    _sync(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    step(keep_grads=True)
    _sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2 ** 30


def _overheads(rows: List[Dict[str, Any]]) -> None:
    plain = next((r for r in rows if r["variant"] == "plain" and r["status"] == "ok"), None)
    cakeops = next((r for r in rows if r["variant"] == "cakeops" and r["status"] == "ok"), None)
    for r in rows:
        # recompute's own cost: its step against the same model without it, in the same run
        r["vs_cakeops_pct"] = (100.0 * (r["step_ms"] - cakeops["step_ms"]) / cakeops["step_ms"]
                               if cakeops is not None and r["status"] == "ok" and _base(r["variant"]) == RECOMPUTE
                               else None)
        ok = plain is not None and r["status"] == "ok"
        r["overhead_pct"] = 100.0 * (r["step_ms"] - plain["step_ms"]) / plain["step_ms"] if ok else None
        r["peak_overhead_pct"] = (100.0 * (r["peak_gib"] - plain["peak_gib"]) / plain["peak_gib"]
                                  if ok and r.get("peak_gib") and plain.get("peak_gib") else None)
        for key in ("peak_above_weights_gib", "activation_peak_gib"):
            mine, plains = r.get(key), plain.get(key) if plain else None
            r[key.replace("_gib", "_vs_plain")] = mine / plains if ok and mine and plains else None


# ---------------------------------------------------------------------------------------------------------------
# The agreement check: the math variant is the cakeops model, in other ops
# ---------------------------------------------------------------------------------------------------------------

def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _forward_backward(model, tokens, targets):
    logits = model(tokens)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    return logits.detach(), loss.detach()


def agreement_check(device: torch.device, norm: str, seed: int, with_te: bool) -> Dict[str, Any]:
    """cakeops vs math (and TE) on the same weights, tiny config, FP32, eager: logits, loss, gradients."""
    cfg = PRESETS["tiny"]
    tokens, targets = _tokens(cfg, device, seed)
    math_model = build(cfg, "math", device, torch.float32, norm, seed)
    with torch.no_grad():  # mappings that matter: at their init (scale 0.01) the layers are ~plain residuals
        gen = torch.Generator().manual_seed(seed + 2)
        for name, p in math_model.named_parameters():
            if name.endswith((".scale", ".base")):
                p.add_(torch.rand(p.shape, generator=gen).to(p.device) * (1.0 if name.endswith("scale") else 0.5))
    state = {k: v.detach().clone() for k, v in math_model.state_dict().items()}
    ref_logits, ref_loss = _forward_backward(math_model, tokens, targets)
    ref_grads = {k: p.grad for k, p in math_model.named_parameters()}
    cake = build(cfg, "cakeops", device, torch.float32, norm, seed, state=state)
    logits, loss = _forward_backward(cake, tokens, targets)
    grads = {k: _rel(p.grad, ref_grads[k]) for k, p in cake.named_parameters()}
    worst = max(grads, key=grads.get)
    result: Dict[str, Any] = {
        "config": cfg.label, "dtype": "float32", "device": str(device),
        "logits_rel_err": _rel(logits, ref_logits), "loss_abs_diff": abs(loss.item() - ref_loss.item()),
        "loss": ref_loss.item(), "grad_max_rel_err": grads[worst], "grad_worst": worst, "tol": dict(CHECK_TOL),
    }
    result["ok"] = (result["logits_rel_err"] <= CHECK_TOL["logits"] and result["loss_abs_diff"] <= CHECK_TOL["loss"]
                    and result["grad_max_rel_err"] <= CHECK_TOL["grads"])
    if with_te:
        try:
            te = build(cfg, "te", device, torch.float32, norm, seed, state=state)
            te_logits, _ = _forward_backward(te, tokens, targets)
            result["te_logits_rel_err"] = _rel(te_logits, ref_logits)
        except Exception as exc:
            result["te_error"] = _first_line(exc)
    return result


def _check_line(c: Dict[str, Any]) -> str:
    line = (f"cakeops vs math on the same weights ({c['config']}, FP32, {c['device']}): logits rel err "
            f"{c['logits_rel_err']:.1e} (tol {c['tol']['logits']:.0e}), |loss diff| {c['loss_abs_diff']:.1e} "
            f"(tol {c['tol']['loss']:.0e}), max gradient rel err {c['grad_max_rel_err']:.1e} ({c['grad_worst']}; "
            f"tol {c['tol']['grads']:.0e}): {'ok' if c['ok'] else 'FAIL'}")
    if "te_logits_rel_err" in c:
        te_ok = c["te_logits_rel_err"] <= TE_CHECK_TOL
        line += (f"; TE vs math logits rel err {c['te_logits_rel_err']:.1e} (informational, expected below "
                 f"{TE_CHECK_TOL:.0e}{'' if te_ok else ': ABOVE'})")
    elif "te_error" in c:
        line += f"; TE failed: {c['te_error']}"
    return line


# ---------------------------------------------------------------------------------------------------------------
# Reports
# ---------------------------------------------------------------------------------------------------------------

def _fmt(v: Optional[float], spec: str, suffix: str = "") -> str:
    return "-" if v is None else format(v, spec) + suffix


def _pct(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:+.1f} %"


FLOOR_CAPTION = ("The byte floor of mHC's step cost (python -m cakeops.bench.floor): rows a layer moves per token, "
                 "fwd + bwd, and the overhead over plain if every pass ran at this run's copy bandwidth.")


def add_floors(results: List[Dict[str, Any]], device: torch.device, dtype: torch.dtype) -> None:
    """Each config's byte floors (bench/floor.py) against its plain step, at the copy bandwidth measured now."""
    plains = {id(res): next((r for r in res["rows"] if r["variant"] == "plain" and r["status"] == "ok"), None)
              for res in results}
    if not any(plains.values()):
        return
    from .core import copy_gbps
    ceiling = copy_gbps(device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    for res in results:
        plain = plains[id(res)]
        if plain is not None:
            res["floor"] = floor.for_config(res["config"], plain["step_ms"], ceiling, itemsize,
                                            floor.GOALS.get(res["preset"]))


def floor_table(results: Sequence[Dict[str, Any]]) -> report.Table:
    cells = []
    for res in results:
        if "floor" in res:
            mine = next((r for r in res["rows"] if r["variant"] == "cakeops" and r["status"] == "ok"), None)
            cells.append(floor.table_rows(res["preset"], res["floor"], mine and mine["overhead_pct"]))
    return floor.HEADER, cells


def summary_table(results: Sequence[Dict[str, Any]], variants: Sequence[str]) -> report.Table:
    """The issue's layout: one row per config, one column per variant, ``ms (+overhead %)``."""
    columns = ["config"] + [_title(v) for v in variants]
    cells = []
    for res in results:
        by = {r["variant"]: r for r in res["rows"]}
        line = [res["config"]["label"]]
        for v in variants:
            r = by[v]
            if r["status"] != "ok":
                line.append(r["status"])
            elif v == "plain" or r["overhead_pct"] is None:
                line.append(f"{r['step_ms']:.1f} ms")
            else:
                line.append(f"{r['step_ms']:.1f} ms ({r['overhead_pct']:+.1f} %)")
        cells.append(line)
    return columns, cells


def detail_table(results: Sequence[Dict[str, Any]], cuda: bool) -> report.Table:
    columns = ["config", "variant", "step ms", "vs plain", "vs cakeops", "host ms", "tokens/s",
               "peak GiB" if cuda else "peak GiB (CUDA)", "peak vs plain", "above weights GiB", "above vs plain",
               "activations GiB", "act. vs plain",
               "compile s", "first loss", "params", "notes"]
    cells = []
    for res in results:
        for r in res["rows"]:
            notes = [] if r["status"] == "ok" else [r["status"]]
            if r.get("recompute_group"):
                notes.append(f"groups of {r['recompute_group']}")
            if r.get("fullgraph") is False:
                notes.append(f"graph breaks ({r.get('graph_break', '')[:80]})")
            cells.append([res["preset"], r["variant"], _fmt(r.get("step_ms"), ".2f"), _pct(r.get("overhead_pct")),
                          _pct(r.get("vs_cakeops_pct")), _fmt(r.get("host_ms"), ".2f"),
                          _fmt(r.get("tokens_per_s"), ".0f"),
                          _fmt(r.get("peak_gib"), ".2f"), _pct(r.get("peak_overhead_pct")),
                          _fmt(r.get("peak_above_weights_gib"), ".2f"),
                          _fmt(r.get("peak_above_weights_vs_plain"), ".2f", "×"),
                          _fmt(r.get("activation_peak_gib"), ".2f"), _fmt(r.get("activation_peak_vs_plain"), ".2f", "×"),
                          _fmt(r.get("compile_s"), ".1f"), _fmt(r.get("loss"), ".4f"),
                          _fmt(r.get("params") and r["params"] / 1e6, ".1f", "M"), "; ".join(notes)])
    return columns, cells


def kind_table(results: Sequence[Dict[str, Any]]) -> report.Table:
    """ms per step by kind of kernel, one row per profiled variant; a "vs plain" row per mHC variant: where its
    overhead goes."""
    kinds = list(kernel_breakdown.KINDS) + ["kernels", "idle", "wall"]
    columns = ["config", "variant"] + kinds
    cells = []
    for res in results:
        by = {r["variant"]: r.get("gpu_ms_by_kind") for r in res["rows"]}
        for variant, ms in by.items():
            if ms is None:
                continue
            cells.append([res["preset"], variant] + [f"{ms[k]:.2f}" for k in kinds])
            if variant != "plain" and by.get("plain"):
                cells.append([res["preset"], f"{variant} - plain"]
                             + [f"{ms[k] - by['plain'][k]:+.2f}" for k in kinds])
    return columns, cells


def step_time_plot(path: Path, results: Sequence[Dict[str, Any]], variants: Sequence[str], title: str) -> Path:
    """Grouped bars: step time per variant (bars) per config (groups); mHC bars labelled with the overhead."""
    plt = plot._pyplot()
    # a variant with no bar anywhere (TE not installed) is left out of the plot; the tables say why
    variants = [v for v in variants if any(r["variant"] == v and r["status"] == "ok"
                                           for res in results for r in res["rows"])]
    width = 0.8 / max(1, len(variants))
    fig, ax = plt.subplots(figsize=(max(6.0, 2.6 * len(results) + 2), 4.5))
    top = max([r["step_ms"] for res in results for r in res["rows"] if r["status"] == "ok"] or [1.0])
    for i, v in enumerate(variants):
        xs, heights, labels = [], [], []
        for g, res in enumerate(results):
            r = next(r for r in res["rows"] if r["variant"] == v)
            x = g + (i - (len(variants) - 1) / 2) * width
            if r["status"] != "ok":  # say why the bar is missing, where it would stand
                ax.text(x, 0.02 * top, r["status"].split(" (")[0][:28], rotation=90, ha="center", va="bottom", fontsize=6,
                        color=_color(v, variants))
                continue
            xs.append(x)
            heights.append(r["step_ms"])
            labels.append(f"{r['step_ms']:.1f}" if r["overhead_pct"] is None or v == "plain"
                          else f"{r['overhead_pct']:+.0f}%")
        bars = ax.bar(xs, heights, width, label=_title(v), color=_color(v, variants))
        ax.bar_label(bars, labels=labels, fontsize=7, padding=2)
    _floor_marks(ax, results, variants, width)
    ax.set_xticks(range(len(results)))
    ax.set_xlim(-0.5, len(results) - 0.5)
    ax.set_xticklabels([r["config"]["label"].replace(", B=", "\nB=") for r in results], fontsize=8)
    ax.set_ylabel("step time (ms, median)")
    ax.set_ylim(0, 1.25 * top)
    ax.set_title(title, fontsize=9)
    # a sweep's long titles ("... (groups of 6)") one per line, inside the axes
    ax.legend(fontsize=8, loc="upper left", ncol=1 if max(len(_title(v)) for v in variants) > 28 else 2)
    return plot._save(fig, path)


def _floor_marks(ax, results: Sequence[Dict[str, Any]], variants: Sequence[str], width: float) -> None:
    """On each cakeops bar with a byte floor: where the step would be if every pass ran at the copy bandwidth,
    today's passes and with every fusion, and the goal."""
    if "cakeops" not in variants:
        return
    x0 = (variants.index("cakeops") - (len(variants) - 1) / 2) * width
    marks = (("today", "k", "-", "byte floor, today's passes"), ("every fusion", "k", ":", "byte floor, every fusion"))
    labelled = set()
    for g, res in enumerate(results):
        f = res.get("floor")
        if not f:
            continue
        levels = [(f["plain_ms"] + f[key]["ms"], color, style, label) for key, color, style, label in marks]
        if "goal_pct" in f:
            levels.append((f["plain_ms"] * (1 + f["goal_pct"] / 100), "tab:red", "--", "goal"))
        for y, color, style, label in levels:
            ax.hlines(y, g + x0 - width / 2, g + x0 + width / 2, colors=color, linestyles=style, linewidth=1.2,
                      label=None if label in labelled else label)
            labelled.add(label)


def _environment(device: torch.device) -> Dict[str, Any]:
    import triton

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.machine()})",
           "transformer_engine": te_status()[1]}
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    return env


def _write(out: Path, env, opts, check, results, variants, dtype_name) -> List[Path]:
    cuda = env["device"] and not env["device"].startswith("CPU")
    step = "forward + backward" + (" + AdamW step" if opts.optimizer else "")
    how = (f"torch.compile backend {opts.backend}" + (f", mode {opts.mode}" if opts.mode else "")
           + ", fullgraph=True (whole model and loss)" if opts.compile else "eager (--no-compile)")
    header = [f"# cakeops model benchmark -- {env['device']}", "",
              f"{env['date']}, torch {env['torch']}, triton {env['triton']}, TransformerEngine: "
              f"{env['transformer_engine']}.",
              f"Llama-like decoder (pre-norms and final norm {opts.norm}.nn.RMSNorm in every variant, causal SDPA "
              f"attention without RoPE, SwiGLU MLP, LM head, cross entropy on random tokens), {dtype_name}, mHC mappings FP32, "
              f"{how}. One step = {step}; median of {opts.steps} steps after the compiling step and {opts.warmup} "
              "warm-up steps; peak = torch.cuda.max_memory_allocated over the timed steps. Overhead = "
              "(variant - plain) / plain; vs cakeops: a recompute row's step against cakeops mHC without it. "
              "Host ms: until the host has queued a step's work (close to the step time: the step waits on the "
              "CPU). First loss: the compiling step's; cakeops and math start from the "
              "same weights, so theirs agree to rounding.", ""]
    if not cuda:
        header += ["**CPU run: a check that every variant runs; CPU timings are not performance numbers.**", ""]
    if check is not None:
        header += ["Agreement check: " + _check_line(check), ""]
    summary = report.markdown(summary_table(results, variants))
    detail = report.markdown(detail_table(results, cuda))
    if any("gpu_ms_by_kind" in r for res in results for r in res["rows"]):
        detail += ("\nGPU time of one step by kind of kernel, ms (`--profile`; idle = wall - kernels: launch gaps "
                   "and host waits):\n\n" + report.markdown(kind_table(results)))
        for res in results:
            for r in res["rows"]:
                if r.get("cakeops_kernel_ms"):
                    top = ", ".join(f"{k} {v:.2f}" for k, v in list(r["cakeops_kernel_ms"].items())[:12])
                    detail += f"\n{res['preset']} {r['variant']}: cakeops kernels, ms per step: {top}\n"
    if any("floor" in res for res in results):
        detail += "\n" + FLOOR_CAPTION + "\n\n" + report.markdown(floor_table(results))
    path_md = out / "model.md"
    out.mkdir(parents=True, exist_ok=True)
    path_md.write_text("\n".join(header) + "\n" + summary + "\n" + detail)
    meta = dict(env, options={k: (str(v) if isinstance(v, Path) else v) for k, v in vars(opts).items()},
                step=step, check=check)
    payload_rows = [dict(r, preset=res["preset"], config=res["config"], floor=res.get("floor"))
                    for res in results for r in res["rows"]]
    written = [path_md, report.write_json(out / "model.json", meta, payload_rows)]
    if plot.available():
        title = f"{env['device']}, {dtype_name}, {step}; bar labels: overhead vs plain"
        if not cuda:
            title += "\n(CPU: checks that the variants run; not performance numbers)"
        written.append(step_time_plot(out / "model.png", results, variants, title))
    else:
        say("matplotlib is not installed: no plot (pip install matplotlib)")
    return written


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------

def _configs(opts, parser, cuda: bool, explicit_cpu: bool) -> List[tuple]:
    names: List[str] = []
    for name in (opts.preset or ("c2048" if cuda else "tiny")).split(","):
        name = name.strip()
        names += PRESET_GROUPS.get(name, [name] if name else [])
    unknown = [n for n in names if n not in PRESETS]
    if unknown or not names:
        parser.error(f"--preset: unknown {', '.join(unknown) or '(none given)'}; known: "
                     f"{', '.join(list(PRESETS) + list(PRESET_GROUPS))}")
    if not cuda and not explicit_cpu and any(n != "tiny" for n in names):
        say(f"No CUDA device: running the tiny config instead of {','.join(names)}.")
        names = ["tiny"]
    names = list(dict.fromkeys(names))
    overrides = {k: getattr(opts, k) for k in SIZE_FLAGS if getattr(opts, k) is not None}
    for k, v in overrides.items():
        if v < 1:
            parser.error(f"--{k.replace('_', '-')}: expected >= 1, got {v}")
    configs = []
    for n in names:
        cfg = Config(**dict(PRESETS[n].as_dict(), **overrides))
        if cfg.dim % cfg.heads:
            parser.error(f"--heads: {cfg.heads} does not divide the hidden size {cfg.dim} ({n})")
        configs.append((n + ("*" if overrides else ""), cfg))
    return configs


def main(argv: Optional[Sequence[str]] = None) -> int:
    threads = torch.get_num_threads()
    try:
        return _main(argv)
    finally:
        torch.set_num_threads(threads)  # a CPU run's one thread does not leak into the caller


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = _parser()
    opts = parser.parse_args(argv)
    variants = [v.strip() for v in opts.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants: unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(VARIANTS)}")
    variants = _recompute_variants(list(dict.fromkeys(variants)), opts.recompute_group, parser)
    if opts.steps < 1 or opts.warmup < 0:
        parser.error("--steps: expected >= 1; --warmup: expected >= 0")
    device = torch.device(opts.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    configs = _configs(opts, parser, cuda, explicit_cpu=opts.device is not None and device.type == "cpu")
    dtype_name = opts.dtype or ("bfloat16" if cuda else "float32")
    dtype = getattr(torch, dtype_name)
    opts.backend = opts.backend or ("inductor" if cuda else "aot_eager")
    env = _environment(device)
    print(f"cakeops bench model on {env['device']}: torch {env['torch']}, triton {env['triton']}, "
          f"TransformerEngine: {env['transformer_engine']}; {dtype_name}; "
          + (f"torch.compile({opts.backend}, fullgraph=True{', mode=' + opts.mode if opts.mode else ''})"
             if opts.compile else "eager")
          + f"; norms {opts.norm}.nn.RMSNorm; a step = forward + backward{' + AdamW' if opts.optimizer else ''}",
          flush=True)
    if not cuda:
        # One thread: the tiny model's matrices are too small to split, and more threads spin against any other
        # load on the machine (steps 10x slower, at random, on a shared 2-core host).
        torch.set_num_threads(1)
        print("No CUDA device: a short CPU run (one thread) that checks every variant runs forward and backward. "
              "CPU timings are not performance numbers.", flush=True)

    ok = True
    check = None
    if opts.check:
        check = agreement_check(device, opts.norm, opts.seed, with_te="te" in variants and cuda and te_status()[0])
        print(_check_line(check), flush=True)
        ok = check["ok"]
    results = []
    for name, cfg in configs:
        print(f"== {name}: {cfg.label}, {cfg.heads} heads, vocab {cfg.vocab}, {cfg.streams} streams ==", flush=True)
        rows = []
        for i, v in enumerate(variants, 1):
            say(f"[{i}/{len(variants)}] {_title(v)}")
            row = run_variant(cfg, v, opts, device, dtype)
            rows.append(row)
            if row["status"] == "ok":
                say(f"  {v}: {row['step_ms']:.2f} ms/step, compile {row['compile_s']:.1f} s, first loss "
                     f"{row['loss']:.4f}" + (f", peak {row['peak_gib']:.2f} GiB" if row["peak_gib"] else ""))
            else:
                say(f"  {v}: {row['status']}")
        _overheads(rows)
        results.append({"preset": name, "config": dict(cfg.as_dict(), label=cfg.label), "rows": rows})
        ok = ok and all(r["status"] == "ok" or r.get("skipped") for r in rows)  # TE absent is no failure
    print()
    print(report.text(summary_table(results, variants)))
    print()
    print(report.text(detail_table(results, cuda)))
    if cuda:
        add_floors(results, device, dtype)
        if any("floor" in res for res in results):
            print()
            print(FLOOR_CAPTION)
            print(report.text(floor_table(results)))
    written = _write(opts.out, env, opts, check, results, variants, dtype_name)
    print("wrote " + ", ".join(str(p) for p in written))
    if not cuda:
        print("(CPU run: the times above only show the run works; they are not performance numbers.)")
    if not ok:
        print("FAIL: the agreement check or a variant failed (see above).")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
