"""The backward's impls side by side with torch's cuDNN and flash backends, in one process (needs a GPU and torch).

    python scripts/bwd_impls.py [--heads 64,128] [--seqlens 1024,4096,16384] [--rounds 3] [--gqa] [--out DIR]

Points: head_dim x S at 16k tokens (B = 16384 // S) and hidden 2048 (H = 2048 // head_dim), causal and not; --gqa
adds B1 S8k H32 Hkv8 hd128 causal and the seed shape (B2 S1024 H8 Hkv1 hd256). Implementations: flashrt split
(deterministic), fused ordered (deterministic), fused unordered, cuDNN, flash (torch SDPA, one backend forced), and
FlashAttention-4 default / deterministic where `flash_attn.cute` imports (../shared/baselines/README.md: how to carry
it to the GPU machine).
Backward = torch.autograd.grad of a kept graph (the same path for every implementation), timed with
triton.testing.do_bench (median) in interleaved rounds; the row keeps the median over rounds. FLOPs: 2.5 x the
forward's 4 B H S^2 D, halved when causal. Before timing, every flashrt impl's dq / dk / dv are compared with
cuDNN's (relative L2 error; > 2e-2 marks the row "error" and drops its timing); peak memory of one backward above
what was allocated before it. Prints a table last; --out writes bwd_impls.json.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

import flashrt

try:  # FlashAttention-4 (CuTe DSL), when carried to the machine
    from flash_attn.cute import flash_attn_func as FA4
except Exception:  # noqa: BLE001 (any import failure: run without it)
    FA4 = None

FLASHRT = {"split": dict(impl="split"), "fused-det": dict(impl="fused"),
           "fused": dict(impl="fused", deterministic=False)}


def impls(causal: bool) -> dict:
    out = {name: (lambda q, k, v, kw=kw: flashrt.attention(q, k, v, causal=causal, **kw), "bshd")
           for name, kw in FLASHRT.items()}

    def sdpa(backend):
        def attn(q, k, v):
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])
        return attn
    out["cudnn"] = (sdpa(SDPBackend.CUDNN_ATTENTION), "bhsd")
    out["flash"] = (sdpa(SDPBackend.FLASH_ATTENTION), "bhsd")
    if FA4 is not None:
        for name, det in (("fa4", False), ("fa4-det", True)):
            out[name] = (lambda q, k, v, det=det: _first(FA4(q, k, v, causal=causal, deterministic=det)), "bshd")
    return out


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_point(B, S, H, Hkv, D, causal, rounds) -> dict:
    g = torch.Generator(device="cuda").manual_seed(S + D)
    make = lambda h: torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v, do = make(H), make(Hkv), make(Hkv), make(H)
    row = dict(B=B, S=S, H=H, Hkv=Hkv, D=D, causal=causal)
    flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
    ready, ref = {}, None
    for name, (attn, layout) in impls(causal).items():
        try:
            to = (lambda t: t.transpose(1, 2).contiguous()) if layout == "bhsd" else (lambda t: t)
            qq, kk, vv = (to(t).detach().requires_grad_() for t in (q, k, v))
            dd = to(do)
            o = attn(qq, kk, vv)
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            grads = torch.autograd.grad(o, (qq, kk, vv), dd, retain_graph=True)
            torch.cuda.synchronize()
            row[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
            back = (lambda t: t.transpose(1, 2)) if layout == "bhsd" else (lambda t: t)
            grads = tuple(back(x) for x in grads)
            if name == "cudnn":
                ref = grads
            ready[name] = (o, qq, kk, vv, dd, grads)
        except Exception as exc:  # noqa: BLE001 (a peer without this shape: noted, not fatal)
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    for name, (*_, grads) in list(ready.items()):
        if ref is not None and name in FLASHRT:
            err = max(rel(a, b) for a, b in zip(grads, ref))
            row[f"{name}_err"] = err
            if not err < 2e-2:
                row[f"{name}_error"] = f"gradients off cuDNN's by {err:.2e}"
                del ready[name]
    times = {name: [] for name in ready}
    def backward(o, ins, dd):
        return lambda: torch.autograd.grad(o, ins, dd, retain_graph=True)

    for _ in range(rounds):
        for name, (o, qq, kk, vv, dd, _) in ready.items():
            times[name].append(do_bench(backward(o, (qq, kk, vv), dd), warmup=10, rep=40, return_mode="median"))
    for name, ts in times.items():
        ms = sorted(ts)[len(ts) // 2]
        row[f"{name}_ms"], row[f"{name}_tf"] = ms, flops / ms / 1e9
    del ready
    torch.cuda.empty_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gqa", action="store_true")
    ap.add_argument("--out")
    a = ap.parse_args()
    points = [(max(1, 16384 // S), S, 2048 // D, 2048 // D, D, c) for D in map(int, a.heads.split(","))
              for S in map(int, a.seqlens.split(",")) for c in (False, True)]
    if a.gqa:
        points += [(1, 8192, 32, 8, 128, True), (2, 1024, 8, 1, 256, False), (2, 1024, 8, 1, 256, True)]
    rows = []
    for p in points:
        rows.append(run_point(*p, rounds=a.rounds))
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "bwd_impls.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    names = ["split", "fused-det", "fused", "cudnn", "flash"] + (["fa4-det", "fa4"] if FA4 is not None else [])
    print(f"\n{torch.cuda.get_device_name()}: backward TF/s (peak MiB)")
    print("| B S H Hkv D causal | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for r in rows:
        cells = [f"{r[n + '_tf']:.0f} ({r[n + '_peak_mib']:.0f})" if n + "_tf" in r else
                 ("error" if n + "_error" in r else "-") for n in names]
        print(f"| {r['B']} {r['S']} {r['H']} {r['Hkv']} {r['D']} {'c' if r['causal'] else 'n'} | " + " | ".join(cells)
              + " |")


if __name__ == "__main__":
    main()
