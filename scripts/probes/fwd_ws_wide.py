"""Tilings of the warp-specialised forward (fwd_sm90_ws) against each other, the plain wgmma forward (fwd_sm90) and
cuDNN: by default 64- and 80-key tiles at head_dim 192 / 256; --variants names others (head_dim 64: 128- and 192-row
tiles, "--heads 64 --variants ws128=fwd_sm90_ws:128:128:12,ws192=fwd_sm90_ws:192:128:16"); a variant's NVRTC
defines follow a "+" ("late=fwd_sm90_ws+-DFRT_FWD_EARLY_Q=0": an A/B of a compile-time switch in one process).

    python scripts/probes/fwd_ws_wide.py [--check-only] [--rounds 3] [--heads 192,256] [--seqlens 1024,4096,16384]
                                         [--seed-only] [--variants name=family[:block_m:block_n:warps][+opt],...]
                                         [--softcap 30] [--alibi]

Checks first (float64 reference, fresh inputs): each variant at small ragged shapes, causal and not, GQA, padded
lengths. Then times flashrt.forward with each variant forced (tiles.forward_family and the tile table patched, the
caches cleared) and torch's cuDNN SDPA beside, CUDA events, medians over interleaved rounds, at 16k tokens and hidden
2048 (B = 16384 // S, H = 2048 // head_dim) and at the seed shape (B2 S1024 H8 Hkv1 head_dim 256). TFLOP/s:
4 B H S^2 D, halved when causal. Prints a table last.
"""
from __future__ import annotations

import argparse
import statistics

import torch

import flashrt
from flashrt import api, launch, spec, tiles

# variant -> (family, its tiling (block_m, block_n, warps) or None: the library's, NVRTC options added); --variants
VARIANTS = {"fwd_sm90": ("fwd_sm90", None, ()), "ws64": ("fwd_sm90_ws", (128, 64, 12), ()),
            "ws80": ("fwd_sm90_ws", (128, 80, 12), ())}
_forward_family = tiles.forward_family
_tables = {f: list(t) for f, t in tiles._PREFERENCES.items()}
_dense = dict(tiles._DENSE_PREFERENCES)
BASE_OPTIONS = spec.NVRTC_OPTIONS


def use(variant: str) -> None:
    family, tiling, opts = VARIANTS[variant]
    if spec.NVRTC_OPTIONS != BASE_OPTIONS + opts:
        spec.NVRTC_OPTIONS = BASE_OPTIONS + opts  # (a cache entry of their own; the loaded kernels dropped)
        launch._functions.clear()
    tiles.forward_family = lambda *a, **k: family if _forward_family(*a, **k).startswith("fwd_sm90") else \
        _forward_family(*a, **k)
    tiles._PREFERENCES[family] = [(256, [tiling])] if tiling else _tables[family]
    # (a forced tiling also replaces the dense calls' preference, which tiles.tiling puts ahead of the table)
    tiles._DENSE_PREFERENCES[family] = {} if tiling else _dense.get(family, {})
    tiles.kernel_for.cache_clear()
    api._PLANS.clear()


def slopes(H):
    """--alibi: the ALiBi paper's geometric slopes for H heads, fp32 (H,)"""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], device="cuda", dtype=torch.float32)


def mods(H, softcap=0.0, alibi=False) -> dict:
    """flashrt.forward's keyword arguments for --softcap / --alibi at H query heads"""
    return {**(dict(softcap=softcap) if softcap else {}), **(dict(alibi_slopes=slopes(H)) if alibi else {})}


def reference(q, k, v, causal, lengths=None, softcap=0.0, alibi=False):
    q, k, v = (x.double().transpose(1, 2) for x in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    Sq, Sk = s.shape[-2:]
    if alibi:  # -slope |j - i - (Lk - Sq)|, bottom-right as flashrt aligns it (each sequence's own key length)
        lk = lengths.double() if lengths is not None else torch.full((q.shape[0],), float(Sk), device=s.device)
        d = (torch.arange(Sk, device=s.device)[None, :] - torch.arange(Sq, device=s.device)[:, None]).double()
        d = (d[None] - (lk - Sq)[:, None, None]).abs()[:, None]
        s = s - slopes(q.shape[1]).double()[None, :, None, None] * d
    hide = torch.zeros(q.shape[0], 1, Sq, Sk, dtype=torch.bool, device=s.device)
    if causal:
        hide |= torch.ones(Sq, Sk, dtype=torch.bool, device=s.device).tril(Sk - Sq).logical_not()
    if lengths is not None:
        kk = torch.arange(Sk, device=s.device)
        hide |= (kk[None, :] >= lengths[:, None])[:, None, None, :]
    s = s.masked_fill(hide, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2).nan_to_num()  # (rows that see no key: 0)


def check(heads, softcap=0.0, alibi=False) -> list[str]:
    rows = []
    torch.manual_seed(0)
    cases = [(2, 300, 300, 4, 4, 192, False, False), (2, 300, 300, 4, 4, 256, True, False),
             (1, 517, 700, 8, 2, 256, True, False), (3, 200, 333, 4, 1, 192, True, False),
             (2, 1024, 1024, 4, 4, 256, False, False), (2, 384, 384, 6, 3, 192, False, True),
             (2, 640, 640, 4, 2, 256, False, True), (1, 131, 77, 4, 4, 256, True, False)]
    heads = set(heads)
    cases = [c for c in cases if c[5] in heads] + [
        (2, 300, 300, 4, 4, 64, False, False), (2, 577, 577, 4, 4, 64, True, False),
        (1, 517, 700, 8, 2, 64, True, False), (3, 200, 333, 4, 1, 64, True, False),
        (2, 1024, 1024, 4, 4, 64, False, False),
        (2, 640, 640, 4, 2, 64, False, True), (1, 131, 77, 4, 4, 64, True, False)] * (64 in heads) + [
        (2, 300, 300, 4, 4, 128, False, False), (1, 517, 700, 8, 2, 128, False, False),
        (2, 1024, 1024, 4, 4, 128, False, False), (2, 640, 640, 4, 2, 128, False, True),
        (1, 131, 77, 4, 4, 128, True, False)] * (128 in heads)
    for B, Sq, Sk, H, Hkv, D, causal, padded in cases:
        q = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=torch.bfloat16)
        lengths = torch.randint(1, Sk + 1, (B,), device="cuda", dtype=torch.int32) if padded else None
        ref = reference(q, k, v, causal, lengths, softcap, alibi)
        for family in VARIANTS:
            use(family)
            kw = dict(seqlens_k=lengths) if padded else {}
            kw.update(mods(H, softcap, alibi))
            try:
                out, _ = flashrt.forward(q, k, v, causal=causal, **kw)
            except (ValueError, tiles.TilingError) as e:  # (a tiling the host refuses for this call)
                rows.append(f"| B{B} Sq{Sq} Sk{Sk} H{H}/{Hkv} D{D} | {family} | refused: {str(e)[:60]} | |")
                continue
            err = float((out.double() - ref).norm() / ref.norm())
            ok = err < 1e-2 and not out.isnan().any()
            rows.append(f"| B{B} Sq{Sq} Sk{Sk} H{H}/{Hkv} D{D} {'causal' if causal else 'full'}"
                        f"{' padded' if padded else ''} | {family} | {err:.1e} | {'ok' if ok else 'FAIL'} |")
            print(rows[-1], flush=True)
    return rows


def time_shape(B, S, H, Hkv, D, causal, rounds, softcap=0.0, alibi=False) -> dict:
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, enable_gqa=H != Hkv)

    kw = mods(H, softcap, alibi)

    def ours(family):
        def run():
            flashrt.forward(q, k, v, causal=causal, **kw)
        return family, run

    variants = {}
    for f in VARIANTS:
        use(f)
        try:
            flashrt.forward(q, k, v, causal=causal, **kw)
            variants.update([ours(f)])
        except (ValueError, tiles.TilingError):  # (a tiling the host refuses for this call)
            pass
    try:
        if kw:
            raise RuntimeError("cuDNN SDPA has no softcap or ALiBi")
        cudnn()
        variants["cudnn"] = cudnn
    except RuntimeError:
        pass
    flops = 4 * B * H * S * S * D / (2 if causal else 1)
    times = {n: [] for n in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            if name in VARIANTS:
                use(name)
            for _ in range(3):
                fn()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            n = min(200, max(10, int(2e12 / flops)))  # (>= ~4 ms a timing: small shapes are not timed by the host)
            e0.record()
            for _ in range(n):
                fn()
            e1.record()
            torch.cuda.synchronize()
            times[name].append(e0.elapsed_time(e1) / n)
    return {n: flops / statistics.median(times[n]) / 1e9 if n in times else float("nan") for n in [*VARIANTS, "cudnn"]
            if n in times or n in VARIANTS}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", default="192,256")
    ap.add_argument("--seqlens", default="1024,4096,16384")
    ap.add_argument("--seed-only", action="store_true", help="time the seed shape only")
    ap.add_argument("--softcap", type=float, default=0.0, help="every call with this softcap (no cuDNN then)")
    ap.add_argument("--alibi", action="store_true", help="every call with ALiBi, geometric (H,) slopes (no cuDNN)")
    ap.add_argument("--variants", help="name=family[:block_m:block_n:warps][+opt...],... instead of fwd_sm90, ws64, "
                    "ws80")
    a = ap.parse_args()
    if a.variants:
        VARIANTS.clear()
        for v in a.variants.split(","):
            name, _, rest = v.partition("=")
            rest, *opts = rest.split("+")
            family, *t = rest.split(":")
            VARIANTS[name] = (family, tuple(map(int, t)) if t else None, tuple(opts))
    print(torch.cuda.get_device_name())
    rows = check(list(map(int, a.heads.split(","))), a.softcap, a.alibi)
    shapes = [] if a.seed_only else [(16384 // S, S, 2048 // D, 2048 // D, D, causal) for D in map(
        int, a.heads.split(",")) for S in map(int, a.seqlens.split(",")) for causal in (False, True)]
    if 256 in map(int, a.heads.split(",")):
        shapes += [(2, 1024, 8, 1, 256, False), (2, 1024, 8, 1, 256, True)]  # the seed shape
    table = []
    for B, S, H, Hkv, D, causal in ([] if a.check_only else shapes):
        tf = time_shape(B, S, H, Hkv, D, causal, a.rounds, a.softcap, a.alibi)
        if not table:
            table = ["| shape | mask | " + " | ".join(tf) + " |", "|" + "---|" * (2 + len(tf))]
        table.append(f"| B{B} S{S} H{H}/{Hkv} D{D} | {'causal' if causal else 'full'} | " +
                     " | ".join(f"{x:.0f}" for x in tf.values()) + " |")
        print(table[-1], flush=True)
    print("\n| shape | family | rel err | |\n|---|---|---|---|")
    print("\n".join(rows))
    print("\nTFLOP/s (flashrt.forward alone; cuDNN: torch SDPA):")
    print("\n".join(table))


if __name__ == "__main__":
    main()
