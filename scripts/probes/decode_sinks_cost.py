"""What sinks cost flashrt.decode: one new token, bf16, contiguous cache, with and without `sinks`, one block per
sequence (decode.cu joins the sink) and split (combine.cu does); medians of CUDA-event times over interleaved
rounds, each call replayed from a CUDA graph (as a serving loop runs it). Prints a table.

    python3 scripts/probes/decode_sinks_cost.py [--rounds 9]
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import flashrt  # noqa: E402

# (B, keys, H, Hkv, D)
SHAPES = [(16, 4096, 32, 8, 128), (64, 2048, 64, 8, 64), (1, 32768, 32, 8, 128), (4, 16384, 8, 1, 128)]


def graphed(fn):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=9)
    a = ap.parse_args()
    rows = []
    for B, L, H, Hkv, D in SHAPES:
        q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(B, L, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        lens = torch.full((B,), L, device="cuda", dtype=torch.int32)
        sinks = torch.randn(H, device="cuda")
        cases = {m: graphed(lambda kw=kw: flashrt.decode(q, kc, vc, cache_seqlens=lens, **kw))
                 for m, kw in (("plain", {}), ("sinks", {"sinks": sinks}))}
        times = {m: [] for m in cases}
        for _ in range(a.rounds):
            for m, fn in cases.items():
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                for _ in range(20):
                    fn()
                e.record()
                torch.cuda.synchronize()
                times[m].append(s.elapsed_time(e) / 20 * 1e3)
        med = {m: statistics.median(t) for m, t in times.items()}
        rows.append((B, L, H, Hkv, D, med["plain"], med["sinks"]))
    print(f"{torch.cuda.get_device_name()}, flashrt.decode, bf16, one new token, graph replays, medians of "
          f"{a.rounds} rounds of 20\n")
    print("| B | keys | H / Hkv | D | plain us | sinks us | ratio |\n|---|---|---|---|---|---|---|")
    for B, L, H, Hkv, D, p, s in rows:
        print(f"| {B} | {L} | {H} / {Hkv} | {D} | {p:.1f} | {s:.1f} | {s / p:.3f}x |")


if __name__ == "__main__":
    main()
