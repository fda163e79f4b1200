"""FlashAttention-4's Hopper backward and flashrt's fused wgmma backward (unordered), one call each inside a profiler
window, for ncu side by side (docs/perf-notes.md: Per-pair fixed cost):

    ncu --profile-from-start off --set full -o $OUT/pair python3 scripts/probes/ncu_fa4_pair.py [--D 128] [--full]

B x S = 16k, H x D = 2048, S 4k, causal unless --full. Both are timed first (FA4 compiles, flashrt loads);
FA4 by torch.autograd.grad of its output, as its users call it; flashrt.backward on one forward's out and lse.
Needs flash_attn.cute on the path (../shared/baselines/README.md)."""
import argparse
import sys
from pathlib import Path

import torch

import flashrt
from flash_attn.cute import flash_attn_func

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mask_times import time_ms  # noqa: E402  (scripts/: CUDA events after 3 warm-up calls, the median of reps)

ap = argparse.ArgumentParser()
ap.add_argument("--D", type=int, default=128)
ap.add_argument("--S", type=int, default=4096)
ap.add_argument("--full", action="store_true", help="not causal")
a = ap.parse_args()
causal, S, D = not a.full, a.S, a.D
B, H = max(1, 16384 // S), 2048 // D
q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
fa_out = flash_attn_func(qg, kg, vg, causal=causal)
fa_out = fa_out[0] if isinstance(fa_out, tuple) else fa_out
out, lse = flashrt.forward(q, k, v, causal=causal)


def fa4():
    return torch.autograd.grad(fa_out, (qg, kg, vg), do, retain_graph=True)


def ours():
    return flashrt.backward(do, q, k, v, out, lse, causal=causal, impl="fused", deterministic=False)


ref, got = fa4(), ours()
err = max(float((g.float() - r.float()).norm() / r.float().norm()) for g, r in zip(got, ref))
for name, f in (("fa4", fa4), ("flashrt", ours)):  # (also the warm-up before the window)
    print(f"{name}: {time_ms(f, 5):.3f} ms a backward (outside ncu, the median of 5 calls)")
print(f"flashrt against FA4's gradients: largest relative norm difference {err:.1e}")
torch.cuda.profiler.start()
fa4()
torch.cuda.synchronize()
ours()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
