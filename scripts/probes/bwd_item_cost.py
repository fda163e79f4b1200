"""A fused wgmma backward block's fixed cost: the kernel alone at grids of a whole number of waves of key-tile blocks
(one block per SM), each with n query-tile pairs, so that time per wave = n t + F (t: a pair, F: a block's cost
outside its pairs: launch, K / V and the first stage's latency, the dK / dV epilogue, the last add's drain).

    python scripts/probes/bwd_item_cost.py [--waves 4] [--seqlens 256,512,768,1536,3072,6144] [--head-dims 64,128]
                                           [--forms "base:,nokv:-DFRT_EXP_NO_KV=1"] [--grid]

Non-causal, deterministic=False, impl="fused", bf16, B=1, H chosen so that H x key tiles = waves x SMs. The kernel's
time from the torch profiler (CUPTI), medians of --rounds calls. Prints per head_dim and form a least-squares fit of
the per-wave time against n, and each point's share of F. --forms: "name:NVRTC defines" each, one after the other in
one process (an A/B of compile-time switches, e.g. experiments' -D switches patched into the kernel). --grid: instead,
flashrt.backward alone (CUDA events over 10 calls, medians of interleaved rounds; the call's three kernels) at the
16k-token grid (B = 16384 / S, H x D = 2048), S 1k / 4k / 16k, causal and not, and 4k causal in four documents
(segment ids; FLOPs counted as 1/8 of dense), unordered and deterministic (not with ids), each form. Run with another
checkout's flashrt first on PYTHONPATH, it times that tree (alternate processes for an A/B of two trees).
"""
import argparse
import statistics

import torch
from torch.profiler import ProfilerActivity, profile

import flashrt
from flashrt import api, launch, spec, tiles

BASE_OPTIONS = spec.NVRTC_OPTIONS


def use_form(form: str) -> None:
    """Compile and launch with form "name:-DX=1 -DY=0"'s NVRTC defines added from here on."""
    spec.NVRTC_OPTIONS = BASE_OPTIONS + tuple(form.partition(":")[2].split())
    launch._functions.clear()
    tiles.kernel_for.cache_clear()
    api._PLANS.clear()


def kernel_us(fn, name: str, rounds: int) -> float:
    """Median device time (us) of the kernels whose name contains `name`, one call of fn per round."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            fn()
        torch.cuda.synchronize()
    times = [e.device_time for e in prof.events() if name in e.name and e.device_time > 0]
    if len(times) != rounds:
        raise RuntimeError(f"{len(times)} kernels named *{name}* in {rounds} calls: "
                           f"{sorted({e.name for e in prof.events()})[:12]}")
    return statistics.median(times)


def fit_table(a, sms: int, form: str) -> list[str]:
    lines = []
    for D in map(int, a.head_dims.split(",")):
        bm = 128 if D == 64 else 64  # the fused kernel's query tile (tiles: 128 rows at head_dim 64)
        pts = []
        for S in map(int, a.seqlens.split(",")):
            tiles_k = S // 128
            if (a.waves * sms) % tiles_k:
                print(f"skip S={S}: {tiles_k} key tiles do not divide {a.waves * sms}")
                continue
            H = a.waves * sms // tiles_k
            g = torch.Generator(device="cuda").manual_seed(S + D)
            q, k, v, do = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
            out, lse = flashrt.forward(q, k, v, causal=False)

            def call():
                flashrt.backward(do, q, k, v, out, lse, causal=False, impl="fused", deterministic=False)
            us = kernel_us(call, "bwd_fused", a.rounds)
            n = S // bm
            pts.append((S, H, n, us, us / a.waves))
        xs, ys = [p[2] for p in pts], [p[4] for p in pts]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        t = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        F = my - t * mx
        for S, H, n, us, w in pts:
            lines.append(f"| {form} | {D} | {S} | {H} | {n} | {us:.1f} | {w:.2f} | {F / w:.0%} |")
        lines.append(f"| {form} | {D} | fit | | | | t = {t:.3f} us a pair, F = {F:.2f} us a block | |")
    return lines


def grid_table(a, forms: list[str]) -> list[str]:
    """flashrt.backward alone per form, CUDA events over 10 calls, medians of interleaved rounds."""
    cases = [(D, S, c, det) for D in map(int, a.head_dims.split(",")) for S in map(int, a.grid_seqlens.split(","))
             for c in (False, True) for det in (False, True)]
    if a.docs:
        cases += [(D, 4096, "docs", False) for D in map(int, a.head_dims.split(","))]  # (ordered: not with ids)
    times = {(f, c): [] for f in forms for c in cases}
    inputs = {}
    for D, S, c, det in cases:
        if (D, S, c) not in inputs:
            B, H = 16384 // S, 2048 // D
            g = torch.Generator(device="cuda").manual_seed(S + D)
            q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
            kw = {}
            if c == "docs":  # causal, four documents a sequence (segment ids: a masked kernel, a block per key tile)
                ids = (torch.arange(S, device="cuda", dtype=torch.int32) * 4 // S).expand(B, S).contiguous()
                kw = dict(causal=True, segment_ids_q=ids, segment_ids_k=ids)
            else:
                kw = dict(causal=c)
            inputs[(D, S, c)] = ((do, q, k, v, *flashrt.forward(q, k, v, **kw)), kw)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(a.rounds):
        for f in forms:
            use_form(f)
            for case in cases:
                D, S, c, det = case
                x, kw = inputs[(D, S, c)]
                flashrt.backward(*x, **kw, impl="fused", deterministic=det)  # (loads the module)
                start.record()
                for _ in range(10):
                    flashrt.backward(*x, **kw, impl="fused", deterministic=det)
                end.record()
                end.synchronize()
                times[(f, case)].append(start.elapsed_time(end) / 10)
    lines = ["| D | S | causal | deterministic | " + " | ".join(f"{f} TFLOP/s" for f in forms) + " | first / last |",
             "|---|---|---|---|" + "---|" * (len(forms) + 1)]
    for case in cases:
        D, S, c, det = case
        flops = 2.5 * 4 * 16384 * S * 2048 / (2 if c is True else 8 if c == "docs" else 1)
        tf = [flops / statistics.median(times[(f, case)]) / 1e9 for f in forms]
        cells = " | ".join(f"{x:.0f}" for x in tf)
        lines.append(f"| {D} | {S} | {c} | {det} | {cells} | {tf[0] / tf[-1]:.3f} |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--seqlens", default="256,512,768,1536,3072,6144")
    ap.add_argument("--head-dims", default="64,128")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--forms", default="base:")
    ap.add_argument("--grid", action="store_true")
    ap.add_argument("--grid-seqlens", default="1024,4096,16384")
    ap.add_argument("--docs", type=int, default=1, help="--grid: also 4k causal in four documents (0: not)")
    a = ap.parse_args()
    sms = launch.device(0).sm_count
    print(torch.cuda.get_device_name(), f"{sms} SMs", flush=True)
    forms = a.forms.split(",")
    if a.grid:
        print("\n".join(grid_table(a, forms)))
        return
    lines = ["| form | D | S | H | pairs a block | kernel us | us a wave | F share |",
             "|---|---|---|---|---|---|---|---|"]
    for form in forms:
        use_form(form)
        lines += fit_table(a, sms, form)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
