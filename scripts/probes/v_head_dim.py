"""v with a head_dim of its own (MLA's q/k 192, v 128): flashrt's forward and backward against the same call with v at
q's head_dim, and torch SDPA's cuDNN and flash backends on the same inputs where they take them.

    python scripts/probes/v_head_dim.py [--rounds 7] [--seqlens 1024,4096,16384] [--pairs 192:128,128:64]

16k tokens (B = 16384 / S), 16 heads; flashrt.forward / flashrt.backward alone (impl="auto", deterministic=True), ten
calls a timing, medians over interleaved rounds (score_mod_cost.medians). TFLOP/s: 2 B H S^2 (D + Dv) forward, 2.5x
that backward, halved when causal. Checks out, dq, dk, dv against float64 first. Prints a table last.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import flashrt  # noqa: E402
from padded_head_dim import errors, reference_of, sdpa  # noqa: E402
from score_mod_cost import grid_args, medians  # noqa: E402

H = 16


def check(D, Dv) -> str:
    g = torch.Generator(device="cuda").manual_seed(D + Dv)
    q = torch.randn(2, 333, 8, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 517, 2, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 517, 2, Dv, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(2, 333, 8, Dv, device="cuda", dtype=torch.bfloat16, generator=g)
    errs = errors(q, k, v, do, True, reference_of(q, k, v, do, True))
    return f"| {D} / {Dv} | " + " ".join(f"{e:.1e}" for e in errs) + f" | {'ok' if max(errs) < 1e-2 else 'FAIL'} |"


def main():
    ap = grid_args()
    ap.add_argument("--pairs", default="192:128,128:64")
    a = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    pairs = [tuple(map(int, p.split(":"))) for p in a.pairs.split(",")]
    checks = [check(D, Dv) for D, Dv in pairs]
    print("\n".join(checks), flush=True)
    table = []
    for D, Dv in pairs:
        for S in map(int, a.seqlens.split(",")):
            B = 16384 // S
            q, k = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            v, do = (torch.randn(B, S, H, Dv, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            v_same = torch.randn(B, S, H, max(D, Dv), device="cuda", dtype=torch.bfloat16)
            do_same = torch.randn(B, S, H, max(D, Dv), device="cuda", dtype=torch.bfloat16)
            q_same, k_same = ((q, k) if D >= Dv else
                              (torch.randn(B, S, H, Dv, device="cuda", dtype=torch.bfloat16) for _ in range(2)))
            for causal in (False, True):
                for backward in (False, True):
                    def ours(q, k, v, do):
                        out, lse = flashrt.forward(q, k, v, causal=causal)

                        def run():
                            for _ in range(10):
                                if backward:
                                    flashrt.backward(do, q, k, v, out, lse, causal=causal)
                                else:
                                    flashrt.forward(q, k, v, causal=causal)
                        run()
                        return run
                    cases = {"flashrt": ours(q, k, v, do), "same": ours(q_same, k_same, v_same, do_same)}
                    for peer in ("cudnn", "flash"):
                        try:
                            cases[peer] = sdpa(q, k, v, do, causal, peer, backward)
                        except RuntimeError:
                            pass
                    ms = medians(cases, a.rounds)
                    flops = 2 * B * H * S * S * (D + Dv) / (2 if causal else 1) * (2.5 if backward else 1)
                    same = 4 * B * H * S * S * max(D, Dv) / (2 if causal else 1) * (2.5 if backward else 1)
                    tf = {n: (same if n == "same" else flops) * 10 / (t * 1e-3) / 1e12 for n, t in ms.items()}
                    table.append(f"| {D} / {Dv} | {S} | {'causal' if causal else 'full'} | "
                                 f"{'bwd' if backward else 'fwd'} | {ms['flashrt'] / 10:.3f} | {ms['same'] / 10:.3f} | "
                                 + " | ".join(f"{tf[n]:.0f}" if n in tf else "n/a"
                                              for n in ("flashrt", "cudnn", "flash"))
                                 + f" | {ms.get('cudnn', float('nan')) / ms['flashrt']:.2f} |")
                    print(table[-1], flush=True)
    print("\n| D / Dv | rel err out dq dk dv | |\n|---|---|---|")
    print("\n".join(checks))
    print("\nflashrt.forward / backward alone, 16k tokens, H = 16: ms per call (v at its own head_dim; v at the larger)"
          ", TFLOP/s (2 B H S^2 (D + Dv), 2.5x backward), cuDNN time / flashrt's")
    print("| D / Dv | S | mask | pass | ms | ms, v at max(D, Dv) | flashrt | cuDNN | SDPA flash | cuDNN / flashrt |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(table))


if __name__ == "__main__":
    main()
