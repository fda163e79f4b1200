"""The seed workload at default settings: masked calls, training steps and host time per call, against
cuDNN and FlexAttention, in one process (needs a GPU and torch).

    python scripts/seed_targets.py [--rounds 5] [--no-flex] [--no-stack] [--kernels] [--out DIR]

Seed shape: B=2, S=1024, H=8, Hkv=1, head_dim 256, bf16; the mask is the vision-language-action
layout as block ids (scripts/bench.py: block_ids "vla": prefix 3S/4, one state token, the action chunk),
passed the documented way (default validate=True). Every figure is the median over --rounds interleaved
rounds of a triton do_bench median (CUDA events, after warm-up):

  fwd            flashrt.forward under no_grad: dense; with ids; with ids and validate=False; flex with the mask
  bwd            flashrt.backward (the same three)
  step           flashrt.attention forward + torch.autograd.grad: dense; with ids; SDPA cuDNN dense; flex masked
  stack          18 checkpointed layers (bench.py's Block) forward + backward: flashrt dense and with ids,
                 cuDNN dense (the same work as a dense-equivalent mask), flex with the block mask
  host us        Python time per call until it returns (the best of 5 loops of 40 calls, each right after a
                 synchronize, at the seed shape: the GPU runs behind, and its launch queue never fills): forward,
                 backward, the autograd step

Prints the table last; writes seed_targets.json to --out.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import bench  # noqa: E402  (scripts/bench.py: Block, run_stack, block_ids, FlexAttention set-up)
import flashrt  # noqa: E402

B, S, H, HKV, D = 2, 1024, 8, 1, 256


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def host_us(fn, n: int = 40, repeats: int = 5) -> float:
    """Python time per call: the best of `repeats` loops of n calls, each right after a synchronize. n is small
    enough that the GPU's launch queue (about 1000 launches) never fills, where a launch would wait for the GPU."""
    for _ in range(10):
        fn()
    best = math.inf
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    torch.cuda.synchronize()
    return best / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--no-stack", action="store_true")
    ap.add_argument("--kernels", action="store_true", help="print each step's kernels and their GPU times first")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args()

    torch.manual_seed(0)
    q = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, S, HKV, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    do = torch.randn_like(q)
    ids = bench.block_ids("vla", B, S).cuda()
    masked = dict(block_ids_q=ids, block_ids_k=ids)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out, lse = flashrt.forward(qd, kd, vd)
    out_m, lse_m = flashrt.forward(qd, kd, vd, **masked)

    def sdpa_cudnn(q, k, v):
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  enable_gqa=True).transpose(1, 2)

    attns = {"flashrt dense": lambda q, k, v: flashrt.attention(q, k, v),
             "flashrt ids": lambda q, k, v: flashrt.attention(q, k, v, **masked),
             "cudnn dense": sdpa_cudnn}
    if not args.no_flex:
        mod = lambda b, h, qi, ki: ids[b, ki] <= ids[b, qi]  # noqa: E731
        _, create_block_mask = bench._flex()
        attns["flex ids"] = bench.flex_with(create_block_mask(mod, B=B, H=None, Q_LEN=S, KV_LEN=S, device="cuda"))

    # The masked answers against the dense ones under the same visibility (a check, not a timing).
    ref_keep = flashrt.reference.visible(B, S, S, block_ids_q=ids.cpu().numpy(), block_ids_k=ids.cpu().numpy())
    ref = bench.attention64(qd, kd, vd, torch.as_tensor(ref_keep, device="cuda"))
    err = float((out_m.double() - ref).norm() / ref.norm())
    assert err < 2e-2, f"masked forward off by {err:.3g} against float64"

    def step(attn):
        def run():
            o = attn(q, k, v)
            torch.autograd.grad(o, (q, k, v), do)
        return run

    timed = {
        ("fwd", "flashrt dense"): lambda: flashrt.forward(qd, kd, vd),
        ("fwd", "flashrt ids"): lambda: flashrt.forward(qd, kd, vd, **masked),
        ("fwd", "flashrt ids validate=False"): lambda: flashrt.forward(qd, kd, vd, validate=False, **masked),
        ("bwd", "flashrt dense"): lambda: flashrt.backward(do, qd, kd, vd, out, lse),
        ("bwd", "flashrt ids"): lambda: flashrt.backward(do, qd, kd, vd, out_m, lse_m, **masked),
        ("bwd", "flashrt ids validate=False"): lambda: flashrt.backward(do, qd, kd, vd, out_m, lse_m, validate=False,
                                                                        **masked),
        **{("step", name): step(attn) for name, attn in attns.items()},
    }
    if "flex ids" in attns:
        flex = attns["flex ids"]
        timed[("fwd", "flex ids")] = lambda: flex(qd, kd, vd)
    hosts = {"forward dense": lambda: flashrt.forward(qd, kd, vd),
             "forward ids": lambda: flashrt.forward(qd, kd, vd, **masked),
             "backward dense": lambda: flashrt.backward(do, qd, kd, vd, out, lse),
             "backward ids": lambda: flashrt.backward(do, qd, kd, vd, out_m, lse_m, **masked),
             "step dense": step(attns["flashrt dense"]), "step ids": step(attns["flashrt ids"]),
             "step cudnn": step(sdpa_cudnn)}

    stack = {}
    if not args.no_stack:
        c = bench.STACK
        blocks = torch.nn.ModuleList(bench.Block(H, HKV, D) for _ in range(c["layers"]))
        blocks = blocks.to(device="cuda", dtype=torch.bfloat16)
        params = list(blocks.parameters())
        x = torch.randn(B, S, H * D, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)

        def stack_step(attn):
            def run():
                torch.autograd.grad(bench.run_stack(blocks, x, attn), params, dy)
            return run
        stack = {("stack", name): stack_step(attn) for name, attn in attns.items()}

    if args.kernels:  # per-kernel GPU times of one step each, through the torch profiler
        for name in ("flashrt dense", "flashrt ids"):
            fn = step(attns[name])
            fn()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
            print(f"--- kernels of 10 steps, {name}")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))

    samples: dict = {}
    with torch.no_grad():
        for fn in (f for (kind, _), f in timed.items() if kind == "fwd"):
            fn()
    for r in range(args.rounds):
        for key, fn in {**timed, **stack}.items():
            if key[0] == "fwd":
                with torch.no_grad():
                    samples.setdefault(key, []).append(ms(fn))
            else:
                samples.setdefault(key, []).append(ms(fn))
        for name, fn in hosts.items():
            samples.setdefault(("host us", name), []).append(host_us(fn))
        print(f"round {r + 1} done", flush=True)
    result = {f"{kind}: {name}": statistics.median(v) for (kind, name), v in samples.items()}
    result["rounds"] = {f"{kind}: {name}": v for (kind, name), v in samples.items()}
    result["device"] = torch.cuda.get_device_name()
    result["masked_fwd_err"] = err
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "seed_targets.json").write_text(json.dumps(result, indent=1))

    def get(key):
        return result.get(key, float("nan"))
    print(f"\n{result['device']}, B={B} S={S} H={H} Hkv={HKV} D={D} bf16, vla block ids, "
          f"medians of {args.rounds} rounds")
    print(f"{'what':40s} {'value':>10s}")
    for key in sorted(k for k in result if ":" in k and not isinstance(result[k], (dict, list))):
        unit = "us" if key.startswith("host") else "ms"
        print(f"{key:40s} {result[key]:10.4f} {unit}")
    print(f"{'ratio fwd ids / fwd dense':40s} {get('fwd: flashrt ids') / get('fwd: flashrt dense'):10.3f}")
    print(f"{'ratio bwd ids / bwd dense':40s} {get('bwd: flashrt ids') / get('bwd: flashrt dense'):10.3f}")
    print(f"{'ratio step ids / step dense':40s} {get('step: flashrt ids') / get('step: flashrt dense'):10.3f}")
    print(f"{'ratio step dense / cudnn step':40s} {get('step: flashrt dense') / get('step: cudnn dense'):10.3f}")
    if stack:
        print(f"{'ratio stack ids / cudnn dense':40s} {get('stack: flashrt ids') / get('stack: cudnn dense'):10.3f}")
        print(f"{'ratio stack ids / flex ids':40s} {get('stack: flashrt ids') / get('stack: flex ids'):10.3f}")


if __name__ == "__main__":
    main()
