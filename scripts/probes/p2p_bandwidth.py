"""The ring's transfer alone: flashrt.distributed._pass_on of tensors like one rank's K and V (or one buffer of
the same bytes) between the visible GPUs, idle otherwise; median of 20 after a warm-up, in ms and GB/s per
direction. NCCL_* variables in the environment apply (run it once per setting).

    python3 scripts/probes/p2p_bandwidth.py [MB per tensor, default 67]
"""
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_cp import join, timed_ms  # noqa: E402


def _worker(rank, world, path, mb):
    join(rank, world, path)
    import flashrt.distributed as fd
    n = int(mb * 2**20) // 2
    two = tuple(torch.randn(n, device="cuda").to(torch.bfloat16) for _ in range(2))
    one = (torch.randn(2 * n, device="cuda").to(torch.bfloat16),)
    line = []
    for name, tensors in (("two tensors", two), ("one buffer", one)):
        run = lambda: fd._wait(fd._pass_on(dist.group.WORLD, tensors)[1])  # noqa: E731
        for _ in range(3):
            run()
        ms = statistics.median(timed_ms(run) for _ in range(20))
        line.append(f"{name}: {ms:.3f} ms {2 * n * 2 / ms / 1e6:.0f} GB/s")
    if rank == 0:
        env = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("NCCL_")) or "(defaults)"
        print(f"{env:40s} {world} GPUs, {2 * n * 2 / 2**20:.0f} MiB: " + "; ".join(line), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    world = torch.cuda.device_count()
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, os.path.join(d, "rdv"), float(sys.argv[1]) if len(sys.argv) > 1 else 67.0),
                 nprocs=world, join=True)
