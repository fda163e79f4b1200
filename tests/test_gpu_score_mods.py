"""GPU tests of the score modifications against a float64 reference: attention sinks (forward's `sinks`, backward's
dsinks, flashrt.attention's gradient), softcap and ALiBi (`alibi_slopes`), alone and with sinks, on every kernel that
computes scores (the wgmma and mma.sync ones, split and fused backward), with masks, GQA and varlen.

Run on a GPU machine with `pytest -m gpu`; they skip elsewhere.
"""
import zlib

import pytest

import flashrt
from flashrt import reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


def _inputs(torch, B, Sq, Sk, H, Hkv, D, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    shapes = ((B, Sq, H, D), (B, Sk, Hkv, D), (B, Sk, Hkv, D), (B, Sq, H, D))
    q, k, v, do = (torch.randn(*s, device="cuda", generator=g).to(dt) for s in shapes)
    sinks = torch.randn(H, device="cuda", generator=g) * 2
    sinks[0] = 6.0  # a sink that outweighs most of its rows' keys
    return q, k, v, do, sinks


def _slopes(torch, n, H, seed):
    """ALiBi slopes: the geometric 2^(-8 k / H), k = 1..H, each times a random factor in [0.5, 1.5); (H,) for n = 0,
    else (n, H) (per batch entry, or per packed sequence)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    geometric = 2.0 ** (-8.0 * torch.arange(1, H + 1, device="cuda") / H)
    factor = 0.5 + torch.rand(max(n, 1), H, device="cuda", generator=g)
    return geometric * (factor[0] if n == 0 else factor)


def _f64(x):
    import cupy
    return cupy.asarray(x.detach().double()) if hasattr(x, "detach") else x.astype(cupy.float64)


# (B, Sq, Sk, H, Hkv, D, causal, dtype, mask): the forward kernels at their head dims (fwd_sm90_ws 64 / 128 with
# 128-key tiles, 192 / 256 with 80-key ones, mma.sync 96 / 72), Sq > Sk causal (rows that see no key), one query row
# (flashrt.forward's decode route, with sinks, softcap or ALiBi), GQA / MQA, a window and packed varlen.
CASES = [
    (2, 200, 300, 4, 4, 64, True, "bf16", None),
    (1, 300, 100, 8, 2, 128, True, "bf16", None),
    (2, 257, 257, 8, 8, 256, False, "fp16", None),
    (1, 130, 190, 4, 1, 192, True, "bf16", None),
    (1, 128, 513, 4, 1, 96, True, "bf16", None),
    (2, 70, 45, 2, 1, 72, False, "fp16", None),
    (2, 1, 513, 8, 2, 128, True, "bf16", None),
    (1, 400, 400, 8, 2, 128, False, "bf16", "window"),
    (1, 300, 300, 4, 2, 64, True, "bf16", "varlen"),
    (2, 200, 260, 4, 2, 128, True, "bf16", "lengths"),  # padding rows past seqlens_q: out 0, lse = the sink
]


def _mask(torch, mask, S):
    if mask == "window":
        return dict(window=(50, 20)), None
    if mask == "varlen":
        cu = torch.tensor([0, 37, 37, 180, S], device="cuda", dtype=torch.int32)  # an empty sequence too
        return dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=143, max_seqlen_k=143), cu
    if mask == "lengths":
        return dict(seqlens_q=torch.tensor(LENGTHS_Q, device="cuda", dtype=torch.int32),
                    seqlens_k=torch.tensor(LENGTHS_K, device="cuda", dtype=torch.int32)), None
    return {}, None


LENGTHS_Q, LENGTHS_K = [200, 131], [260, 170]  # (the "lengths" case's valid rows and keys per batch entry)


def _reference(torch, q, k, v, do, sinks, causal, mask, cu, forward_only=False, softcap=None, alibi=None):
    """float64 (out, lse, dq, dk, dv[, dsinks]), batch-shaped like q (forward_only: (out, lse)); alibi: the slopes
    (each batch entry's or packed sequence's own lengths align them, bottom-right)."""
    import cupy
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    m = bias = None
    if alibi is not None:
        lengths = dict(seqlens_q=LENGTHS_Q, seqlens_k=LENGTHS_K) if mask == "lengths" else {}
        if mask == "varlen":
            lengths = dict(cu_seqlens_q=cupy.asarray(cu), cu_seqlens_k=cupy.asarray(cu))
        bias = reference.alibi_bias(B, Sq, Sk, _f64(alibi), xp=cupy, **lengths)
    if mask == "window":
        m = reference.visible(B, Sq, Sk, window=(50, 20), xp=cupy)
    elif mask == "lengths":
        m = reference.visible(B, Sq, Sk, causal=causal, seqlens_q=LENGTHS_Q, seqlens_k=LENGTHS_K, xp=cupy)
    elif mask == "varlen":
        doc = torch.searchsorted(cu[1:], torch.arange(Sq, device="cuda", dtype=torch.int32), right=True)
        ids = cupy.asarray(doc.to(torch.int32))[None]
        m = reference.visible(B, Sq, Sk, segment_ids_q=ids, segment_ids_k=ids, xp=cupy)
    causal = causal and mask != "lengths"  # (there the mask holds each batch entry's own causal alignment)
    return reference.attention(_f64(q), _f64(k), _f64(v), causal=causal, dout=None if forward_only else _f64(do),
                               mask=m, sinks=None if sinks is None else _f64(sinks), softcap=softcap, bias=bias)


def _dsinks_scale(sinks, lse, dout, out):
    """Per head, the sum over its rows and head-dim columns of |exp(sink - lse) * dout * out| (float64; lse (B, H, S),
    dout and out (B, S, H, D)): the scale of dsinks' terms. dsinks is their signed sum, which can cancel (within a
    row's rowsum(dout o out) as well as across rows) to a small fraction of it, so its rounding error (out is rounded
    to bf16 / fp16 before the backward reads it) is bounded against this scale, not against dsinks itself."""
    import cupy
    p = cupy.exp(_f64(sinks)[None, :, None] - lse)
    terms = cupy.abs(_f64(dout) * _f64(out)).sum(-1).transpose(0, 2, 1)
    return cupy.where(cupy.isfinite(lse), p * terms, 0).sum(axis=(0, 2))


def _id(c):
    B, Sq, Sk, H, Hkv, D, causal, dtype, mask = c
    return f"B{B}-Sq{Sq}-Sk{Sk}-H{H}-Hkv{Hkv}-D{D}-{'causal' if causal else 'full'}-{dtype}" + (f"-{mask}" if mask
                                                                                                 else "")


SOFTCAP = 5.0  # (scores of N(0, 1) inputs reach ~3-4 after the scale: the cap bends them)


@pytest.mark.parametrize("mods", ["sinks", "softcap", "softcap+sinks", "alibi", "alibi+sinks"])
@pytest.mark.parametrize("no_sm90", [False, True], ids=["default-kernels", "mma-sync"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_score_mods_match_float64_reference(torch, monkeypatch, case, no_sm90, mods):
    import cupy
    if no_sm90:
        monkeypatch.setenv("FLASHRT_NO_SM90", "1")
    B, Sq, Sk, H, Hkv, D, causal, dtype, mask = case
    q, k, v, do, sinks = _inputs(torch, B, Sq, Sk, H, Hkv, D, dtype, zlib.crc32(repr(case).encode()))
    sinks = sinks if "sinks" in mods else None
    softcap = SOFTCAP if "softcap" in mods else None
    kw, cu = _mask(torch, mask, Sq)
    # ALiBi: (H,) slopes for one batch entry, (B, H) for several, and one row per sequence when packed
    n = len(cu) - 1 if cu is not None else (B if B > 1 else 0)
    alibi = _slopes(torch, n, H, zlib.crc32(repr(case).encode()) + 1) if "alibi" in mods else None
    packed = (lambda x: x[0]) if cu is not None else (lambda x: x)  # noqa: E731
    mod_kw = dict(softcap=softcap, alibi_slopes=alibi, sinks=sinks)
    out, lse = flashrt.forward(*(packed(x) for x in (q, k, v)), causal=causal, **mod_kw, **kw)
    grads = {impl: flashrt.backward(packed(do), *(packed(x) for x in (q, k, v)), out, lse, causal=causal, impl=impl,
                                    **mod_kw, **kw) for impl in ("split", "fused")}
    ro, rlse, rdq, rdk, rdv, *rds = _reference(torch, q, k, v, do, sinks, causal, mask, cu, softcap=softcap,
                                               alibi=alibi)
    if cu is not None:  # packed (total, H, D) and lse (H, total): as one batch entry
        out, lse = out[None], lse[None]
        grads = {i: (g[0][None], g[1][None], g[2][None], *g[3:]) for i, g in grads.items()}
    empty = ~cupy.isfinite(rlse)
    assert float(cupy.abs(cupy.where(empty, 0, _f64(lse) - rlse)).max()) < 2e-3, "lse"
    assert bool((_f64(lse)[empty] == -cupy.inf).all()), "rows that see no key and no sink: lse -inf"
    seen = cupy.isfinite(_reference(torch, q, k, v, do, None, causal, mask, cu, forward_only=True)[1])
    if not bool(seen.all()):  # a row that saw no key: out 0 (lse -inf, or its sink: checked above)
        assert bool((_f64(out).transpose(0, 2, 1, 3)[~seen] == 0).all())
    bound = {"bf16": 2e-2, "fp16": 5e-3}[dtype]
    assert reference.rel_error(_f64(out), ro) < bound
    for impl, (dq, dk, dv, *ds) in grads.items():
        assert len(ds) == (sinks is not None)
        for name, x, r in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
            e = reference.rel_error(_f64(x), r)
            assert e < bound, f"{impl} {name}: rel err {e:.2e}"
        if ds:  # per head, against its terms' scale (_dsinks_scale)
            assert ds[0].shape == (H,) and ds[0].dtype == torch.float32
            e = float((cupy.abs(_f64(ds[0]) - rds[0]) / _dsinks_scale(sinks, rlse, do, ro)).max())
            assert e < bound / 4, f"{impl} dsinks: error {e:.2e} of its terms' scale; {_f64(ds[0])} against {rds[0]}"


def test_a_sink_far_below_every_score_changes_nothing(torch):
    # add_sink with a negligible sink must leave the kernels' own arithmetic as it was: bitwise the same out and lse
    for D, causal in ((64, True), (128, False), (256, True), (96, False)):
        q, k, v, _, _ = _inputs(torch, 2, 150, 170, 4, 2, D, "bf16", D)
        out, lse = flashrt.forward(q, k, v, causal=causal)
        out_s, lse_s = flashrt.forward(q, k, v, causal=causal, sinks=torch.full((4,), -1e4, device="cuda"))
        assert torch.equal(out, out_s) and torch.equal(lse, lse_s), D


def test_sinks_backward_is_bitwise_repeatable(torch):
    q, k, v, do, sinks = _inputs(torch, 2, 300, 300, 8, 2, 128, "bf16", 5)
    out, lse = flashrt.forward(q, k, v, causal=True, sinks=sinks)
    first = flashrt.backward(do, q, k, v, out, lse, causal=True, sinks=sinks)
    for _ in range(3):
        again = flashrt.backward(do, q, k, v, out, lse, causal=True, sinks=sinks)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_attention_gives_the_sinks_their_gradient(torch, compiled):
    q, k, v, do, sinks = _inputs(torch, 2, 200, 200, 4, 2, 64, "bf16", 9)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    learned = sinks.to(torch.bfloat16).requires_grad_()  # a bf16 parameter: computed in fp32, gradient in bf16
    fn = lambda *a: flashrt.attention(*a, causal=True, sinks=learned)  # noqa: E731
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    out = fn(*leaves)
    out.backward(do)
    ref = reference.attention(*(_f64(x) for x in (q, k, v)), causal=True, dout=_f64(do), sinks=_f64(learned.float()))
    assert learned.grad is not None and learned.grad.dtype == torch.bfloat16
    assert reference.rel_error(_f64(out), ref[0]) < 2e-2
    for x, r in zip((t.grad for t in leaves), ref[2:5]):
        assert reference.rel_error(_f64(x), r) < 2e-2
    import cupy  # dsinks (rounded to bf16 here) against its terms' scale, as in the reference test above
    scale = _dsinks_scale(learned.float(), ref[1], do, ref[0])
    assert float((cupy.abs(_f64(learned.grad) - ref[5]) / scale).max()) < 1e-2


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_attention_with_softcap_and_sinks_matches_reference(torch, compiled):
    q, k, v, do, sinks = _inputs(torch, 1, 256, 256, 8, 2, 128, "bf16", 11)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    learned = sinks.clone().requires_grad_()
    fn = lambda *a: flashrt.attention(*a, causal=True, softcap=SOFTCAP, sinks=learned)  # noqa: E731
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    out = fn(*leaves)
    out.backward(do)
    ref = reference.attention(*(_f64(x) for x in (q, k, v)), causal=True, dout=_f64(do), sinks=_f64(sinks),
                              softcap=SOFTCAP)
    for x, r in zip((out, *(t.grad for t in leaves), learned.grad), (ref[0], *ref[2:])):
        assert reference.rel_error(_f64(x), r) < 2e-2


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_attention_with_alibi_and_sinks_matches_reference(torch, compiled):
    """(B, H) slopes in bf16 (computed in fp32), top-left causal alignment with Sq < Sk (a shift of 0, not Sk - Sq)."""
    B, Sq, Sk, H = 2, 192, 256, 8
    q, k, v, do, sinks = _inputs(torch, B, Sq, Sk, H, 2, 128, "bf16", 13)
    slopes = _slopes(torch, B, H, 13).to(torch.bfloat16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    learned = sinks.clone().requires_grad_()
    fn = lambda *a: flashrt.attention(*a, causal="top_left", alibi_slopes=slopes, sinks=learned)  # noqa: E731
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    out = fn(*leaves)
    out.backward(do)
    import cupy
    mask = reference.visible(B, Sq, Sk, causal=True, align="top_left", xp=cupy)
    bias = reference.alibi_bias(B, Sq, Sk, _f64(slopes.float()), align="top_left", xp=cupy)
    ref = reference.attention(*(_f64(x) for x in (q, k, v)), dout=_f64(do), sinks=_f64(sinks), mask=mask, bias=bias)
    for x, r in zip((out, *(t.grad for t in leaves)), (ref[0], *ref[2:5])):
        assert reference.rel_error(_f64(x), r) < 2e-2
    scale = _dsinks_scale(sinks, ref[1], do, ref[0])
    assert float((cupy.abs(_f64(learned.grad) - ref[5]) / scale).max()) < 1e-2


def test_alibi_plans_follow_the_slopes_shape_and_are_not_the_sinks(torch):
    """The plan cache tells (H,) slopes from (B, H) ones and from sinks of the same shape: each call gets its own."""
    q, k, v, _, _ = _inputs(torch, 2, 100, 140, 4, 2, 64, "bf16", 3)
    slopes = _slopes(torch, 0, 4, 3)
    per_head = flashrt.forward(q, k, v, causal=True, alibi_slopes=slopes)
    per_entry = flashrt.forward(q, k, v, causal=True, alibi_slopes=slopes.expand(2, 4).contiguous())
    as_sinks = flashrt.forward(q, k, v, causal=True, sinks=slopes)
    again = flashrt.forward(q, k, v, causal=True, alibi_slopes=slopes)
    assert all(torch.equal(a, b) for a, b in zip(per_head, per_entry)) and torch.equal(per_head[0], again[0])
    assert not torch.equal(per_head[1], as_sinks[1])
    # (B, H) slopes that differ per batch entry: each entry reads its own row (alibi_bstride), bitwise as the (H,)
    # plan with that row
    halved = flashrt.forward(q, k, v, causal=True, alibi_slopes=slopes * 0.5)
    mixed = flashrt.forward(q, k, v, causal=True, alibi_slopes=torch.stack([slopes, slopes * 0.5]))
    assert torch.equal(mixed[0][0], per_head[0][0]) and torch.equal(mixed[0][1], halved[0][1])
    assert not torch.equal(mixed[0][1], per_head[0][1])
    ref = reference.attention(*(_f64(x) for x in (q, k, v)), causal=True, alibi_slopes=_f64(slopes))
    assert reference.rel_error(_f64(per_head[0]), ref[0]) < 2e-2


def test_alibi_errors_are_clear(torch):
    q, k, v, do, sinks = _inputs(torch, 2, 16, 16, 4, 2, 64, "bf16", 1)
    slopes = _slopes(torch, 2, 4, 1)
    for bad, pattern in ((slopes[:, :3], r"alibi_slopes must have shape \(4,\) or \(2, 4\)"),
                         (slopes[None], r"alibi_slopes must have shape"),
                         (slopes.half(), "alibi_slopes must be float32, got fp16"),
                         (slopes.cpu(), "alibi_slopes must be a torch array on cuda:0 like q, got torch on the host"),
                         (slopes.t().contiguous().t(), "alibi_slopes must be contiguous")):
        with pytest.raises(ValueError, match=pattern):
            flashrt.forward(q, k, v, alibi_slopes=bad)
    out, lse = flashrt.forward(q, k, v, alibi_slopes=slopes)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(4,\) or \(2, 4\)"):
        flashrt.backward(do, q, k, v, out, lse, alibi_slopes=slopes[0, :2])
    with pytest.raises(ValueError, match="softcap and alibi_slopes together are not supported yet"):
        flashrt.forward(q, k, v, softcap=SOFTCAP, alibi_slopes=slopes)
    with pytest.raises(ValueError, match=r"pass alibi_slopes\.detach\(\)"):
        flashrt.attention(q, k, v, alibi_slopes=slopes.clone().requires_grad_())
    with pytest.raises(ValueError, match="alibi_slopes must be a floating-point tensor"):
        flashrt.attention(q, k, v, alibi_slopes=torch.ones(4, dtype=torch.int32, device="cuda"))


def test_softcap_errors_are_clear(torch):
    q, k, v, _, _ = _inputs(torch, 1, 16, 16, 4, 2, 64, "bf16", 1)
    for bad in (0, -1.0, float("inf"), float("nan"), "30", True):
        with pytest.raises(ValueError, match="softcap must be a finite positive number"):
            flashrt.forward(q, k, v, softcap=bad)
        with pytest.raises(ValueError, match="softcap must be a finite positive number"):
            flashrt.attention(q, k, v, softcap=bad)


def test_sinks_errors_are_clear(torch):
    q, k, v, do, sinks = _inputs(torch, 1, 16, 16, 4, 2, 64, "bf16", 1)
    for bad in (sinks[:3], sinks.half(), sinks.cpu(), torch.zeros(8, device="cuda")[::2]):
        with pytest.raises(ValueError, match="sinks must be a contiguous torch float32 array of shape"):
            flashrt.forward(q, k, v, sinks=bad)
    out, lse = flashrt.forward(q, k, v, sinks=sinks)
    with pytest.raises(ValueError, match="sinks must be"):
        flashrt.backward(do, q, k, v, out, lse, sinks=sinks[:2])
    with pytest.raises(ValueError, match="sinks must be a floating-point tensor"):
        flashrt.attention(q, k, v, sinks=torch.zeros(4, dtype=torch.int32, device="cuda"))
