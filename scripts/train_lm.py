"""Train a small transformer language model with flashrt and with torch's SDPA; compare losses and step times.

    python scripts/train_lm.py --out /tmp/train_lm      # defaults sized for under two minutes on an H100

The two runs start from the same weights and see the same batches; the only
difference is one line, the attention call: flashrt.torch.scaled_dot_product_attention
instead of F.scaled_dot_product_attention, with the same (B, H, S, D) views,
is_causal=True and enable_gqa=True. fp32 weights, bf16 autocast, AdamW.

Synthetic data that only a working attention can fit: each sequence repeats one
block of --period tokens drawn from a sparse random bigram chain (--branch
successors per token). Within the first block the best possible loss is the
bigram entropy ln(branch); every later token copies the token `period` positions
back, which only attention can fetch. So a loss well below ln(branch) means
attention is right, and the two curves must overlap.

Prints a table and writes results.json and loss.png (needs matplotlib) to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import flashrt.torch  # noqa: E402

BACKENDS = {"flashrt": flashrt.torch.scaled_dot_product_attention, "sdpa": F.scaled_dot_product_attention}


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x (B, heads, S, D) at positions pos (S,): relative offsets are easy to learn."""
    D = x.shape[-1]
    freqs = 10000.0 ** (-torch.arange(0, D, 2, device=x.device, dtype=torch.float32) / D)
    angles = pos[:, None].float() * freqs[None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, sdpa):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.sdpa = heads, kv_heads, head_dim, sdpa
        self.qkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
        self.proj = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        qkv = self.qkv(x).view(B, S, self.heads + 2 * self.kv_heads, self.head_dim).transpose(1, 2)
        q, k, v = qkv.split([self.heads, self.kv_heads, self.kv_heads], dim=1)  # (B, heads, S, D) views
        q, k = rope(q, pos), rope(k, pos)
        o = self.sdpa(q, k, v, is_causal=True, enable_gqa=self.heads != self.kv_heads)
        return self.proj(o.transpose(1, 2).reshape(B, S, -1))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, sdpa):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, kv_heads, head_dim, sdpa)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), pos)
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, args, sdpa):
        super().__init__()
        self.embed = nn.Embedding(args.vocab, args.dim)
        self.blocks = nn.ModuleList(Block(args.dim, args.heads, args.kv_heads, args.dim // args.heads, sdpa)
                                    for _ in range(args.layers))
        self.norm = nn.LayerNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, pos)
        return self.head(self.norm(x))


def make_data(args, device) -> torch.Tensor:
    """(steps, batch, seq + 1) tokens: a bigram-chain block of `period` tokens, repeated."""
    g = torch.Generator(device=device).manual_seed(args.seed)
    successors = torch.randint(args.vocab, (args.vocab, args.branch), generator=g, device=device)
    n = args.steps * args.batch
    choice = torch.randint(args.branch, (n, args.period), generator=g, device=device)
    block = torch.empty(n, args.period, dtype=torch.long, device=device)
    block[:, 0] = torch.randint(args.vocab, (n,), generator=g, device=device)
    for t in range(1, args.period):
        block[:, t] = successors[block[:, t - 1], choice[:, t]]
    reps = -(-(args.seq + 1) // args.period)
    return block.repeat(1, reps)[:, :args.seq + 1].view(args.steps, args.batch, args.seq + 1)


def train(args, backend: str, data: torch.Tensor) -> dict:
    torch.manual_seed(args.seed)  # the same initial weights for every backend
    model = LM(args, BACKENDS[backend]).cuda()
    step_fn = torch.compile(model) if args.compile else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / args.steps))))
    torch.cuda.reset_peak_memory_stats()
    losses, t0 = [], time.perf_counter()
    first_step_s = timed_from = None
    for step in range(args.steps):
        if step == args.timing_skip:
            torch.cuda.synchronize()
            timed_from = time.perf_counter()
        tokens = data[step]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = step_fn(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.detach())  # no .item() in the loop: a host sync per step would distort the timing
        if step == 0:
            torch.cuda.synchronize()
            first_step_s = time.perf_counter() - t0  # includes loading (or compiling) kernels
    torch.cuda.synchronize()
    step_ms = (time.perf_counter() - timed_from) * 1e3 / (args.steps - args.timing_skip)
    return {"loss": torch.stack(losses).tolist(), "step_ms": step_ms, "first_step_s": first_step_s,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def plot(results: dict, args, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        ax.plot(r["loss"], label=f"{name} ({r['step_ms']:.1f} ms/step)", linewidth=1)
    ax.axhline(math.log(args.branch), color="gray", linestyle=":", label=f"bigram entropy ln({args.branch})")
    ax.set(xlabel="step", ylabel="training loss (nats/token)", yscale="log",
           title=f"{args.layers} layers, dim {args.dim}, {args.heads}/{args.kv_heads} heads, "
                 f"B={args.batch}, S={args.seq}, bf16 autocast")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--period", type=int, default=64, help="length of the repeated block")
    ap.add_argument("--branch", type=int, default=4, help="successors per token in the bigram chain")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timing-skip", type=int, default=20, help="steps left out of the step time (warm-up)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model (both backends)")
    ap.add_argument("--backends", default="flashrt,sdpa")
    ap.add_argument("--out", type=Path, default=Path("train_lm_out"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("train_lm.py needs a CUDA GPU", file=sys.stderr)
        return 1
    if args.dim % args.heads or (args.dim // args.heads) % 8:
        ap.error("--dim / --heads must be a multiple of 8 (flashrt's head_dim)")
    if not 0 <= args.timing_skip < args.steps:
        ap.error("--timing-skip must be below --steps")

    data = make_data(args, "cuda")
    results = {name: train(args, name, data) for name in args.backends.split(",")}

    args.out.mkdir(parents=True, exist_ok=True)
    print(f"{'backend':<9} {'first step s':>12} {'step ms':>8} {'peak GiB':>9} {'loss@0':>7} {'final loss':>10}")
    for name, r in results.items():
        final = sum(r["loss"][-20:]) / len(r["loss"][-20:])
        print(f"{name:<9} {r['first_step_s']:>12.2f} {r['step_ms']:>8.2f} {r['peak_gib']:>9.2f} "
              f"{r['loss'][0]:>7.3f} {final:>10.4f}")
    summary = {"config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "device": torch.cuda.get_device_name(), "torch": torch.__version__, "results": results}
    if len(results) == 2:
        a, b = (r["loss"] for r in results.values())
        summary["max_abs_loss_diff"] = max(abs(x - y) for x, y in zip(a, b))
        print(f"max |loss difference| over {args.steps} steps: {summary['max_abs_loss_diff']:.4f} "
              f"(bigram entropy ln({args.branch}) = {math.log(args.branch):.3f})")
    (args.out / "results.json").write_text(json.dumps(summary, indent=1))
    png = args.out / "loss.png"
    print(f"wrote {args.out / 'results.json'}" + (f" and {png}" if plot(results, args, png) else
                                                     " (pip install matplotlib for loss.png)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
