"""The ring's steps at two ranks, zigzag, causal, on ONE GPU: each step's kernel call and merge timed alone, against
one GPU's call over the whole sequence (where bench_cp.py's "no comm" time goes).

    python3 scripts/probes/cp_steps.py [--seqlens 32768,65536] [--heads 16/16/128] [--rounds 7]

Rank r of 2 holds chunks r and 3-r of the sequence (S/4 tokens each). Step 0: its 2 chunks causal (S/2 x S/2);
step 1 with the other rank's keys: rank 0 its tail chunk against all S/2 held keys, rank 1 all its S/2 queries
against the held head chunk (S/4 x S/2 and S/2 x S/4 dense). "+ combine": step 1 and distributed._merge_steps
(flashrt.combine) queued behind it, "+ torch merge" the torch ops it replaced; the backward's steps likewise
(deterministic). Times: CUDA events, medians of interleaved rounds, after a warm-up.
"""
import argparse
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def timed(fn, reps=3):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def _torch_merge(acc, acc_lse, out, lse):
    """The ring forward's merge before flashrt.combine took it (torch ops, fp32, rounded once), for comparison."""
    new = torch.logaddexp(acc_lse, lse)
    safe = torch.where(new == -math.inf, 0.0, new)
    w_acc = torch.exp(acc_lse - safe).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(lse - safe).transpose(1, 2).unsqueeze(-1)
    acc.copy_((acc * w_acc).addcmul_(out, w_new))
    acc_lse.copy_(new)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqlens", default="32768,65536")
    ap.add_argument("--heads", default="16/16/128")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    import flashrt.api as api
    import flashrt.distributed as fd
    H, Hkv, D = map(int, args.heads.split("/"))
    print(torch.cuda.get_device_name())
    lines = ["| S | case | ms | TF/s |", "|---|---|---|---|"]
    for S in map(int, args.seqlens.split(",")):
        n, c = S // 2, S // 4
        g = torch.Generator(device="cuda").manual_seed(S)
        q, k, v, do = (torch.randn(1, S, h, D, device="cuda", generator=g, dtype=torch.bfloat16)
                       for h in (H, Hkv, Hkv, H))
        lq, lk, lv = (fd.shard_sequence(t, world=2, rank=0) for t in (q, k, v))
        rk, rv = (fd.shard_sequence(t, world=2, rank=1) for t in (k, v))
        o0, l0 = api.forward(lq, lk, lv, causal=True)
        o1a, l1a = api.forward(lq[:, c:], rk, rv)
        o1b, l1b = api.forward(lq, rk[:, :c], rv[:, :c])
        fl = 4 * H * D
        ld = fd.shard_sequence(do, world=2, rank=0)
        oq, lq_ = api.forward(q, k, v, causal=True)
        cases = {
            "one GPU, S causal": (lambda: api.forward(q, k, v, causal=True), fl * S * S / 2),
            "step 0, S/2 causal": (lambda: api.forward(lq, lk, lv, causal=True), fl * n * n / 2),
            "step 1 rank 0, S/4 x S/2": (lambda: api.forward(lq[:, c:], rk, rv), fl * c * n),
            "step 1 rank 1, S/2 x S/4": (lambda: api.forward(lq, rk[:, :c], rv[:, :c]), fl * c * n),
            # the merges queued behind a step's kernel, as in the ring (alone, their host time would be timed)
            "step 1 rank 0 + combine": (lambda: fd._merge_steps([(0, n, o0.clone(), l0.clone()),
                                                                 (c, n, *api.forward(lq[:, c:], rk, rv))], n), 0),
            "step 1 rank 0 + torch merge": (lambda: _torch_merge(o0.clone()[:, c:], l0.clone()[:, :, c:],
                                                                 *api.forward(lq[:, c:], rk, rv)), 0),
            "step 1 rank 1 + combine": (lambda: fd._merge_steps([(0, n, o0, l0),
                                                                 (0, n, *api.forward(lq, rk[:, :c], rv[:, :c]))],
                                                                n), 0),
            "step 1 rank 1 + torch merge": (lambda: _torch_merge(o0.clone(), l0.clone(),
                                                                 *api.forward(lq, rk[:, :c], rv[:, :c])), 0),
            "clone (the merges' copies)": (lambda: (o0.clone(), l0.clone()), 0),
            "bwd one GPU, S causal": (lambda: api.backward(do, q, k, v, oq, lq_, causal=True, deterministic=True),
                                      2.5 * fl * S * S / 2),
            "bwd step 0": (lambda: api.backward(ld, lq, lk, lv, o0, l0, causal=True, deterministic=True),
                           2.5 * fl * n * n / 2),
            "bwd step 1 rank 0": (lambda: api.backward(ld[:, c:], lq[:, c:], rk, rv, o0[:, c:],
                                                       l0[:, :, c:].contiguous(), deterministic=True),
                                  2.5 * fl * c * n),
            "bwd step 1 rank 1": (lambda: api.backward(ld, lq, rk[:, :c], rv[:, :c], o0, l0, deterministic=True),
                                  2.5 * fl * c * n),
        }
        for fn, _ in cases.values():
            fn()
        times = {name: [] for name in cases}
        for _ in range(args.rounds):
            for name, (fn, _) in cases.items():
                times[name].append(timed(fn))
        for name, (_, flops) in cases.items():
            ms = statistics.median(times[name])
            lines.append(f"| {S // 1024}k | {name} | {ms:.3f} | {flops / ms / 1e9:.0f} |" if flops else
                         f"| {S // 1024}k | {name} | {ms:.3f} | |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
