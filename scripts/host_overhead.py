"""Host-side cost of one flashrt call (Python validation, planning and launch), against torch SDPA; an autograd step
(torch.autograd.grad) of each with autograd's device threads on and off (the backward on this thread).

    python scripts/host_overhead.py          # per-call microseconds at a tiny shape, then a cProfile of each path

At B=1, S=128 the kernels take a few microseconds, so a loop of calls with one
synchronisation at the end measures what the CPU spends per call.
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import flashrt  # noqa: E402

N = 2000
q = torch.randn(1, 128, 8, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k = torch.randn(1, 128, 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
v = torch.randn_like(k, requires_grad=True)
do = torch.randn_like(q)
out, lse = flashrt.forward(q.detach(), k.detach(), v.detach(), causal=True)


def fwd():
    flashrt.forward(q.detach(), k.detach(), v.detach(), causal=True)


def bwd():
    flashrt.backward(do, q.detach(), k.detach(), v.detach(), out, lse, causal=True)


def bwd_fused():  # (the fused kernel, unordered: three launches)
    flashrt.backward(do, q.detach(), k.detach(), v.detach(), out, lse, causal=True, impl="fused", deterministic=False)


def bwd_split():
    flashrt.backward(do, q.detach(), k.detach(), v.detach(), out, lse, causal=True, impl="split", deterministic=False)


def autograd():
    flashrt.attention(q, k, v, causal=True).backward(do)


def sdpa():
    F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                   enable_gqa=True).transpose(1, 2).backward(do)


def step(attend, args):
    def run():
        torch.autograd.grad(attend(*args), args, do if args[0] is q else do.transpose(1, 2))
    return run


def threads_off(fn):  # the backward on this thread: autograd's device threads off
    def run():
        with torch.autograd.set_multithreading_enabled(False):
            fn()
    return run


bhsd = [x.detach().transpose(1, 2).requires_grad_() for x in (q, k, v)]
flashrt_step = step(lambda *a: flashrt.attention(*a, causal=True), (q, k, v))
sdpa_step = step(lambda *a: F.scaled_dot_product_attention(*a, is_causal=True, enable_gqa=True), tuple(bhsd))


def per_call_us(fn) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(N):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / N * 1e6


rows = [(name, per_call_us(fn)) for name, fn in
        (("flashrt.forward", fwd), ("flashrt.backward", bwd), ("flashrt.backward fused", bwd_fused),
         ("flashrt.backward split", bwd_split), ("flashrt.attention fwd+bwd", autograd), ("torch SDPA fwd+bwd", sdpa),
         ("flashrt autograd.grad step", flashrt_step), ("  autograd threads off", threads_off(flashrt_step)),
         ("SDPA autograd.grad step", sdpa_step), ("  autograd threads off", threads_off(sdpa_step)))]
for name, fn in (("forward", fwd), ("backward", bwd), ("backward fused", bwd_fused), ("backward split", bwd_split),
                 ("attention fwd+bwd", autograd)):
    prof = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):  # the backward in this thread, where cProfile sees it
        prof.runcall(lambda: [fn() for _ in range(500)])
    print(f"--- cProfile of 500 x flashrt.{name} (top 15 by own time)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(15)
print(f"{'call':28s} {'us per call':>12s}")
for name, us in rows:
    print(f"{name:28s} {us:12.1f}")
