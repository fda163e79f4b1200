"""The unordered fused backward (deterministic=False) against the split pair at small grids: where the fused
kernel's blocks (one per batch entry, KV head and key tile) fill fewer than one or two waves of the SMs.

    python scripts/probes/unordered_small.py [--rounds 5] [--shapes "B,S,H,Hkv;..."] [--head-dims 64,128] [--graph]

flashrt.backward alone (out and lse from one forward), bf16, causal and not: impl="split" and "fused" with
deterministic=False, and impl="auto"; ten calls a timing, medians of interleaved rounds (score_mod_cost.medians);
with --graph the ten calls are one CUDA graph's replay (the GPU's time, without the host's per call).
key waves: B Hkv ceil(S / the fused kernel's key tile) / SMs (tiles.backward_impl's key_waves). Prints a table last:
us per call and fused / split time.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import flashrt  # noqa: E402
from flashrt import launch, tiles  # noqa: E402
from score_mod_cost import medians  # noqa: E402

SHAPES = ("1,512,8,8;1,1024,8,8;1,1024,16,16;2,1024,16,16;1,2048,16,16;4,1024,16,16;1,4096,8,8;1,1024,32,32;"
          "1,1024,32,8;1,2048,32,8;2,2048,32,8;1,4096,32,8")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--graph", action="store_true")
    a = ap.parse_args()
    dev = launch.device(0)
    print(torch.cuda.get_device_name(), f"{dev.sm_count} SMs", flush=True)
    table = []
    for D in map(int, a.head_dims.split(",")):
        for shape in a.shapes.split(";"):
            B, S, H, Hkv = map(int, shape.split(","))
            q, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            for causal in (False, True):
                out, lse = flashrt.forward(q, k, v, causal=causal)
                fam = tiles.fused_family(D, dev.arch, dev.smem_optin)
                bn = tiles.kernel_for(fam, tiles.sm90_head_dim(fam, D), "bf16", causal, dev).block_n
                waves = B * Hkv * -(-S // bn) / dev.sm_count

                def call(**kw):
                    def run():
                        for _ in range(10):
                            flashrt.backward(do, q, k, v, out, lse, causal=causal, **kw)
                    if not a.graph:
                        return run
                    run()  # (compiled and planned before the capture)
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        run()
                    return graph.replay

                ms = medians({"split": call(impl="split", deterministic=False),
                              "fused": call(impl="fused", deterministic=False),
                              "auto": call(impl="auto", deterministic=False)}, a.rounds)
                us = {n: t * 100 for n, t in ms.items()}  # (ms per 10 calls -> us per call)
                table.append(f"| {D} | {S} | {B} x {H} / {Hkv} | {'causal' if causal else 'full'} | {waves:.2f} | "
                             f"{us['split']:.1f} | {us['fused']:.1f} | {us['auto']:.1f} | "
                             f"{us['fused'] / us['split']:.2f} |")
                print(table[-1], flush=True)
    how = "CUDA graph replays" if a.graph else "eager calls"
    print(f"\n{torch.cuda.get_device_name()}, bf16, deterministic=False, {a.rounds} rounds of {how}; us per backward "
          f"call")
    print("| D | S | B x H / Hkv | mask | key waves | split | fused | auto | fused / split |\n|" + "---|" * 9)
    print("\n".join(table))


if __name__ == "__main__":
    main()
