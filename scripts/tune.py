"""Measure tile candidates of each kernel family on this GPU (the data behind flashrt/tiles.py).

    python scripts/tune.py [--head-dims 64,128,256] [--out DIR]

For each (family, head_dim, causal) every candidate tiling is compiled (in
parallel), checked for register spills, checked to agree with the default
tiling's result, and timed (median of CUDA-event timings). Forward and backward
are timed as whole passes with only the family under test overridden, so the
differences between candidates are that kernel's.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import flashrt  # noqa: E402
from flashrt import cache, launch, tiles  # noqa: E402
from flashrt.spec import KernelSpec  # noqa: E402

CANDIDATES = {
    "fwd": [(128, 64, 8), (64, 64, 4), (128, 32, 8), (64, 32, 4), (128, 64, 4), (128, 128, 8), (64, 128, 4),
            (128, 32, 4), (192, 64, 12), (192, 32, 12)],
    "bwd_dq": [(64, 64, 4), (128, 64, 8), (64, 32, 4), (128, 32, 8), (64, 128, 4), (64, 64, 2), (32, 64, 2),
               (128, 32, 4), (128, 64, 4)],
    "bwd_dkdv": [(64, 64, 8), (64, 128, 8), (128, 64, 8), (128, 128, 8), (32, 64, 4), (64, 64, 4), (64, 32, 8),
                 (32, 128, 8), (128, 32, 8)],
}
CANDIDATES["bwd_fused"] = CANDIDATES["bwd_dkdv"]
IMPL = {"bwd_dq": "split", "bwd_dkdv": "split", "bwd_fused": "fused"}


def shapes(D: int) -> list[tuple[int, int, int, int]]:
    """(B, S, H, Hkv) points: the FlashAttention grid at 16k tokens, S = 1k and 4k."""
    return [(16, 1024, 2048 // D, 2048 // D), (4, 4096, 2048 // D, 2048 // D)]


_override: dict[str, KernelSpec] = {}  # family -> the tiling under test (every call's kernel of that family)
_kernel_for = tiles.kernel_for


def _kernel_for_with_override(family, *args):
    return _override.get(family) or _kernel_for(family, *args)


tiles.kernel_for = _kernel_for_with_override


def measured_tilings(family: str, D: int, causal: bool, dev) -> list[KernelSpec]:
    """The CANDIDATES of `family` that are valid at head_dim D and fit dev's shared memory."""
    out = []
    for bm, bn, nw in CANDIDATES[family]:
        try:
            s = KernelSpec(family, D, "bf16", bm, bn, nw, causal, dev.arch)
        except ValueError:
            continue
        if s.smem_bytes <= dev.smem_optin:
            out.append(s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default="64,128,256")
    ap.add_argument("--families", default=",".join(CANDIDATES))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    dev = launch.device(0)
    head_dims = [int(x) for x in args.head_dims.split(",")]
    families = args.families.split(",")
    todo = [s for fam in families for D in head_dims for c in (False, True) for s in measured_tilings(fam, D, c, dev)]
    with concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        list(pool.map(cache.lookup, todo))
    rows = []
    for D in head_dims:
        for causal in (False, True):
            for B, S, H, Hkv in shapes(D):
                torch.manual_seed(0)
                q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
                k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
                v = torch.randn_like(k)
                do = torch.randn_like(q)
                _override.clear()
                out0, lse0 = flashrt.forward(q, k, v, causal=causal)
                grads0 = flashrt.backward(do, q, k, v, out0, lse0, causal=causal)
                fl = 4 * B * H * S * S * D / (2 if causal else 1)
                for family in families:
                    for spec in measured_tilings(family, D, causal, dev):
                        _override.clear()
                        _override[family] = spec
                        attrs = launch.function_attributes(spec, dev)
                        if family == "fwd":
                            fn = lambda: flashrt.forward(q, k, v, causal=causal)  # noqa: E731
                            got, want, flops = fn()[0], out0, fl
                        else:
                            fn = lambda: flashrt.backward(do, q, k, v, out0, lse0, causal=causal,  # noqa: E731
                                                          impl=IMPL[family], deterministic=family != "bwd_fused")
                            got = fn()[0 if family == "bwd_dq" else 1]
                            want, flops = grads0[0 if family == "bwd_dq" else 1], 2.5 * fl
                        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
                        ms = do_bench(fn, warmup=10, rep=60, return_mode="median")
                        row = dict(family=family, D=D, causal=causal, B=B, S=S, H=H, tile=spec.name.split("_")[-3],
                                   bm=spec.block_m, bn=spec.block_n, warps=spec.warps, ms=ms,
                                   tflops=flops / ms / 1e9, regs=attrs["num_regs"],
                                   spill=attrs["local_size_bytes"], diff_vs_default=err)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    _override.clear()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tune.json").write_text(json.dumps(rows, indent=1))
    # best per (family, D, causal): highest mean TFLOP/s over the shapes
    print(f"{'family':9s} {'D':>4s} {'causal':6s}  best tiles (mean TFLOP/s over shapes; all candidates)")
    keys = sorted({(r["family"], r["D"], r["causal"]) for r in rows})
    for key in keys:
        per = {}
        for r in rows:
            if (r["family"], r["D"], r["causal"]) == key and not r["spill"] and r["diff_vs_default"] < 1e-2:
                per.setdefault((r["bm"], r["bn"], r["warps"]), []).append(r["tflops"])
        ranked = sorted(((sum(v) / len(v), t) for t, v in per.items()), reverse=True)
        print(f"{key[0]:9s} {key[1]:4d} {str(key[2]):6s}  " +
              "  ".join(f"{t[0]}x{t[1]}w{t[2]}:{m:.0f}" for m, t in ranked))


if __name__ == "__main__":
    main()
