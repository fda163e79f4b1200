"""The warp-specialised wgmma fused backward (bwd_fused_sm90), ordered and not, against the split pair.

    python scripts/probes/bwd_fused_ws.py [--check-only] [--rounds 3] [--heads 64,128] [--seqlens 1024,4096,16384]
                                         [--gqa] [--defines "a=-DX=1;b=-DX=0"] [--no-sm90] [--softcap C]

Checks first (float64 reference, fresh inputs): the fused kernel, ordered and not, at small shapes with causal, GQA
and MQA; the ordered form bitwise over repeats. Then times flashrt.backward alone (out and lse from one
forward) with CUDA events, medians over interleaved rounds, at 16k tokens and hidden 2048 (B = 16384 // S,
H = 2048 // head_dim), or with --gqa at GQA prefill shapes (head_dim 128). TFLOP/s: 2.5 x the forward's
4 B H S^2 D, halved when causal. Prints a table last.
--defines: an A/B of compile-time switches in one process: the fused variants are checked and timed once per named
set of NVRTC defines (the kernels reloaded at each switch), the split pair once; an item "bm64=64" sets the fused
kernel's query tile at head_dim 64, "rotate=0" turns the ordered non-causal rotation off (tiles.rotate_ordered_dq),
"pdl=0" launches the fused kernel the ordinary way (spec.PROGRAMMATIC).
--no-sm90: the same for the mma.sync fused kernel and split pair (FLASHRT_NO_SM90=1).
--softcap C / --alibi: every call (forward, backward, reference) with softcap=C / ALiBi's geometric (H,) slopes.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch

import flashrt
from flashrt import api, launch, spec, tiles

BASE_OPTIONS = spec.NVRTC_OPTIONS
BASE_TILES = list(tiles._PREFERENCES["bwd_fused_sm90"])
BASE_MOD_TILES = list(tiles._SCORE_MOD_PREFERENCES["bwd_fused_sm90"])
BASE_ALIBI_TILES = list(tiles._ALIBI_PREFERENCES["bwd_fused_sm90"])
BASE_ROTATION = tiles.ORDERED_ROTATION_SM_SHARE
BASE_PROGRAMMATIC = spec.PROGRAMMATIC
DEFINES: dict[str, tuple] = {"": ()}  # name -> NVRTC options added, and "bm64=M" (--defines)
MODS: dict = {}  # --softcap's cap, --alibi


def mods(H: int) -> dict:
    """The keyword arguments of every call at H query heads (--softcap, --alibi: the ALiBi paper's slopes)"""
    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device="cuda")
    return {**({"softcap": MODS["softcap"]} if "softcap" in MODS else {}),
            **({"alibi_slopes": slopes} if "alibi" in MODS else {})}


def use_defines(name: str) -> None:
    """Compile and load the kernels with the named set of defines from here on (a separate cache entry each); a
    "bm64=M" item: the fused kernel's query tile of M rows at head_dim 64 (with a score modification too);
    "rotate=X": tiles.ORDERED_ROTATION_SM_SHARE (0: the ordered non-causal kernel's query tiles in order); "pdl=0":
    the fused kernel launched the ordinary way, not as bwd_preprocess's programmatic dependent."""
    opts = tuple(o for o in DEFINES[name] if not o.startswith(("bm64=", "rotate=", "pdl=")))
    pdl = [o != "pdl=0" for o in DEFINES[name] if o.startswith("pdl=")] or [True]
    programmatic = BASE_PROGRAMMATIC if pdl[0] else {f: a for f, a in BASE_PROGRAMMATIC.items()
                                                   if f != "bwd_fused_sm90"}
    bm64 = [int(o[5:]) for o in DEFINES[name] if o.startswith("bm64=")]
    rotate = [float(o[7:]) for o in DEFINES[name] if o.startswith("rotate=")] or [BASE_ROTATION]
    prefs = BASE_TILES if not bm64 else [(64, [(bm64[0], 128, 12)]), *BASE_TILES[1:]]
    mod_prefs = BASE_MOD_TILES if not bm64 else [(64, [(bm64[0], 128, 12)]), (128, [(64, 128, 12)])]
    alibi_prefs = BASE_ALIBI_TILES if not bm64 else mod_prefs
    if (spec.NVRTC_OPTIONS != BASE_OPTIONS + opts or tiles._PREFERENCES["bwd_fused_sm90"] != prefs
            or tiles._SCORE_MOD_PREFERENCES["bwd_fused_sm90"] != mod_prefs
            or tiles._ALIBI_PREFERENCES["bwd_fused_sm90"] != alibi_prefs
            or tiles.ORDERED_ROTATION_SM_SHARE != rotate[0] or spec.PROGRAMMATIC != programmatic):
        spec.NVRTC_OPTIONS = BASE_OPTIONS + opts
        spec.PROGRAMMATIC = programmatic
        tiles._PREFERENCES["bwd_fused_sm90"] = prefs
        tiles._SCORE_MOD_PREFERENCES["bwd_fused_sm90"] = mod_prefs
        tiles._ALIBI_PREFERENCES["bwd_fused_sm90"] = alibi_prefs
        tiles.ORDERED_ROTATION_SM_SHARE = rotate[0]
        launch._functions.clear()
        tiles.kernel_for.cache_clear()
        api._PLANS.clear()


def reference(q, k, v, do, causal):
    q, k, v, do = (x.double().transpose(1, 2).requires_grad_() for x in (q, k, v, do))
    q.retain_grad()
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) / q.shape[-1] ** 0.5
    if MODS.get("softcap"):
        s = MODS["softcap"] * torch.tanh(s / MODS["softcap"])
    if "alibi" in MODS:  # -slope |j - i - (Sk - Sq)|
        Sq, Sk = s.shape[-2:]
        d = torch.arange(Sk, device=s.device)[None, :] - torch.arange(Sq, device=s.device)[:, None] - (Sk - Sq)
        s = s - mods(q.shape[1])["alibi_slopes"].double()[:, None, None] * d.abs().double()
    Sq, Sk = s.shape[-2:]
    mask = torch.zeros(Sq, Sk, dtype=torch.bool, device=s.device)
    if causal:
        mask = torch.ones(Sq, Sk, dtype=torch.bool, device=s.device).tril(Sk - Sq).logical_not()
    # (a query that sees no key, as where Sq > Sk causal: output and gradients zero, as flashrt's)
    p = torch.softmax(s.masked_fill(mask, -1e30), -1) * mask.logical_not()
    (p @ vv).backward(do)
    return [x.grad.transpose(1, 2) for x in (q, k, v)]


def check() -> list[str]:
    rows = []
    torch.manual_seed(0)
    cases = [(2, 300, 300, 4, 4, 64, False), (2, 300, 300, 4, 4, 128, True), (1, 512, 512, 8, 2, 128, True),
             (3, 200, 333, 4, 1, 64, False), (2, 1024, 1024, 4, 4, 128, False), (1, 700, 700, 6, 3, 64, False),
             (2, 333, 333, 4, 2, 64, True), (1, 200, 517, 4, 4, 64, True), (1, 1024, 1024, 8, 8, 64, True),
             (1, 517, 200, 4, 4, 64, True), (1, 1000, 1000, 8, 1, 128, True),  # (MQA: dK/dV splits)
             (1, 1000, 1000, 8, 1, 64, True)]
    for B, Sq, Sk, H, Hkv, D, causal in cases:
        q = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16)
        do = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16)
        ref = reference(q, k, v, do, causal)
        out, lse = flashrt.forward(q, k, v, causal=causal, **mods(H))
        for dname, det in ((dname, det) for dname in DEFINES for det in (False, True)):
            use_defines(dname)
            got = flashrt.backward(do, q, k, v, out, lse, causal=causal, impl="fused", deterministic=det, **mods(H))
            errs = [float((a.double() - r).norm() / r.norm()) for a, r in zip(got, ref)]
            same = ""
            if det:
                again = [flashrt.backward(do, q, k, v, out, lse, causal=causal, impl="fused", deterministic=True,
                                          **mods(H)) for _ in range(3)]
                same = all(torch.equal(a, b) for g2 in again for a, b in zip(got, g2))
                same = "bitwise" if same else "DIFFERS"
            ok = all(e < 2e-2 for e in errs) and same != "DIFFERS"
            rows.append(f"| B{B} Sq{Sq} Sk{Sk} H{H}/{Hkv} D{D} {'causal' if causal else 'full'} | "
                        f"{dname + ' ' if dname else ''}{'det' if det else 'nondet'} | "
                        f"{' '.join(f'{e:.1e}' for e in errs)} | {same} | "
                        f"{'ok' if ok else 'FAIL'} |")
            print(rows[-1], flush=True)
    return rows


def time_shape(B, S, H, Hkv, D, causal, rounds) -> dict:
    """TFLOP/s of each variant at one shape (medians over interleaved rounds)."""
    q, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kw = mods(H)
    out, lse = flashrt.forward(q, k, v, causal=causal, **kw)
    variants = {}
    for dname in DEFINES:
        tag = f"{dname} " if dname else ""
        variants[tag + "fused-det"] = (dname, dict(impl="fused", **kw))
        variants[tag + "fused"] = (dname, dict(impl="fused", deterministic=False, **kw))
    variants["split"] = (next(iter(DEFINES)), dict(impl="split", **kw))
    times = {n: [] for n in variants}
    for _ in range(rounds):
        for name, (dname, kw) in variants.items():
            use_defines(dname)
            for _ in range(3):
                flashrt.backward(do, q, k, v, out, lse, causal=causal, **kw)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            n = 10
            e0.record()
            for _ in range(n):
                flashrt.backward(do, q, k, v, out, lse, causal=causal, **kw)
            e1.record()
            torch.cuda.synchronize()
            times[name].append(e0.elapsed_time(e1) / n)
    flops = 2.5 * 4 * B * H * S * S * D / (2 if causal else 1)
    return {n: flops / statistics.median(t) / 1e9 for n, t in times.items()}


def time_grid(shapes, rounds) -> list[str]:
    rows, names = [], None
    for B, S, H, Hkv, D, causal in shapes:
        tf = time_shape(B, S, H, Hkv, D, causal, rounds)
        names = list(tf)
        rows.append(f"| B{B} S{S} H{H}/{Hkv} D{D} | {'causal' if causal else 'full'} | " +
                    " | ".join(f"{tf[n]:.0f}" for n in names) + " |")
        print(rows[-1], flush=True)
    return ["| shape | mask | " + " | ".join(names) + " |", "|" + "---|" * (2 + len(names))] + rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", default="64,128")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--gqa", action="store_true", help="GQA shapes instead of the grid")
    ap.add_argument("--defines", default="", help='named sets of NVRTC defines to A/B: "a=-DX=1 -DY=2;b=-DX=0"')
    ap.add_argument("--no-sm90", action="store_true", help="FLASHRT_NO_SM90=1: the mma.sync fused kernel and pair")
    ap.add_argument("--softcap", type=float, default=0.0, help="softcap=C in every call")
    ap.add_argument("--alibi", action="store_true", help="ALiBi (geometric (H,) slopes) in every call")
    a = ap.parse_args()
    if a.softcap:
        MODS["softcap"] = a.softcap
    if a.alibi:
        MODS["alibi"] = True
    if a.no_sm90:
        os.environ["FLASHRT_NO_SM90"] = "1"
    if a.defines:
        DEFINES.clear()
        for item in a.defines.split(";"):
            name, _, opts = item.partition("=")
            DEFINES[name.strip()] = tuple(opts.split())
    print(torch.cuda.get_device_name())
    rows = check()
    if a.gqa:  # GQA prefill 32/8 and 16/2 at head_dim 128
        shapes = [(1, 8192, 32, 8, 128, True), (1, 8192, 32, 8, 128, False), (2, 4096, 16, 2, 128, True)]
    else:
        shapes = [(16384 // S, S, 2048 // D, 2048 // D, D, causal) for D in map(int, a.heads.split(","))
                  for S in map(int, a.seqlens.split(",")) for causal in (False, True)]
    table = [] if a.check_only else time_grid(shapes, a.rounds)
    print("\n| shape | kernel | dq dk dv rel err | repeats | |\n|---|---|---|---|---|")
    print("\n".join(rows))
    print("\nTFLOP/s (flashrt.backward alone):")
    print("\n".join(table))


if __name__ == "__main__":
    main()
