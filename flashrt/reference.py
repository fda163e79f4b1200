"""Float64 oracle for attention forward and backward, used by tests and `flashrt check`.

Works on NumPy or CuPy arrays of layout (B, S, H, D) (the math runs in float64
in that library); it materialises the (Sq, Sk) score matrix, so it is meant for
checking sizes only.
"""
from __future__ import annotations

import math


def _xp(a):
    return __import__(type(a).__module__.split(".")[0])


def visible(B, Sq, Sk, *, causal=False, align="bottom_right", window=(-1, -1), seqlens_q=None, seqlens_k=None,
            block_ids_q=None, block_ids_k=None, segment_ids_q=None, segment_ids_k=None, mask_mod=None, heads=1,
            xp=None):
    """Which keys each query sees, as a bool array (B, 1, Sq, Sk) ((B, heads, Sq, Sk) with mask_mod):
    the dense form of every mask kind.

    Key j is visible to query i of batch b iff all of these hold:
      - both exist: i < seqlens_q[b] and j < seqlens_k[b] (padding; default: the full extents);
      - causal: j <= i + shift, where shift = seqlens_k[b] - seqlens_q[b] when aligned
        "bottom_right" (the last query sees the last key) and 0 when "top_left";
      - window (left, right), -1 = unbounded: i + shift - left <= j <= i + shift + right;
      - block ids (non-decreasing): block_ids_k[b, j] <= block_ids_q[b, i];
      - segment ids: segment_ids_q[b, i] == segment_ids_k[b, j];
      - mask_mod(b, h, i, j, Lq, Lk) is true: the Python form of a mask_mod expression, called once
        with broadcasting integer arrays (b: (B,1,1,1), h: (1,heads,1,1), i: (1,1,Sq,1), j: (1,1,1,Sk),
        Lq, Lk: the lengths, (B,1,1,1)).
    A query row that sees no key gets out = 0, lse = -inf and zero gradients.
    """
    import numpy
    xp = xp or numpy
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"align must be 'bottom_right' or 'top_left', got {align!r}")
    lq = xp.asarray(seqlens_q if seqlens_q is not None else [Sq] * B).reshape(B, 1, 1, 1)
    lk = xp.asarray(seqlens_k if seqlens_k is not None else [Sk] * B).reshape(B, 1, 1, 1)
    i = xp.arange(Sq).reshape(1, 1, Sq, 1)
    j = xp.arange(Sk).reshape(1, 1, 1, Sk)
    keep = (i < lq) & (j < lk)
    shift = lk - lq if align == "bottom_right" else xp.zeros_like(lk)
    if causal:
        keep &= j <= i + shift
    left, right = window
    if left >= 0:
        keep &= j >= i + shift - left
    if right >= 0:
        keep &= j <= i + shift + right
    if block_ids_q is not None:
        keep &= xp.asarray(block_ids_k)[:, None, None, :] <= xp.asarray(block_ids_q)[:, None, :, None]
    if segment_ids_q is not None:
        keep &= xp.asarray(segment_ids_k)[:, None, None, :] == xp.asarray(segment_ids_q)[:, None, :, None]
    if mask_mod is not None:
        b, h = xp.arange(B).reshape(B, 1, 1, 1), xp.arange(heads).reshape(1, heads, 1, 1)
        keep = keep & xp.asarray(mask_mod(b, h, i, j, lq, lk), dtype=bool)
    return keep


def positions(B, Sq, Sk, *, seqlens_q=None, seqlens_k=None, cu_seqlens_q=None, cu_seqlens_k=None, xp=None):
    """(b, i, j, Lq, Lk) of every (query, key) pair, as broadcasting integer arrays: the sequence, the query and key
    positions in it and its lengths, as a score_mod expression and ALiBi see them.

    Batched: b (B,1,1,1), i (1,1,Sq,1), j (1,1,1,Sk), Lq and Lk (B,1,1,1): seqlens_q[b] and seqlens_k[b] (default:
    the whole extents Sq, Sk).
    Packed varlen (cu_seqlens_q/k, the (n + 1,) offsets of flashrt.forward): the packed rows as one batch entry (B = 1,
    Sq = total_q, Sk = total_k); b, i, Lq, Lk (1,1,Sq,1) and j (1,1,Sq,Sk) are those of query i's sequence: i and j
    count from its start (pairs across sequences get positions too: `visible` with segment ids hides them).
    """
    import numpy
    xp = xp or numpy
    i = xp.arange(Sq).reshape(1, 1, Sq, 1)
    j = xp.arange(Sk).reshape(1, 1, 1, Sk)
    if cu_seqlens_q is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the packed rows are one batch entry: B must be 1, got {B}")
        cu_q, cu_k = (xp.asarray(c, dtype=xp.int64).reshape(-1) for c in (cu_seqlens_q, cu_seqlens_k))
        n = cu_q.shape[0] - 1
        seq = xp.clip(xp.searchsorted(cu_q, xp.arange(Sq), side="right") - 1, 0, n - 1)  # query i's sequence
        lq, lk = (cu_q[1:] - cu_q[:-1])[seq], (cu_k[1:] - cu_k[:-1])[seq]
        row = (1, 1, Sq, 1)
        return (seq.reshape(row), i - cu_q[seq].reshape(row), j - cu_k[seq].reshape(row), lq.reshape(row),
                lk.reshape(row))
    lq = xp.asarray(seqlens_q if seqlens_q is not None else [Sq] * B).reshape(B, 1, 1, 1)
    lk = xp.asarray(seqlens_k if seqlens_k is not None else [Sk] * B).reshape(B, 1, 1, 1)
    return xp.arange(B).reshape(B, 1, 1, 1), i, j, lq, lk


def alibi_bias(B, Sq, Sk, slopes, *, align="bottom_right", seqlens_q=None, seqlens_k=None, cu_seqlens_q=None,
               cu_seqlens_k=None, xp=None):
    """ALiBi's additive bias (B, H, Sq, Sk) in float64 (flashrt.forward's alibi_slopes), for attention's `bias`.

    Query i and key j of batch entry b gain -slopes[b, h] * |j - i - shift|, with `visible`'s shift (causal or not):
    seqlens_k[b] - seqlens_q[b] (default: Sk - Sq) when aligned "bottom_right", 0 when "top_left". slopes: (H,) or
    (B, H).
    Packed varlen (cu_seqlens_q/k, the (B + 1,) offsets of flashrt.forward): the packed rows as one batch entry (B = 1,
    Sq = total_q, Sk = total_k), slopes (H,) or (sequences, H); i and j count from their sequence's start, the shift
    and slopes are those of query i's sequence (`positions`).
    """
    import numpy
    xp = xp or numpy
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"align must be 'bottom_right' or 'top_left', got {align!r}")
    slopes = xp.asarray(slopes, dtype=xp.float64)
    H = slopes.shape[-1]
    b, i, j, lq, lk = positions(B, Sq, Sk, seqlens_q=seqlens_q, seqlens_k=seqlens_k, cu_seqlens_q=cu_seqlens_q,
                                cu_seqlens_k=cu_seqlens_k, xp=xp)
    shift = lk - lq if align == "bottom_right" else xp.zeros_like(lk)
    if cu_seqlens_q is not None:  # the slopes of query i's sequence b
        slope = (slopes if slopes.ndim == 1 else slopes[b.reshape(-1)]).reshape(-1, H).T.reshape(1, H, -1, 1)
    else:
        slope = slopes.reshape(-1, H, 1, 1)
    return -slope * xp.abs(j - i - shift)


_M32 = 0xFFFFFFFF


def philox4x32(counter, key, rounds=10, xp=None):
    """Philox-4x32 with `rounds` rounds (Salmon et al., SC 2011) of counters (4 broadcasting integer arrays of 32-bit
    words) under a key (2 ints): its 4 output words, as uint64 arrays (kernels_cu/attention/dropout.cuh: philox4x32;
    dropout takes 7 rounds)."""
    import numpy
    xp = xp or numpy
    c0, c1, c2, c3 = (xp.asarray(c).astype(xp.uint64) & _M32 for c in counter)
    k0, k1 = (int(x) & _M32 for x in key)
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
        p0, p1 = c0 * xp.uint64(0xD2511F53), c2 * xp.uint64(0xCD9E8D57)
        c0, c1, c2, c3 = ((p1 >> xp.uint64(32)) ^ c1 ^ xp.uint64(k0), p1 & xp.uint64(_M32),
                          (p0 >> xp.uint64(32)) ^ c3 ^ xp.uint64(k1), p0 & xp.uint64(_M32))
    return c0, c1, c2, c3


def dropout_mask(rng, dropout_p, B, H, Sq, Sk, *, at=None, xp=None):
    """flashrt's dropout as a float64 multiplier (B, H, Sq, Sk) of the probabilities: 0 where dropped, 2^bits / keep
    where kept ((bits, keep) = spec.dropout_resolution(dropout_p): 8 or 16 bits of a draw per element, kept under
    keep ~ (1 - dropout_p) 2^bits), for attention's `dropout`. rng: the call's dropout_rng values (seed, offset); at:
    the (b, i, j, Lq, Lk) of `positions` (default: positions(B, Sq, Sk); packed varlen: positions(...,
    cu_seqlens_q=...)), pairs keyed by their sequence, query head and positions in the sequence
    (kernels_cu/attention/dropout.cuh)."""
    import numpy

    from .spec import dropout_resolution
    xp = xp or numpy
    seed, offset = (int(x) & (2**64 - 1) for x in rng)
    b, i, j, _, _ = at if at is not None else positions(B, Sq, Sk, xp=xp)
    i, j = xp.maximum(i, 0), xp.maximum(j, 0)  # (pairs across packed sequences: hidden, any value)
    h = xp.arange(H).reshape(1, H, 1, 1)
    shape = (B, H, Sq, Sk)
    q, k = xp.broadcast_to(i, shape), xp.broadcast_to(j, shape)
    bh = xp.broadcast_to(b, shape) * H + h
    bits, keep = dropout_resolution(dropout_p)
    if bits == 8:  # draws of 16: queries 2 a + pq + 8 hq by keys 2 b + pk + 8 hk of a 16 x 16 block
        counter = 16 * (k >> 4) + 4 * ((q & 7) >> 1) + ((k & 7) >> 1)
        pick = 2 * (q & 1) + ((k >> 3) & 1)
        shift = 8 * (2 * ((q >> 3) & 1) + (k & 1))
    else:  # draws of 8: queries g + 8 a by keys 2 t + e + 8 c
        counter = 32 * (k >> 4) + 4 * (q & 7) + ((k & 7) >> 1)
        pick = 2 * ((q >> 3) & 1) + ((k >> 3) & 1)
        shift = 16 * (k & 1)
    words = philox4x32((counter, q >> 4, bh, xp.full(shape, offset & _M32)),
                       (seed & _M32, (seed >> 32) ^ (offset >> 32)), 7, xp)
    word = xp.where(pick == 0, words[0], xp.where(pick == 1, words[1], xp.where(pick == 2, words[2], words[3])))
    draw = (word >> shift.astype(xp.uint64)) & xp.uint64((1 << bits) - 1)
    return xp.where(draw < keep, (1 << bits) / keep, 0.0)


def attention(q, k, v, *, causal=False, softmax_scale=None, dout=None, mask=None, sinks=None, softcap=None,
              alibi_slopes=None, bias=None, score_mod=None, score_mod_grad=None, score_positions=None, dropout=None):
    """Returns (out, lse) and, when dout is given, (out, lse, dq, dk, dv) (and dsinks with sinks); all float64.

    mask: optional bool array broadcastable to (B, H, Sq, Sk) (see `visible`), applied on
    top of `causal`; False hides a key from a query.
    sinks: optional (H,) logits, one more column of every row's softmax with no value (flashrt.forward's sinks).
    softcap: optional c > 0: every scaled score x becomes c * tanh(x / c) before the mask and the softmax.
    alibi_slopes: optional (H,) or (B, H) ALiBi slopes: every scaled score x (after softcap) of query i and key j
    becomes x - slope[b, h] * |j - i - (Sk - Sq)| (alibi_bias with its defaults: the whole extents, bottom-right, as
    `causal`). For other lengths (seqlens, packed varlen) or causal="top_left", pass alibi_bias(...) as `bias`.
    bias: optional float array broadcastable to (B, H, Sq, Sk), added to the scaled scores (after softcap).
    score_mod: optional Python form of a score_mod expression, called once with broadcasting arrays: s, the float64
    (B, H, Sq, Sk) scaled scores, then b, h (1,H,1,1), i, j, Lq, Lk as `positions` gives them; its value replaces s
    before the mask (and before `bias` is added). Not with softcap or alibi_slopes (as flashrt: write them into the
    expression). The positions are clamped into the sequence (i <= Lq - 1, j <= Lk - 1, as the kernels clamp them,
    and >= 0), so a table it indexes is never read outside a sequence's pairs. score_mod_grad: the same form of its
    derivative in s, which dS is multiplied by; None: a float64 central difference of score_mod.
    score_positions: the (b, i, j, Lq, Lk) that score_mod sees, positions(...) with the call's lengths (default:
    positions(B, Sq, Sk), the whole extents); pass positions(..., seqlens_q=...) or positions(..., cu_seqlens_q=...)
    for padding or packed sequences.
    dropout: optional multiplier of the probabilities broadcastable to (B, H, Sq, Sk) (dropout_mask), applied after
    the softmax (lse is that of the probabilities before it).
    """
    xp = _xp(q)
    q, k, v = (x.astype(xp.float64) for x in (q, k, v))
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    group = H // Hkv
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    ke, ve = xp.repeat(k, group, axis=2), xp.repeat(v, group, axis=2)
    s = xp.einsum("bqhd,bkhd->bhqk", q, ke) * scale
    cap_grad = 1.0
    if softcap is not None:
        th = xp.tanh(s / softcap)
        s, cap_grad = softcap * th, 1.0 - th * th
    if alibi_slopes is not None:
        s = s + alibi_bias(B, Sq, Sk, alibi_slopes, xp=xp)
    mod_grad = 1.0
    if score_mod is not None:
        if softcap is not None or alibi_slopes is not None:
            raise ValueError("score_mod with softcap or alibi_slopes is not supported (nor by flashrt): write them "
                             "into the expression")
        s, mod_grad = _score_mod(s, score_mod, score_mod_grad, score_positions or positions(B, Sq, Sk, xp=xp), xp)
    if bias is not None:
        s = s + xp.asarray(bias, dtype=xp.float64)
    keep = xp.ones((Sq, Sk), dtype=bool)
    if causal:  # bottom-right aligned: query i sees key j iff j <= i + Sk - Sq
        keep = xp.arange(Sk)[None, :] <= xp.arange(Sq)[:, None] + (Sk - Sq)
    if mask is not None:
        keep = keep & xp.asarray(mask, dtype=bool)
    s = xp.where(keep, s, -xp.inf)
    if score_mod is not None:  # (a hidden pair's derivative is never used, whatever it is: NaN included)
        mod_grad = xp.where(keep, mod_grad, 0.0)
    m = s.max(axis=-1, keepdims=True) if Sk else xp.full(s.shape[:-1] + (1,), -xp.inf)
    sink = None if sinks is None else xp.asarray(sinks, dtype=xp.float64).reshape(1, H, 1, 1)
    if sink is not None:
        m = xp.maximum(m, sink)
    m = xp.where(xp.isfinite(m), m, 0.0)
    p = xp.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + xp.exp(sink - m)
    with_keys = denom > 0
    lse = xp.where(with_keys, xp.log(xp.where(with_keys, denom, 1.0)) + m, -xp.inf)[..., 0]
    p = p / xp.where(with_keys, denom, 1.0)
    kept = p if dropout is None else p * dropout
    out = xp.einsum("bhqk,bkhd->bqhd", kept, ve)
    if dout is None:
        return out, lse
    do = dout.astype(xp.float64)
    dv = xp.einsum("bhqk,bqhd->bkhd", kept, do)
    dp = xp.einsum("bqhd,bkhd->bhqk", do, ve)
    if dropout is not None:  # (the derivative in the probabilities before dropout)
        dp = dp * dropout
    delta = (p * dp).sum(axis=-1, keepdims=True)  # = rowsum(dout * out)
    ds = p * (dp - delta) * cap_grad * mod_grad
    dq = xp.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
    dk = xp.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    fold = lambda g: g.reshape(B, Sk, Hkv, group, g.shape[-1]).sum(axis=3)  # noqa: E731  (sum over the GQA group)
    if sink is None:
        return out, lse, dq, fold(dk), fold(dv)
    p_sink = xp.exp(sink[..., 0] - lse)  # (B, H, Sq): the sink's probability in each row
    return out, lse, dq, fold(dk), fold(dv), -(p_sink * delta[..., 0]).sum(axis=(0, 2))


def _score_mod(s, f, df, at, xp):
    """(f(s, ...), its derivative in s) at each pair's positions `at` (positions(...)), clamped into the sequence;
    the derivative is df's, or with df None a central difference of f in float64, its step relative to |s|."""
    b, i, j, lq, lk = at
    i, j = xp.maximum(0, xp.minimum(i, lq - 1)), xp.maximum(0, xp.minimum(j, lk - 1))
    h = xp.arange(s.shape[1]).reshape(1, -1, 1, 1)

    def call(g, x):
        return xp.broadcast_to(xp.asarray(g(x, b, h, i, j, lq, lk), dtype=xp.float64), s.shape)

    if df is not None:
        return call(f, s), call(df, s)
    step = 1e-5 * xp.maximum(1.0, xp.abs(s))
    return call(f, s), (call(f, s + step) - call(f, s - step)) / (2 * step)


def rel_error(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64 (inf if x has NaN where ref does not)."""
    xp = _xp(ref)
    x = x.astype(xp.float64)
    denom = float(xp.linalg.norm(ref.ravel()))
    num = float(xp.linalg.norm((x - ref).ravel()))
    if math.isnan(num):
        return math.inf
    return num / denom if denom > 0 else num
