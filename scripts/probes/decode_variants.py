"""Decode tilings side by side (CUDA-graph replays, interleaved rounds): python scripts/probes/decode_variants.py.
Each variant is (block_n, min_blocks) at the block_m decode_spec picks; prints TB/s per point and variant."""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from flashrt import api, spec as specmod, tiles  # noqa: E402
from bench_decode import capture, copies_for, decode_calls, kv_bytes, make_set, replay_ms  # noqa: E402

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
    sets = [make_set(B, S, H, Hkv, D, c) for c in range(copies_for(kv_bytes(B, S, Hkv, D), 60 * 2**20))]
    calls = decode_calls(sets, torch.full((B,), S, dtype=torch.int32, device="cuda"))
    graphs = {}
    for v in VARIANTS:
        tiles.decode_spec = patched(*v)
        api._PLANS.clear()
        try:
            graphs[v] = capture(calls, 20)
        except Exception as exc:
            print(v, "error", str(exc)[:200])
    tiles.decode_spec = real
    row = "  ".join(f"{v[0]}:{v[1]} {kv_bytes(B, S, Hkv, D) / ms / 1e9:.2f}" for v, ms in replay_ms(graphs, 20).items())
    print(f"{H}/{Hkv} D{D} {B}x{S}: {row}", flush=True)
    del sets, calls, graphs
    torch.cuda.empty_cache()
