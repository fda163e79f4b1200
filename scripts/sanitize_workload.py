"""Small forward+backward runs that touch every kernel family and edge path; the workload
that scripts/sanitize.sh runs under compute-sanitizer."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import flashrt  # noqa: E402

# (B, Sq, Sk, H, Hkv, D, causal, dtype): ragged tiles, padded head dims, GQA, Sq != Sk both ways.
CASES = [
    (1, 70, 45, 2, 1, 64, True, torch.bfloat16),
    (1, 45, 70, 2, 2, 72, False, torch.float16),
    (1, 33, 97, 4, 2, 256, True, torch.bfloat16),
    (2, 130, 130, 2, 1, 128, False, torch.bfloat16),
    (1, 17, 9, 2, 1, 8, True, torch.float16),
    (2, 200, 200, 8, 1, 96, True, torch.bfloat16),  # MQA, small grid: split dK/dV with partials
]

for B, Sq, Sk, H, Hkv, D, causal, dt in CASES:
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dt)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt)
    out, lse = flashrt.forward(q, k, v, causal=causal)
    do = torch.randn_like(out)
    flashrt.backward(do, q, k, v, out, lse, causal=causal, impl="split")
    flashrt.backward(do, q, k, v, out, lse, causal=causal, impl="fused", deterministic=False)
    flashrt.backward(do, q, k, v, out, lse, causal=causal, impl="fused", deterministic=True)
torch.cuda.synchronize()
print(f"sanitize workload: {len(CASES)} cases ran")
