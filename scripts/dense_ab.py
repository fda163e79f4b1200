"""Dense forward / backward time of the flashrt importable from sys.path (for A/B runs of two trees,
or of one tree with and without FLASHRT_NO_SM90=1).

    PYTHONPATH=<tree> python scripts/dense_ab.py LABEL
"""
import sys

import torch

import flashrt
from mask_times import time_ms  # scripts/ is sys.path[0] when run as a script


for B, S, H, D, causal in ((2, 8192, 16, 128, False), (2, 8192, 16, 128, True), (2, 8192, 32, 64, False),
                           (2, 8192, 8, 256, False)):
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    out, lse = flashrt.forward(q, k, v, causal=causal)
    f = time_ms(lambda: flashrt.forward(q, k, v, causal=causal))
    b = time_ms(lambda: flashrt.backward(do, q, k, v, out, lse, causal=causal))
    print(f"{sys.argv[1]:6s} B={B} S={S} H={H} D={D} causal={causal!s:5s} fwd {f:6.2f} ms  bwd {b:6.2f} ms")
