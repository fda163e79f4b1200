"""One decode call after warm-up, for ncu: python scripts/probes/decode_one.py B S H Hkv D [page_size]."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

import flashrt  # noqa: E402

B, S, H, Hkv, D = map(int, sys.argv[1:6])
page = int(sys.argv[6]) if len(sys.argv) > 6 else 0
q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
if page:
    kc, vc = (torch.randn(B * S // page, page, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(B * S // page, device="cuda").view(B, -1).to(torch.int32)
else:
    kc, vc = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = None
lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
for _ in range(3):
    flashrt.decode(q, kc, vc, cache_seqlens=lens, page_table=table)
torch.cuda.synchronize()
