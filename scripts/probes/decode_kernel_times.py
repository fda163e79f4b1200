"""Per-kernel GPU time of flashrt.decode (decode.cu and its combine) and of SDPA cuDNN's decode on the same tensors,
torch profiler / CUPTI, 20 calls each: python scripts/probes/decode_kernel_times.py [H/Hkv/D:B:S,...]. Also the
call's time in a CUDA graph of 20 (bench_decode's), so that the launches' gaps show beside the kernels' own time."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import flashrt  # noqa: E402
from bench_decode import call_of, capture, replay_ms  # noqa: E402

SHAPES = [tuple(map(int, s.replace("/", ":").split(":"))) for s in (sys.argv[1] if len(sys.argv) > 1 else
          "8/1/128:1:32768,32/8/128:1:32768,8/1/128:16:4096,32/8/128:16:1024,8/1/128:128:1024,32/8/128:64:4096"
          ).split(",")]

for H, Hkv, D, B, S in SHAPES:
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    calls = {"flashrt": lambda: flashrt.decode(q, k, v, cache_seqlens=lens),
             "cudnn": call_of("cudnn", q, k, v, lens, None)}
    graphs = {name: capture([f], 20) for name, f in calls.items()}
    graph_us = {name: ms * 1e3 for name, ms in replay_ms(graphs, 20).items()}
    for name, f in calls.items():
        for _ in range(3):
            f()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                f()
            torch.cuda.synchronize()
        row = [f"{ev.key[:60]} {ev.device_time_total / ev.count:.1f} us" for ev in prof.key_averages()
               if ev.count >= 20 and ev.device_time_total > 0]
        print(f"{H}/{Hkv} D{D} {B}x{S} {name}: graph {graph_us[name]:.1f} us per call; " + "; ".join(row), flush=True)
