"""The backward with a score modification, split pair against the fused kernel, ordered (deterministic) and not:
flashrt.backward alone (out and lse from one forward), bf16, B*S = 16k tokens, H*D = 2048, causal and not; medians
of CUDA-event times over interleaved rounds after a warm-up. Prints ms of the split pair and fused / split per
modification (plain, softcap 30, ALiBi, and the score_mod expressions of scripts/probes/score_mod_cost.py), the
input to tiles.backward_impl's choice with a modification.

    python3 scripts/probes/bwd_mods_impl.py [--rounds 5] [--seqlens 1024,4096,16384] [--head-dims 128]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import flashrt  # noqa: E402
from flashrt import launch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from score_mod_cost import grid, grid_args, medians, modifications  # noqa: E402


def main():
    ap = grid_args(rounds=5, head_dims="128")
    a = ap.parse_args()
    rows = []
    for D, S, H, q, k, v, do in grid(a):
        mods = {m: kw for m, kw in modifications(H, S)[0].items() if m != "sinks"}
        for causal in (False, True):
            fwd = {m: flashrt.forward(q, k, v, causal=causal, **kw) for m, kw in mods.items()}
            cases = {}
            for m, kw in mods.items():
                for det in (False, True):
                    for impl in ("split", "fused"):
                        def run(m=m, kw=kw, det=det, impl=impl):
                            flashrt.backward(do, q, k, v, *fwd[m], causal=causal, impl=impl, deterministic=det,
                                             **kw)
                        cases[(m, det, impl)] = run
            rows.append((D, S, causal, medians(cases, a.rounds), list(mods)))
    print(f"{torch.cuda.get_device_name()}, bf16, B*S = 16k, H*D = 2048, flashrt.backward alone, medians of "
          f"{a.rounds} interleaved rounds; per modification and determinism: split ms, fused / split\n")
    _, _, _, _, names = rows[0]
    head = ["D", "S", "causal"] + [f"{m} {'det' if det else 'nondet'}" for det in (False, True) for m in names]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for D, S, causal, t, names in rows:
        cells = [f"{t[(m, det, 'split')]:.3f} / {t[(m, det, 'fused')] / t[(m, det, 'split')]:.3f}x"
                 for det in (False, True) for m in names]
        print(f"| {D} | {S} | {causal} | " + " | ".join(cells) + " |")
    print("\nbackward kernels loaded:", ", ".join(sorted({n for n, _ in launch._functions if "_bwd_" in n})))


if __name__ == "__main__":
    main()
