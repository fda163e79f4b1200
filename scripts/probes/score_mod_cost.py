"""What the score modifications cost: flashrt.forward and forward+backward (flashrt.backward, deterministic auto)
plain, with `sinks`, with `softcap=30`, with ALiBi (`alibi_slopes`, (H,) geometric as in the ALiBi paper), and with
score_mod expressions written to match them ("s:cap", "s:alibi") and a relative-position bias table read per pair
("s:rel", (H, 2S - 1) fp32), bf16, B*S = 16k tokens, H*D = 2048, causal and not; medians of CUDA-event times over
interleaved rounds after a warm-up. Prints a table: ms plain and each modification's ratio.

    python3 scripts/probes/score_mod_cost.py [--rounds 7] [--seqlens 1024,4096,16384] [--head-dims 64,128]
                                             [--tanh-exact] [--fa4] [--flex] [--mods plain,softcap,...]

--tanh-exact compiles the softcap's tanh as 1 - 2 / (2^(2x log2 e) + 1) (kernels_cu/attention/score_mod.cuh:
FRT_TANH_EXACT) instead of tanh.approx.f32, an A/B of one process against another run without it (each run's own
plain column is its baseline).
--fa4 times FlashAttention-4 (flash_attn.cute.flash_attn_func: softcap=, learnable_sink=; forward+backward through
torch.autograd.grad) in the same rounds: its plain ms, its own ratios, and flashrt's time over FA4's per column.
--flex times FlexAttention (torch.compile(flex_attention), a causal block mask) with the same modifications as
score_mod functions in the same rounds, and prints flashrt's time over Flex's per column (s:* against the same
function; its inputs are (B, H, S, D) contiguous copies, made once).
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

import flashrt  # noqa: E402

COLS = ("sinks", "softcap", "alibi", "s:cap", "s:alibi", "s:rel")  # the modifications, each against "plain"


def timed(fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b)


def grid_args(rounds: int = 7, seqlens: str = "1024,4096,16384", head_dims: str = "64,128") -> argparse.ArgumentParser:
    """The probes' parser with their grid's options: --rounds, --seqlens, --head-dims (comma-separated)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--seqlens", default=seqlens)
    ap.add_argument("--head-dims", default=head_dims)
    return ap


def grid(a):
    """(D, S, H, q, k, v, do) per head_dim and sequence length of the options `a` (grid_args): bf16 N(0, 1) inputs of
    16k tokens (B = 16k / S) and H * D = 2048."""
    for D in map(int, a.head_dims.split(",")):
        for S in map(int, a.seqlens.split(",")):
            B, H = 16384 // S, 2048 // D
            yield D, S, H, *(torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))


def main():
    ap = grid_args()
    ap.add_argument("--tanh-exact", action="store_true")
    ap.add_argument("--fa4", action="store_true")
    ap.add_argument("--flex", action="store_true")
    ap.add_argument("--mods", default=",".join(COLS))
    a = ap.parse_args()
    cols = tuple(c for c in a.mods.split(",") if c in COLS)
    fa4 = None
    if a.fa4:
        from flash_attn.cute import flash_attn_func as fa4
    if a.tanh_exact:
        from flashrt import spec
        spec.NVRTC_OPTIONS = (*spec.NVRTC_OPTIONS, "-DFRT_TANH_EXACT=1")
    rows = []
    for D, S, H, q, k, v, do in grid(a):
        mods, slopes, bias = modifications(H, S)
        mods = {m: kw for m, kw in mods.items() if m == "plain" or m in cols}
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
            if a.flex:
                cases.update(flex_cases(q, k, v, do, causal, mods, slopes, bias))
            rows.append((D, S, causal, medians(cases, a.rounds)))
    print(f"{torch.cuda.get_device_name()}, bf16, B*S = 16k, H*D = 2048, medians of {a.rounds} interleaved rounds; "
          f"softcap 30{' (exact tanh)' if a.tanh_exact else ''}; ratios against the same library's plain time"
          + ("; 'vs FA4': flashrt's time over FlashAttention-4's, same modification" if fa4 else "")
          + ("; 'vs Flex': flashrt's time over FlexAttention's, same modification" if a.flex else "") + "\n")
    head = ["D", "S", "causal"]
    for pas in ("fwd", "fwd+bwd"):
        head += [f"{pas} ms", *cols] + ([f"FA4 {pas} ms", *(f"FA4 {c}" for c in cols),
                                         *(f"vs FA4 {c}" for c in ("plain", *cols))] if fa4 else [])
        head += [f"vs Flex {c}" for c in ("plain", *cols)] if a.flex else []
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
            if a.flex:
                cells += [ratio(m[(pas, x)], m.get(("flex " + pas, x))) for x in ("plain", *cols)]
        print(f"| {D} | {S} | {causal} | " + " | ".join(cells) + " |")


def modifications(H, S):
    """name -> flashrt's keyword arguments of each modification timed here ("plain" none), and the ALiBi slopes
    (H,) and relative-position table (H, 2S - 1) they read."""
    slopes = 2.0 ** (-8.0 * torch.arange(1, H + 1, device="cuda") / H)
    bias = torch.randn(H, 2 * S - 1, device="cuda")
    mods = {"plain": {}, "sinks": {"sinks": torch.randn(H, device="cuda")}, "softcap": {"softcap": 30.0},
            "alibi": {"alibi_slopes": slopes},
            "s:cap": {"score_mod": "30.f * tanhf(s * (1.f / 30.f))"},
            "s:alibi": {"score_mod": "s - slopes[h] * fabsf(kf - qf - (float)(Lk - Lq))",
                        "score_tensors": {"slopes": slopes}},
            "s:rel": {"score_mod": f"s + bias[h * {2 * S - 1} + k - q + {S - 1}]", "score_tensors": {"bias": bias}}}
    return mods, slopes, bias


def medians(cases: dict, rounds: int) -> dict:
    """name -> the median ms (CUDA events) of each case's function over `rounds` interleaved rounds, after three
    warm-up calls each."""
    for fn in cases.values():
        for _ in range(3):
            fn()
    times = {n: [] for n in cases}
    for _ in range(rounds):
        for n, fn in cases.items():
            times[n].append(timed(fn))
    return {n: statistics.median(t) for n, t in times.items()}


def ratio(a, b):
    return f"{a / b:.3f}x" if a and b else "n/a"


def flex_cases(q, k, v, do, causal, mods, slopes, bias):
    """FlexAttention's forward and forward+backward per modification (the same function as flashrt's s:*; its
    built-in twins: softcap as s:cap, ALiBi as s:alibi); sinks are left out (n/a)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    # (each function, mask and requires_grad is a compile of its own: past dynamo's default limit of 8, Flex falls
    # back to its unfused eager form)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 256)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 1024)
    flex = torch.compile(flex_attention, dynamic=False)  # (static shapes, as for one shape alone)
    B, S, H, D = q.shape
    qt, kt, vt, dot = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    qg, kg, vg = (x.detach().requires_grad_() for x in (qt, kt, vt))
    block = create_block_mask(lambda b, h, i, j: j <= i, None, None, S, S) if causal else None
    fns = {"plain": None, "softcap": lambda x, b, h, i, j: 30 * torch.tanh(x / 30),
           "alibi": lambda x, b, h, i, j: x - slopes[h] * (j - i).abs(),
           "s:rel": lambda x, b, h, i, j: x + bias[h, j - i + S - 1]}
    fns["s:cap"], fns["s:alibi"] = fns["softcap"], fns["alibi"]
    cases = {}
    for m in mods:
        if m not in fns:
            continue
        fn = fns[m]

        def fwd(fn=fn):
            return flex(qt, kt, vt, score_mod=fn, block_mask=block)

        def fb(fn=fn):
            torch.autograd.grad(flex(qg, kg, vg, score_mod=fn, block_mask=block), (qg, kg, vg), dot)
        add_if_runs(cases, "flex", m, fwd, fb)
    return cases


def add_if_runs(cases, peer, m, fwd, fb):
    """cases[(f"{peer} fwd" | f"{peer} fwd+bwd", m)] = each of fwd, fb that runs once; one that raises is left out
    (n/a in the table) and said on stderr."""
    for pas, fn in ((f"{peer} fwd", fwd), (f"{peer} fwd+bwd", fb)):
        try:
            fn()
            torch.cuda.synchronize()
            cases[(pas, m)] = fn
        except Exception as e:
            print(f"{pas} {m}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)


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
        add_if_runs(cases, "fa4", m, fwd, fb)
    return cases


if __name__ == "__main__":
    main()
