"""Would a copy-engine transfer hide behind the ring's step 0 where NCCL's does not? One process, two GPUs: each GPU
runs the 2-GPU zigzag ring's causal forward (step 0: its 16k-token shard, causal; step 1: against the other GPU's K /
V, non-causal) while its K and V go to the other GPU by cudaMemcpyPeerAsync on a side stream (the copy engines, no
SMs). Both GPUs at once, the host ahead (a sleep on every stream first), CUDA events, medians over interleaved rounds.

    python3 scripts/probes/cp_copy_engine.py [S per GPU, default 16384] [H/Hkv/D, default 16/16/128] [--rounds 7]

Modes: "no comm" (step 1 against the GPU's own K / V, the steps' cost), "copy engine" (the copy issued first, step
1 after it), "step 0 alone", "copy alone"; and in "copy engine" how long step 0 and the copy each took beside the
other. NCCL's pass took 0.60 ms alone and ~1.97 ms beside step 0 (docs/perf-notes.md: Context parallelism).
"""
import argparse
import statistics
import os
import sys

import cupy
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import flashrt  # noqa: E402

SLEEP = 20_000_000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("S", nargs="?", type=int, default=16384)
    ap.add_argument("heads", nargs="?", default="16/16/128")
    ap.add_argument("--rounds", type=int, default=7)
    a = ap.parse_args()
    H, Hkv, D = map(int, a.heads.split("/"))
    assert torch.cuda.device_count() >= 2, "two GPUs"
    gpus = (0, 1)
    for d in gpus:
        with cupy.cuda.Device(d):
            try:
                cupy.cuda.runtime.deviceEnablePeerAccess(1 - d)
            except cupy.cuda.runtime.CUDARuntimeError as e:  # (already enabled by torch)
                print(f"peer access {d}->{1 - d}: {e}")
    S, half = a.S, a.S // 2
    t = {}
    for d in gpus:
        g = torch.Generator(device=f"cuda:{d}").manual_seed(d)
        t[d] = dict(q=torch.randn(1, S, H, D, device=f"cuda:{d}", generator=g, dtype=torch.bfloat16),
                    k=torch.randn(1, S, Hkv, D, device=f"cuda:{d}", generator=g, dtype=torch.bfloat16),
                    v=torch.randn(1, S, Hkv, D, device=f"cuda:{d}", generator=g, dtype=torch.bfloat16),
                    rk=torch.empty(1, S, Hkv, D, device=f"cuda:{d}", dtype=torch.bfloat16),
                    rv=torch.empty(1, S, Hkv, D, device=f"cuda:{d}", dtype=torch.bfloat16),
                    main=torch.cuda.Stream(device=d), side=torch.cuda.Stream(device=d))
    nbytes = t[0]["k"].numel() * 2

    def step1(d, k, v):  # the zigzag ring's step 1 (distributed.ring.ring_steps): rank 0 its tail rows, rank 1 all
        q = t[d]["q"]  # rows against the head chunk
        if d == 0:
            return flashrt.forward(q[:, half:], k, v)
        return flashrt.forward(q, k[:, :half], v[:, :half])

    def run(mode):
        """Queue `mode` on both GPUs behind a sleep; returns per GPU (start, step0 end, copy end, end) events."""
        ev = {}
        for d in gpus:
            x = t[d]
            e = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
            with torch.cuda.device(d):
                x["main"].wait_stream(torch.cuda.current_stream(d))
                with torch.cuda.stream(x["main"]):
                    torch.cuda._sleep(SLEEP)
                    e[0].record()
                x["side"].wait_event(e[0])
            ev[d] = e
        for d in gpus:  # the copies first, as the ring issues its pass before step 0
            x, peer = t[d], t[1 - d]
            if mode in ("copy engine", "copy alone"):
                with torch.cuda.device(d), cupy.cuda.Device(d):
                    s = x["side"].cuda_stream
                    for src, dst in ((x["k"], peer["rk"]), (x["v"], peer["rv"])):
                        cupy.cuda.runtime.memcpyPeerAsync(dst.data_ptr(), 1 - d, src.data_ptr(), d, nbytes, s)
            ev[d][2].record(x["side"])  # (no copy: at the start)
        for d in gpus:
            x, peer = t[d], t[1 - d]
            with torch.cuda.device(d), torch.cuda.stream(x["main"]):
                if mode != "copy alone":
                    flashrt.forward(x["q"], x["k"], x["v"], causal=True)
                ev[d][1].record()
                if mode == "copy engine":
                    x["main"].wait_event(ev[d][2])  # (the other GPU's copy into this one: its side stream's)
                    x["main"].wait_event(ev[1 - d][2])
                    step1(d, x["rk"], x["rv"])
                elif mode == "no comm":
                    step1(d, x["k"], x["v"])
                if mode == "copy alone":
                    x["main"].wait_event(ev[d][2])
                ev[d][3].record()
        for d in gpus:
            torch.cuda.synchronize(d)
        return {d: [ev[d][0].elapsed_time(e) for e in ev[d][1:]] for d in gpus}

    modes = ("no comm", "copy engine", "step 0 alone", "copy alone")
    for m in modes:
        run(m)
    res = {m: [] for m in modes}
    for _ in range(a.rounds):
        for m in modes:
            res[m].append(run(m))
    # check: step 1 on copied K / V gives what it gives on the other GPU's own
    for d in gpus:
        with torch.cuda.device(d):
            got = step1(d, t[d]["rk"], t[d]["rv"])[0]
            want = step1(d, t[1 - d]["k"].to(f"cuda:{d}"), t[1 - d]["v"].to(f"cuda:{d}"))[0]
            assert torch.equal(got, want), "the copied K / V differ"

    def med(m, d, i):
        return statistics.median(r[d][i] for r in res[m])

    print(f"S {S} per GPU, H {H}/{Hkv} D {D}, K + V {2 * nbytes / 2**20:.0f} MiB each way, {a.rounds} rounds, "
          f"{torch.cuda.get_device_name(0)}")
    print("| GPU | no comm | copy engine | step 0 alone | step 0 beside copy | copy alone | copy beside step 0 |")
    print("|---|---|---|---|---|---|---|")
    for d in gpus:
        print(f"| {d} | {med('no comm', d, 2):.3f} | {med('copy engine', d, 2):.3f} | {med('step 0 alone', d, 0):.3f} "
              f"| {med('copy engine', d, 0):.3f} | {med('copy alone', d, 1):.3f} | {med('copy engine', d, 1):.3f} |")
    print(f"copy alone: {2 * nbytes / med('copy alone', 0, 1) / 1e6:.0f} GB/s per direction (GPU 0's)")


if __name__ == "__main__":
    main()
