"""Context-parallel benchmark: flashrt.distributed.ring_attention on every visible GPU against one GPU running
the whole sequence, causal, bf16, forward and forward+backward.

    python3 scripts/bench_cp.py [--seqlens 32768,65536,131072] [--heads 16/16/128] [--layout zigzag] [--out DIR]

Per point, interleaved rounds (medians; CUDA events, after a warm-up), each rank timing its own calls and the
slowest rank counting:
  ring: ring_attention over the world; ring (no comm): the same kernels with the transfers replaced by the
  local keys (what the steps cost with nothing to hide); ulysses: ulysses_attention (all-to-all); single:
  flashrt.attention on one GPU, whole sequence. Ring and Ulysses with check=False (their cross-rank argument check
  is a host synchronisation). The ring's transfers go by the copy engines where they can (flashrt/p2p.py;
  FLASHRT_NO_COPY_ENGINE=1: by NCCL).
Every call is timed with the host ahead of the GPU (as in training: a sleep kernel, then an all-reduce that lines
the GPUs up, while the host queues it), and, in the last column, alone (its host time before the first kernel
counted).
Per-GPU TF/s = FLOPs / world / time (FLOPs: 4*B*H*S^2*D halved for causal, x2.5 for the backward); scaling
efficiency = single time / (world * ring time); hidden = no-comm time / ring time; K/V pass: one step's
transfer alone (each rank's keys and values to the next rank).
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def join(rank: int, world: int, path: str) -> None:
    """This process as rank `rank` of an NCCL group on GPU `rank` (a file rendezvous at `path`)."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def no_comm(fn):
    """fn with the ring's transfers (flashrt.distributed._pass_on, every one) replaced by what was sent: the steps' cost
    with nothing to hide."""
    import flashrt.distributed as fd

    def run():
        real = fd._pass_on
        fd._pass_on = lambda group, tensors, back=False: (tensors, [])
        try:
            return fn()
        finally:
            fd._pass_on = real
    return run


AHEAD_CYCLES = 20_000_000  # (~10 ms of GPU time at ~2 GHz, longer than a call's host time)


def timed_ms(fn, ahead: bool) -> tuple:
    """One call of fn on every rank at once (a barrier first): (ms by CUDA events, whether the host fell behind).
    ahead: the GPU is first kept busy (torch.cuda._sleep, then an all-reduce that lines the GPUs up again: their
    sleeps end apart) while the host queues the call, which is then timed as in training, where the host runs ahead of
    the GPU; behind: the GPU reached the call before the host had queued it (a call too long on the host for the
    sleep, or one that waits for the GPU). Otherwise the call's host time before its first kernel counts too (a call
    timed alone)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dist.barrier()
    torch.cuda.synchronize()
    if ahead:
        torch.cuda._sleep(AHEAD_CYCLES)
        dist.all_reduce(torch.zeros(1, device="cuda"))
    start.record()
    fn()
    end.record()
    behind = ahead and start.query()
    torch.cuda.synchronize()
    return start.elapsed_time(end), behind


def _slowest(ms: float) -> float:
    t = torch.tensor([ms], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _worker(rank, world, path, args, results_path):
    join(rank, world, path)
    import flashrt
    import flashrt.distributed as fd
    H, Hkv, D = map(int, args.heads.split("/"))
    rows = []
    for S in map(int, args.seqlens.split(",")):
        g = torch.Generator(device="cuda").manual_seed(S)
        whole = [torch.randn(1, S, h, D, device="cuda", generator=g, dtype=torch.bfloat16) for h in (H, Hkv, Hkv, H)]
        local = [fd.shard_sequence(t, layout=args.layout) for t in whole]

        def ring_fwd():
            fd.ring_attention(*local[:3], causal=True, layout=args.layout, check=False)

        def ring_fb():
            x = [t.requires_grad_() for t in local[:3]]
            out = fd.ring_attention(*x, causal=True, layout=args.layout, check=False)
            torch.autograd.grad(out, x, local[3])

        def ulysses(fb):
            def run():
                x = [t.requires_grad_(fb) for t in local[:3]]
                out = fd.ulysses_attention(*x, causal=True, layout=args.layout, check=False)
                if fb:
                    torch.autograd.grad(out, x, local[3])
            return run

        def single(fb):
            def run():
                if rank == 0:
                    x = [t.requires_grad_(fb) for t in whole[:3]]
                    out = flashrt.attention(*x, causal=True)
                    if fb:
                        torch.autograd.grad(out, x, whole[3])
            return run

        def kv_pass():  # the forward's transfer alone: this rank's keys and values to the next rank
            fd._wait(fd._pass_on(dist.group.WORLD, tuple(local[1:3]))[1])

        cases = {"kv pass": kv_pass, "ring fwd": ring_fwd, "ring fwd (no comm)": no_comm(ring_fwd),
                 "ulysses fwd": ulysses(False), "single fwd": single(False), "ring fwd+bwd": ring_fb,
                 "ring fwd+bwd (no comm)": no_comm(ring_fb), "ulysses fwd+bwd": ulysses(True),
                 "single fwd+bwd": single(True)}
        times = {(name, ahead): [] for name in cases for ahead in (True, False)}
        for fn in cases.values():  # warm-up (compiles the kernels)
            fn()
        behind = {name: 0 for name in cases}  # rounds where the host fell behind (timed_ms)

        def one(key):
            ms, late = timed_ms(cases[key[0]], key[1])
            times[key].append(ms)
            behind[key[0]] += late
        if args.grouped:  # every round of one case, then the next case's
            for key in times:
                for _ in range(args.rounds):
                    one(key)
        else:
            for _ in range(args.rounds):
                for key in times:
                    one(key)
        alone = {name: _slowest(statistics.median(t)) for (name, ahead), t in times.items() if not ahead}
        med = {name: _slowest(statistics.median(t)) for (name, ahead), t in times.items() if ahead}
        spread = {name: (_slowest(min(t)), _slowest(max(t))) for (name, ahead), t in times.items() if ahead}
        behind = {name: int(_slowest(n)) for name, n in behind.items()}
        flops = 4 * H * S * S * D / 2
        for kind, mult in (("fwd", 1.0), ("fwd+bwd", 3.5)):
            ring_ms, alone_ms, single_ms = med[f"ring {kind}"], med[f"ring {kind} (no comm)"], med[f"single {kind}"]
            rows.append(dict(S=S, H=H, Hkv=Hkv, D=D, world=world, layout=args.layout, kind=kind, ring_ms=ring_ms,
                             no_comm_ms=alone_ms, single_ms=single_ms,
                             ring_tfs_per_gpu=flops * mult / world / ring_ms / 1e9,
                             single_tfs=flops * mult / single_ms / 1e9,
                             efficiency=single_ms / (world * ring_ms), hidden=alone_ms / ring_ms,
                             ring_ms_alone=alone[f"ring {kind}"], single_ms_alone=alone[f"single {kind}"],
                             efficiency_alone=alone[f"single {kind}"] / (world * alone[f"ring {kind}"]),
                             kv_pass_ms=med["kv pass"], ulysses_ms=med[f"ulysses {kind}"],
                             ulysses_efficiency=single_ms / (world * med[f"ulysses {kind}"]),
                             min_max_ms={n: spread[n] for n in spread if kind in n.split() or n == "kv pass"},
                             host_behind={n: behind[n] for n in behind if kind in n.split() or n == "kv pass"}))
        whole = local = cases = None  # (frees them before the next length)
        torch.cuda.empty_cache()
    if rank == 0:
        with open(results_path, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqlens", default="32768,65536,131072")
    ap.add_argument("--heads", default="16/16/128", help="H/Hkv/D")
    ap.add_argument("--layout", default="zigzag")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--world", type=int, default=torch.cuda.device_count())
    ap.add_argument("--grouped", action="store_true", help="run a case's rounds back to back (default: interleaved)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        results = os.path.join(d, "results.json")
        mp.spawn(_worker, args=(args.world, os.path.join(d, "rendezvous"), args, results), nprocs=args.world)
        with open(results) as f:
            data = json.load(f)
    lines = [f"Context parallel, {data['device']} x{args.world}, causal bf16, {args.layout}, medians of "
             f"{args.rounds} rounds", "",
             "| S | H/Hkv/D | pass | ring ms | no-comm ms | single-GPU ms | per-GPU TF/s (ring) | single TF/s | "
             "efficiency | hidden | K/V pass ms | Ulysses ms | Ulysses efficiency | timed alone: ring / single ms, "
             "efficiency |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['S'] // 1024}k | {r['H']}/{r['Hkv']}/{r['D']} | {r['kind']} | {r['ring_ms']:.2f} | "
                     f"{r['no_comm_ms']:.2f} | {r['single_ms']:.2f} | {r['ring_tfs_per_gpu']:.0f} | "
                     f"{r['single_tfs']:.0f} | {r['efficiency']:.1%} | {r['hidden']:.1%} | {r['kv_pass_ms']:.2f} | "
                     f"{r['ulysses_ms']:.2f} | {r['ulysses_efficiency']:.1%} | {r['ring_ms_alone']:.2f} / "
                     f"{r['single_ms_alone']:.2f}, {r['efficiency_alone']:.1%} |")
    late = {f"{r['S'] // 1024}k {n}": b for r in data["rows"] for n, b in r["host_behind"].items() if b}
    if late:
        lines += ["", f"The host fell behind the GPU (rounds of {args.rounds}, the worse rank): {late}"]
    text = "\n".join(lines)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "cp.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(args.out, "cp.json"), "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
