"""The float64 oracle itself: checked against a per-row loop and against finite differences."""
import numpy as np
import pytest

from flashrt import reference, spec


def _rand(rng, *shape):
    return rng.standard_normal(shape)


def _loop_attention(q, k, v, causal, scale):
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    lse = np.full((B, H, Sq), -np.inf)
    for b in range(B):
        for h in range(H):
            for i in range(Sq):
                keys = [j for j in range(Sk) if not causal or j <= i + Sk - Sq]
                if not keys:
                    continue
                s = np.array([q[b, i, h] @ k[b, j, h // (H // Hkv)] * scale for j in keys])
                lse[b, h, i] = np.log(np.exp(s - s.max()).sum()) + s.max()
                p = np.exp(s - lse[b, h, i])
                out[b, i, h] = sum(pj * v[b, j, h // (H // Hkv)] for pj, j in zip(p, keys))
    return out, lse


@pytest.mark.parametrize("Sq,Sk,causal", [(5, 7, False), (7, 5, True), (5, 7, True), (4, 4, True)])
def test_forward_matches_loop(Sq, Sk, causal):
    rng = np.random.default_rng(0)
    q, k, v = _rand(rng, 2, Sq, 4, 8), _rand(rng, 2, Sk, 2, 8), _rand(rng, 2, Sk, 2, 8)
    out, lse = reference.attention(q, k, v, causal=causal, softmax_scale=0.3)
    want_out, want_lse = _loop_attention(q, k, v, causal, 0.3)
    np.testing.assert_allclose(out, want_out, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
    np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], atol=1e-12)


@pytest.mark.parametrize("causal,mask", [(False, None), (True, None), (False, "window+padding")])
def test_gradients_match_finite_differences(causal, mask):
    rng = np.random.default_rng(1)
    q, k, v, do = _rand(rng, 1, 4, 4, 8), _rand(rng, 1, 6, 2, 8), _rand(rng, 1, 6, 2, 8), _rand(rng, 1, 4, 4, 8)
    if mask:
        mask = reference.visible(1, 4, 6, window=(1, 1), seqlens_k=[5])
    _, _, dq, dk, dv = reference.attention(q, k, v, causal=causal, dout=do, mask=mask)

    def loss(q_, k_, v_):
        return float((reference.attention(q_, k_, v_, causal=causal, mask=mask)[0] * do).sum())

    for grad, i in ((dq, 0), (dk, 1), (dv, 2)):
        for idx in [(0, 1, 1, 3), (0, 3, 0, 7), (0, 0, 1, 0)]:
            assert abs(_central_difference(loss, (q, k, v), i, idx) - grad[idx]) < 1e-6


def test_rel_error():
    ref = np.ones(4)
    assert reference.rel_error(ref, ref) == 0
    assert reference.rel_error(ref * 1.5, ref) == pytest.approx(0.5)
    assert reference.rel_error(np.array([np.nan, 1, 1, 1]), ref) == np.inf


def _loop_visible(b, i, j, Sq, Sk, causal, align, window, lq, lk, bq, bk, sq, sk):
    if i >= lq[b] or j >= lk[b]:
        return False
    shift = lk[b] - lq[b] if align == "bottom_right" else 0
    if causal and j > i + shift:
        return False
    if window[0] >= 0 and j < i + shift - window[0]:
        return False
    if window[1] >= 0 and j > i + shift + window[1]:
        return False
    if bq is not None and bk[b][j] > bq[b][i]:
        return False
    return sq is None or sq[b][i] == sk[b][j]


@pytest.mark.parametrize("kind", ["causal-br", "causal-tl", "window", "causal+window", "padding", "blocks",
                                  "segments", "everything"])
def test_visible_matches_its_definition(kind):
    rng = np.random.default_rng(2)
    B, Sq, Sk = 2, 9, 12
    opts = dict(causal=False, align="bottom_right", window=(-1, -1), seqlens_q=None, seqlens_k=None,
                block_ids_q=None, block_ids_k=None, segment_ids_q=None, segment_ids_k=None)
    blocks_k = np.sort(rng.integers(0, 4, (B, Sk)), axis=1)
    blocks_q = np.sort(rng.integers(0, 4, (B, Sq)), axis=1)
    segs_q, segs_k = np.sort(rng.integers(0, 3, (B, Sq)), axis=1), np.sort(rng.integers(0, 3, (B, Sk)), axis=1)
    extra = {
        "causal-br": dict(causal=True),
        "causal-tl": dict(causal=True, align="top_left"),
        "window": dict(window=(3, 1)),
        "causal+window": dict(causal=True, window=(2, -1)),
        "padding": dict(seqlens_q=[9, 4], seqlens_k=[7, 12], causal=True),
        "blocks": dict(block_ids_q=blocks_q, block_ids_k=blocks_k),
        "segments": dict(segment_ids_q=segs_q, segment_ids_k=segs_k),
        "everything": dict(causal=True, window=(5, -1), seqlens_q=[8, 9], seqlens_k=[12, 10],
                           block_ids_q=blocks_q, block_ids_k=blocks_k, segment_ids_q=segs_q, segment_ids_k=segs_k),
    }[kind]
    opts.update(extra)
    got = reference.visible(B, Sq, Sk, **opts)
    lq = opts["seqlens_q"] or [Sq] * B
    lk = opts["seqlens_k"] or [Sk] * B
    for b in range(B):
        for i in range(Sq):
            for j in range(Sk):
                want = _loop_visible(b, i, j, Sq, Sk, opts["causal"], opts["align"], opts["window"], lq, lk,
                                     opts["block_ids_q"], opts["block_ids_k"], opts["segment_ids_q"],
                                     opts["segment_ids_k"])
                assert got[b, 0, i, j] == want, (b, i, j)


def test_masked_attention_and_padding_rows():
    rng = np.random.default_rng(3)
    B, Sq, Sk = 2, 6, 8
    q, k, v, do = _rand(rng, B, Sq, 4, 8), _rand(rng, B, Sk, 2, 8), _rand(rng, B, Sk, 2, 8), _rand(rng, B, Sq, 4, 8)
    mask = reference.visible(B, Sq, Sk, seqlens_q=[6, 3], seqlens_k=[8, 5], window=(2, 2))
    out, lse, dq, dk, dv = reference.attention(q, k, v, dout=do, mask=mask)
    # Padded query rows: no key, so out 0, lse -inf, dq 0; padded keys get no gradient.
    assert (out[1, 3:] == 0).all() and np.isinf(lse[1, :, 3:]).all() and (dq[1, 3:] == 0).all()
    assert (dk[1, 5:] == 0).all() and (dv[1, 5:] == 0).all()
    # Each valid row equals attention over exactly its visible keys.
    for b in range(B):
        for i in range(Sq):
            for h in range(4):
                keys = np.flatnonzero(mask[b, 0, i])
                if keys.size == 0:
                    continue
                s = np.array([q[b, i, h] @ k[b, j, h // 2] for j in keys]) / np.sqrt(8)
                p = np.exp(s - s.max())
                p /= p.sum()
                np.testing.assert_allclose(out[b, i, h], p @ v[b, keys, h // 2], atol=1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_sinks_join_the_denominator_and_their_gradient_matches_finite_differences(causal):
    rng = np.random.default_rng(3)
    q, k, v, do = _rand(rng, 2, 5, 4, 8), _rand(rng, 2, 3, 2, 8), _rand(rng, 2, 3, 2, 8), _rand(rng, 2, 5, 4, 8)
    sinks = np.array([0.5, -1.0, 3.0, -30.0])
    out, lse, dq, dk, dv, dsinks = reference.attention(q, k, v, causal=causal, dout=do, sinks=sinks)
    # the sink as one more key whose value is 0: a key of its own logit, appended to every row
    plain_out, plain_lse = reference.attention(q, k, v, causal=causal)
    want_lse = np.logaddexp(plain_lse, sinks[None, :, None])
    assert np.allclose(lse, want_lse)
    assert np.allclose(out, plain_out * np.exp(plain_lse - want_lse).transpose(0, 2, 1)[..., None])
    if causal:  # Sq > Sk: the first two rows see no key, only their sink
        assert (out[:, :2] == 0).all() and np.allclose(lse[:, :, :2], sinks[None, :, None])

    def loss(q_, k_, v_, s_):
        return float((reference.attention(q_, k_, v_, causal=causal, sinks=s_)[0] * do).sum())

    for h in range(4):
        assert abs(_central_difference(loss, (q, k, v, sinks), 3, (h,)) - dsinks[h]) < 1e-6
    for grad, i in ((dq, 0), (dk, 1), (dv, 2)):
        idx = (1, 2, 1, 3)
        assert abs(_central_difference(loss, (q, k, v, sinks), i, idx) - grad[idx]) < 1e-6


def test_softcap_caps_the_scaled_scores_and_its_gradients_match_finite_differences():
    rng = np.random.default_rng(4)
    q, k, v, do = (_rand(rng, 1, 4, 2, 8) * 3 for _ in range(4))  # large scores: the cap bends them
    out, lse, dq, dk, dv = reference.attention(q, k, v, causal=True, dout=do, softcap=2.0)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
    s = np.where(np.tril(np.ones((4, 4), dtype=bool)), 2.0 * np.tanh(s / 2.0), -np.inf)
    assert np.allclose(lse, np.log(np.exp(s).sum(-1)))
    assert not np.allclose(lse, reference.attention(q, k, v, causal=True)[1])

    def loss(q_, k_, v_):
        return float((reference.attention(q_, k_, v_, causal=True, softcap=2.0)[0] * do).sum())

    for grad, i in ((dq, 0), (dk, 1), (dv, 2)):
        for idx in [(0, 1, 1, 3), (0, 3, 0, 7)]:
            assert abs(_central_difference(loss, (q, k, v), i, idx) - grad[idx]) < 1e-6


def _alibi_loop(q, k, v, slopes, causal, scale, shift):
    """(out, lse) of one batch entry (S, H, D) with ALiBi, row by row: softmax over the visible keys of
    scale * q.k - slope[h] * |j - i - shift|, causal aligned by the same shift."""
    Sq, H, _ = q.shape
    Sk, Hkv = k.shape[0], k.shape[1]
    out, lse = np.zeros_like(q), np.full((H, Sq), -np.inf)
    for h in range(H):
        for i in range(Sq):
            keys = [j for j in range(Sk) if not causal or j <= i + shift]
            if not keys:
                continue
            s = np.array([q[i, h] @ k[j, h // (H // Hkv)] * scale - slopes[h] * abs(j - i - shift) for j in keys])
            lse[h, i] = np.log(np.exp(s - s.max()).sum()) + s.max()
            out[i, h] = sum(np.exp(sj - lse[h, i]) * v[j, h // (H // Hkv)] for sj, j in zip(s, keys))
    return out, lse


@pytest.mark.parametrize("Sq,Sk,causal", [(5, 7, False), (7, 5, True), (6, 6, True), (7, 4, False)])
def test_alibi_matches_a_loop_and_its_gradients_finite_differences(Sq, Sk, causal):
    rng = np.random.default_rng(5)
    q, k, v, do = _rand(rng, 2, Sq, 4, 8), _rand(rng, 2, Sk, 2, 8), _rand(rng, 2, Sk, 2, 8), _rand(rng, 2, Sq, 4, 8)
    slopes = 2.0 ** (-8 * np.arange(1, 5) / 4) * rng.uniform(0.5, 2.0, (2, 4))  # (B, H)
    out, lse, dq, dk, dv = reference.attention(q, k, v, causal=causal, softmax_scale=0.3, dout=do, alibi_slopes=slopes)
    for b in range(2):
        want_out, want_lse = _alibi_loop(q[b], k[b], v[b], slopes[b], causal, 0.3, Sk - Sq)
        np.testing.assert_allclose(out[b], want_out, atol=1e-12)
        np.testing.assert_array_equal(np.isinf(lse[b]), np.isinf(want_lse))
        np.testing.assert_allclose(lse[b][np.isfinite(lse[b])], want_lse[np.isfinite(want_lse)], atol=1e-12)
    assert not np.allclose(out, reference.attention(q, k, v, causal=causal, softmax_scale=0.3)[0])

    def loss(q_, k_, v_):
        return float((reference.attention(q_, k_, v_, causal=causal, softmax_scale=0.3,
                                          alibi_slopes=slopes)[0] * do).sum())

    for x, grad, i in ((q, dq, 0), (k, dk, 1), (v, dv, 2)):
        idx = (1, x.shape[1] - 1, 1, 3)
        assert abs(_central_difference(loss, (q, k, v), i, idx) - grad[idx]) < 1e-6


def _central_difference(loss, inputs, i, idx, eps=1e-6):
    """d loss / d inputs[i][idx] by a central difference (copies of the inputs)."""
    args = [x.copy() for x in inputs]
    args[i][idx] += eps
    up = loss(*args)
    args[i][idx] -= 2 * eps
    return (up - loss(*args)) / (2 * eps)


def test_alibi_slopes_zero_change_nothing_and_per_head_slopes_broadcast():
    rng = np.random.default_rng(6)
    q, k, v, do = _rand(rng, 3, 6, 4, 8), _rand(rng, 3, 9, 2, 8), _rand(rng, 3, 9, 2, 8), _rand(rng, 3, 6, 4, 8)
    plain = reference.attention(q, k, v, causal=True, dout=do)
    for got, want in zip(reference.attention(q, k, v, causal=True, dout=do, alibi_slopes=np.zeros(4)), plain):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-14)  # (equal but for the matmuls' summation order)
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    per_head = reference.attention(q, k, v, causal=True, dout=do, alibi_slopes=slopes)
    per_entry = reference.attention(q, k, v, causal=True, dout=do, alibi_slopes=np.tile(slopes, (3, 1)))
    for a, b in zip(per_head, per_entry):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-14)
    # the bias form gives the same, and top_left alignment is a shift of 0
    bias = reference.alibi_bias(3, 6, 9, slopes)
    assert bias.shape == (3, 4, 6, 9) and bias[0, 1, 2, 5] == -0.25 * abs(5 - 2 - 3)
    np.testing.assert_allclose(reference.attention(q, k, v, causal=True, bias=bias)[1], per_head[1], rtol=0, atol=1e-14)
    assert reference.alibi_bias(1, 6, 9, slopes, align="top_left")[0, 1, 2, 5] == -0.25 * abs(5 - 2)


def test_alibi_with_lengths_and_packed_sequences_is_each_sequence_on_its_own():
    """alibi_bias with seqlens and with cu_seqlens: each sequence gets the bias of its own lengths (bottom-right:
    shift Lk - Lq) and its own slopes, as that sequence alone with alibi_slopes would."""
    rng = np.random.default_rng(7)
    lens_q, lens_k = [3, 6, 0, 5], [7, 4, 2, 5]
    slopes = rng.uniform(0.1, 1.0, (4, 2))  # (sequences, H)
    seqs = [(_rand(rng, 1, lq, 2, 8), _rand(rng, 1, lk, 1, 8), _rand(rng, 1, lk, 1, 8))
            for lq, lk in zip(lens_q, lens_k)]
    alone = [reference.attention(q, k, v, causal=True, alibi_slopes=s[None]) if q.shape[1] else None
             for (q, k, v), s in zip(seqs, slopes)]
    # padding: (B, max S) with seqlens
    Sq, Sk = max(lens_q), max(lens_k)
    pad = lambda x, S: np.concatenate([x, np.zeros((1, S - x.shape[1], *x.shape[2:]))], axis=1)  # noqa: E731
    q, k, v = (np.concatenate([pad(s[n], S) for s in seqs]) for n, S in ((0, Sq), (1, Sk), (2, Sk)))
    mask = reference.visible(4, Sq, Sk, causal=True, seqlens_q=lens_q, seqlens_k=lens_k)
    bias = reference.alibi_bias(4, Sq, Sk, slopes, seqlens_q=lens_q, seqlens_k=lens_k)
    out, lse = reference.attention(q, k, v, mask=mask, bias=bias)
    for b, got in enumerate(alone):
        if got is not None:
            np.testing.assert_allclose(out[b, :lens_q[b]], got[0][0], atol=1e-12)
            np.testing.assert_allclose(lse[b, :, :lens_q[b]], got[1][0], atol=1e-12)
    # packed varlen: one batch entry, sequences told apart by segment ids
    cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    q, k, v = (np.concatenate([s[n] for s in seqs], axis=1) for n in range(3))
    ids_q, ids_k = (np.repeat(np.arange(4), lens)[None] for lens in (lens_q, lens_k))
    doc = reference.visible(1, cu_q[-1], cu_k[-1], segment_ids_q=ids_q, segment_ids_k=ids_k)
    keep = doc.copy()  # and causal within each sequence, bottom-right aligned by its own lengths
    for s, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
        keep[0, 0, cu_q[s]:cu_q[s + 1], cu_k[s]:cu_k[s + 1]] &= j <= i + lk - lq
    bias = reference.alibi_bias(1, cu_q[-1], cu_k[-1], slopes, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = reference.attention(q, k, v, mask=keep, bias=bias)
    for s, got in enumerate(alone):
        if got is not None:
            np.testing.assert_allclose(out[0, cu_q[s]:cu_q[s + 1]], got[0][0], atol=1e-12)
            np.testing.assert_allclose(lse[0, :, cu_q[s]:cu_q[s + 1]], got[1][0], atol=1e-12)


def _leaky(s, b, h, i, j, Lq, Lk):
    """A score_mod whose derivative matters: slope 1 above 0, 0.5 below, plus a per-head, per-distance term."""
    return np.where(s > 0, s, 0.5 * s) + 0.25 * h - 0.1 * np.abs(j - i)


def test_score_mod_replaces_the_scaled_scores_before_the_mask():
    rng = np.random.default_rng(8)
    q, k, v = _rand(rng, 2, 5, 4, 8), _rand(rng, 2, 7, 2, 8), _rand(rng, 2, 7, 2, 8)
    out, lse = reference.attention(q, k, v, causal=True, softmax_scale=0.3, score_mod=_leaky)
    for b in range(2):
        for h in range(4):
            for i in range(5):
                keys = np.arange(i + 7 - 5 + 1)  # bottom-right causal
                s = np.array([q[b, i, h] @ k[b, j, h // 2] * 0.3 for j in keys])
                s = np.where(s > 0, s, 0.5 * s) + 0.25 * h - 0.1 * np.abs(keys - i)
                assert lse[b, h, i] == pytest.approx(np.log(np.exp(s).sum()), abs=1e-12)
                np.testing.assert_allclose(out[b, i, h], np.exp(s - lse[b, h, i]) @ v[b, keys, h // 2], atol=1e-12)
    with pytest.raises(ValueError, match="score_mod with softcap or alibi_slopes"):
        reference.attention(q, k, v, score_mod=_leaky, softcap=2.0)


def test_score_mod_equal_to_softcap_gives_softcaps_results():
    rng = np.random.default_rng(9)
    q, k, v, do = (_rand(rng, 1, 6, 2, 8) * 3 for _ in range(4))
    cap = lambda s, *_: 2.0 * np.tanh(s / 2.0)  # noqa: E731
    cap_grad = lambda s, *_: 1.0 - np.tanh(s / 2.0) ** 2  # noqa: E731
    want = reference.attention(q, k, v, causal=True, dout=do, softcap=2.0)
    exact = reference.attention(q, k, v, causal=True, dout=do, score_mod=cap, score_mod_grad=cap_grad)
    central = reference.attention(q, k, v, causal=True, dout=do, score_mod=cap)
    for w, e, c in zip(want, exact, central):
        np.testing.assert_allclose(e, w, rtol=0, atol=1e-13)
        np.testing.assert_allclose(c, w, rtol=0, atol=1e-9)  # (the central difference's error, O(step^2))


@pytest.mark.parametrize("mod", ["leaky", "square"])
def test_score_mod_gradients_match_finite_differences(mod):
    """dS times the derivative: the reference's central difference (score_mod_grad None) and an analytic
    score_mod_grad agree, and both give the finite differences of the loss."""
    rng = np.random.default_rng(10)
    q, k, v, do = _rand(rng, 2, 4, 4, 8), _rand(rng, 2, 6, 2, 8), _rand(rng, 2, 6, 2, 8), _rand(rng, 2, 4, 4, 8)
    f, df = {"leaky": (_leaky, lambda s, *_: np.where(s > 0, 1.0, 0.5)),
             "square": (lambda s, *_: s * s / 8.0, lambda s, *_: s / 4.0)}[mod]
    mask = reference.visible(2, 4, 6, window=(2, 1), seqlens_k=[6, 4])
    analytic = reference.attention(q, k, v, dout=do, mask=mask, score_mod=f, score_mod_grad=df)
    central = reference.attention(q, k, v, dout=do, mask=mask, score_mod=f)
    for a, c in zip(analytic[2:], central[2:]):
        np.testing.assert_allclose(c, a, rtol=0, atol=1e-8)
    plain = reference.attention(q, k, v, dout=do, mask=mask)
    assert not np.allclose(analytic[2], plain[2])

    def loss(q_, k_, v_):
        return float((reference.attention(q_, k_, v_, mask=mask, score_mod=f)[0] * do).sum())

    for grad, i in ((analytic[2], 0), (analytic[3], 1), (analytic[4], 2)):
        for idx in [(0, 1, 1, 3), (1, 3, 0, 7), (1, 0, 1, 0)]:
            assert abs(_central_difference(loss, (q, k, v), i, idx) - grad[idx]) < 1e-6


def test_score_mod_positions_with_lengths_and_packed_sequences_are_each_sequences_own():
    """With padding (seqlens) and packed varlen (cu_seqlens), score_mod sees each sequence's own index, positions and
    lengths (positions), as that sequence alone does; positions past a sequence's end are clamped into it, so a table
    of its length is never read outside."""
    rng = np.random.default_rng(11)
    lens_q, lens_k = [3, 6, 0, 5], [7, 4, 2, 5]
    tables = [rng.standard_normal(lk) for lk in lens_k]  # a bias per key, each sequence's own table

    def f(s, b, h, i, j, Lq, Lk):
        bias = np.stack([np.pad(t, (0, 8 - len(t))) for t in tables])[b, j]  # (raises past a table's 8 entries)
        assert (j < Lk).all() and (i < np.maximum(Lq, 1)).all()
        return s + bias + 0.1 * (Lk - Lq) - 0.05 * i + 0.3 * b

    seqs = [(_rand(rng, 1, lq, 2, 8), _rand(rng, 1, lk, 1, 8), _rand(rng, 1, lk, 1, 8), _rand(rng, 1, lq, 2, 8))
            for lq, lk in zip(lens_q, lens_k)]
    alone = []
    for b, (q, k, v, do) in enumerate(seqs):
        g = lambda s, _b, h, i, j, Lq, Lk, b=b: f(s, _b + b, h, i, j, Lq, Lk)  # noqa: E731  (its index in the batch)
        alone.append(reference.attention(q, k, v, causal=True, dout=do, score_mod=g) if q.shape[1] else None)
    Sq, Sk = max(lens_q), max(lens_k)
    pad = lambda x, S: np.concatenate([x, np.zeros((1, S - x.shape[1], *x.shape[2:]))], axis=1)  # noqa: E731
    q, k, v, do = (np.concatenate([pad(s[n], S) for s in seqs]) for n, S in ((0, Sq), (1, Sk), (2, Sk), (3, Sq)))
    mask = reference.visible(4, Sq, Sk, causal=True, seqlens_q=lens_q, seqlens_k=lens_k)
    at = reference.positions(4, Sq, Sk, seqlens_q=lens_q, seqlens_k=lens_k)
    out, lse, dq, dk, dv = reference.attention(q, k, v, mask=mask, dout=do, score_mod=f, score_positions=at)
    for b, got in enumerate(alone):
        if got is not None:
            for x, want in ((out[b, :lens_q[b]], got[0][0]), (lse[b, :, :lens_q[b]], got[1][0]),
                            (dq[b, :lens_q[b]], got[2][0]), (dk[b, :lens_k[b]], got[3][0])):
                np.testing.assert_allclose(x, want, atol=1e-9)
    cu_q, cu_k = np.cumsum([0] + lens_q), np.cumsum([0] + lens_k)
    q, k, v, do = (np.concatenate([s[n] for s in seqs], axis=1) for n in range(4))
    ids_q, ids_k = (np.repeat(np.arange(4), lens)[None] for lens in (lens_q, lens_k))
    keep = reference.visible(1, cu_q[-1], cu_k[-1], segment_ids_q=ids_q, segment_ids_k=ids_k)
    for s, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
        keep[0, 0, cu_q[s]:cu_q[s + 1], cu_k[s]:cu_k[s + 1]] &= j <= i + lk - lq
    at = reference.positions(1, cu_q[-1], cu_k[-1], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse, dq, dk, dv = reference.attention(q, k, v, mask=keep, dout=do, score_mod=f, score_positions=at)
    for s, got in enumerate(alone):
        if got is not None:
            np.testing.assert_allclose(out[0, cu_q[s]:cu_q[s + 1]], got[0][0], atol=1e-9)
            np.testing.assert_allclose(lse[0, :, cu_q[s]:cu_q[s + 1]], got[1][0], atol=1e-9)
            np.testing.assert_allclose(dq[0, cu_q[s]:cu_q[s + 1]], got[2][0], atol=1e-9)
            np.testing.assert_allclose(dk[0, cu_k[s]:cu_k[s + 1]], got[3][0], atol=1e-9)


def test_philox_matches_its_published_known_answers():
    # Random123's known-answer vectors for Philox-4x32-10 (counter, key -> output); dropout takes the same rounds, 7
    for counter, key, want in (((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
                               ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
                               ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
                                (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))):
        got = reference.philox4x32([np.array(c) for c in counter], key)
        assert [int(w) for w in got] == list(want)


@pytest.mark.parametrize("p, bits", [(0.3, 8), (0.1, 8), (0.01, 16), (0.5, 8)])
def test_dropout_mask_keeps_the_rate_and_draws_each_element_once(p, bits):
    assert spec.dropout_resolution(p)[0] == bits
    drop = reference.dropout_mask((2**63 + 5, 77), p, 2, 3, 96, 160)  # (a seed over 2^63: int64's negative half)
    keep = spec.dropout_resolution(p)[1]
    assert set(np.unique(drop)) == {0.0, 2**bits / keep}
    assert abs((drop == 0).mean() - p) < max(0.01, 5 * np.sqrt(p * (1 - p) / drop.size))
    # each element is its own bits: neighbours in a draw (columns 1 and 8 apart, rows 1 and 8 apart), heads and
    # batch entries are independent
    for a, b in ((drop[..., 0::2], drop[..., 1::2]), (drop[..., 0:8], drop[..., 8:16]),
                 (drop[:, :, 0::2], drop[:, :, 1::2]), (drop[:, :, 0:8], drop[:, :, 8:16]), (drop[:, 0], drop[:, 1]),
                 (drop[0], drop[1])):
        differ = 2 * p * (1 - p)
        assert abs((a != b).mean() - differ) < max(0.07 * differ, 5 * np.sqrt(differ / a.size))
    # a function of the seed and offset
    assert (reference.dropout_mask((2**63 + 5, 78), p, 2, 3, 96, 160) != drop).mean() > p
    # packed varlen: a sequence's pairs are keyed by its index and its own positions
    cu = np.array([0, 40, 96])
    at = reference.positions(1, 96, 96, cu_seqlens_q=cu, cu_seqlens_k=cu)
    packed = reference.dropout_mask((9, 9), p, 1, 3, 96, 96, at=at)
    alone = reference.dropout_mask((9, 9), p, 2, 3, 56, 56)
    assert np.array_equal(packed[0, :, 40:, 40:], alone[1])


def test_dropout_resolution_takes_8_bits_where_they_give_p_closely():
    assert spec.dropout_resolution(0.1) == (8, 230)  # drops 26 / 256 = 0.1016
    assert spec.dropout_resolution(0.5) == (8, 128)
    assert spec.dropout_resolution(0.05) == (8, 243)
    assert spec.dropout_resolution(0.01) == (16, round(0.99 * 2**16))  # (8 bits: 3 / 256 = 0.0117)
    assert spec.dropout_resolution(1e-4) == (16, round((1 - 1e-4) * 2**16))
    assert spec.dropout_resolution(0.9995) == (16, round(0.0005 * 2**16))  # (8 bits would keep none)
    for p in np.linspace(0.078125, 0.998, 997):  # from 0.078 on, every p: at most half a step off, 1/512
        bits, keep = spec.dropout_resolution(p)
        assert bits == 8 and abs((256 - keep) / 256 - p) <= 0.025 * p


def test_dropout_in_attention_scales_the_kept_probabilities_and_its_gradients_match_finite_differences():
    rng = np.random.default_rng(6)
    q, k, v, do = (_rand(rng, 1, 6, 2, 8) for _ in range(4))
    drop = reference.dropout_mask((3, 4), 0.4, 1, 2, 6, 6)
    out, lse, dq, dk, dv = reference.attention(q, k, v, causal=True, dout=do, dropout=drop)
    plain = reference.attention(q, k, v, causal=True)
    assert np.array_equal(lse, plain[1])  # lse: the probabilities before dropout
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(8)
    p = np.exp(np.where(np.tril(np.ones((6, 6), dtype=bool)), s, -np.inf) - lse[..., None])
    assert np.allclose(out, np.einsum("bhqk,bkhd->bqhd", p * drop, v))

    def loss(q_, k_, v_):
        return float((reference.attention(q_, k_, v_, causal=True, dropout=drop)[0] * do).sum())

    for grad, i in ((dq, 0), (dk, 1), (dv, 2)):
        for idx in [(0, 1, 1, 3), (0, 5, 0, 7)]:
            assert abs(_central_difference(loss, (q, k, v), i, idx) - grad[idx]) < 1e-6
