"""What the score modifications cost: flashrt.forward and forward+backward (flashrt.backward, deterministic auto)
plain, with `sinks`, with `softcap=30` and with ALiBi (`alibi_slopes`, (H,) geometric as in the ALiBi paper), bf16,
B*S = 16k tokens, H*D = 2048, causal and not; medians of CUDA-event times over interleaved rounds after a warm-up.
Prints a table: ms plain and each modification's ratio.

    python3 scripts/probes/score_mod_cost.py [--rounds 7] [--seqlens 1024,4096,16384] [--head-dims 64,128]
                                             [--tanh-exact] [--fa4]

--tanh-exact compiles the softcap's tanh as 1 - 2 / (2^(2x log2 e) + 1) (kernels_cu/attention/score_mod.cuh:
FRT_TANH_EXACT) instead of tanh.approx.f32, an A/B of one process against another run without it (each run's own
plain column is its baseline).
--fa4 times FlashAttention-4 (flash_attn.cute.flash_attn_func: softcap=, learnable_sink=; forward+backward through
torch.autograd.grad) in the same rounds: its plain ms, its own ratios, and flashrt's time over FA4's per column.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import flashrt  # noqa: E402

MODS = {"plain": {}, "sinks": None, "softcap": {"softcap": 30.0}}  # (sinks: made per shape)


def timed(fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--tanh-exact", action="store_true")
    ap.add_argument("--fa4", action="store_true")
    a = ap.parse_args()
    fa4 = None
    if a.fa4:
        from flash_attn.cute import flash_attn_func as fa4
    if a.tanh_exact:
        from flashrt import spec
        spec.NVRTC_OPTIONS = (*spec.NVRTC_OPTIONS, "-DFRT_TANH_EXACT=1")
    rows = []
    for D in map(int, a.head_dims.split(",")):
        for S in map(int, a.seqlens.split(",")):
            B, H = 16384 // S, 2048 // D
            q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
            slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device="cuda") / H)
            mods = dict(MODS, sinks={"sinks": torch.randn(H, device="cuda")}, alibi={"alibi_slopes": slopes})
            for causal in (False, True):
                def fwd(kw):
                    return lambda: flashrt.forward(q, k, v, causal=causal, **kw)

                def fb(kw):
                    def run():
                        out, lse = flashrt.forward(q, k, v, causal=causal, **kw)
                        flashrt.backward(do, q, k, v, out, lse, causal=causal, **kw)
                    return run
                cases = {(pas, m): (fwd if pas == "fwd" else fb)(kw) for pas in ("fwd", "fwd+bwd")
                         for m, kw in mods.items()}
                if fa4 is not None:
                    cases.update(fa4_cases(fa4, q, k, v, do, causal, mods))
                times = {n: [] for n in cases}
                for fn in cases.values():
                    for _ in range(3):
                        fn()
                for _ in range(a.rounds):
                    for n, fn in cases.items():
                        times[n].append(timed(fn))
                rows.append((D, S, causal, {n: statistics.median(t) for n, t in times.items()}))
    print(f"{torch.cuda.get_device_name()}, bf16, B*S = 16k, H*D = 2048, medians of {a.rounds} interleaved rounds; "
          f"softcap 30{' (exact tanh)' if a.tanh_exact else ''}; ratios against the same library's plain time"
          + ("; 'vs FA4': flashrt's time over FlashAttention-4's, same modification" if fa4 else "") + "\n")
    cols = ("sinks", "softcap", "alibi")
    head = ["D", "S", "causal"]
    for pas in ("fwd", "fwd+bwd"):
        head += [f"{pas} ms", *cols] + ([f"FA4 {pas} ms", *(f"FA4 {c}" for c in cols),
                                         *(f"vs FA4 {c}" for c in ("plain", *cols))] if fa4 else [])
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for D, S, causal, m in rows:
        cells = []
        for pas in ("fwd", "fwd+bwd"):
            base = m[(pas, "plain")]
            cells += [f"{base:.3f}", *(f"{m[(pas, x)] / base:.3f}x" for x in cols)]
            if fa4:
                fbase = m.get(("fa4 " + pas, "plain"))
                cells += [f"{fbase:.3f}" if fbase else "n/a",
                          *(ratio(m.get(("fa4 " + pas, x)), fbase) for x in cols),
                          *(ratio(m[(pas, x)], m.get(("fa4 " + pas, x))) for x in ("plain", *cols))]
        print(f"| {D} | {S} | {causal} | " + " | ".join(cells) + " |")


def ratio(a, b):
    return f"{a / b:.3f}x" if a and b else "n/a"


def fa4_cases(fa4, q, k, v, do, causal, mods):
    """FlashAttention-4's forward and forward+backward per modification; one FA4 cannot run is left out (n/a)."""
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    cases = {}
    for m, kw in mods.items():
        if "alibi_slopes" in kw:  # (FA4 has no ALiBi)
            continue
        fkw = {{"sinks": "learnable_sink"}.get(n, n): x for n, x in kw.items()}  # (FA4 names sinks learnable_sink)

        def fwd(fkw=fkw):
            r = fa4(q, k, v, causal=causal, **fkw)
            return r[0] if isinstance(r, tuple) else r

        def fb(fkw=fkw):
            r = fa4(qg, kg, vg, causal=causal, **fkw)
            torch.autograd.grad(r[0] if isinstance(r, tuple) else r, (qg, kg, vg), do)
        for pas, fn in (("fa4 fwd", fwd), ("fa4 fwd+bwd", fb)):
            try:
                fn()
                torch.cuda.synchronize()
                cases[(pas, m)] = fn
            except Exception as e:  # (reported as n/a in the table)
                print(f"FA4 {pas} {m}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    return cases

if __name__ == "__main__":
    main()
