"""GPU tests of the edges users hit: a random sweep of valid configurations, NaN/Inf inputs,
fp16 logits beyond fp16's range, tensors past 2^31 elements, and a 128k-token sequence.

Run on a GPU machine with `pytest -m gpu`; they skip elsewhere.
"""
import math
import random

import pytest

import flashrt
from flashrt import reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def f64(x):
    import cupy
    return cupy.from_dlpack(x.detach().double().contiguous())


def _error(x, ref, scale: float) -> float:
    """||x - ref|| over max(||ref||, scale): relative, except where the true gradient is far below the
    typical size `scale` (e.g. dq with one visible key is 0, and any rounding would be infinitely wrong)."""
    import cupy
    return float(cupy.linalg.norm((f64(x) - ref).ravel())) / max(float(cupy.linalg.norm(ref.ravel())), scale)


def _layout(torch, shape, dtype, kind, gen):
    """A (B, S, H, D) tensor stored plainly, inside a wider packed tensor, or as a (B, H, S, D) transpose."""
    B, S, H, D = shape
    if kind == "packed":  # every other head of a tensor with twice the heads: strides (S*2H*D, 2H*D, 2D, 1)
        return torch.randn(B, S, H, 2 * D, device="cuda", dtype=dtype, generator=gen)[..., :D]
    if kind == "bhsd":
        return torch.randn(B, H, S, D, device="cuda", dtype=dtype, generator=gen).transpose(1, 2)
    return torch.randn(B, S, H, D, device="cuda", dtype=dtype, generator=gen)


def test_fuzz_random_configurations_match_float64(torch):
    rng = random.Random(20261122)
    gen = torch.Generator(device="cuda").manual_seed(20261122)
    failures = []
    for i in range(200):
        B, Sq, Sk = rng.randint(1, 3), rng.randint(1, 300), rng.randint(1, 300)
        Hkv = rng.choice([1, 2, 3])
        H = Hkv * rng.choice([1, 2, 4])
        D = 8 * rng.randint(1, 32)
        causal = rng.random() < 0.5
        dtype = rng.choice(["bf16", "fp16"])
        impl, deterministic = rng.choice([("auto", True), ("split", True), ("fused", True), ("fused", False)])
        kinds = [rng.choice(["plain", "packed", "bhsd"]) for _ in range(4)]
        dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
        q, k, v, do = (_layout(torch, shape, dt, kind, gen) for shape, kind in
                       zip(((B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), (B, Sq, H, D)), kinds))
        out, lse = flashrt.forward(q, k, v, causal=causal)
        grads = flashrt.backward(do, q, k, v, out, lse, causal=causal, impl=impl, deterministic=deterministic)
        ref = reference.attention(f64(q), f64(k), f64(v), causal=causal, dout=f64(do))
        bound = {"bf16": 2e-2, "fp16": 4e-3}[dtype]
        typical = 0.05 * float(do.float().norm())
        for name, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref[0], *ref[2:])):
            err = _error(x, r, typical)
            if not err <= bound:
                failures.append(f"#{i} B={B} Sq={Sq} Sk={Sk} H={H} Hkv={Hkv} D={D} causal={causal} {dtype} "
                                f"impl={impl} det={deterministic} layouts={kinds}: {name} rel err {err:.2e}")
    assert not failures, "\n".join(failures)


def test_nan_and_inf_inputs_propagate_like_the_reference(torch):
    import cupy
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(1, 64, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 80, 1, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, 80, 1, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    # (A NaN in V is left out: where a masked key's P is 0, 0 * NaN makes the reference's output
    # NaN while flashrt, which never reads a tile the mask hides, gives a number.)
    q[0, 3, 1, :] = float("nan")  # one query row
    k[0, 5, 0, 7] = float("inf")  # one key: +inf or -inf scores depending on the query's sign
    for causal in (False, True):
        out, lse = flashrt.forward(q, k, v, causal=causal)
        ref_out, _ = reference.attention(f64(q), f64(k), f64(v), causal=causal)
        got, want = cupy.isnan(f64(out)), cupy.isnan(ref_out)
        assert bool(want.any()), "the case must produce NaN somewhere"
        assert bool((got == want).all()), f"NaN outputs differ from the reference (causal={causal})"
        finite = ~want
        assert float(cupy.abs(cupy.where(finite, f64(out) - ref_out, 0)).max()) < 5e-2


def test_fp16_logits_beyond_fp16_range(torch):
    # |q.k| reaches ~1e5 (fp16 max 65504): the scores are formed and scaled in fp32.
    g = torch.Generator(device="cuda").manual_seed(4)
    q = (torch.randn(2, 128, 4, 64, device="cuda", generator=g) * 40).half()
    k = (torch.randn(2, 128, 4, 64, device="cuda", generator=g) * 40).half()
    v = torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.float16, generator=g)
    do = torch.randn_like(q)
    out, lse = flashrt.forward(q, k, v)
    grads = flashrt.backward(do, q, k, v, out, lse)
    ro, rlse, *rgrads = reference.attention(f64(q), f64(k), f64(v), dout=f64(do))
    assert float(abs(f64(lse) - rlse).max()) < 1e-2 * float(abs(rlse).max())
    assert reference.rel_error(f64(out), ro) < 4e-3
    for x, r in zip(grads, rgrads):  # near one-hot softmax: gradients are large and sparse
        assert bool(torch.isfinite(x).all())
        assert reference.rel_error(f64(x), r) < 2e-2


def test_tensors_beyond_2_31_elements(torch):
    # q, out, dout, dq: 2^21 + 64 queries x 8 heads x 128 = 2^31 + 2^16 elements each; a short
    # key sequence keeps the work small. Element offsets past 2^31 need 64-bit index math.
    import cupy
    Sq, Sk, H, D = 2**21 + 64, 192, 8, 128
    g = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(1, Sq, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, Sk, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, Sk, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(1, Sq, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    assert q.numel() > 2**31
    out, lse = flashrt.forward(q, k, v)
    dq, dk, dv = flashrt.backward(do, q, k, v, out, lse, impl="split")
    tail = slice(Sq - 300, Sq)  # rows whose elements sit past 2^31
    ro, rlse, rdq, _, _ = reference.attention(f64(q[:, tail]), f64(k), f64(v), dout=f64(do[:, tail]))
    assert reference.rel_error(f64(out[:, tail]), ro) < 2e-2
    assert float(cupy.abs(f64(lse[:, :, tail]) - rlse).max()) < 1e-3
    assert reference.rel_error(f64(dq[:, tail]), rdq) < 2e-2
    # dK/dV sum over all queries: the same sum taken in two halves (rows are independent given lse).
    half = Sq // 2
    parts = [flashrt.backward(do[:, s], q[:, s], k, v, out[:, s], lse[:, :, s].contiguous(), impl="split")
             for s in (slice(0, half), slice(half, Sq))]
    for name, full, i in (("dk", dk, 1), ("dv", dv, 2)):
        want = parts[0][i].double() + parts[1][i].double()
        err = ((full.double() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"{name}: rel err {err:.2e} against the two-half sum"
    fused = flashrt.backward(do, q, k, v, out, lse, impl="fused", deterministic=False)
    assert reference.rel_error(f64(fused[0][:, tail]), rdq) < 2e-2


def test_128k_tokens_forward_and_backward_memory_linear(torch):
    S, H, D = 131072, 16, 128
    g = torch.Generator(device="cuda").manual_seed(6)
    q, k, v, do = (torch.randn(1, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
    inputs = 4 * q.numel() * q.element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out, lse = flashrt.forward(q, k, v, causal=True)
    dq, dk, dv = flashrt.backward(do, q, k, v, out, lse, causal=True)
    end.record()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    # out + dq + dk + dv (4 x q's size), the fused backward's fp32 dQ buffer (2 x q's size) and
    # lse/delta: linear in S (an S x S score matrix would be 512 GiB).
    assert extra < 2 * inputs, f"{extra / 2**20:.0f} MiB beyond the inputs"
    print(f"\n128k tokens, H=16, D=128, causal: fwd+bwd {start.elapsed_time(end):.0f} ms, "
          f"{extra / 2**20:.0f} MiB beyond {inputs / 2**20:.0f} MiB of inputs")
    rows = slice(S - 64, S)
    ro, _, rdq, _, _ = reference.attention(f64(q[:, rows, :1]), f64(k[:, :, :1]), f64(v[:, :, :1]), causal=True,
                                           dout=f64(do[:, rows, :1]))
    assert reference.rel_error(f64(out[:, rows, :1]), ro) < 2e-2
    assert reference.rel_error(f64(dq[:, rows, :1]), rdq) < 2e-2
    assert math.isfinite(float(dk.float().norm())) and math.isfinite(float(dv.float().norm()))
