"""What a score tensor's gradient costs: forward+backward of a relative-position bias table (H, 2S - 1) read per
pair, "s + bias[h * (2S - 1) + k - q + S - 1]", detached against learned (flashrt.backward's score_grads: the dQ
kernel's tensor-gradient pass) by fp32 atomics (deterministic=False) and into exact sums (deterministic=True, the
backward's other kernels then ordered too), and FlexAttention with the same learned table (torch.compile, a
captured buffer that requires grad) in the same interleaved rounds; bf16, B*S = 16k tokens, H*D = 2048, causal and
not. Prints ms and ratios (each learned form against the detached one of the same determinism).

    python3 scripts/probes/score_grads_cost.py [--rounds 5] [--seqlens 4096,16384] [--head-dims 64,128] [--no-flex]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import flashrt  # noqa: E402
from score_mod_cost import add_if_runs, grid, grid_args, medians  # noqa: E402


def main():
    ap = grid_args(rounds=5, seqlens="4096,16384")
    ap.add_argument("--no-flex", action="store_true")
    a = ap.parse_args()
    rows = []
    for D, S, H, q, k, v, do in grid(a):
        bias = torch.randn(H, 2 * S - 1, device="cuda")
        dbias = torch.zeros_like(bias)
        expr = f"s + bias[h * {2 * S - 1} + k - q + {S - 1}]"
        for causal in (False, True):
            kw = dict(causal=causal, score_mod=expr, score_tensors={"bias": bias})

            def run(grads=None, det=False, kw=kw):
                out, lse = flashrt.forward(q, k, v, **kw)
                flashrt.backward(do, q, k, v, out, lse, deterministic=det, **kw,
                                 **({"score_grads": grads} if grads is not None else {}))
            cases = {"detached": run, "learned": lambda: run({"bias": dbias}),
                     "detached det": lambda: run(det=True), "learned det": lambda: run({"bias": dbias}, True)}
            if not a.no_flex:
                add_flex(cases, q, k, v, do, causal, bias)
            rows.append((D, S, causal, medians(cases, a.rounds)))
    print(f"{torch.cuda.get_device_name()}, bf16, B*S = 16k, H*D = 2048, forward+backward, medians of {a.rounds} "
          f"interleaved rounds; a relative-position bias table, detached or learned\n")
    print("| D | S | causal | detached ms | learned ms | learned / detached | det: detached ms | learned ms | "
          "learned / detached | Flex learned ms | flashrt (atomics) / Flex |\n" + "|---" * 11 + "|")
    for D, S, causal, t in rows:
        flex = t.get(("flex fwd+bwd", "learned"))
        print(f"| {D} | {S} | {causal} | {t['detached']:.3f} | {t['learned']:.3f} | "
              f"{t['learned'] / t['detached']:.3f}x | {t['detached det']:.3f} | {t['learned det']:.3f} | "
              f"{t['learned det'] / t['detached det']:.3f}x | {f'{flex:.3f}' if flex else 'n/a'} | "
              f"{ratio(t['learned'], flex)} |")


def ratio(a, b):
    return f"{a / b:.3f}x" if a and b else "n/a"


def add_flex(cases, q, k, v, do, causal, bias):
    """FlexAttention's forward+backward with the table as a captured buffer that requires grad."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
    flex = torch.compile(flex_attention, dynamic=False)
    B, S, H, D = q.shape
    qg, kg, vg = (x.transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
    dot = do.transpose(1, 2).contiguous()
    table = bias.clone().requires_grad_()
    block = create_block_mask(lambda b, h, i, j: j <= i, None, None, S, S) if causal else None

    def fn(x, b, h, i, j):
        return x + table[h, j - i + S - 1]

    def fb():
        torch.autograd.grad(flex(qg, kg, vg, score_mod=fn, block_mask=block), (qg, kg, vg, table), dot)
    add_if_runs(cases, "flex", "learned", fb, fb)
    cases.pop(("flex fwd", "learned"), None)


if __name__ == "__main__":
    main()
