"""A fused wgmma backward block's fixed cost: the kernel alone at grids of a whole number of waves of key-tile blocks
(one block per SM), each with n query-tile pairs, so that time per wave = n t + F (t: a pair, F: a block's cost
outside its pairs: launch, K / V and the first stage's latency, the dK / dV epilogue, the last add's drain).

    python scripts/probes/bwd_item_cost.py [--waves 4] [--seqlens 256,512,768,1536,3072,6144] [--head-dims 64,128]

Non-causal, deterministic=False, impl="fused", bf16, B=1, H chosen so that H x key tiles = waves x SMs. The kernel's
time from the torch profiler (CUPTI), medians of --rounds calls. Prints per head_dim a least-squares fit of the
per-wave time against n, and each point's share of F.
"""
from __future__ import annotations

import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import flashrt
from flashrt import launch


def kernel_us(fn, name: str, rounds: int) -> float:
    """Median device time (us) of the kernels whose name contains `name`, one call of fn per round."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            fn()
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if name in e.name and e.device_time > 0]
    if len(times) != rounds:
        raise RuntimeError(f"{len(times)} kernels named *{name}* in {rounds} calls: "
                           f"{sorted({e.name for e in prof.events()})[:12]}")
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--seqlens", default="256,512,768,1536,3072,6144")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    sms = launch.device(0).sm_count
    print(torch.cuda.get_device_name(), f"{sms} SMs", flush=True)
    lines = ["| D | S | H | pairs a block | kernel us | us a wave | F share |", "|---|---|---|---|---|---|---|"]
    for D in map(int, a.head_dims.split(",")):
        bm = 128 if D == 64 else 64  # the fused kernel's query tile (tiles: 128 rows at head_dim 64)
        pts = []
        for S in map(int, a.seqlens.split(",")):
            tiles_k = S // 128
            if (a.waves * sms) % tiles_k:
                print(f"skip S={S}: {tiles_k} key tiles do not divide {a.waves * sms}")
                continue
            H = a.waves * sms // tiles_k
            g = torch.Generator(device="cuda").manual_seed(S + D)
            q, k, v, do = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
            out, lse = flashrt.forward(q, k, v, causal=False)

            def call():
                flashrt.backward(do, q, k, v, out, lse, causal=False, impl="fused", deterministic=False)
            us = kernel_us(call, "bwd_fused", a.rounds)
            n = S // bm
            pts.append((S, H, n, us, us / a.waves))
        xs, ys = [p[2] for p in pts], [p[4] for p in pts]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        t = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        F = my - t * mx
        for S, H, n, us, w in pts:
            lines.append(f"| {D} | {S} | {H} | {n} | {us:.1f} | {w:.2f} | {F / w:.0%} |")
        lines.append(f"| {D} | fit | | | | t = {t:.3f} us a pair, F = {F:.2f} us a block | |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
