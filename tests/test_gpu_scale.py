"""GPU tests of the edges users hit: a random sweep of valid configurations, NaN/Inf inputs,
fp16 logits beyond fp16's range, tensors past 2^31 elements, and a 128k-token sequence.

Run on a GPU machine with `pytest -m gpu`; they skip elsewhere.
"""
import itertools
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


def _random_masks(rng, B, Sq, Sk):
    """Half the configurations get masks: (flashrt keyword arguments, reference.visible's, packed varlen or not),
    drawn from lengths, a window, block or segment ids (sorted random), causal alignments, packed varlen."""
    import numpy as np
    if rng.random() < 0.5:
        return {}, None, False
    kw = {}
    nrng = np.random.default_rng(rng.randrange(2**32))
    varlen = rng.random() < 0.3
    if varlen or rng.random() < 0.4:
        kw["seqlens_q"] = nrng.integers(0, Sq + 1, B).astype(np.int32)
        kw["seqlens_k"] = nrng.integers(0, Sk + 1, B).astype(np.int32)
    if rng.random() < 0.3:
        kw["window"] = (rng.choice([-1, rng.randint(0, 64)]), rng.choice([-1, rng.randint(0, 64)]))
    ids = rng.choice([None, "block_ids", "segment_ids"])
    if ids:
        n = rng.randint(1, 6)
        kw[f"{ids}_q"] = np.sort(nrng.integers(0, n, (B, Sq)), axis=1).astype(np.int32)
        kw[f"{ids}_k"] = np.sort(nrng.integers(0, n, (B, Sk)), axis=1).astype(np.int32)
    causal = rng.choice([False, True, "top_left"])
    ref = dict(kw, causal=bool(causal), align="top_left" if causal == "top_left" else "bottom_right")
    ref["window"] = ref.get("window", (-1, -1))
    return dict(kw, causal=causal), ref, varlen


def _packed(torch, x, lengths):
    """The rows [0, lengths[b]) of each batch entry of x (B, S, ...), one after another."""
    return torch.cat([x[b, :int(n)] for b, n in enumerate(lengths)])


def test_fuzz_random_configurations_match_float64(torch):
    """200 random valid configurations (shapes, GQA, head dims, dtypes, layouts, backward impls, and in half of
    them masks: lengths, windows, ids, both causal alignments, packed varlen), every output and gradient
    against float64, the mask arrays checked on the device (validate=True, reported by flashrt.synchronize)."""
    import cupy
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
        mask, ref_mask, varlen = _random_masks(rng, B, Sq, Sk)
        if mask:
            causal = mask.pop("causal")
            if "segment_ids_q" in mask and impl == "fused" and deterministic:
                impl = "split"  # (the ordered fused dQ takes no segment ids)
            keep = reference.visible(B, Sq, Sk, xp=cupy, **{n: cupy.asarray(x) if hasattr(x, "shape") else x
                                                           for n, x in ref_mask.items()})
            ref = reference.attention(f64(q), f64(k), f64(v), dout=f64(do), mask=keep)
        else:
            ref = reference.attention(f64(q), f64(k), f64(v), causal=causal, dout=f64(do))
        ref = (ref[0], *ref[2:])
        lq, lk = mask.get("seqlens_q"), mask.get("seqlens_k")
        if varlen:  # the same sequences packed: (total, H, D), lengths as cu_seqlens
            q, k, v, do = (_packed(torch, x, n).contiguous() for x, n in ((q, lq), (k, lk), (v, lk), (do, lq)))
            ref = tuple(cupy.concatenate([r[b, :int(n)] for b, n in enumerate(lens)])[None]
                        for r, lens in zip(ref, (lq, lq, lk, lk)))
            cu = {n: torch.tensor([0, *itertools.accumulate(int(x) for x in lens)], dtype=torch.int32, device="cuda")
                  for n, lens in (("cu_seqlens_q", mask.pop("seqlens_q")), ("cu_seqlens_k", mask.pop("seqlens_k")))}
            for side, cu_name, lens in (("q", "cu_seqlens_q", lq), ("k", "cu_seqlens_k", lk)):
                for ids in ("block_ids", "segment_ids"):
                    if f"{ids}_{side}" in mask:
                        mask[f"{ids}_{side}"] = _packed(torch, torch.as_tensor(mask[f"{ids}_{side}"]), lens)
            mask.update(cu, max_seqlen_q=Sq, max_seqlen_k=Sk)
        mask = {n: torch.as_tensor(x).cuda() if hasattr(x, "shape") else x for n, x in mask.items()}
        out, lse = flashrt.forward(q, k, v, causal=causal, **mask)
        grads = flashrt.backward(do, q, k, v, out, lse, causal=causal, impl=impl, deterministic=deterministic,
                                 **mask)
        flashrt.synchronize()  # a device check's report (none: the arrays are valid)
        bound = {"bf16": 2e-2, "fp16": 4e-3}[dtype]
        typical = 0.05 * float(do.float().norm())
        for name, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), ref):
            err = _error(x[None] if varlen else x, r, typical)
            if not err <= bound:
                failures.append(f"#{i} B={B} Sq={Sq} Sk={Sk} H={H} Hkv={Hkv} D={D} causal={causal} {dtype} "
                                f"impl={impl} det={deterministic} layouts={kinds} masks={sorted(mask)}: "
                                f"{name} rel err {err:.2e}")
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
