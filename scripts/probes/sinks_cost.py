"""What attention sinks cost: flashrt.forward and forward+backward (flashrt.backward, deterministic auto) with and
without `sinks`, bf16, B*S = 16k tokens, H*D = 2048, causal and not; medians of CUDA-event times over interleaved
rounds after a warm-up. Prints a table: ms without / with sinks and the ratio.

    python3 scripts/probes/sinks_cost.py [--rounds 7] [--seqlens 1024,4096,16384] [--head-dims 64,128]
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import flashrt  # noqa: E402


def timed(fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--head-dims", default="64,128")
    a = ap.parse_args()
    rows = []
    for D in map(int, a.head_dims.split(",")):
        for S in map(int, a.seqlens.split(",")):
            B, H = 16384 // S, 2048 // D
            q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            sinks = torch.randn(H, device="cuda")
            for causal in (False, True):
                def fwd(s):
                    return lambda: flashrt.forward(q, k, v, causal=causal, sinks=s)

                def fb(s):
                    def run():
                        out, lse = flashrt.forward(q, k, v, causal=causal, sinks=s)
                        flashrt.backward(do, q, k, v, out, lse, causal=causal, sinks=s)
                    return run
                cases = {"fwd": fwd(None), "fwd sinks": fwd(sinks), "fwd+bwd": fb(None), "fwd+bwd sinks": fb(sinks)}
                times = {n: [] for n in cases}
                for fn in cases.values():
                    for _ in range(3):
                        fn()
                for _ in range(a.rounds):
                    for n, fn in cases.items():
                        times[n].append(timed(fn))
                med = {n: statistics.median(t) for n, t in times.items()}
                rows.append((D, S, causal, med))
    print(f"{torch.cuda.get_device_name()}, bf16, B*S = 16k, H*D = 2048, medians of {a.rounds} interleaved rounds\n")
    print("| D | S | causal | fwd ms | fwd + sinks | ratio | fwd+bwd ms | fwd+bwd + sinks | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for D, S, causal, m in rows:
        print(f"| {D} | {S} | {causal} | {m['fwd']:.3f} | {m['fwd sinks']:.3f} | {m['fwd sinks'] / m['fwd']:.3f} | "
              f"{m['fwd+bwd']:.3f} | {m['fwd+bwd sinks']:.3f} | {m['fwd+bwd sinks'] / m['fwd+bwd']:.3f} |")


if __name__ == "__main__":
    main()
