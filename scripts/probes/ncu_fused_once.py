"""One ordered and one unordered fused backward at head_dim 128, S 4k (B4 H16), for ncu; the first pair compiles and
warms up. The two launches run the same cubin (ordered: dq_sem set), so their warp-stall samples compare address by
address (docs/perf-notes.md: The writer's fence):

    ncu --kernel-name regex:flashrt_bwd_fused_sm90 --launch-skip 2 --launch-count 2 --page source --print-source sass \
        --csv --section SourceCounters python3 scripts/probes/ncu_fused_once.py > ncu_src.csv
"""
import torch

import flashrt

B, S, H, D = 4, 4096, 16, 128
q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
out, lse = flashrt.forward(q, k, v)
for det in (True, False, True, False):
    flashrt.backward(do, q, k, v, out, lse, impl="fused", deterministic=det)
torch.cuda.synchronize()
