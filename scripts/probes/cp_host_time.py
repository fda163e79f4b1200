"""Host time inside one ring_attention forward on each rank: how long _pass_on (the copy engines' pass, or NCCL's),
_take_report and each step's api.forward take on the host (time.perf_counter around each, medians of 20 calls after
a warm-up; the GPU is made busy first so that the host never waits for it), and the whole call's host time.

    python3 scripts/probes/cp_host_time.py [S] [H/Hkv/D] [--profile]     (every visible GPU)

With --profile, rank 0 runs 20 more calls under cProfile and prints the functions that took the most host
time (their own, then with what they call): where `_pass_on`'s and `_merge_steps`' time goes.
"""
import os
import statistics
import sys
import time

import torch

from cp_timeline import join, run, shards  # (it puts the repository and scripts/ on the path)

if "--profile" in sys.argv:  # (to the spawned ranks by the environment: they see the parent's argv without it)
    sys.argv.remove("--profile")
    os.environ["CP_HOST_TIME_PROFILE"] = "1"
PROFILE = os.environ.get("CP_HOST_TIME_PROFILE") == "1"


def _worker(rank, world, path, S, heads):
    join(rank, world, path)
    import flashrt.distributed as fd
    from flashrt import api
    q, k, v, _ = shards(S, heads)
    spent = {"_pass_on": [], "_take_report": [], "api.forward": [], "_merge_steps": [], "whole call": []}

    def timed(owner, name):
        real = getattr(owner, name.split(".")[-1])

        def wrapped(*a, **kw):
            t = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                spent[name].append((time.perf_counter() - t) * 1e6)
        setattr(owner, name.split(".")[-1], wrapped)

    for _ in range(3):
        fd.ring_attention(q, k, v, causal=True, check=False)
    torch.cuda.synchronize()
    timed(fd, "_pass_on"), timed(fd, "_take_report"), timed(fd, "_merge_steps"), timed(api, "api.forward")
    for _ in range(20):
        torch.cuda._sleep(20_000_000)  # (~10 ms of GPU time: the host runs ahead)
        t = time.perf_counter()
        fd.ring_attention(q, k, v, causal=True, check=False)
        spent["whole call"].append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    print(f"rank {rank}, S={S}: host us per call (median of {len(spent['whole call'])}), per occurrence: "
          + ", ".join(f"{n} {statistics.median(t):.0f} x{len(t) // 20}" for n, t in spent.items() if t), flush=True)
    if PROFILE:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        for _ in range(20):
            torch.cuda._sleep(20_000_000)
            prof.enable()
            fd.ring_attention(q, k, v, causal=True, check=False)
            prof.disable()
            torch.cuda.synchronize()
        if rank == 0:
            for key in ("tottime", "cumtime"):
                pstats.Stats(prof).sort_stats(key).print_stats(22)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    run(_worker, 32768)
