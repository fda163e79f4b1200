"""Per-kernel GPU time of flashrt.decode (decode.cu and its combine) at small shapes, torch profiler / CUPTI:
python scripts/probes/decode_kernel_times.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import flashrt  # noqa: E402

for H, Hkv, D, B, S in [(8, 1, 128, 1, 32768), (32, 8, 128, 1, 32768), (8, 1, 128, 16, 4096), (32, 8, 128, 16, 1024),
                        (8, 1, 128, 128, 1024), (32, 8, 128, 64, 4096)]:
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    for _ in range(3):
        flashrt.decode(q, k, v, cache_seqlens=lens)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            flashrt.decode(q, k, v, cache_seqlens=lens)
        torch.cuda.synchronize()
    row = [f"{ev.key.split('_')[1]}_{ev.key.split('_')[2]} {ev.device_time_total / ev.count:.1f} us"
           for ev in prof.key_averages() if "flashrt" in ev.key and ev.count]
    print(f"{H}/{Hkv} D{D} {B}x{S}: " + ", ".join(row))
