"""What attention dropout costs: flashrt.forward and forward+backward (flashrt.backward, deterministic auto) with
dropout_p=0.1 against none, and torch SDPA's flash backend (FlashAttention-2) with and without dropout in the same
rounds, bf16, B*S = 16k tokens, H*D = 2048, causal and not; medians of CUDA-event times over interleaved rounds after
a warm-up (score_mod_cost.medians). Prints a table: ms without dropout and each one's ratio with it, and flashrt's
time over SDPA flash's with dropout.

    python3 scripts/probes/dropout_cost.py [--rounds 7] [--seqlens 1024,4096,16384] [--head-dims 64,128] [--p 0.1]
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
    ap.add_argument("--p", type=float, default=0.1)
    a = ap.parse_args()
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
            for p in (0.0, a.p):
                cases.update({("flashrt", "fwd", p): fwd(p), ("flashrt", "fwd+bwd", p): fb(p),
                              ("sdpa", "fwd", p): sdpa_fwd(p), ("sdpa", "fwd+bwd", p): sdpa_fb(p)})
            t = medians(cases, a.rounds)
            for pas in ("fwd", "fwd+bwd"):
                f0, f1 = t[("flashrt", pas, 0.0)], t[("flashrt", pas, a.p)]
                s0, s1 = t[("sdpa", pas, 0.0)], t[("sdpa", pas, a.p)]
                rows.append((D, S, "causal" if causal else "full", pas, f"{f0:.3f}", ratio(f1, f0), f"{s0:.3f}",
                             ratio(s1, s0), ratio(f1, s1)))
                print(*rows[-1], flush=True)
    print(f"\n{torch.cuda.get_device_name()}, bf16, B*S = 16k, H*D = 2048, dropout_p = {a.p}, {a.rounds} rounds")
    head = ("D", "S", "mask", "pass", "flashrt ms", "flashrt drop/none", "flash ms", "flash drop/none",
            "flashrt/flash drop")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(map(str, r)) + " |")


if __name__ == "__main__":
    main()
