"""Per-kernel GPU time of flashrt's forward and backward at a few shapes (torch profiler / CUPTI).

    python scripts/kernel_times.py            # prints one table per shape and backward impl: kernel, calls, mean us
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import flashrt  # noqa: E402

# (B, S, H, Hkv, D, causal)
SHAPES = [(2, 1024, 8, 1, 256, False), (2, 1024, 8, 1, 256, True), (2, 8192, 16, 16, 128, False),
          (2, 8192, 8, 8, 256, False), (2, 8192, 32, 32, 64, False)]
REPEATS = 10

VARIANTS = (("split", True), ("fused", True), ("fused", False))  # (impl, deterministic)
for (B, S, H, Hkv, D, causal), (impl, det) in ((shape, v) for shape in SHAPES for v in VARIANTS):
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    do = torch.randn_like(q)
    opts = dict(causal=causal, impl=impl, deterministic=det)
    for _ in range(3):
        out, lse = flashrt.forward(q, k, v, causal=causal)
        flashrt.backward(do, q, k, v, out, lse, **opts)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(REPEATS):
            out, lse = flashrt.forward(q, k, v, causal=causal)
            flashrt.backward(do, q, k, v, out, lse, **opts)
        torch.cuda.synchronize()
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    total = 0.0
    print(f"B={B} S={S} H={H} Hkv={Hkv} D={D} causal={causal} impl={impl} deterministic={det}  (fwd {flops / 1e9:.1f} GFLOP, bwd x2.5)")
    for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total):
        if ev.device_time_total and "flashrt" in ev.key:
            us = ev.device_time_total / REPEATS
            total += us if "_fwd_" not in ev.key else 0.0
            print(f"  {ev.key:60s} {ev.count // REPEATS:3d}x {us:9.1f} us")
    print(f"  backward kernels: {total:.1f} us = {2.5 * flops / total / 1e6:.0f} TFLOP/s")
