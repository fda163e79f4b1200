"""score_mod expressions against a float64 torch autograd reference: flashrt.forward / backward (split and fused,
deterministic) over expressions, head dims, causal or not, GQA and padding lengths; prints one line per case with
the largest error of out, lse, dq, dk, dv relative to the reference's largest magnitude, and FAIL past the bound.

    python3 scripts/probes/score_mod_check.py [--head-dims 64,96,128,256] [--quick]
"""
import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import flashrt  # noqa: E402


def exprs(H, S, dev):
    """name -> (flashrt kwargs, Python form over torch tensors (s, b, h, q, k, Lq, Lk))."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device=dev, dtype=torch.float32) / H)
    bias = torch.randn(H, 2 * S - 1, device=dev, dtype=torch.float32)
    ids = torch.randint(0, 3, (S,), device=dev, dtype=torch.int32)
    return {
        "cap": (dict(score_mod="30.f * tanhf(s / 30.f)"), lambda s, b, h, q, k, Lq, Lk: 30 * torch.tanh(s / 30)),
        "alibi": (dict(score_mod="s - slopes[h] * fabsf((float)(k - q - (Lk - Lq)))", score_tensors={"slopes": slopes}),
                  lambda s, b, h, q, k, Lq, Lk: s - slopes.double()[h] * (k - q - (Lk - Lq)).abs()),
        "alibi_f": (dict(score_mod="s - slopes[h] * fabsf(kf - qf - (float)(Lk - Lq))",
                         score_tensors={"slopes": slopes}),
                    lambda s, b, h, q, k, Lq, Lk: s - slopes.double()[h] * (k - q - (Lk - Lq)).abs()),
        "rel": (dict(score_mod=f"s + bias[h * {2 * S - 1} + k - q + {S - 1}]", score_tensors={"bias": bias}),
                lambda s, b, h, q, k, Lq, Lk: s + bias.double()[h, k - q + S - 1]),
        "leaky": (dict(score_mod="s > 0.f ? s : 0.25f * s"),
                  lambda s, b, h, q, k, Lq, Lk: torch.where(s > 0, s, 0.25 * s)),
        "square_grad": (dict(score_mod="s * s / 8.f", score_mod_grad="s / 4.f"),
                        lambda s, b, h, q, k, Lq, Lk: s * s / 8),
        "ints": (dict(score_mod="s + 0.5f * (float)ids[k] - 0.25f * (float)ids[q]", score_tensors={"ids": ids}),
                 lambda s, b, h, q, k, Lq, Lk: s + 0.5 * ids.double()[k] - 0.25 * ids.double()[q]),
    }


def reference(q, k, v, do, causal, fn, lq, lk):
    """float64 out, lse, dq, dk, dv with the score modification fn and padding lengths lq, lk (B,)."""
    q, k, v = (x.double().detach().requires_grad_() for x in (q, k, v))
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    kk, vv = (x.repeat_interleave(H // Hkv, dim=2) for x in (k, v))
    s = torch.einsum("bqhd,bkhd->bhqk", q, kk) / math.sqrt(D)
    b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    h = torch.arange(H, device=q.device).view(1, H, 1, 1)
    i = torch.arange(Sq, device=q.device).view(1, 1, Sq, 1)
    j = torch.arange(Sk, device=q.device).view(1, 1, 1, Sk)
    Lq, Lk = lq.view(B, 1, 1, 1).long(), lk.view(B, 1, 1, 1).long()
    iq, jk = torch.minimum(i, Lq - 1).clamp(min=0), torch.minimum(j, Lk - 1).clamp(min=0)
    s = fn(s, b, h, iq.expand(B, H, Sq, Sk), jk.expand(B, H, Sq, Sk), Lq, Lk)
    keep = (i < Lq) & (j < Lk)
    if causal:
        keep &= j <= i + Lk - Lq
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vv)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do.double())
    return out, lse, dq, dk, dv


def err(x, ref, rows=None):
    x, ref = x.double(), ref.double()
    if rows is not None:
        x, ref = x[rows], ref[rows]
    fin = torch.isfinite(ref)
    if not torch.equal(fin, torch.isfinite(x)):
        return math.inf
    scale = ref[fin].abs().max().item() if fin.any() else 1.0
    return ((x - ref)[fin].abs().max().item() / max(scale, 1e-6)) if fin.any() else 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--head-dims", default="64,96,128,256")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    dev = "cuda"
    torch.manual_seed(0)
    bad = 0
    for D in map(int, a.head_dims.split(",")):
        for causal in (False, True):
            B, S, H, Hkv = 2, 200, 4, 2
            q = torch.randn(B, S, H, D, device=dev, dtype=torch.bfloat16)
            k, v = (torch.randn(B, S, Hkv, D, device=dev, dtype=torch.bfloat16) for _ in range(2))
            do = torch.randn_like(q)
            lq = torch.tensor([S, 131], device=dev, dtype=torch.int32)
            lk = torch.tensor([S, 177], device=dev, dtype=torch.int32)
            for name, (kw, fn) in exprs(H, S, dev).items():
                if a.quick and name not in ("rel", "leaky"):
                    continue
                ref = reference(q, k, v, do, causal, fn, lq, lk)
                for impl in ("split", "fused"):
                    out, lse = flashrt.forward(q, k, v, causal=causal, seqlens_q=lq, seqlens_k=lk, **kw)
                    grads = flashrt.backward(do, q, k, v, out, lse, causal=causal, impl=impl, seqlens_q=lq,
                                             seqlens_k=lk, **kw)
                    again = flashrt.backward(do, q, k, v, out, lse, causal=causal, impl=impl, seqlens_q=lq,
                                             seqlens_k=lk, **kw)
                    rep = all(torch.equal(x, y) for x, y in zip(grads, again))
                    lse_ref = ref[1].clone()
                    lse_ref[~torch.isfinite(lse_ref)] = -math.inf
                    e = [err(out, ref[0]), err(lse, lse_ref), *(err(g, r) for g, r in zip(grads, ref[2:]))]
                    ok = max(e) < 2e-2 and rep
                    bad += not ok
                    print(f"{'ok  ' if ok else 'FAIL'} D={D} causal={causal} {name:11s} {impl:5s} "
                          f"out {e[0]:.1e} lse {e[1]:.1e} dq {e[2]:.1e} dk {e[3]:.1e} dv {e[4]:.1e} "
                          f"repeatable={rep}", flush=True)
    print(f"{bad} failed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
