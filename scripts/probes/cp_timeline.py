"""Timeline of one ring_attention forward+backward on rank 0 (torch.profiler, CUDA activity): each kernel's
stream, start and duration relative to the first, so that the NCCL transfers can be seen against the steps.

    python3 scripts/probes/cp_timeline.py [S] [H/Hkv/D]     (every visible GPU; prints rank 0's timeline)
"""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_cp import join, no_comm, timed_ms  # noqa: E402


def shards(S: int, heads: tuple) -> list:
    """This rank's zigzag shards of fresh (1, S, h, D) bf16 q, k, v and dout (seeded by S: every rank alike)."""
    import flashrt.distributed as fd
    H, Hkv, D = heads
    g = torch.Generator(device="cuda").manual_seed(S)
    return [fd.shard_sequence(torch.randn(1, S, h, D, device="cuda", generator=g, dtype=torch.bfloat16))
            for h in (H, Hkv, Hkv, H)]


def run(worker, default_S: int) -> None:
    """worker(rank, world, rendezvous path, S, (H, Hkv, D)) on every visible GPU, S and H/Hkv/D from the command
    line."""
    S = int(sys.argv[1]) if len(sys.argv) > 1 else default_S
    heads = tuple(map(int, (sys.argv[2] if len(sys.argv) > 2 else "16/16/128").split("/")))
    world = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(worker, args=(world, os.path.join(d, "rendezvous"), S, heads), nprocs=world)


def _worker(rank, world, path, S, heads):
    join(rank, world, path)
    import flashrt.distributed as fd
    local = shards(S, heads)
    x = [t.requires_grad_() for t in local[:3]]

    def step():
        out = fd.ring_attention(*x, causal=True, check=False)
        torch.autograd.grad(out, x, local[3])

    for _ in range(2):
        step()
    times = [(timed_ms(step), timed_ms(no_comm(step))) for _ in range(5)]  # (ring, no comm), interleaved
    print(f"rank {rank}: ring / no-comm ms per fwd+bwd: " + ", ".join(f"{a:.2f}/{b:.2f}" for a, b in times))
    torch.cuda.synchronize()
    dist.barrier()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    if rank == 0:
        import json
        trace = os.path.join(tempfile.mkdtemp(), "trace.json")
        prof.export_chrome_trace(trace)
        kernels = [e for e in json.load(open(trace))["traceEvents"] if e.get("cat") in ("kernel", "gpu_memcpy",
                                                                                          "gpu_memset")]
        t0 = min(e["ts"] for e in kernels)
        for e in sorted(kernels, key=lambda e: e["ts"]):
            if e["dur"] >= 50:
                stream = e["args"].get("stream", "?")
                print(f"{(e['ts'] - t0) / 1e3:9.2f} ms  +{e['dur'] / 1e3:7.2f}  stream {stream:>3}  {e['name'][:80]}")
    dist.destroy_process_group()


if __name__ == "__main__":
    run(_worker, 65536)
