"""Decode's cp.async ring depth side by side (CUDA-graph replays, interleaved rounds):
python scripts/probes/decode_stages.py [run,...] [H/Hkv/D,...] [B:S,...]. A run is a depth n (spec.KernelSpec.
decode_stages patched: the kernel's define and the host's shared-memory size follow it, so that tiles.decode_splits
sees the blocks per SM it gives; 0: the library's own, 3 at head_dim <= 128), optionally with a split count: "6" (the
count the split model picks for that depth), "6:=" (the library's count at 3 stages), "6:1" (one split). Checks each
depth against float64 first; prints TB/s of K/V read per point and run."""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from flashrt import spec as specmod  # noqa: E402
from bench_decode import (capture, copies_for, decode_calls, decode_error, kv_bytes, library_splits,  # noqa: E402
                          make_set, replay_ms)
from variants import fresh  # noqa: E402

RUN_ARGS = (sys.argv[1] if len(sys.argv) > 1 else "0,4,4:=,6,6:=").split(",")
RUNS = [(int(r.split(":")[0]), r.split(":")[1] if ":" in r else "") for r in RUN_ARGS]
DEPTHS = sorted({d for d, _ in RUNS})
HEADS = [tuple(map(int, h.split("/"))) for h in
         (sys.argv[2] if len(sys.argv) > 2 else "8/1/64,32/8/64,32/8/128").split(",")]
POINTS = [tuple(map(int, p.split(":"))) for p in
          (sys.argv[3] if len(sys.argv) > 3 else "1:4096,16:1024,128:1024,16:8192,64:4096,1:32768").split(",")]
real_stages = specmod.KernelSpec.decode_stages


def use(depth: int) -> None:
    specmod.KernelSpec.decode_stages = property(lambda spec: depth) if depth else real_stages
    fresh()


print(torch.cuda.get_device_name())
for depth, (H, Hkv, D) in itertools.product(DEPTHS, HEADS):
    use(depth)
    print(f"check depth {depth} {H}/{Hkv} D{D}: rel err {decode_error(H, Hkv, D):.1e}", flush=True)
table = ["| H/Hkv D | B x S | splits | " + " | ".join(RUN_ARGS) + " |", "|---|---|---|" + "---|" * len(RUNS)]
for (H, Hkv, D), (B, S) in itertools.product(HEADS, POINTS):
    sets = [make_set(B, S, H, Hkv, D, c) for c in range(copies_for(kv_bytes(B, S, Hkv, D), 60 * 2**20))]
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    use(0)
    lib = library_splits(B, S, H, Hkv, D)
    graphs = {}
    for d, sp in RUNS:
        use(d)
        graphs[(d, sp)] = capture(decode_calls(sets, lens, lib if sp == "=" else int(sp or 0)), 20)
    tbs = {r: kv_bytes(B, S, Hkv, D) / ms / 1e9 for r, ms in replay_ms(graphs, 20).items()}
    table.append(f"| {H}/{Hkv} D{D} | {B} x {S} | {lib} | " + " | ".join(f"{tbs[r]:.2f}" for r in RUNS) + " |")
    print(table[-1], flush=True)
    del sets, graphs
    torch.cuda.empty_cache()
use(0)
print("\nTB/s of K/V read:")
print("\n".join(table))
