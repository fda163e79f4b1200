"""Decode with at most 128 against at most 256 splits (tiles.DECODE_MAX_SPLITS), CUDA-graph replays, interleaved:
python scripts/probes/decode_max_splits.py."""
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

import flashrt  # noqa: E402
from flashrt import api, tiles  # noqa: E402
from bench_decode import kv_bytes, make_set  # noqa: E402

for H, Hkv, D, B, S in [(8, 1, 128, 1, 32768), (8, 1, 128, 1, 131072), (8, 1, 64, 1, 32768), (32, 8, 128, 1, 4096),
                        (8, 1, 128, 2, 32768)]:
    copies = max(1, min(8, -(-3 * 60 * 2**20 // kv_bytes(B, S, Hkv, D))))
    sets = [make_set(B, S, H, Hkv, D, c) for c in range(copies)]
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    graphs = {}
    for most in (128, 256):
        tiles.DECODE_MAX_SPLITS = most
        api._PLANS.clear()
        for q, k, v in sets:
            flashrt.decode(q, k, v, cache_seqlens=lens)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for r in range(20):
                q, k, v = sets[r % copies]
                flashrt.decode(q, k, v, cache_seqlens=lens)
        graphs[most] = g
    times = {m: [] for m in graphs}
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(7):
        for m, g in graphs.items():
            g.replay()
            s.record()
            g.replay()
            e.record()
            e.synchronize()
            times[m].append(s.elapsed_time(e) / 20)
    print(f"{H}/{Hkv} D{D} {B}x{S}: " + "  ".join(
        f"max {m}: {kv_bytes(B, S, Hkv, D) / statistics.median(t) / 1e9:.2f} TB/s" for m, t in times.items()))
