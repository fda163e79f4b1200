"""Decode benchmark (scripts/bench.py --set decode, or alone): one new token per sequence against a KV cache, bf16.

    python scripts/bench_decode.py [--quick] [--points B:Sk,...] [--out DIR]

Implementations, on the same tensors, every sequence holding Sk tokens:
  flashrt        flashrt.decode, contiguous cache (B, Sk, Hkv, D)
  flashrt-paged  flashrt.decode, the same tokens in 64-token pages with a shuffled page table
  flash, cudnn   torch SDPA with that backend forced, q (B, H, 1, D) against transposed views of the cache,
                 enable_gqa=True (no copy of K/V per query head)
Score: K/V bytes read per second (B * Sk * Hkv * D * 2 bytes * 2), the quantity every implementation must move.
Checked first: each output against float64 on the first two sequences (rel. L2 error under 2e-2), or no timing.
Timing: CUDA events around the replay of a CUDA graph of 20 calls, which rotate among enough copies of the inputs
to exceed 3x the L2 cache (a small cache would otherwise be read from L2); medians of 5 interleaved rounds
(implementations in turn). The graph keeps host launch overhead out: serving loops capture their decode steps.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flashrt  # noqa: E402

IMPLS = ("flashrt", "flashrt-paged", "flash", "cudnn")
HEADS = [(32, 8, 128), (8, 1, 128), (32, 8, 64), (8, 1, 64), (32, 8, 256), (8, 1, 256)]
POINTS = [(B, S) for B in (1, 16, 64, 128) for S in (1024, 4096, 32768, 131072)]
QUICK = [(1, 32768), (16, 8192), (64, 4096), (128, 1024)]
ROUNDS = 5
PAGE = 64


def kv_bytes(B, S, Hkv, D) -> int:
    return B * S * Hkv * D * 2 * 2


def make_set(B, S, H, Hkv, D, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v


def paged(k, v, seed):
    """The same tokens in PAGE-token pages, pages shuffled: (pool_k, pool_v, table)."""
    B, S, Hkv, D = k.shape
    n = B * (S // PAGE)
    perm = torch.randperm(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))
    table = perm.view(B, S // PAGE).to(torch.int32)
    pk = torch.empty(n, PAGE, Hkv, D, device="cuda", dtype=k.dtype)
    pv = torch.empty_like(pk)
    pk[perm] = k.reshape(n, PAGE, Hkv, D)
    pv[perm] = v.reshape(n, PAGE, Hkv, D)
    return pk, pv, table


def call_of(impl, q, k, v, lens, extra):
    if impl == "flashrt":
        return lambda: flashrt.decode(q, k, v, cache_seqlens=lens)
    if impl == "flashrt-paged":
        pk, pv, table = extra
        return lambda: flashrt.decode(q, pk, pv, cache_seqlens=lens, page_table=table)
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def sdpa():
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True).transpose(1, 2)
    return sdpa


def rel_err(out, q, k, v) -> float:
    """Relative L2 error of out's first two sequences against float64."""
    H, Hkv = q.shape[2], k.shape[2]
    n = min(2, q.shape[0])
    qq = q[:n].double().transpose(1, 2)
    kk = k[:n].double().transpose(1, 2).repeat_interleave(H // Hkv, 1)
    vv = v[:n].double().transpose(1, 2).repeat_interleave(H // Hkv, 1)
    ref = torch.softmax(qq @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ vv
    o = out[:n].double().transpose(1, 2)
    return ((o - ref).norm() / ref.norm()).item()


def decode_error(H, Hkv, D, splits=(3,)) -> float:
    """flashrt.decode's largest relative error against float64 over ragged lengths (700, 0 and 333 of 700 keys), one
    new token, at each forced split count: a probe's check of a kernel variant before it times it."""
    torch.manual_seed(1)
    B, S = 3, 700
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([700, 0, 333], dtype=torch.int32, device="cuda")
    err = 0.0
    for n_splits in splits:
        out = flashrt.decode(q, k, v, cache_seqlens=lens, num_splits=n_splits)
        for b in (0, 2):
            n = int(lens[b])
            qq = q[b, 0].double().view(Hkv, H // Hkv, D)
            kk, vv = k[b, :n].double().permute(1, 0, 2), v[b, :n].double().permute(1, 0, 2)
            ref = (torch.softmax(qq @ kk.transpose(1, 2) / D ** 0.5, -1) @ vv).reshape(H, D)
            err = max(err, ((out[b, 0].double() - ref).abs().max() / ref.abs().max()).item())
    return err


def library_splits(B, S, H, Hkv, D) -> int:
    """The split count flashrt.decode picks for one new token at this point on the current device (tiles.decode_splits:
    the probes' reference column)."""
    from flashrt import launch, tiles
    dev = launch.device(torch.cuda.current_device())
    return tiles.decode_splits(tiles.decode_spec(D, "bf16", H // Hkv, dev.arch, dev.smem_optin), B, Hkv, H // Hkv, S,
                               dev.sm_count, dev.smem_optin)


def copies_for(nbytes: int, l2_bytes: int) -> int:
    """Input sets a timed run rotates through: enough to exceed 3x L2 (else the caches are read from L2), at most 8."""
    return max(1, min(8, math.ceil(3 * l2_bytes / nbytes)))


def decode_calls(sets, lens, num_splits: int = 0) -> list:
    """flashrt.decode on each (q, k, v) set, contiguous caches holding lens tokens (num_splits: flashrt.decode's): a
    list of calls for capture."""
    return [lambda q=q, k=k, v=v: flashrt.decode(q, k, v, cache_seqlens=lens, num_splits=num_splits)
            for q, k, v in sets]


def capture(fns, reps: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `reps` calls cycling through fns (each called once first: kernels compiled, plans made)."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for r in range(reps):
            fns[r % len(fns)]()
    return graph


def replay_ms(graphs: dict, reps: int, rounds: int = ROUNDS) -> dict:
    """Median ms per call of each graph of `reps` calls (capture), over interleaved rounds (one replay to warm)."""
    times = {name: [] for name in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(rounds):
        for name, graph in graphs.items():
            graph.replay()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / reps)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_point(B, S, H, Hkv, D, impls, l2_bytes) -> list[dict]:
    free = torch.cuda.mem_get_info()[0]
    if kv_bytes(B, S, Hkv, D) * 1.2 > free:
        return [dict(B=B, S=S, H=H, Hkv=Hkv, D=D, impl=i, skipped=f"needs {kv_bytes(B, S, Hkv, D) / 2**30:.1f} GiB")
                for i in impls]
    if "flashrt-paged" in impls and 2 * kv_bytes(B, S, Hkv, D) * 1.2 > free:  # (the paged copy does not fit too)
        return bench_point(B, S, H, Hkv, D, [i for i in impls if i != "flashrt-paged"], l2_bytes) + \
            [dict(B=B, S=S, H=H, Hkv=Hkv, D=D, impl="flashrt-paged", skipped="no room for a second copy")]
    need = kv_bytes(B, S, Hkv, D) * (2 if "flashrt-paged" in impls else 1)
    copies = copies_for(kv_bytes(B, S, Hkv, D), l2_bytes)
    if need * copies * 1.2 > free:
        copies = 1
    sets = []
    for c in range(copies):
        q, k, v = make_set(B, S, H, Hkv, D, seed=c)
        lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
        extra = paged(k, v, seed=c) if "flashrt-paged" in impls else None
        sets.append((q, k, v, lens, extra))
    rows, calls = {}, {}
    for impl in impls:
        row = dict(B=B, S=S, H=H, Hkv=Hkv, D=D, impl=impl)
        try:
            fns = [call_of(impl, *s) for s in sets]
            err = rel_err(fns[0](), *sets[0][:3])
            row["err"] = err
            if not err < 2e-2:
                row["error"] = f"wrong answer: rel. error {err:.2e}"
            else:
                calls[impl] = fns
        except Exception as exc:  # a backend that does not take this shape
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        rows[impl] = row
    # Each implementation's calls captured once into a CUDA graph (as a serving loop runs them), so the timings
    # are the GPU's, not the host's launch overhead.
    reps = max(len(sets), 20 // len(sets) * len(sets))
    times = replay_ms({impl: capture(fns, reps) for impl, fns in calls.items()}, reps)
    for impl, ms in times.items():
        rows[impl].update(us=ms * 1e3, tbs=kv_bytes(B, S, Hkv, D) / (ms * 1e-3) / 1e12, copies=copies)
    del sets, calls
    torch.cuda.empty_cache()
    return list(rows.values())


def markdown(rows) -> str:
    lines = ["| H/Hkv D | B x Sk | " + " | ".join(f"{i} TB/s" for i in IMPLS) + " | flashrt / best peer |",
             "|---|---|" + "---|" * (len(IMPLS) + 1)]
    keys = sorted({(r["H"], r["Hkv"], r["D"], r["B"], r["S"]) for r in rows},
                  key=lambda t: (t[2], -t[0] // t[1], t[3], t[4]))
    for H, Hkv, D, B, S in keys:
        sel = {r["impl"]: r for r in rows if (r["H"], r["Hkv"], r["D"], r["B"], r["S"]) == (H, Hkv, D, B, S)}
        cells = []
        for i in IMPLS:
            r = sel.get(i, {})
            cells.append(f"{r['tbs']:.2f}" if "tbs" in r else ("skip" if "skipped" in r else "err" if r else "-"))
        peers = [sel[i]["tbs"] for i in ("flash", "cudnn") if "tbs" in sel.get(i, {})]
        ratio = f"{sel['flashrt']['tbs'] / max(peers):.2f}" if peers and "tbs" in sel.get("flashrt", {}) else "-"
        lines.append(f"| {H}/{Hkv} {D} | {B} x {S // 1024}k | " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def run(out: Path, quick: bool = False, points=None, heads=None, impls=IMPLS) -> str:
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    points = points or (QUICK if quick else POINTS)
    heads = heads or (HEADS[:2] if quick else HEADS)
    rows = []
    for H, Hkv, D in heads:
        for B, S in points:
            for r in bench_point(B, S, H, Hkv, D, impls, l2):
                rows.append(r)
                print(json.dumps(r), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(device=props.name, torch=torch.__version__, flashrt=flashrt.__version__)
    (out / "decode.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))
    text = f"Decode, {props.name}, K/V bytes read per second (TB/s)\n\n" + markdown(rows)
    (out / "decode.md").write_text(text + "\n")
    plot(rows, out / "decode.png", props.name)
    return text


def plot(rows, path: Path, device: str) -> None:
    """TB/s against Sk, a panel per (H/Hkv, head_dim), a line per implementation and batch (needs matplotlib)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("pip install matplotlib for decode.png")
        return
    panels = sorted({(r["H"], r["Hkv"], r["D"]) for r in rows}, key=lambda t: (t[2], t[1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    colors = dict(zip(IMPLS, ("C0", "C1", "C2", "C3")))
    styles = dict(zip((1, 16, 64, 128), ("-", "--", "-.", ":")))
    for ax, (H, Hkv, D) in zip(axes[0], panels):
        for impl in IMPLS:
            for B in styles:
                pts = sorted((r["S"], r["tbs"]) for r in rows if (r["H"], r["Hkv"], r["D"], r["B"], r["impl"])
                             == (H, Hkv, D, B, impl) and "tbs" in r)
                if pts:
                    ax.plot(*zip(*pts), styles[B], color=colors[impl], marker="o", ms=3,
                            label=f"{impl} B={B}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"H/Hkv {H}/{Hkv}, head_dim {D}")
        ax.set_xlabel("Sk")
        ax.set_ylabel("TB/s")
    axes[0][0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"flashrt.decode vs SDPA, {device}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="4 points at H/Hkv 32/8 and 8/1, head_dim 128")
    ap.add_argument("--points", help="B:Sk,... e.g. 1:32768,16:8192")
    ap.add_argument("--heads", help="H/Hkv/D,... e.g. 32/8/128")
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    args = ap.parse_args()
    points = [tuple(map(int, p.split(":"))) for p in args.points.split(",")] if args.points else None
    heads = [tuple(map(int, h.split("/"))) for h in args.heads.split(",")] if args.heads else None
    print(run(Path(args.out), args.quick, points, heads))


if __name__ == "__main__":
    main()
