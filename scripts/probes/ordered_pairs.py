"""The ordered causal fused backward over many (batch entry, KV head) pairs: its key-tile-major grid in chunks of
pairs (tiles.ordered_key_chunk) against the split pair and the unordered fused kernel.

    python scripts/probes/ordered_pairs.py [--rounds 3] [--chunks 0,66,44,33,16] [--shapes "B,S,H,Hkv,D;..."]

Checks first: at a small many-pair shape, each chunk's gradients bitwise equal to one chunk's and close to
float64. Then flashrt.backward alone (out and lse from one forward), causal, bf16: impl="split" and "fused"
deterministic, the fused kernel once per chunk ("c0": one chunk of every pair, the grid before chunks), "fused"
deterministic=False and "auto"; ten calls a timing, medians of interleaved rounds (score_mod_cost.medians).
TFLOP/s: 2.5 x 4 B H S^2 D / 2. Prints a table last.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import flashrt  # noqa: E402
from flashrt import api, launch, tiles  # noqa: E402
from bwd_fused_ws import reference  # noqa: E402
from score_mod_cost import medians  # noqa: E402

RULE = tiles.ordered_key_chunk
SHAPES = "8,4096,16,16,128;4,4096,32,32,128;2,8192,64,64,128;1,16384,96,96,128;2,8192,32,32,128;" \
         "1,16384,32,32,128;4,4096,21,21,96;2,8192,64,64,64;1,16384,128,128,64;4,8192,32,8,128"


_PLANS_BY_CHUNK: dict = {}


def use_chunk(chunk: int | None) -> None:
    """The ordered grid's chunk from here on (None: tiles' rule), with plans of its own (api._PLANS)."""
    tiles.ordered_key_chunk = RULE if chunk is None else (lambda dev, pairs, splits: chunk)
    api._PLANS = _PLANS_BY_CHUNK.setdefault(chunk, {})


def inputs(B, S, H, Hkv, D):
    q, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return q, k, v, do


def check(chunks) -> list[str]:
    rows = []
    for B, S, H, Hkv, D in ((6, 1024, 4, 2, 128), (5, 1536, 4, 4, 64)):
        q, k, v, do = inputs(B, S, H, Hkv, D)
        ref = reference(q, k, v, do, True)
        out, lse = flashrt.forward(q, k, v, causal=True)
        first = None
        for c in (1, *chunks):
            use_chunk(c)
            got = flashrt.backward(do, q, k, v, out, lse, causal=True, impl="fused", deterministic=True)
            errs = [float((a.double() - r).norm() / r.norm()) for a, r in zip(got, ref)]
            first = first or got
            same = all(torch.equal(a, b) for a, b in zip(got, first))
            ok = same and max(errs) < 2e-2
            rows.append(f"| B{B} S{S} H{H}/{Hkv} D{D} | {c} | {' '.join(f'{e:.1e}' for e in errs)} | "
                        f"{'bitwise' if same else 'DIFFERS'} | {'ok' if ok else 'FAIL'} |")
            print(rows[-1], flush=True)
    use_chunk(None)
    return rows


def time_shape(B, S, H, Hkv, D, chunks, rounds) -> tuple[list[str], list[float]]:
    q, k, v, do = inputs(B, S, H, Hkv, D)
    out, lse = flashrt.forward(q, k, v, causal=True)

    def call(chunk, **kw):
        def run():
            use_chunk(chunk)
            for _ in range(10):
                flashrt.backward(do, q, k, v, out, lse, causal=True, **kw)
        return run

    cases = {"split": call(None, impl="split"), "unordered": call(None, impl="fused", deterministic=False),
             "auto": call(None, impl="auto")}
    cases.update({f"c{c}": call(c, impl="fused") for c in chunks})
    cases["rule"] = call(None, impl="fused")
    ms = medians(cases, rounds)
    flops = 2.5 * 4 * B * H * S * S * D / 2
    return list(ms), [flops * 10 / t / 1e9 for t in ms.values()]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--chunks", default="0,66,44,33,16")
    ap.add_argument("--shapes", default=SHAPES)
    a = ap.parse_args()
    chunks = [int(c) for c in a.chunks.split(",")]
    dev = launch.device(0)
    print(torch.cuda.get_device_name(), f"{dev.sm_count} SMs; the rule's chunks: ordered_key_chunk")
    rows = check(chunks)
    table, names = [], None
    for shape in a.shapes.split(";"):
        B, S, H, Hkv, D = map(int, shape.split(","))
        names, tf = time_shape(B, S, H, Hkv, D, chunks, a.rounds)
        rule = tiles.ordered_key_chunk(dev, B * Hkv, 1)
        table.append(f"| {D} | {S} | {B} x {H} / {Hkv} | {B * Hkv} | {rule} | " + " | ".join(f"{x:.0f}" for x in tf)
                     + " |")
        print(table[-1], flush=True)
    print("\n| shape | chunk | dq dk dv rel err | against chunk 1 | |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nTFLOP/s, causal (c<N>: ordered fused in chunks of N pairs; c0: one chunk; rule: the rule's chunk):")
    print("| D | S | B x H / Hkv | pairs | rule | " + " | ".join(names) + " |\n|" + "---|" * (5 + len(names)))
    print("\n".join(table))


if __name__ == "__main__":
    main()
