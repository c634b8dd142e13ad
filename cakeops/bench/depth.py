"""``python -m cakeops.bench.depth``: compile a deep mHC transformer with Inductor and train it beside eager.

The model is ``TinyLM`` with ``--blocks`` blocks (two ``nn.MHC`` layers each: attention and MLP branches behind
cakeops RMSNorm pre-norms, ``StreamExpand`` in front, ``MHCHead`` at the end). Two copies start from the same
weights; one runs eagerly, one under ``torch.compile(fullgraph=True)`` (Inductor). The script reports the compile
time (the first step, forward and backward), the step times after it, and the largest difference of the losses
and of every parameter gradient of the first step between the two. ``--json`` writes the record.

In bf16 / fp16 the two copies round differently (Inductor keeps FP32 inside its fused branch kernels, eager rounds
after every op), and gradients that are sums of cancelling per-token terms (the mHC ``base`` and ``scale``) show
relative differences of several percent between them. So a low-precision run also takes the first step on a
float32 copy of the same weights and reports how far each of eager and compiled is from it: a compiled graph
that computes differently from eager would stand out as much farther from float32 than eager is.

On a GPU ``--dtype bfloat16`` runs the activations and the branch weights in bf16 with the mHC mappings kept in
FP32. The compile tests run the same code on CPU (``compile_tests/test_deep_model.py``).
"""
import argparse
import copy
import json
import sys
import time
from statistics import geometric_mean

import torch

from ..nn import MHC, recompute_mhc
from ..testing import rel_err
from ..tiny_lm import TinyLM


def build(blocks: int, dim: int, heads: int, vocab: int, seq: int, dtype: torch.dtype, device: str, seed: int,
          recompute_group: int = 1):
    torch.manual_seed(seed)
    model = TinyLM(vocab, dim, layers=blocks, heads=heads, max_len=seq + 1).to(device)
    if recompute_group != 1:
        recompute_mhc(model, None if recompute_group == 0 else recompute_group)
    if dtype != torch.float32:
        model.to(dtype)
        for module in model.modules():  # the mappings stay FP32 (the cakeops mHC ops take FP32 parameters)
            if isinstance(module, MHC):
                for p in (module.fn, module.scale, module.base):
                    p.data = p.data.float()
    return model


def _loss(model):
    """Next-token cross entropy in FP32 (the logits of a bf16 model are bf16)."""
    def loss(tokens):
        logits = model(tokens[:, :-1]).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return loss


def _step(loss_fn, model, tokens, opt):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(tokens)
    loss.backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    opt.step()
    return loss.detach().float(), grads


def _rel_errors(names, grads, truth) -> dict:
    return {name: rel_err(a, b) for name, a, b in zip(names, grads, truth)}


def _against_float32(names, eager_grads, compiled_grads, truth_grads) -> dict:
    """Each side's per-parameter gradient distance to the float32 copy's, and how the two distances compare."""
    eager = _rel_errors(names, eager_grads, truth_grads)
    compiled = _rel_errors(names, compiled_grads, truth_grads)
    ratios = [compiled[k] / max(eager[k], 1e-30) for k in names]
    return {"eager": eager, "compiled": compiled,
            "eager_max": max(eager.values()), "compiled_max": max(compiled.values()),
            "compiled_closer": sum(compiled[k] <= eager[k] for k in names),
            "ratio_geomean": geometric_mean(max(r, 1e-30) for r in ratios),
            "ratio_max": max(ratios), "ratio_max_param": names[max(range(len(ratios)), key=ratios.__getitem__)]}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(blocks=16, dim=32, heads=4, vocab=48, batch=2, seq=16, steps=3, dtype=torch.float32, device="cpu",
        seed=0, lr=1e-4, recompute_group=1, log=None) -> dict:
    """Trains the eager and the compiled copy for ``steps`` steps on the same tokens; returns the record.
    ``recompute_group``: both copies under ``recompute_mhc`` with groups of this size (0: its default; 1: off)."""
    eager = build(blocks, dim, heads, vocab, seq, dtype, device, seed, recompute_group)
    compiled_model = copy.deepcopy(eager)
    # the same weights in float32 (the mHC mappings already are): the reference for a low-precision run
    float32_model = copy.deepcopy(eager).float() if dtype != torch.float32 else None
    opt_e = torch.optim.AdamW(eager.parameters(), lr=lr)
    opt_c = torch.optim.AdamW(compiled_model.parameters(), lr=lr)
    torch._dynamo.reset()
    compiled = torch.compile(_loss(compiled_model), fullgraph=True)
    # One batch, seen every step: the models memorize it, so the loss falls within a few steps.
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    record = {"blocks": blocks, "mhc_layers": 2 * blocks, "dim": dim, "batch": batch, "seq": seq,
              "dtype": str(dtype).replace("torch.", ""), "device": device, "torch": torch.__version__,
              "recompute_group": next(m.recompute_group for m in eager.modules() if isinstance(m, MHC)),
              "losses_eager": [], "losses_compiled": [], "step_s_eager": [], "step_s_compiled": []}
    names = [name for name, _ in eager.named_parameters()]
    for step in range(steps):
        times = {}
        outs = {}
        for name, fn, model, opt in (("compiled", compiled, compiled_model, opt_c), ("eager", _loss(eager), eager, opt_e)):
            _sync(device)
            t0 = time.perf_counter()
            outs[name] = _step(fn, model, tokens, opt)
            _sync(device)
            times[name] = time.perf_counter() - t0
        if step == 0:
            record["compile_s"] = times["compiled"]
            ge, gc = outs["eager"][1], outs["compiled"][1]
            errors = _rel_errors(names, gc, ge)
            record["grad_rel_err"] = dict(sorted(errors.items(), key=lambda kv: -kv[1]))
            if float32_model is not None:
                float32_model.zero_grad(set_to_none=True)
                _loss(float32_model)(tokens).backward()
                record["vs_float32"] = _against_float32(names, ge, gc, [p.grad for p in float32_model.parameters()])
                float32_model = None  # its memory back before the next steps
            record["grad_max_rel_err"] = max(errors.values())
            record["grad_names"] = len(ge)
        record["losses_eager"].append(outs["eager"][0].item())
        record["losses_compiled"].append(outs["compiled"][0].item())
        record["step_s_eager"].append(times["eager"])
        record["step_s_compiled"].append(times["compiled"])
        if log:
            log(f"step {step}: loss eager {record['losses_eager'][-1]:.5f} compiled "
                f"{record['losses_compiled'][-1]:.5f}; {times['eager']:.3f} s / {times['compiled']:.3f} s")
    from .._ops.inductor import fallbacks_registered

    record["inductor_fallbacks"] = fallbacks_registered()
    record["loss_max_abs_diff"] = max(abs(a - b) for a, b in zip(record["losses_eager"], record["losses_compiled"]))
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cakeops.bench.depth", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=16, help="transformer blocks; each has two mHC layers (16)")
    p.add_argument("--dim", type=int, default=32, help="hidden size C (32)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (4)")
    p.add_argument("--batch", type=int, default=2, help="sequences per step (2)")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence (16)")
    p.add_argument("--steps", type=int, default=3, help="training steps, the first one compiles (3)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="activations and branch weights; mHC mappings stay FP32 (float32)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda or cpu")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (1e-4)")
    p.add_argument("--recompute-group", type=int, default=1,
                   help="stream recompute (cakeops.nn.recompute_mhc) in both copies with groups of this size; 0: its "
                        "default (1: off)")
    p.add_argument("--json", default=None, help="write the record here")
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}; {args.blocks} blocks ({2 * args.blocks} mHC layers), C={args.dim}, "
          f"{args.dtype} on {args.device}: compiling with Inductor...", flush=True)
    record = run(args.blocks, args.dim, args.heads, 48, args.batch, args.seq, args.steps,
                 getattr(torch, args.dtype), args.device, lr=args.lr, recompute_group=args.recompute_group,
                 log=lambda s: print(s, flush=True))
    steady = record["step_s_compiled"][1:] or record["step_s_compiled"]
    print(f"compile (first step) {record['compile_s']:.1f} s; compiled step {sorted(steady)[len(steady) // 2]:.4f} s; "
          f"loss max |eager - compiled| {record['loss_max_abs_diff']:.3g}; "
          f"gradient max rel err {record['grad_max_rel_err']:.3g} over {record['grad_names']} parameters")
    print("largest gradient differences (first step): " +
          ", ".join(f"{k} {v:.2g}" for k, v in list(record["grad_rel_err"].items())[:6]))
    if "vs_float32" in record:
        f32 = record["vs_float32"]
        print(f"against a float32 copy of the same weights (first step): gradient max rel err eager "
              f"{f32['eager_max']:.3g}, compiled {f32['compiled_max']:.3g}; compiled as close or closer on "
              f"{f32['compiled_closer']} of {record['grad_names']} parameters; compiled / eager distance: geometric "
              f"mean {f32['ratio_geomean']:.3g}, largest {f32['ratio_max']:.3g} ({f32['ratio_max_param']})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
