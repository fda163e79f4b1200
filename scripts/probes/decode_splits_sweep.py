"""flashrt.decode's split count (num_splits) at short and mid-length caches: every power of two against the automatic
choice (tiles.decode_splits), CUDA-graph replays of 20 calls, interleaved rounds, the inputs rotated past 3x L2
(bench_decode.py's method).

    python3 scripts/probes/decode_splits_sweep.py [--rounds 7] [--shapes "H,Hkv,D,B,Sk;..."] [--extra 3,33]

Prints a table: us per call of each split count, auto's pick and its time over the best one's.
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

import flashrt  # noqa: E402
from flashrt import launch, tiles  # noqa: E402
from bench_decode import capture, copies_for, kv_bytes, make_set, replay_ms  # noqa: E402

SHAPES = [(32, 8, 128, 1, 512), (32, 8, 128, 1, 1024), (32, 8, 128, 1, 2048), (32, 8, 128, 1, 4096),
          (32, 8, 128, 1, 16384), (8, 1, 128, 1, 1024), (8, 1, 128, 1, 4096), (32, 8, 128, 4, 1024),
          (32, 8, 128, 16, 1024), (32, 8, 64, 1, 1024)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shapes", default=";".join(",".join(map(str, x)) for x in SHAPES))
    ap.add_argument("--extra", default="", help="split counts timed beside the powers of two")
    a = ap.parse_args()
    dev = launch.device(0)
    rows = []
    for H, Hkv, D, B, S in (map(int, x.split(",")) for x in a.shapes.split(";")):
        sets = [make_set(B, S, H, Hkv, D, c) for c in range(copies_for(kv_bytes(B, S, Hkv, D), dev.l2_bytes))]
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        extra = [int(x) for x in a.extra.split(",") if x]
        counts = [0] + sorted({s for s in (1, 2, 4, 8, 16, 32, 64, 128, *extra) if s <= -(-S // 64)})
        graphs = {}
        for n in counts:
            calls = [lambda q=q, k=k, v=v, n=n: flashrt.decode(q, k, v, cache_seqlens=lens, num_splits=n)
                     for q, k, v in sets]
            graphs[n] = capture(calls, 20)
        ms = replay_ms(graphs, 20, rounds=a.rounds)
        spec = tiles.decode_spec(D, "bf16", H // Hkv, dev.arch, dev.smem_optin, False, False)
        auto = tiles.decode_splits(spec, B, Hkv, H // Hkv, S, dev.sm_count, dev.smem_optin)  # (decoding's call)
        best = min((t, n) for n, t in ms.items() if n)
        cells = [f"{ms[n] * 1e3:.1f}" if n in ms else "" for n in (0, 1, 2, 4, 8, 16, 32, 64, 128)]
        rows.append(f"| {H}/{Hkv} | {D} | {B} x {S} | " + " | ".join(cells) + f" | {auto} | {best[1]} | "
                    f"{ms[0] / best[0]:.2f} |")
        print(rows[-1], " other counts:", {n: round(ms[n] * 1e3, 1) for n in counts if n not in
                                             (0, 1, 2, 4, 8, 16, 32, 64, 128)}, flush=True)
    print(f"\n{torch.cuda.get_device_name()}, bf16, Sq=1, us per call (column 0: num_splits=0, the automatic choice)")
    print("| H/Hkv | D | B x Sk | auto | 1 | 2 | 4 | 8 | 16 | 32 | 64 | 128 | auto's pick | best | auto / best |")
    print("|" + "---|" * 15)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
