"""The mma.sync backward (bwd_dq, bwd_dkdv, bwd_fused; FLASHRT_NO_SM90=1 on Hopper) with unpadded, swizzled Q / K / V /
dO tiles (spec.SWIZZLED_BWD_HEAD_DIMS, KernelSpec.swizzled, where swizzle_fits) against padded ones, interleaved rounds
in one process:
    python scripts/probes/bwd_swizzle.py [--heads 64,128,256] [--seqlens 1024,4096] [--rounds 5] [--check-only]

Both forms' gradients are checked against float64 first (split and fused, ordered and not, GQA, causal and not);
then prints backward TFLOP/s (2.5 x 4 B H S^2 D, halved causal) per shape and impl, 16k tokens, H x D = 2048
(docs/perf-notes.md, Backward: split pair)."""
import argparse
import os
import sys
from pathlib import Path

os.environ["FLASHRT_NO_SM90"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402

import flashrt  # noqa: E402
from flashrt import launch, spec as specmod, tiles  # noqa: E402
from variants import fresh, interleaved_ms  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--heads", default="64,128,256")
ap.add_argument("--seqlens", default="1024,4096")
ap.add_argument("--impls", default="split,fused")
ap.add_argument("--rounds", type=int, default=5)
ap.add_argument("--check-only", action="store_true", help="compile and check, no timing")
args = ap.parse_args()
HEADS = tuple(map(int, args.heads.split(",")))
RUNS = ("swizzled", "padded")


def use(run: str) -> None:
    specmod.SWIZZLED_BWD_HEAD_DIMS = {f: HEADS if run == "swizzled" else () for f in specmod.SWIZZLED_BWD_HEAD_DIMS}
    fresh()


def which(D: int, causal: bool) -> str:
    """The backward kernels' tiles and whether each is swizzled, for the log."""
    out, dev = [], launch.device(torch.cuda.current_device())
    for fam in ("bwd_dq", "bwd_dkdv", "bwd_fused"):
        s = tiles.tiling(fam, D, "bf16", causal, dev.arch, dev.smem_optin)
        out.append(f"{fam} {s.block_m}x{s.block_n}w{s.warps}{' swz' if s.swizzled else ''}")
    return ", ".join(out)


def check(D: int) -> float:
    """Largest error of dQ, dK, dV relative to each float64 gradient's largest element, over the cases."""
    torch.manual_seed(0)
    err = 0.0
    for causal, H, Hkv in ((False, 4, 4), (True, 4, 1)):
        q = torch.randn(2, 300, H, D, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(2, 257, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        do = torch.randn_like(q)
        qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
        kr, vr = (x.repeat_interleave(H // Hkv, 2) for x in (kd, vd))
        s = torch.einsum("bqhd,bkhd->bhqk", qd, kr) / D ** 0.5
        if causal:  # (bottom-right)
            s = s.masked_fill(torch.ones(300, 257, device="cuda", dtype=torch.bool).triu(257 - 300 + 1),
                              float("-inf"))
        ref = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), vr)
        grads = torch.autograd.grad(ref, (qd, kd, vd), do.double())
        out, lse = flashrt.forward(q, k, v, causal=causal)
        for impl, det in (("split", True), ("fused", True), ("fused", False)):
            got = flashrt.backward(do, q, k, v, out, lse, causal=causal, impl=impl, deterministic=det)
            for g, r in zip(got, grads):
                err = max(err, ((g.double() - r).abs().max() / r.abs().max()).item())
    return err


print(torch.cuda.get_device_name())
for run in RUNS:
    use(run)
    for D in HEADS:
        print(f"check {run} D{D}: rel err {check(D):.1e}; {which(D, True)}", flush=True)
if args.check_only:
    sys.exit(0)
table = ["| head_dim | S | mask | impl | " + " | ".join(RUNS) + " | swizzled / padded |", "|---" * 7 + "|"]
for D in HEADS:
    for S in map(int, args.seqlens.split(",")):
        B, H = max(1, 16384 // S), 2048 // D
        q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for causal in (False, True):
            out, lse = flashrt.forward(q, k, v, causal=causal)
            flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
            for impl in args.impls.split(","):
                kw = dict(causal=causal, impl=impl, deterministic=impl == "split")
                ms = interleaved_ms(RUNS, use, lambda: flashrt.backward(do, q, k, v, out, lse, **kw), args.rounds, 3)
                tf = {r: flops / ms[r] / 1e9 for r in RUNS}
                table.append(f"| {D} | {S} | {'causal' if causal else 'full'} | {impl} | "
                             + " | ".join(f"{tf[r]:.0f}" for r in RUNS) + f" | {tf['swizzled'] / tf['padded']:.3f} |")
                print(table[-1], flush=True)
print("\nTFLOP/s (flashrt.backward, mma.sync kernels; split ordered by construction, fused unordered):")
print("\n".join(table))
