"""One decode call after warm-up, for ncu (only that call is profiled: run ncu with --profile-from-start off):

    python scripts/probes/decode_one.py B S H Hkv D [page_size] [--cudnn]

--cudnn: torch SDPA's cuDNN backend on the same cache instead (q (B, H, 1, D) against transposed views)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flashrt  # noqa: E402

args = [a for a in sys.argv[1:] if not a.startswith("--")]
B, S, H, Hkv, D = map(int, args[:5])
page = int(args[5]) if len(args) > 5 else 0
q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
if page:
    kc, vc = (torch.randn(B * S // page, page, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(B * S // page, device="cuda").view(B, -1).to(torch.int32)
else:
    kc, vc = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table = None
lens = torch.full((B,), S, dtype=torch.int32, device="cuda")


def call():
    if "--cudnn" in sys.argv:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), kc.transpose(1, 2),
                                                                    vc.transpose(1, 2), enable_gqa=True)
    return flashrt.decode(q, kc, vc, cache_seqlens=lens, page_table=table)


for _ in range(3):
    call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
call()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
