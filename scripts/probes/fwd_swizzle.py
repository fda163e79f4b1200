"""The mma.sync forward (fwd.cu, FLASHRT_NO_SM90=1 on Hopper) with unpadded, swizzled Q / K / V tiles (the library's,
spec.KernelSpec.swizzled) against padded ones, interleaved rounds in one process:
python scripts/probes/fwd_swizzle.py [--heads 64,128] [--seqlens 1024,4096,16384] [--rounds 7]. Both forms are
checked against float64 first; prints TFLOP/s (4 B H S^2 D, halved causal) per shape, 16k tokens, H x D = 2048
(docs/perf-notes.md, Forward: mma.sync)."""
import argparse
import os
import sys
from pathlib import Path

os.environ["FLASHRT_NO_SM90"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

import flashrt  # noqa: E402
from flashrt import spec as specmod  # noqa: E402
from variants import fresh, interleaved_ms  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--heads", default="64,128")
ap.add_argument("--seqlens", default="1024,4096,16384")
ap.add_argument("--rounds", type=int, default=7)
args = ap.parse_args()
real = specmod.KernelSpec.swizzled


def use(swizzled: bool) -> None:
    specmod.KernelSpec.swizzled = real if swizzled else property(lambda spec: False)
    fresh()


def check(D: int) -> float:
    torch.manual_seed(0)
    err = 0.0
    for causal in (False, True):
        q, k, v = (torch.randn(2, 300, 4, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        out = flashrt.forward(q, k, v, causal=causal)[0]
        qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
        s = qd @ kd.transpose(-1, -2) / D ** 0.5
        if causal:
            s = s.masked_fill(torch.ones(300, 300, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
        ref = (torch.softmax(s, -1) @ vd).transpose(1, 2)
        err = max(err, ((out.double() - ref).abs().max() / ref.abs().max()).item())
    return err


print(torch.cuda.get_device_name())
RUNS = ("swizzled", "padded")
for run in RUNS:
    use(run == "swizzled")
    for D in map(int, args.heads.split(",")):
        print(f"check {run} D{D}: rel err {check(D):.1e}", flush=True)
table = ["| head_dim | S | mask | " + " | ".join(RUNS) + " | swizzled / padded |", "|---|---|---|---|---|---|"]
for D in map(int, args.heads.split(",")):
    for S in map(int, args.seqlens.split(",")):
        B, H = max(1, 16384 // S), 2048 // D
        q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        for causal in (False, True):
            flops = 4 * B * H * S * S * D / (2 if causal else 1)
            ms = interleaved_ms(RUNS, lambda run: use(run == "swizzled"),
                                lambda: flashrt.forward(q, k, v, causal=causal), args.rounds, 5)
            tf = {r: flops / ms[r] / 1e9 for r in RUNS}
            table.append(f"| {D} | {S} | {'causal' if causal else 'full'} | " + " | ".join(f"{tf[r]:.0f}" for r in RUNS)
                         + f" | {tf['swizzled'] / tf['padded']:.3f} |")
            print(table[-1], flush=True)
use(True)
print("\nTFLOP/s (flashrt.forward, mma.sync kernels):")
print("\n".join(table))
