"""Forward and backward time of each mask kind against dense attention at one shape (H100 notes).

    python scripts/mask_times.py [--seqlen 8192] [--heads 16] [--head-dim 128]

Prints, per mask: the fraction of visible (query, key) pairs (density), median forward and
backward (deterministic auto) milliseconds over CUDA events, and the time relative to the
dense run. Tile skipping should make time track density; the target (issue 5) is at most
0.6x the dense time at 50% density. Each mask's output is checked against the float64
reference on a few rows of one head first.
"""
import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy  # noqa: E402
import torch  # noqa: E402

import flashrt  # noqa: E402
from flashrt import reference  # noqa: E402


def ids_of(lengths):
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)]).cuda()


def time_ms(fn, reps=10):
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    a = ap.parse_args()
    B, S, H, D = a.batch, a.seqlen, a.heads, a.head_dim
    q, k, v, do = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    half = ids_of([S // 2, S // 2]).expand(B, S).contiguous()
    docs = ids_of([S // 4] * 4).expand(B, S).contiguous()
    masks = {
        "dense": (False, {}),
        "causal": (True, {}),
        "window S/4 both sides": (False, dict(window=(S // 4, S // 4))),
        "causal + window S/2": (True, dict(window=(S // 2, 0))),
        "block-causal 2 blocks": (False, dict(block_ids_q=half, block_ids_k=half)),
        "segments 4 docs": (False, dict(segment_ids_q=docs, segment_ids_k=docs)),
        "padding half": (False, dict(seqlens_q=torch.full((B,), S, dtype=torch.int32, device="cuda"),
                                     seqlens_k=torch.full((B,), S // 2, dtype=torch.int32, device="cuda"))),
    }
    rows = []
    for name, (causal, kw) in masks.items():
        ref_kw = {n: (x if n == "window" else x[:1].cpu().numpy()) for n, x in kw.items()}  # batch entry 0
        keep = reference.visible(1, S, S, causal=causal, **ref_kw)
        density = float(keep.mean())
        out, lse = flashrt.forward(q, k, v, causal=causal, **kw)
        sl = slice(S - 64, S)  # check the last 64 query rows of head 0 against float64
        ro, _ = reference.attention(cupy.from_dlpack(q[:1, sl, :1].double().contiguous()),
                                    cupy.from_dlpack(k[:1, :, :1].double().contiguous()),
                                    cupy.from_dlpack(v[:1, :, :1].double().contiguous()),
                                    mask=cupy.asarray(keep[:, :, sl]))
        err = reference.rel_error(cupy.from_dlpack(out[:1, sl, :1].double().contiguous()), ro)
        assert err < 2e-2, f"{name}: rel err {err}"
        fwd = time_ms(lambda: flashrt.forward(q, k, v, causal=causal, validate=False, **kw))
        bwd = time_ms(lambda: flashrt.backward(do, q, k, v, out, lse, causal=causal, validate=False, **kw))
        rows.append((name, density, fwd, bwd))
    dense_f, dense_b = rows[0][2], rows[0][3]
    print(f"B={B} S={S} H={H} D={D} bf16, deterministic backward (impl auto)")
    print(f"{'mask':26s} {'density':>8s} {'fwd ms':>8s} {'x dense':>8s} {'bwd ms':>8s} {'x dense':>8s}")
    for name, dens, f, b in rows:
        print(f"{name:26s} {dens:8.3f} {f:8.2f} {f / dense_f:8.2f} {b:8.2f} {b / dense_b:8.2f}")


if __name__ == "__main__":
    main()
