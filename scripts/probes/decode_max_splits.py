"""Decode with at most 128 against at most 256 splits (tiles.DECODE_MAX_SPLITS), CUDA-graph replays, interleaved:
python scripts/probes/decode_max_splits.py."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from flashrt import api, tiles  # noqa: E402
from bench_decode import capture, copies_for, decode_calls, kv_bytes, make_set, replay_ms  # noqa: E402

for H, Hkv, D, B, S in [(8, 1, 128, 1, 32768), (8, 1, 128, 1, 131072), (8, 1, 64, 1, 32768), (32, 8, 128, 1, 4096),
                        (8, 1, 128, 2, 32768)]:
    sets = [make_set(B, S, H, Hkv, D, c) for c in range(copies_for(kv_bytes(B, S, Hkv, D), 60 * 2**20))]
    calls = decode_calls(sets, torch.full((B,), S, dtype=torch.int32, device="cuda"))
    graphs = {}
    for most in (128, 256):
        tiles.DECODE_MAX_SPLITS = most
        api._PLANS.clear()
        graphs[most] = capture(calls, 20)
    times = replay_ms(graphs, 20, rounds=7)
    print(f"{H}/{Hkv} D{D} {B}x{S}: " + "  ".join(
        f"max {m}: {kv_bytes(B, S, Hkv, D) / ms / 1e9:.2f} TB/s" for m, ms in times.items()))
