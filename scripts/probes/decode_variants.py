"""Decode tilings side by side (CUDA-graph replays, interleaved rounds): python scripts/probes/decode_variants.py.
Each variant is (block_n, min_blocks) at the block_m decode_spec picks; prints TB/s per point and variant."""
import itertools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

import flashrt  # noqa: E402
from flashrt import api, spec as specmod, tiles  # noqa: E402
from bench_decode import kv_bytes, make_set  # noqa: E402

VARIANTS = [tuple(map(int, v.split(":"))) for v in (sys.argv[1] if len(sys.argv) > 1 else "64:1,64:3").split(",")]
HEADS = [tuple(map(int, h.split("/"))) for h in (sys.argv[2] if len(sys.argv) > 2 else "32/8/128,8/1/128").split(",")]
POINTS = [(1, 32768), (16, 8192), (64, 4096), (128, 1024)]
real = tiles.decode_spec


def patched(bn, mb):
    def decode_spec(head_dim, dtype, rows, arch, smem_limit):
        base = real(head_dim, dtype, rows, arch, smem_limit)
        return specmod.KernelSpec("decode", head_dim, dtype, base.block_m, bn, base.warps, False, arch, min_blocks=mb)
    return decode_spec


for (H, Hkv, D), (B, S) in itertools.product(HEADS, POINTS):
    copies = max(1, min(8, -(-3 * 60 * 2**20 // kv_bytes(B, S, Hkv, D))))
    sets = [make_set(B, S, H, Hkv, D, c) for c in range(copies)]
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    graphs = {}
    for v in VARIANTS:
        tiles.decode_spec = patched(*v)
        api._PLANS.clear()
        try:
            for q, k, vv in sets:
                flashrt.decode(q, k, vv, cache_seqlens=lens)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for r in range(20):
                    q, k, vv = sets[r % copies]
                    flashrt.decode(q, k, vv, cache_seqlens=lens)
            graphs[v] = g
        except Exception as exc:
            print(v, "error", str(exc)[:200])
    tiles.decode_spec = real
    times = {v: [] for v in graphs}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        for v, g in graphs.items():
            g.replay()
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            times[v].append(start.elapsed_time(end) / 20)
    row = "  ".join(f"{v[0]}:{v[1]} {kv_bytes(B, S, Hkv, D) / statistics.median(t) / 1e9:.2f}"
                    for v, t in times.items())
    print(f"{H}/{Hkv} D{D} {B}x{S}: {row}", flush=True)
    del sets, graphs
    torch.cuda.empty_cache()
