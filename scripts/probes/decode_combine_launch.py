"""The combine after decode's splits four ways, CUDA-graph replays of 20 calls, interleaved rounds, beside SDPA cuDNN:
the library's ("pdl": a programmatic dependent launch, tiles.combine_row_warps' warps per row, a warp's first parts
loaded beside the lse values), "late" (those parts loaded after the lse values: -DFRT_COMBINE_EARLY=0), "plain" (an
ordinary launch), "rw1" (one warp per row): python scripts/probes/decode_combine_launch.py [H/Hkv/D:B:S,...]. Prints
us per call (docs/perf-notes.md, Decode: splits and the combine)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from flashrt import spec as specmod, tiles  # noqa: E402
from bench_decode import call_of, capture, copies_for, decode_calls, kv_bytes, make_set, replay_ms  # noqa: E402
from variants import fresh  # noqa: E402

SHAPES = [tuple(map(int, s.replace("/", ":").split(":"))) for s in (sys.argv[1] if len(sys.argv) > 1 else
          "32/8/128:1:1024,32/8/64:1:1024,8/1/128:1:4096,8/1/64:16:1024,32/8/128:1:4096,8/1/128:1:32768").split(",")]
real_programmatic, real_rw = specmod.KernelSpec.programmatic, tiles.combine_row_warps
BASE_OPTIONS = list(specmod.NVRTC_OPTIONS)


def use(pdl: bool, rw1: bool, early: bool) -> None:
    specmod.KernelSpec.programmatic = real_programmatic if pdl else property(lambda spec: False)
    tiles.combine_row_warps = (lambda *a: 1) if rw1 else real_rw
    specmod.NVRTC_OPTIONS = BASE_OPTIONS + ([] if early else ["-DFRT_COMBINE_EARLY=0"])
    fresh()


RUNS = {"pdl": (True, False, True), "late": (True, False, False), "plain": (False, False, True),
        "rw1": (True, True, True)}
print(torch.cuda.get_device_name())
lines = ["| H/Hkv D | B x S | " + " | ".join(RUNS) + " | cudnn |", "|---|---|" + "---|" * (len(RUNS) + 1)]
for H, Hkv, D, B, S in SHAPES:
    sets = [make_set(B, S, H, Hkv, D, c) for c in range(copies_for(kv_bytes(B, S, Hkv, D), 60 * 2**20))]
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    graphs, outs = {}, {}
    for name, (pdl, rw1, early) in RUNS.items():
        use(pdl, rw1, early)
        outs[name] = decode_calls(sets, lens)[0]()
        graphs[name] = capture(decode_calls(sets, lens), 20)
    same = [name for name in RUNS if torch.equal(outs[name], outs["pdl"])]
    print(f"{H}/{Hkv} D{D} {B} x {S}: bitwise equal to the library's: {', '.join(same)}", flush=True)
    graphs["cudnn"] = capture([call_of("cudnn", q, k, v, lens, None) for q, k, v in sets], 20)
    ms = replay_ms(graphs, 20, rounds=9)
    lines.append(f"| {H}/{Hkv} D{D} | {B} x {S} | " + " | ".join(f"{ms[r] * 1e3:.2f}" for r in graphs) + " |")
    print(lines[-1], flush=True)
use(True, False, True)
print("\nus per call:")
print("\n".join(lines))
