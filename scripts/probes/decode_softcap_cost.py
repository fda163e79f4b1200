"""What a softcap costs flashrt.decode (kernels_cu/sm80/decode.cu: Softcap before the mask): plain against
softcap=50, bf16, one and four new tokens, contiguous caches filled to their length; medians of CUDA-event times
(200 back-to-back calls each) over interleaved rounds after a warm-up. Prints a table: us plain, us capped, ratio.

    python3 scripts/probes/decode_softcap_cost.py [--rounds 7]
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import flashrt  # noqa: E402

# (B, Sk, H, Hkv, D): a GQA 32/8 model at 4k and 32k tokens, a Gemma-2-like 16/8 at head_dim 256
SHAPES = [(64, 4096, 32, 8, 128), (16, 32768, 32, 8, 128), (64, 4096, 16, 8, 256)]
CALLS = 200


def timed(fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(CALLS):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / CALLS


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    rows = []
    for B, Sk, H, Hkv, D in SHAPES:
        for Sq in (1, 4):
            q = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16)
            kc, vc = (torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            lens = torch.full((B,), Sk, dtype=torch.int32, device="cuda")
            runs = {name: (lambda kw=kw: flashrt.decode(q, kc, vc, cache_seqlens=lens, **kw))
                    for name, kw in (("plain", {}), ("softcap", {"softcap": 50.0}))}
            times = {name: [] for name in runs}
            for fn in runs.values():
                fn()
            for _ in range(args.rounds):
                for name, fn in runs.items():
                    times[name].append(timed(fn))
            plain, capped = (statistics.median(times[n]) for n in runs)
            rows.append(f"| B{B} Sk{Sk} H{H}/{Hkv} D{D} Sq{Sq} | {plain:.1f} | {capped:.1f} | {capped / plain:.3f} |")
            print(rows[-1], flush=True)
    print("\n| shape | plain us | softcap us | ratio |\n|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
