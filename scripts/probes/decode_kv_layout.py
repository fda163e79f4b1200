"""Decode's bandwidth against where K and V lie: separate allocations, one buffer with V a gap after K, or K and V
interleaved per token ((B, S, 2, Hkv, D)), beside SDPA cuDNN on the same tensors; CUDA-graph replays, interleaved:
python scripts/probes/decode_kv_layout.py [H/Hkv/D,...] [B:S,...] [layout,...]. A layout: "sep", "gap:<bytes>", "kv".
Prints TB/s of K/V read per point and layout (flashrt, then cuDNN)."""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

from bench_decode import call_of, capture, decode_calls, kv_bytes, rel_err, replay_ms  # noqa: E402

HEADS = [tuple(map(int, h.split("/"))) for h in
         (sys.argv[1] if len(sys.argv) > 1 else "32/8/64,32/8/128,8/1/128").split(",")]
POINTS = [tuple(map(int, p.split(":"))) for p in (sys.argv[2] if len(sys.argv) > 2 else "64:4096,16:8192").split(",")]
LAYOUTS = (sys.argv[3] if len(sys.argv) > 3 else "sep,gap:0,gap:4096,gap:69632,gap:2097152,kv").split(",")


def tensors(layout, B, S, H, Hkv, D):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    n = B * S * Hkv * D
    if layout == "sep":
        k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    elif layout == "kv":
        kv = torch.randn(B, S, 2, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = kv[:, :, 0], kv[:, :, 1]
    else:
        gap = int(layout.split(":")[1]) // 2
        buf = torch.randn(2 * n + gap, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = buf[:n].view(B, S, Hkv, D), buf[n + gap:].view(B, S, Hkv, D)
    return q, k, v


print(torch.cuda.get_device_name())
table = ["| H/Hkv D | B x S | " + " | ".join(LAYOUTS) + " |", "|---|---|" + "---|" * len(LAYOUTS)]
for (H, Hkv, D), (B, S) in itertools.product(HEADS, POINTS):
    graphs, notes = {}, []
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    kept = []
    for layout in LAYOUTS:
        q, k, v = tensors(layout, B, S, H, Hkv, D)
        kept.append((q, k, v))
        fr = decode_calls([(q, k, v)], lens)
        err = rel_err(fr[0](), q, k, v)
        assert err < 2e-2, (layout, err)
        graphs[("flashrt", layout)] = capture(fr, 20)
        graphs[("cudnn", layout)] = capture([call_of("cudnn", q, k, v, lens, None)], 20)
        notes.append(f"{layout}: k % 2MiB {k.data_ptr() % 2**21}, v - k {v.data_ptr() - k.data_ptr()}")
    ms = replay_ms(graphs, 20, rounds=5)
    tb = {key: kv_bytes(B, S, Hkv, D) / t / 1e9 for key, t in ms.items()}
    table.append(f"| {H}/{Hkv} D{D} | {B} x {S} | " +
                 " | ".join(f"{tb[('flashrt', lay)]:.2f} / {tb[('cudnn', lay)]:.2f}" for lay in LAYOUTS) + " |")
    print(table[-1], "  ", "; ".join(notes), flush=True)
    del graphs, kept
    torch.cuda.empty_cache()
print("\nTB/s of K/V read, flashrt / cuDNN:")
print("\n".join(table))
