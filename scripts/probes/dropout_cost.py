"""What attention dropout costs: flashrt.forward and forward+backward (flashrt.backward, deterministic auto) with
dropout_p=0.1 (or each of --p's) against none, and torch SDPA's flash backend (FlashAttention-2) with and without
dropout in the same rounds, bf16, B*S = 16k tokens, H*D = 2048, causal and not; medians of CUDA-event times over
interleaved rounds after a warm-up (score_mod_cost.medians). Prints a table: ms without dropout and each p's ratio
with it, and flashrt's time over SDPA flash's with dropout. Several p in one run compare draw resolutions
(spec.dropout_resolution: 0.1 takes 8-bit draws, 0.01 16-bit ones).

    python3 scripts/probes/dropout_cost.py [--rounds 7] [--seqlens 1024,4096,16384] [--head-dims 64,128] [--p 0.1,0.01]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flashrt  # noqa: E402
from score_mod_cost import grid, grid_args, medians, ratio  # noqa: E402


def main():
    ap = grid_args()
    ap.add_argument("--p", default="0.1", help="dropout probabilities, comma-separated")
    a = ap.parse_args()
    ps = [float(x) for x in a.p.split(",")]
    rows = []
    for D, S, H, q, k, v, do in grid(a):
        rng = flashrt.dropout_rng(q)
        bhsd = [x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v)]
        do_bhsd = do.transpose(1, 2).contiguous()
        for causal in (False, True):
            def fwd(p):
                return lambda: flashrt.forward(q, k, v, causal=causal, dropout_p=p, dropout_rng=rng)

            def fb(p):
                def run():
                    out, lse = flashrt.forward(q, k, v, causal=causal, dropout_p=p, dropout_rng=rng)
                    flashrt.backward(do, q, k, v, out, lse, causal=causal, dropout_p=p, dropout_rng=rng)
                return run

            def sdpa_fwd(p):
                def run():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.no_grad():
                        F.scaled_dot_product_attention(*bhsd, dropout_p=p, is_causal=causal)
                return run

            def sdpa_fb(p):
                def run():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        out = F.scaled_dot_product_attention(*bhsd, dropout_p=p, is_causal=causal)
                    torch.autograd.grad(out, bhsd, do_bhsd)
                return run
            cases = {}
            for p in (0.0, *ps):
                cases.update({("flashrt", "fwd", p): fwd(p), ("flashrt", "fwd+bwd", p): fb(p)})
            for p in (0.0, ps[0]):  # (SDPA flash: one p)
                cases.update({("sdpa", "fwd", p): sdpa_fwd(p), ("sdpa", "fwd+bwd", p): sdpa_fb(p)})
            t = medians(cases, a.rounds)
            for pas in ("fwd", "fwd+bwd"):
                f0, s0, s1 = t[("flashrt", pas, 0.0)], t[("sdpa", pas, 0.0)], t[("sdpa", pas, ps[0])]
                rows.append((D, S, "causal" if causal else "full", pas, f"{f0:.3f}",
                             *(ratio(t[("flashrt", pas, p)], f0) for p in ps), f"{s0:.3f}", ratio(s1, s0),
                             ratio(t[("flashrt", pas, ps[0])], s1)))
                print(*rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, bf16, B*S = 16k, H*D = 2048, dropout_p = {a.p}, {a.rounds} rounds")
    head = ("D", "S", "mask", "pass", "flashrt ms", *(f"flashrt p={p}/none" for p in ps), "flash ms",
            f"flash p={ps[0]}/none", f"flashrt/flash p={ps[0]}")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")


if __name__ == "__main__":
    main()
