"""Benchmark flashrt against torch SDPA backends in one run (needs a GPU and torch).

    python scripts/bench.py --set grid --out benchmarks/results

Every implementation's output is first checked against a float64 reference on a
subset of query rows (a fast wrong answer is not a result). Times are medians
of CUDA-event timings after warm-up (triton.testing.do_bench); backward is
timed as (forward+backward) - forward for every implementation alike.
FLOPs: forward 4*B*H*Sq*Sk*D (halved when causal), backward 2.5x forward.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flashrt  # noqa: E402

SDPA = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}


def shape_sets(name: str) -> list[dict]:
    grid = []
    for D in (64, 128, 256):
        for S in (512, 1024, 2048, 4096, 8192, 16384):
            for causal in (False, True):
                grid.append(dict(B=16384 // S, H=2048 // D, Hkv=2048 // D, S=S, D=D, causal=causal))
    seed = [dict(B=2, H=8, Hkv=1, S=1024, D=256, causal=c) for c in (False, True)]
    sets = {"grid": grid, "seed": seed, "quick": [g for g in grid if g["S"] in (1024, 8192)] + seed}
    return sets["grid"] + sets["seed"] if name == "all" else sets[name]


def flops(c: dict, mode: str) -> float:
    f = 4 * c["B"] * c["H"] * c["S"] * c["S"] * c["D"] / (2 if c["causal"] else 1)
    return f * {"fwd": 1.0, "bwd": 2.5}[mode]


def make_fn(impl: str, q, k, v, causal: bool):
    """A forward closure on (B, S, H, D) leaf tensors for one implementation."""
    if impl == "flashrt":
        return lambda: flashrt.attention(q, k, v, causal=causal)
    group = q.shape[2] // k.shape[2]

    def run():
        with sdpa_kernel([SDPA[impl]]):
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=causal, enable_gqa=group > 1)
        return o.transpose(1, 2)
    return run


def reference_rows(q, k, v, causal, rows):
    """float64 attention output for the given query rows."""
    qs = q[:, rows].double()
    H, Hkv = q.shape[2], k.shape[2]
    ke = k.double().repeat_interleave(H // Hkv, dim=2)
    ve = v.double().repeat_interleave(H // Hkv, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", qs, ke) / math.sqrt(q.shape[-1])
    if causal:
        Sq, Sk = q.shape[1], k.shape[1]
        keep = torch.arange(Sk, device=q.device)[None, :] <= rows[:, None] + (Sk - Sq)
        s = s.masked_fill(~keep, -math.inf)
    return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), ve)


def time_ms(fn, grad_to_none=None) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median", grad_to_none=grad_to_none)


def bench_case(c: dict, impls: list[str]) -> list[dict]:
    torch.manual_seed(0)
    q = torch.randn(c["B"], c["S"], c["H"], c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(c["B"], c["S"], c["Hkv"], c["D"], device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    rows = torch.cat([torch.arange(0, 64), torch.arange(c["S"] - 64, c["S"])]).cuda()
    with torch.no_grad():
        ref = reference_rows(q, k, v, c["causal"], rows)
    results = []
    for impl in impls:
        row = dict(c, impl=impl)
        fn = make_fn(impl, q, k, v, c["causal"])
        try:
            with torch.no_grad():
                o = fn()
            err = ((o[:, rows].double() - ref).norm() / ref.norm()).item()
            row["rel_err"] = err
            if not err < 2e-2:
                row["error"] = f"wrong output: rel err {err:.2e} vs float64"
                results.append(row)
                continue
            do = torch.randn_like(o)
            with torch.no_grad():
                row["fwd_ms"] = time_ms(fn)

            def fwd_bwd():
                fn().backward(do)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            fwd_bwd()
            torch.cuda.synchronize()
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            row["fwdbwd_ms"] = time_ms(fwd_bwd, grad_to_none=[q, k, v])
            row["bwd_ms"] = row["fwdbwd_ms"] - row["fwd_ms"]
            row["fwd_tflops"] = flops(c, "fwd") / row["fwd_ms"] / 1e9
            row["bwd_tflops"] = flops(c, "bwd") / row["bwd_ms"] / 1e9
        except Exception as exc:  # an implementation that cannot run this case
            row["error"] = str(exc).splitlines()[0][:160]
        results.append(row)
        q.grad = k.grad = v.grad = None
        torch.cuda.empty_cache()
    return results


def environment() -> dict:
    import cupy
    from flashrt import nvrtc
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cupy": cupy.__version__, "nvrtc": list(nvrtc.version()),
            "driver": cupy.cuda.runtime.driverGetVersion(), "flashrt": flashrt.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M")}


def markdown(rows: list[dict]) -> str:
    lines = ["| D | S | B | H | Hkv | causal | impl | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | peak MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['D']} | {r['S']} | {r['B']} | {r['H']} | {r['Hkv']} | {r['causal']} | {r['impl']} "
                         f"| {r['error']} |||||")
            continue
        lines.append(f"| {r['D']} | {r['S']} | {r['B']} | {r['H']} | {r['Hkv']} | {r['causal']} | {r['impl']} | "
                     f"{r['fwd_ms']:.3f} | {r['fwd_tflops']:.0f} | {r['bwd_ms']:.3f} | {r['bwd_tflops']:.0f} | "
                     f"{r['peak_mib']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--set", default="all", choices=["grid", "seed", "quick", "all"])
    ap.add_argument("--impls", default="flashrt,flash,cudnn")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    impls = args.impls.split(",")
    env = environment()
    print(json.dumps(env))
    rows = []
    for c in shape_sets(args.set):
        for r in bench_case(c, impls):
            rows.append(r)
            print(json.dumps(r), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    table = markdown(rows)
    (out / "bench.md").write_text(f"{env['gpu']}, torch {env['torch']}, NVRTC {env['nvrtc']}\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
