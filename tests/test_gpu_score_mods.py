"""GPU tests of the score modifications against a float64 reference: attention sinks (forward's `sinks`, backward's
dsinks, flashrt.attention's gradient), softcap and ALiBi (`alibi_slopes`), alone and with sinks, on every kernel that
computes scores (the wgmma and mma.sync ones, split and fused backward), with masks, GQA and varlen.

Run on a GPU machine with `pytest -m gpu`; they skip elsewhere.
"""
import zlib

import pytest

import flashrt
from flashrt import reference

from test_gpu import f64, poison  # noqa: F401  (fixture)

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


def _reference(torch, q, k, v, do, sinks, causal, mask, cu, forward_only=False, softcap=None, alibi=None, drop=None):
    """float64 (out, lse, dq, dk, dv[, dsinks]), batch-shaped like q (forward_only: (out, lse)); alibi: the slopes
    (each batch entry's or packed sequence's own lengths align them, bottom-right); drop: dropout's (rng values, p),
    its mask keyed by each sequence's own positions (reference.dropout_mask)."""
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
    if drop is not None:
        at = (reference.positions(B, Sq, Sk, cu_seqlens_q=cupy.asarray(cu), cu_seqlens_k=cupy.asarray(cu), xp=cupy)
              if mask == "varlen" else None)
        drop = reference.dropout_mask(*drop, B, q.shape[2], Sq, Sk, at=at, xp=cupy)
    causal = causal and mask != "lengths"  # (there the mask holds each batch entry's own causal alignment)
    return reference.attention(_f64(q), _f64(k), _f64(v), causal=causal, dout=None if forward_only else _f64(do),
                               mask=m, sinks=None if sinks is None else _f64(sinks), softcap=softcap, bias=bias,
                               dropout=drop)


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


@pytest.mark.parametrize("mods", ["softcap+sinks", "alibi+sinks", "score_mod", "dropout"])
@pytest.mark.parametrize("dims", [(192, 128), (64, 128), (128, 64)], ids=lambda d: f"qk{d[0]}-v{d[1]}")
@pytest.mark.parametrize("no_sm90", [False, True], ids=["default-kernels", "mma-sync"])
@pytest.mark.parametrize("mask", [None, "varlen"])
def test_score_mods_with_a_v_head_dim_of_its_own_match_float64(torch, monkeypatch, mask, no_sm90, dims, mods):
    """v (and out, dout, dv) with a head_dim of its own beside softcap, ALiBi and sinks (dsinks too), a score_mod
    expression, or dropout: the forward and the split and fused backward, GQA, causal, dense and packed varlen
    (an empty sequence too), against float64."""
    import cupy
    if no_sm90:
        monkeypatch.setenv("FLASHRT_NO_SM90", "1")
    (D, Dv), (B, S, H, Hkv) = dims, (1 if mask else 2, 300, 4, 2)
    seed = zlib.crc32(repr((mask, dims, mods)).encode())
    q, k, _, _, sinks = _inputs(torch, B, S, S, H, Hkv, D, "bf16", seed)
    _, _, v, do, _ = _inputs(torch, B, S, S, H, Hkv, Dv, "bf16", seed + 1)
    kw, cu = _mask(torch, mask, S)
    packed = (lambda x: x[0]) if cu is not None else (lambda x: x)  # noqa: E731
    sinks = sinks if "sinks" in mods else None
    softcap = SOFTCAP if "softcap" in mods else None
    alibi = _slopes(torch, len(cu) - 1 if cu is not None else B, H, seed + 2) if "alibi" in mods else None
    mod_kw = dict(softcap=softcap, alibi_slopes=alibi, sinks=sinks)
    rng = torch.tensor([seed * 7919 - 2**40, seed], device="cuda", dtype=torch.int64)
    if mods == "dropout":
        mod_kw = dict(dropout_p=0.2, dropout_rng=rng)
    elif mods == "score_mod":  # (an ALiBi-like bias over each sequence's own positions)
        mod_kw = dict(score_mod="s - 0.05f * fabsf(kf - qf)")
    out, lse = flashrt.forward(*(packed(x) for x in (q, k, v)), causal=True, **mod_kw, **kw)
    assert out.shape[-1] == Dv
    grads = {impl: flashrt.backward(packed(do), *(packed(x) for x in (q, k, v)), out, lse, causal=True, impl=impl,
                                    **mod_kw, **kw) for impl in ("split", "fused")}
    if mods == "score_mod":
        ref = _score_reference(cupy, q, k, v, do, True, mask, None if cu is None else cupy.asarray(cu),
                               dict(score_mod=lambda s, b, h, i, j, lq, lk: s - 0.05 * abs(j - i)))
    else:
        ref = _reference(torch, q, k, v, do, sinks, True, mask, cu, softcap=softcap, alibi=alibi,
                         drop=(rng.tolist(), 0.2) if mods == "dropout" else None)
    ro, rlse, rdq, rdk, rdv, *rds = ref
    if cu is not None:
        out = out[None]
        grads = {i: (g[0][None], g[1][None], g[2][None], *g[3:]) for i, g in grads.items()}
    assert reference.rel_error(_f64(out), ro) < 2e-2, "out"
    for impl, (dq, dk, dv, *ds) in grads.items():
        assert [x.shape[-1] for x in (dq, dk, dv)] == [D, D, Dv]
        for name, x, r in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
            e = reference.rel_error(_f64(x), r)
            assert e < 2e-2, f"{impl} {name}: rel err {e:.2e}"
        if sinks is not None:
            e = float((cupy.abs(_f64(ds[0]) - rds[0]) / _dsinks_scale(sinks, rlse, do, ro)).max())
            assert e < 5e-3, f"{impl} dsinks: error {e:.2e} of its terms' scale"


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


# ---------------------------------------------------------------------------------------------------------------
# score_mod: a user's CUDA expression over the scaled score (and its derivative), against the float64 reference with
# the expression's Python form (reference.attention's score_mod, over reference.positions' arrays).

def _score_mods(cupy, name, H, S, seed):
    """name -> (flashrt kwargs, reference kwargs): the expression, its tensors (CuPy, like the inputs), its Python
    form (s, b, h, i, j, Lq, Lk: broadcasting CuPy arrays) and, where given, its derivative. S bounds every position."""
    rng = cupy.random.default_rng(seed)
    if name == "cap":  # the built-in softcap, written out (test_score_mod_matches_the_built_ins compares them)
        return (dict(score_mod=f"{SOFTCAP}f * tanhf(s / {SOFTCAP}f)"),
                dict(score_mod=lambda s, b, h, i, j, Lq, Lk: SOFTCAP * cupy.tanh(s / SOFTCAP)))
    if name == "alibi":  # ALiBi as the built-in aligns it (bottom-right), reading a float32 slopes tensor
        slopes = (2.0 ** (-8.0 * cupy.arange(1, H + 1) / H) * (0.5 + rng.random(H))).astype(cupy.float32)
        per_head = slopes.astype(cupy.float64)
        return (dict(score_mod="s - slopes[h] * fabsf((float)(k - q - (Lk - Lq)))", score_tensors={"slopes": slopes}),
                dict(score_mod=lambda s, b, h, i, j, Lq, Lk: s - per_head[h] * abs(j - i - (Lk - Lq))))
    if name == "rel":  # a relative-position bias table (H, 2S - 1), float32
        bias = rng.standard_normal((H, 2 * S - 1), dtype=cupy.float32)
        return (dict(score_mod=f"s + bias[h * {2 * S - 1} + k - q + {S - 1}]", score_tensors={"bias": bias}),
                dict(score_mod=lambda s, b, h, i, j, Lq, Lk: s + bias.astype(cupy.float64)[h, j - i + S - 1]))
    if name == "int":  # int32 tensors: a per-position group and a per-head switch
        group = rng.integers(0, 3, S, dtype=cupy.int32)
        on = cupy.asarray([1, 0] * (H // 2), dtype=cupy.int32)
        return (dict(score_mod="group[q] == group[k] || on[h] == 0 ? s : 0.5f * s - 1.f",
                     score_tensors={"group": group, "on": on}),
                dict(score_mod=lambda s, b, h, i, j, Lq, Lk: cupy.where((group[i] == group[j]) | (on[h] == 0), s,
                                                                       0.5 * s - 1.0)))
    if name == "grad":  # an explicit derivative
        return (dict(score_mod="s * s / 8.f + s", score_mod_grad="s / 4.f + 1.f"),
                dict(score_mod=lambda s, *_: s * s / 8.0 + s, score_mod_grad=lambda s, *_: s / 4.0 + 1.0))
    if name == "leaky":  # automatic derivative (dual numbers) through a branch
        return (dict(score_mod="s > 0.f ? s : 0.25f * s"),
                dict(score_mod=lambda s, *_: cupy.where(s > 0, s, 0.25 * s)))
    assert name == "square"  # automatic derivative of a product, with the batch entry in it
    return (dict(score_mod="s * s / 8.f - 0.5f * b"), dict(score_mod=lambda s, b, *_: s * s / 8.0 - 0.5 * b))


# (B, Sq, Sk, H, Hkv, D, causal, mask) as CASES above; one query row: flashrt.forward's decode route is not taken
SCORE_CASES = {
    "d64-causal": (2, 200, 300, 4, 4, 64, True, None),
    "d128-gqa-no-key-rows": (1, 300, 100, 8, 2, 128, True, None),  # Sq > Sk causal: rows that see no key
    "d256-full": (2, 257, 257, 8, 8, 256, False, None),
    "d96-gqa": (1, 128, 250, 8, 2, 96, True, None),
    "d128-window": (1, 300, 300, 8, 2, 128, False, "window"),
    "d64-lengths": (2, 200, 260, 4, 2, 64, True, "lengths"),
    "d64-varlen": (1, 300, 300, 4, 2, 64, True, "varlen"),
    "d256-varlen-gqa": (1, 300, 300, 8, 2, 256, True, "varlen"),
    "one-row": (2, 1, 513, 8, 2, 128, True, None),
}
# (expression, case, mma.sync kernels (FLASHRT_NO_SM90=1) on Hopper)
SCORE_RUNS = [("cap", "d64-causal", False), ("cap", "d256-full", False), ("cap", "d96-gqa", True),
              ("alibi", "d128-gqa-no-key-rows", False), ("alibi", "d64-lengths", False),
              ("alibi", "d128-window", True), ("alibi", "one-row", False),
              ("rel", "d64-causal", False), ("rel", "d64-varlen", False), ("rel", "d256-full", True),
              ("int", "d128-window", False), ("int", "d256-varlen-gqa", False),
              ("grad", "d128-gqa-no-key-rows", False), ("grad", "d96-gqa", False),
              ("leaky", "d64-causal", False), ("leaky", "d64-lengths", True), ("leaky", "d256-varlen-gqa", False),
              ("square", "d128-gqa-no-key-rows", True), ("square", "d64-varlen", False)]


def _score_reference(cupy, q, k, v, do, causal, mask, cu, ref_kw):
    """float64 (out, lse, dq, dk, dv), batch-shaped like q, with the expression at each pair's positions in its
    sequence (reference.positions: padding lengths, packed sequences)."""
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    m, at = None, reference.positions(B, Sq, Sk, xp=cupy)
    if mask == "window":
        m = reference.visible(B, Sq, Sk, window=(50, 20), xp=cupy)
    elif mask == "lengths":
        m = reference.visible(B, Sq, Sk, causal=causal, seqlens_q=LENGTHS_Q, seqlens_k=LENGTHS_K, xp=cupy)
        at = reference.positions(B, Sq, Sk, seqlens_q=LENGTHS_Q, seqlens_k=LENGTHS_K, xp=cupy)
        causal = False  # (the mask holds each batch entry's own causal alignment)
    elif mask == "varlen":
        ids = cupy.searchsorted(cu[1:], cupy.arange(Sq), side="right").astype(cupy.int32)[None]
        m = reference.visible(B, Sq, Sk, segment_ids_q=ids, segment_ids_k=ids, xp=cupy)
        at = reference.positions(1, Sq, Sk, cu_seqlens_q=cu, cu_seqlens_k=cu, xp=cupy)
    return reference.attention(f64(q), f64(k), f64(v), causal=causal, dout=f64(do), mask=m, score_positions=at,
                               **ref_kw)


@pytest.mark.parametrize("name,case,no_sm90", SCORE_RUNS,
                         ids=[f"{n}-{c}{'-mma' if m else ''}" for n, c, m in SCORE_RUNS])
def test_score_mod_matches_float64_reference(torch, poison, monkeypatch, name, case, no_sm90):  # noqa: F811
    """Forward and every backward impl (split, fused, fused ordered) with fresh inputs and poisoned (NaN) outputs."""
    import cupy
    if no_sm90:
        monkeypatch.setenv("FLASHRT_NO_SM90", "1")
    B, Sq, Sk, H, Hkv, D, causal, mask = SCORE_CASES[case]
    seed = zlib.crc32(f"{name}-{case}".encode())
    q, k, v, do = (cupy.from_dlpack(x) for x in _inputs(torch, B, Sq, Sk, H, Hkv, D, "bf16", seed)[:4])
    kw, cu = _mask(torch, mask, Sq)
    kw = {n: cupy.from_dlpack(x) if hasattr(x, "__dlpack__") else x for n, x in kw.items()}
    cu = None if cu is None else cupy.from_dlpack(cu)
    mod, ref_kw = _score_mods(cupy, name, H, max(Sq, Sk), seed)
    packed = (lambda x: x[0]) if cu is not None else (lambda x: x)  # noqa: E731
    out, lse = flashrt.forward(*(packed(x) for x in (q, k, v)), causal=causal, **mod, **kw)
    grads = {(impl, det): flashrt.backward(packed(do), *(packed(x) for x in (q, k, v)), out, lse, causal=causal,
                                           impl=impl, deterministic=det, **mod, **kw)
             for impl, det in (("split", True), ("fused", False), ("fused", True))}
    if cu is not None:  # packed (total, H, D) and lse (H, total): as one batch entry
        out, lse = out[None], lse[None]
        grads = {i: tuple(x[None] for x in g) for i, g in grads.items()}
    ro, rlse, rdq, rdk, rdv = _score_reference(cupy, q, k, v, do, causal, mask, cu, ref_kw)
    for what, x in (("out", out), ("lse", lse), *((f"{i} {n}", x) for i, g in grads.items()
                                                  for n, x in zip(("dq", "dk", "dv"), g))):
        assert not bool(cupy.isnan(f64(x)).any()), f"{what} has NaN: unwritten (poisoned) elements, or a NaN f'"
    empty = ~cupy.isfinite(rlse)
    assert bool((f64(lse)[empty] == -cupy.inf).all()), "rows that see no key: lse -inf"
    assert float(cupy.abs(cupy.where(empty, 0, f64(lse) - rlse)).max()) < 2e-2, "lse"
    assert reference.rel_error(f64(out), ro) < 2e-2, "out"
    for impl, g in grads.items():
        for n, x, r in zip(("dq", "dk", "dv"), g, (rdq, rdk, rdv)):
            e = reference.rel_error(f64(x), r)
            assert e < 2e-2, f"{impl} {n}: rel err {e:.2e}"


def test_score_mod_matches_the_built_ins(torch):
    """An expression equal to the built-in softcap or ALiBi gives their results, loosely: the same tanh.approx, but
    the built-in softcap recovers its derivative from P, the expression's comes from dual numbers; ALiBi's distance
    is a conversion per score in the expression."""
    import cupy
    B, Sq, Sk, H, Hkv, D = 2, 200, 260, 8, 2, 128
    q, k, v, do, _ = _inputs(torch, B, Sq, Sk, H, Hkv, D, "bf16", 21)
    slopes = _slopes(torch, 0, H, 21)
    for mod, builtin in (
            (dict(score_mod=f"{SOFTCAP}f * tanhf(s / {SOFTCAP}f)"), dict(softcap=SOFTCAP)),
            (dict(score_mod="s - slopes[h] * fabsf((float)(k - q - (Lk - Lq)))", score_tensors={"slopes": slopes}),
             dict(alibi_slopes=slopes))):
        got, want = [], []
        for kw, into in ((mod, got), (builtin, want)):
            out, lse = flashrt.forward(q, k, v, causal=True, **kw)
            into += [out, lse, *flashrt.backward(do, q, k, v, out, lse, causal=True, **kw)]
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            e = reference.rel_error(_f64(a), _f64(b))
            assert e < 1e-2, f"{list(builtin)[0]} {name}: rel err {e:.2e} between the expression and the built-in"
        assert bool(cupy.isfinite(_f64(got[1])).all())


def test_score_mod_is_bitwise_repeatable_and_plans_follow_its_tensors(torch):
    """deterministic=True: bitwise the same results call after call (split and fused). A reused plan reads the
    call's own score tensors (their pointers, like the inputs'), and another expression is another kernel."""
    B, S, H, Hkv, D = 2, 300, 8, 2, 128
    q, k, v, do, _ = _inputs(torch, B, S, S, H, Hkv, D, "bf16", 23)
    g = torch.Generator(device="cuda").manual_seed(23)
    tables = [torch.randn(H, 2 * S - 1, device="cuda", generator=g) for _ in range(2)]

    def run(table, expr=f"s + bias[h * {2 * S - 1} + k - q + {S - 1}]", impl="split"):
        kw = dict(causal=True, score_mod=expr, score_tensors={"bias": table})
        out, lse = flashrt.forward(q, k, v, **kw)
        return (out, lse, *flashrt.backward(do, q, k, v, out, lse, impl=impl, deterministic=True, **kw))

    for impl in ("split", "fused"):
        first = run(tables[0], impl=impl)
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(first, run(tables[0], impl=impl))), impl
    other = run(tables[1])
    assert not torch.equal(other[0], first[0])
    assert all(torch.equal(a, b) for a, b in zip(run(tables[0].clone()), run(tables[0])))  # a copy: the same values
    ref = reference.attention(*(_f64(x) for x in (q, k, v)), causal=True, dout=_f64(do),
                              score_mod=lambda s, b, h, i, j, Lq, Lk: s + _f64(tables[1])[h, j - i + S - 1])
    for x, r in zip((other[0], *other[2:]), (ref[0], *ref[2:])):
        assert reference.rel_error(_f64(x), r) < 2e-2
    halved = run(tables[0], expr=f"s + 0.5f * bias[h * {2 * S - 1} + k - q + {S - 1}]")
    assert not torch.equal(halved[0], run(tables[0])[0])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_attention_with_score_mod_matches_reference(torch, compiled):
    """flashrt.attention with a float32 table and an int32 tensor, eager and under torch.compile(fullgraph=True),
    sinks beside it (their gradient too)."""
    B, S, H, Hkv, D = 2, 256, 8, 2, 64
    q, k, v, do, sinks = _inputs(torch, B, S, S, H, Hkv, D, "bf16", 25)
    g = torch.Generator(device="cuda").manual_seed(25)
    bias = torch.randn(H, 2 * S - 1, device="cuda", generator=g)
    on = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    learned = sinks.clone().requires_grad_()

    def fn(q, k, v):
        return flashrt.attention(q, k, v, causal=True, sinks=learned, score_mod=f"s + bias[h * {2 * S - 1} + k - q + "
                                 f"{S - 1}] * on[b]", score_tensors={"bias": bias, "on": on})
    if compiled:
        fn = torch.compile(fn, fullgraph=True)
    out = fn(*leaves)
    out.backward(do)
    ref = reference.attention(*(_f64(x) for x in (q, k, v)), causal=True, dout=_f64(do), sinks=_f64(sinks),
                              score_mod=lambda s, b, h, i, j, Lq, Lk: s + _f64(bias)[h, j - i + S - 1] * _f64(on)[b])
    for name, x, r in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), (ref[0], *ref[2:5])):
        assert reference.rel_error(_f64(x), r) < 2e-2, name
    import cupy
    scale = _dsinks_scale(sinks, ref[1], do, ref[0])
    assert float((cupy.abs(_f64(learned.grad) - ref[5]) / scale).max()) < 1e-2


def test_cuda_graph_replays_score_mod_with_its_tensors_new_contents(torch):
    """Forward and backward with a score_mod captured into a CUDA graph: each replay reads the table's current
    contents (a pointer, not a copy), bitwise as an eager call."""
    B, S, H, Hkv, D = 2, 256, 8, 2, 128
    q, k, v, do, _ = _inputs(torch, B, S, S, H, Hkv, D, "bf16", 27)
    bias = torch.zeros(H, 2 * S - 1, device="cuda")
    ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))

    def step():
        out = flashrt.attention(ql, kl, vl, causal=True, score_mod=f"s + bias[h * {2 * S - 1} + k - q + {S - 1}]",
                                score_tensors={"bias": bias})
        return (out, *torch.autograd.grad(out, (ql, kl, vl), do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles and loads the kernels
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    for seed in (1, 2):
        bias.copy_(torch.randn(bias.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        expected = step()
        torch.cuda.synchronize()
        for name, a, b in zip(("out", "dq", "dk", "dv"), static, expected):
            assert torch.equal(a, b), f"{name} of the replayed graph differs from eager"


def test_score_mod_errors_are_clear(torch):
    q, k, v, do, _ = _inputs(torch, 1, 64, 64, 4, 2, 64, "bf16", 29)
    with pytest.raises(ValueError, match=r'(?s)score_mod does not compile as a CUDA float expression.*'
                                         r'score_mod\(1\): error: identifier "kk" is undefined\n\s+s \+ kk\n\s+\^'):
        flashrt.forward(q, k, v, score_mod="s + kk")
    # the forward compiles no derivative: a cast of s runs there, and the backward asks for score_mod_grad
    out, lse = flashrt.forward(q, k, v, causal=True, score_mod="(float)s * 2.f")
    for impl in ("split", "fused"):
        with pytest.raises(ValueError, match=r'(?s)score_mod\'s automatic derivative does not compile.*Pass '
                                             r'score_mod_grad="\.\.\."'):
            flashrt.backward(do, q, k, v, out, lse, causal=True, impl=impl, score_mod="(float)s * 2.f")
    given = flashrt.backward(do, q, k, v, out, lse, causal=True, score_mod="(float)s * 2.f", score_mod_grad="2.f")
    ref = reference.attention(*(_f64(x) for x in (q, k, v)), causal=True, dout=_f64(do),
                              score_mod=lambda s, *_: 2 * s)
    for x, r in zip((out, *given), (ref[0], *ref[2:])):
        assert reference.rel_error(_f64(x), r) < 2e-2
    bias = torch.randn(127, device="cuda")
    with pytest.raises(ValueError, match=r"score_tensors\['bias'\] requires grad: only float32 score tensors take "
                                         r"one, got torch\.float64"):
        flashrt.attention(q, k, v, score_mod="s + bias[k - q + 63]",
                          score_tensors={"bias": bias.double().requires_grad_()})
    for bad, error, pattern in ((bias.detach().double(), TypeError, "must be float32 .* or int32 .*, got float64"),
                                (bias.detach().cpu(), ValueError, "must be a torch array on cuda:0 like q"),
                                (bias.detach()[::2], ValueError, r"must be contiguous")):
        with pytest.raises(error, match=pattern):
            flashrt.forward(q, k, v, score_mod="s + bias[k - q + 63]", score_tensors={"bias": bad})
    for kw in (dict(softcap=SOFTCAP), dict(alibi_slopes=_slopes(torch, 0, 4, 29))):
        with pytest.raises(ValueError, match="score_mod with softcap or alibi_slopes is not supported"):
            flashrt.forward(q, k, v, score_mod="s", **kw)
    with pytest.raises(TypeError, match="unexpected keyword argument 'score_mod'"):
        flashrt.decode(q[:, :1], k, v, cache_seqlens=torch.full((1,), 64, dtype=torch.int32, device="cuda"),
                       score_mod="s")


def _learned_reference(torch, q, k, v, do, causal, fn, tables, lq, lk):
    """float64 torch autograd: out and the gradients of `tables` (name -> tensor) through fn(s, tables, b, h, i, j)
    over the scaled scores, positions clamped into each sequence (lq, lk: (B,) lengths), causal bottom-right."""
    t = {n: x.double().detach().requires_grad_() for n, x in tables.items()}
    q, k, v = (x.double() for x in (q, k, v))
    B, Sq, H, D = q.shape
    Sk, group = k.shape[1], H // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(group, 2)) / D ** 0.5
    b, h = torch.arange(B, device="cuda").view(B, 1, 1, 1), torch.arange(H, device="cuda").view(1, H, 1, 1)
    i, j = torch.arange(Sq, device="cuda").view(1, 1, Sq, 1), torch.arange(Sk, device="cuda").view(1, 1, 1, Sk)
    Lq, Lk = lq.view(B, 1, 1, 1).long(), lk.view(B, 1, 1, 1).long()
    s = fn(s, t, b, h, torch.minimum(i, Lq - 1), torch.minimum(j, Lk - 1))
    keep = (i < Lq) & (j < Lk) & ((j <= i + Lk - Lq) if causal else True)
    p = torch.softmax(s.masked_fill(~keep, -torch.inf), -1).nan_to_num(0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", p, v.repeat_interleave(group, 2))
    return out, dict(zip(t, torch.autograd.grad(out, list(t.values()), do.double())))


@pytest.mark.parametrize("D,causal,impl,expr,lengths,det", [
    (64, True, "fused", "rel", False, False), (128, False, "split", "rel", True, True),
    (128, True, "auto", "two", False, False), (96, True, "split", "two", True, True),
    (256, False, "auto", "rel", False, True), (64, False, "auto", "two", False, True),
    (128, True, "split", "twice", True, True), (64, False, "fused", "twice", False, False)])
def test_score_tensor_gradients_match_float64_autograd(torch, D, causal, impl, expr, lengths, det):
    """score_grads (flashrt.backward) and flashrt.attention's gradient of float32 score tensors (a relative-position
    bias table, a per-head weight beside an int32 tensor), GQA, padding lengths, every impl, fp32 atomics
    (deterministic=False) or exact sums (True, bitwise repeatable): against float64 torch autograd; dq / dk / dv as
    without score_grads."""
    B, S, H, Hkv = 2, 300, 4, 2
    q, k, v, do, _ = _inputs(torch, B, S, S, H, Hkv, D, "bf16", 70 + D)
    g = torch.Generator(device="cuda").manual_seed(D)
    tables = {"bias": torch.randn(H, 2 * S - 1, device="cuda", generator=g)}
    text = f"s + bias[h * {2 * S - 1} + k - q + {S - 1}]"
    if expr == "two":
        tables["w"] = 0.5 + torch.rand(H, device="cuda", generator=g)
        text = f"s * w[h] + 0.5f * bias[h * {2 * S - 1} + k - q + {S - 1}] + 0.1f * (float)ids[k]"
    elif expr == "twice":  # the table read twice on one branch, once on the other
        text = (f"s + (k >= q ? bias[h * {2 * S - 1} + k - q + {S - 1}] : "
                f"0.5f * bias[h * {2 * S - 1} + k - q + {S - 1}] * bias[h * {2 * S - 1}])")
    ids = torch.randint(0, 4, (S,), device="cuda", dtype=torch.int32, generator=g)

    def fn(s, t, b, h, i, j):
        rel = t["bias"][h, j - i + S - 1]
        if expr == "twice":
            return s + torch.where(j >= i, rel, 0.5 * rel * t["bias"][h, 0])
        return s + rel if expr == "rel" else s * t["w"][h] + 0.5 * rel + 0.1 * ids.double()[j]

    lq = torch.tensor([S - 31, S], device="cuda", dtype=torch.int32) if lengths else torch.full((B,), S).cuda()
    lk = torch.tensor([S, S - 17], device="cuda", dtype=torch.int32) if lengths else torch.full((B,), S).cuda()
    kw = dict(causal=causal, score_mod=text, score_tensors={**tables, "ids": ids},
              **(dict(seqlens_q=lq, seqlens_k=lk) if lengths else {}))
    out, lse = flashrt.forward(q, k, v, **kw)
    grads = {n: torch.zeros_like(x) for n, x in tables.items()}
    got = flashrt.backward(do, q, k, v, out, lse, impl=impl, deterministic=det, score_grads=grads, **kw)
    plain = flashrt.backward(do, q, k, v, out, lse, impl=impl, deterministic=det, **kw)
    if det:  # exact sums: the same bits again (added into fresh zeros)
        again = {n: torch.zeros_like(x) for n, x in tables.items()}
        flashrt.backward(do, q, k, v, out, lse, impl=impl, deterministic=True, score_grads=again, **kw)
        assert all(torch.equal(grads[n], again[n]) for n in tables)
    ref_out, ref = _learned_reference(torch, q, k, v, do, causal, fn, tables, lq, lk)
    assert reference.rel_error(_f64(out), _f64(ref_out)) < 2e-2
    for name in tables:
        e = reference.rel_error(_f64(grads[name]), _f64(ref[name]))
        assert e < 2e-2, f"d{name}: rel err {e:.2e}"
    for a, b in zip(got, plain):  # (dq, dk, dv: the tensor-gradient pass writes none of them)
        assert torch.equal(a, b) if det else reference.rel_error(_f64(a), _f64(b)) < 1e-2
    # flashrt.attention: autograd routes them (eager)
    learned = {n: x.clone().requires_grad_() for n, x in tables.items()}
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    kw_t = dict(kw, score_tensors={**learned, "ids": ids})
    o = flashrt.attention(*leaves, impl=impl, deterministic=det, **kw_t)
    auto = torch.autograd.grad(o, [*leaves, *learned.values()], do)
    for name, a in zip(learned, auto[3:]):
        assert reference.rel_error(_f64(a), _f64(ref[name])) < 2e-2, name
        if det:
            assert torch.equal(a, grads[name]), name
    with pytest.raises(ValueError, match=r"score_grads with a mask_mod are not computed yet"):
        flashrt.backward(do, q, k, v, out, lse, impl=impl, score_grads=grads, mask_mod="k <= q || k > 0", **kw)
