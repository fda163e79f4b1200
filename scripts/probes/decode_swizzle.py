"""Decode's tiles unpadded and swizzled (spec.KernelSpec.swizzled, the library's) against padded rows, beside
SDPA cuDNN; CUDA-graph replays, interleaved rounds: python scripts/probes/decode_swizzle.py [H/Hkv/D,...] [B:S,...].
Both forms are checked against float64 first (ragged lengths, 3 splits); prints TB/s of K/V read per point
(docs/perf-notes.md, Decode: the loader)."""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from flashrt import launch, spec as specmod, tiles  # noqa: E402
from bench_decode import (call_of, capture, copies_for, decode_calls, decode_error, kv_bytes, make_set,  # noqa: E402
                          replay_ms)
from variants import fresh  # noqa: E402

HEADS = [tuple(map(int, h.split("/"))) for h in
         (sys.argv[1] if len(sys.argv) > 1 else "32/8/64,8/1/128,32/8/128,8/1/256").split(",")]
POINTS = [tuple(map(int, p.split(":"))) for p in (sys.argv[2] if len(sys.argv) > 2 else
          "1:4096,16:1024,4:8192,1:32768,16:8192,64:4096,128:1024").split(",")]
real = specmod.KernelSpec.swizzled


def use(swizzled: bool) -> None:
    specmod.KernelSpec.swizzled = real if swizzled else property(lambda spec: False)
    fresh()


print(torch.cuda.get_device_name())
for swz, (H, Hkv, D) in itertools.product((True, False), HEADS):
    use(swz)
    err = decode_error(H, Hkv, D, (1, 3))
    print(f"check {'swizzled' if swz else 'padded'} {H}/{Hkv} D{D}: rel err {err:.1e}", flush=True)
RUNS = ("swizzled", "padded", "cudnn")
table = ["| H/Hkv D | B x S | splits | " + " | ".join(RUNS) + " | swizzled / padded |", "|---|---|---|---|---|---|---|"]
for (H, Hkv, D), (B, S) in itertools.product(HEADS, POINTS):
    sets = [make_set(B, S, H, Hkv, D, c) for c in range(copies_for(kv_bytes(B, S, Hkv, D), 60 * 2**20))]
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    dev = launch.device(torch.cuda.current_device())
    graphs, picks = {}, []
    for run in RUNS:
        if run == "cudnn":
            graphs[run] = capture([call_of("cudnn", q, k, v, lens, None) for q, k, v in sets], 20)
            continue
        use(run == "swizzled")
        spec = tiles.decode_spec(D, "bf16", H // Hkv, dev.arch, dev.smem_optin)
        picks.append(tiles.decode_splits(spec, B, Hkv, H // Hkv, S, dev.sm_count, dev.smem_optin))
        graphs[run] = capture(decode_calls(sets, lens), 20)
    tb = {r: kv_bytes(B, S, Hkv, D) / ms / 1e9 for r, ms in replay_ms(graphs, 20, rounds=7).items()}
    table.append(f"| {H}/{Hkv} D{D} | {B} x {S} | {'/'.join(map(str, picks))} | " +
                 " | ".join(f"{tb[r]:.2f}" for r in RUNS) + f" | {tb['swizzled'] / tb['padded']:.3f} |")
    print(table[-1], flush=True)
    del sets, graphs
    torch.cuda.empty_cache()
use(True)
print("\nTB/s of K/V read:")
print("\n".join(table))
