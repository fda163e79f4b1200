import sys, time
sys.path.insert(0, ".")
import torch
import flashrt
from flashrt import torch_ops
N = 1000
class Sig(torch.autograd.Function):  # flashrt's signature, trivial work
    @staticmethod
    def forward(ctx, q, k, v, *rest):
        out, lse = q * 1, torch.empty(2, 8, q.shape[1], device="cuda")
        ctx.save_for_backward(q, k, v, out, lse); ctx.mark_non_differentiable(lse)
        return out, lse
    @staticmethod
    def backward(ctx, g, _):
        q, k, v, out, lse = ctx.saved_tensors
        return (g, torch.empty_like(k), torch.empty_like(v)) + (None,) * 11
args = ("none", None, "auto", True, None, None, None, False, [None] * 8, "", "")
def S(): Sig.apply(q, k, v, *args)[0].backward(do)
def D(): flashrt.attention(q, k, v).backward(do)
def F(): flashrt.attention(q, k, v)
def FB(): torch.autograd.grad(flashrt.attention(q, k, v), (q,), do)
def per(fn):
    for _ in range(30): fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(N): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / N * 1e6
orig = torch_ops._Eager.backward
acc = [0.0]
def timed(ctx, *a):
    t0 = time.perf_counter(); r = orig(ctx, *a); acc[0] += time.perf_counter() - t0; return r
for S_ in (1024, 128, 1024, 128):
    q = torch.randn(2, S_, 8, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(2, S_, 1, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    do = torch.randn_like(q)
    print("S", S_, end=": ")
    r = {"sig": per(S), "attn fwd": per(F), "attn": per(D)}
    torch_ops._Eager.backward = staticmethod(timed); acc[0] = 0; t = per(D); r["attn(timed)"] = t; r["  in backward"] = acc[0] / (N + 30) * 1e6
    torch_ops._Eager.backward = orig
    with torch.autograd.set_multithreading_enabled(False):
        r["sig 1t"] = per(S); r["attn 1t"] = per(D)
    print("  ".join(f"{n}={x:.0f}" for n, x in r.items()))
