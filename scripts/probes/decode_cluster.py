"""Decode's splits merged in a thread block cluster (decode.cu: cluster_combine) against combine.cu's launch, side by
side (CUDA-graph replays, interleaved rounds):

    python scripts/probes/decode_cluster.py [run,...] [H/Hkv/D,...] [B:S,...]

A run is "x:n": x = "k" (combine.cu: tiles.DECODE_CLUSTER_SPLITS = 0) or "c" (the library: a cluster where
tiles.decode_cluster takes one), n the split count: "" the library's, "=8" the library's capped at 8, or a number.
Checks first, against float64 with ragged lengths (0 and a full cache among them), the cluster at 2, 3, 5 and 8
splits, with and without sinks, bitwise repeatable; prints TB/s of K/V read per point and run, a table last.
"""
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch  # noqa: E402

import flashrt  # noqa: E402
from flashrt import tiles  # noqa: E402
from bench_decode import capture, copies_for, decode_calls, kv_bytes, library_splits, make_set, replay_ms  # noqa: E402,E501
from variants import fresh  # noqa: E402

RUN_ARGS = (sys.argv[1] if len(sys.argv) > 1 else "k:,c:,c:=8").split(",")
HEADS = [tuple(map(int, h.split("/"))) for h in
         (sys.argv[2] if len(sys.argv) > 2 else "8/1/64,32/8/64,8/1/128,32/8/128,8/1/256").split(",")]
POINTS = [tuple(map(int, p.split(":"))) for p in
          (sys.argv[3] if len(sys.argv) > 3 else "1:1024,1:4096,16:1024,4:8192,1:32768").split(",")]
LIBRARY_CLUSTER = tiles.DECODE_CLUSTER_SPLITS


def use(kind: str) -> None:
    tiles.DECODE_CLUSTER_SPLITS = LIBRARY_CLUSTER if kind == "c" else 0
    fresh()


def reference(q, k, v, lens, sinks=None):
    """float64 attention of each sequence's one new token over its lens[b] keys (with sinks: one more logit each)."""
    B, _, H, D = q.shape
    Hkv = k.shape[2]
    out = torch.zeros(B, H, D, dtype=torch.float64, device=q.device)
    for b in range(B):
        n = int(lens[b])
        qq = q[b, 0].double().view(Hkv, H // Hkv, D)
        kk, vv = k[b, :n].double().permute(1, 0, 2), v[b, :n].double().permute(1, 0, 2)
        s = (qq @ kk.transpose(1, 2) / D ** 0.5).reshape(H, n)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None]], 1)
        p = torch.softmax(s, -1)[:, :n].reshape(Hkv, H // Hkv, n)
        out[b] = (p @ vv).reshape(H, D)
    return out


def check(H, Hkv, D) -> str:
    torch.manual_seed(3)
    B, S = 4, 900
    q = torch.randn(B, 1, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.tensor([900, 0, 333, 64], dtype=torch.int32, device="cuda")
    sinks = torch.randn(H, device="cuda", dtype=torch.float32)
    worst = 0.0
    use("c")
    for splits, sk in itertools.product((2, 3, 5, 8), (None, sinks)):
        outs = [flashrt.decode(q, k, v, cache_seqlens=lens, num_splits=splits, sinks=sk) for _ in range(3)]
        assert all(torch.equal(outs[0], o) for o in outs[1:]), f"{H}/{Hkv} D{D} splits {splits}: not bitwise repeatable"
        out = outs[0]
        ref = reference(q, k, v, lens, sk)
        for b in range(B):
            if int(lens[b]) == 0 and sk is None:
                assert torch.all(out[b] == 0), "an empty sequence's out is not 0"
                continue
            err = ((out[b, 0].double() - ref[b]).abs().max() / ref[b].abs().max().clamp_min(1e-6)).item()
            worst = max(worst, err)
    assert worst < 2e-2, f"{H}/{Hkv} D{D}: rel err {worst:.1e}"
    return f"{worst:.1e}"


print(torch.cuda.get_device_name())
for H, Hkv, D in HEADS:
    print(f"check {H}/{Hkv} D{D}: cluster, splits 2 / 3 / 5 / 8, sinks or not: rel err {check(H, Hkv, D)}", flush=True)
RUNS = [(r.split(":")[0], r.split(":")[1]) for r in RUN_ARGS]
table = ["| H/Hkv D | B x S | splits | " + " | ".join(RUN_ARGS) + " |", "|---|---|---|" + "---|" * len(RUNS)]
for (H, Hkv, D), (B, S) in itertools.product(HEADS, POINTS):
    sets = [make_set(B, S, H, Hkv, D, c) for c in range(copies_for(kv_bytes(B, S, Hkv, D), 60 * 2**20))]
    lens = torch.full((B,), S, dtype=torch.int32, device="cuda")
    use("c")
    lib = library_splits(B, S, H, Hkv, D)  # (the library's own count: the "splits" column)
    graphs = {}
    for kind, sp in RUNS:
        use(kind)
        n = 0 if sp == "" else min(lib, int(sp[1:])) if sp.startswith("=") else int(sp)
        graphs[(kind, sp)] = capture(decode_calls(sets, lens, n), 20)
    tbs = {r: kv_bytes(B, S, Hkv, D) / ms / 1e9 for r, ms in replay_ms(graphs, 20).items()}
    table.append(f"| {H}/{Hkv} D{D} | {B} x {S} | {lib} | " + " | ".join(f"{tbs[r]:.2f}" for r in RUNS) + " |")
    print(table[-1], flush=True)
    del sets, graphs
    torch.cuda.empty_cache()
use("c")
print("\nTB/s of K/V read:")
print("\n".join(table))
