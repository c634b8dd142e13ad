"""``python -m cakeops demo``: train a small mHC transformer language model under torch.compile, beside the same
model with plain residual connections, on generated data (no downloads).

The corpus is lines of integer additions (``"37+58=95"``), character level: the model has to learn the format and
the carries, so the loss falls well below the unigram entropy. On a GPU the compile backend is Inductor; on a CPU
it is ``aot_eager`` (the same graph capture and autograd, without C++ code generation, which would take most of
the few minutes the demo is meant to last).
"""
import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from .tiny_lm import TinyLM

ALPHABET = "0123456789+=\n"
# the exit status says whether the mHC model learned: its mean loss over the last 20 steps against the first 10
LEARNING_CHECK_STEPS = 40


def corpus(n_lines: int, seed: int) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        a, b = rng.randrange(1000), rng.randrange(1000)
        lines.append(f"{a}+{b}={a + b}")
    return "\n".join(lines) + "\n"


def encode(text: str) -> torch.Tensor:
    index = {ch: i for i, ch in enumerate(ALPHABET)}
    return torch.tensor([index[ch] for ch in text], dtype=torch.long)


def batches(data: torch.Tensor, batch: int, length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - length - 1, (batch,), generator=gen)
        yield torch.stack([data[s:s + length + 1] for s in starts.tolist()])


class _Progress:
    """tqdm when installed, else one line rewritten in place."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.n, self.t0 = total, label, 0, time.time()
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, desc=label, unit="step", mininterval=0.5)
        except ImportError:
            self.bar = None

    def update(self, loss: float) -> None:
        self.n += 1
        if self.bar is not None:
            # no forced refresh: tqdm redraws at most every mininterval seconds, so a log file is not flooded
            self.bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            self.bar.update(1)
        elif self.n % max(1, self.total // 50) == 0 or self.n == self.total:
            done = int(30 * self.n / self.total)
            sys.stdout.write(f"\r{self.label} [{'#' * done}{'.' * (30 - done)}] {self.n}/{self.total} "
                             f"loss {loss:.3f} {time.time() - self.t0:5.1f}s")
            sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stdout.write("\n")


def train(hyper_connections: bool, args, device: torch.device, backend: str):
    data = encode(corpus(20000, seed=0)).to(device)
    held_out = encode(corpus(500, seed=1)).to(device)
    torch.manual_seed(args.seed)
    model = TinyLM(len(ALPHABET), args.dim, args.layers, heads=4, max_len=args.length + 1,
                   hyper_connections=hyper_connections).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    step_fn = torch.compile(model.loss, fullgraph=True, backend=backend)
    label = "mHC (4 streams)" if hyper_connections else "plain residual"
    stream = batches(data, args.batch, args.length, seed=args.seed)
    losses, t_compile = [], time.time()
    first = next(stream)
    step_fn(first).backward()  # compile before the clock starts
    opt.zero_grad(set_to_none=True)
    t_compile = time.time() - t_compile
    progress = _Progress(args.steps, f"{label:>16}")
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.time()
    for _ in range(args.steps):
        loss = step_fn(next(stream))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        progress.update(losses[-1])
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.time() - t0
    progress.close()
    with torch.no_grad():
        eval_loss = model.loss(next(batches(held_out, 64, args.length, seed=7))).item()
    tokens = args.steps * args.batch * args.length
    return {"model": label, "losses": losses, "final_loss": sum(losses[-20:]) / len(losses[-20:]),
            "eval_loss": eval_loss, "tokens_per_s": tokens / elapsed, "compile_s": t_compile,
            "params": sum(p.numel() for p in model.parameters())}


def plot(results, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        k = 10  # moving average over k steps: the per-step loss is noisy
        smooth = [sum(r["losses"][max(0, i - k + 1):i + 1]) / len(r["losses"][max(0, i - k + 1):i + 1])
                  for i in range(len(r["losses"]))]
        ax.plot(smooth, label=f"{r['model']} (final {r['final_loss']:.3f})")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/char, 10-step mean)")
    ax.set_title("TinyLM on generated additions, torch.compile")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m cakeops demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per model (default: 300 on CPU, 1500 on GPU); from 40 steps on, the exit "
                        "status is 1 if the mHC model's loss did not fall")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (16)")
    p.add_argument("--length", type=int, default=64, help="tokens per sequence (64)")
    p.add_argument("--dim", type=int, default=64, help="hidden size of both models (64)")
    p.add_argument("--layers", type=int, default=2,
                   help="transformer blocks, each an attention and an MLP branch (2)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (3e-3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches (0)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--out", type=Path, default=Path("demo_out"), help="directory where loss.png and demo.json go (demo_out)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch (default 1: the model's 64-wide matrices are too small to split, and "
                        "more threads spin against any other load on the machine; 0 keeps torch's own choice)")
    args = p.parse_args(argv)
    if args.threads < 0:
        p.error("--threads: expected >= 0")
    saved_threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _run(args, p)
    finally:
        torch.set_num_threads(saved_threads)


def _run(args, p) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.steps is None:
        args.steps = 1500 if device.type == "cuda" else 300
    if args.steps < 1:
        p.error("--steps: expected >= 1")
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"cakeops demo: TinyLM dim={args.dim} layers={args.layers} on {device} ({where}), torch.compile backend "
          f"{backend}, {args.steps} steps of {args.batch}x{args.length} tokens", flush=True)
    results = [train(True, args, device, backend), train(False, args, device, backend)]
    print(f"\n{'model':>16} | {'params':>7} | {'compile s':>9} | {'tokens/s':>9} | {'train loss':>10} | {'held-out':>8}")
    for r in results:
        print(f"{r['model']:>16} | {r['params']:>7} | {r['compile_s']:>9.1f} | {r['tokens_per_s']:>9.0f} | "
              f"{r['final_loss']:>10.3f} | {r['eval_loss']:>8.3f}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo.json").write_text(json.dumps({"device": str(device), "backend": backend, "steps": args.steps,
                                                    "results": results}, indent=1))
    if plot(results, args.out / "loss.png"):
        print(f"wrote {args.out / 'loss.png'} and {args.out / 'demo.json'}")
    else:
        print(f"wrote {args.out / 'demo.json'} (install matplotlib for the loss-curve PNG)")
    if args.steps < LEARNING_CHECK_STEPS:  # the first 10 and the last 20 steps would overlap: nothing to judge
        print(f"({args.steps} steps: too few to check that the loss falls; that check needs >= "
              f"{LEARNING_CHECK_STEPS})")
        return 0
    start = sum(results[0]["losses"][:10]) / min(10, len(results[0]["losses"]))
    if not results[0]["final_loss"] < start:
        print("the mHC model's loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
