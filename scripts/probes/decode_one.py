"""One decode call after warm-up, for ncu (only that call is profiled: run ncu with --profile-from-start off):

    python scripts/probes/decode_one.py B S H Hkv D [page_size] [--cudnn]

--cudnn: torch SDPA's cuDNN backend on the same cache instead (q (B, H, 1, D) against transposed views)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

import flashrt  # noqa: E402
from bench_decode import call_of  # noqa: E402

args = [a for a in sys.argv[1:] if not a.startswith("--")]
B, S, H, Hkv, D = map(int, args[:5])
page = int(args[5]) if len(args) > 5 else 0
assert not (page and "--cudnn" in sys.argv), "--cudnn reads a contiguous cache"
q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
if page:
    kc, vc = (torch.randn(B * S // page, page, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(B * S // page, device="cuda").view(B, -1).to(torch.int32)
else:
    kc, vc = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = None
lens = torch.full((B,), S, dtype=torch.int32, device="cuda")

call = (call_of("cudnn", q, kc, vc, lens, None) if "--cudnn" in sys.argv  # (bench_decode's SDPA call)
        else lambda: flashrt.decode(q, kc, vc, cache_seqlens=lens, page_table=table))

for _ in range(3):
    call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
