"""flashrt.forward at a few query rows, through decode.cu and through the forward kernels
(FLASHRT_NO_DECODE_FORWARD=1), CUDA-graph replays, interleaved rounds: python scripts/probes/forward_small_q.py."""
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

import flashrt  # noqa: E402
from bench_decode import capture, replay_ms  # noqa: E402

CASES = [(1, 1, 32, 8, 128, 128), (1, 1, 32, 8, 128, 1024), (8, 1, 32, 8, 128, 512), (1, 16, 32, 8, 128, 512),
         (4, 16, 16, 16, 64, 2048), (16, 4, 32, 8, 128, 4096), (2, 16, 8, 1, 256, 256), (1, 8, 16, 16, 128, 64)]
for B, Sq, H, Hkv, D, Sk in CASES:
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    graphs = {}
    for mode in ("decode", "forward"):
        os.environ["FLASHRT_NO_DECODE_FORWARD"] = "1" if mode == "forward" else "0"
        graphs[mode] = capture([lambda: flashrt.forward(q, k, v, causal=True)], 20)
    times = replay_ms(graphs, 20, rounds=7)
    d, f = (times[m] * 1e3 for m in ("decode", "forward"))
    print(f"B{B} Sq{Sq} H{H}/{Hkv} D{D} Sk{Sk}: decode {d:.1f} us, forward {f:.1f} us, forward/decode {f / d:.2f}")
