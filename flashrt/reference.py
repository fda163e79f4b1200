"""Float64 oracle for attention forward and backward, used by tests and `flashrt check`.

Works on NumPy or CuPy arrays of layout (B, S, H, D) (the math runs in float64
in that library); it materialises the (Sq, Sk) score matrix, so it is meant for
checking sizes only.
"""
from __future__ import annotations

import math


def _xp(a):
    return __import__(type(a).__module__.split(".")[0])


def attention(q, k, v, *, causal=False, softmax_scale=None, dout=None):
    """Returns (out, lse) and, when dout is given, (out, lse, dq, dk, dv); all float64."""
    xp = _xp(q)
    q, k, v = (x.astype(xp.float64) for x in (q, k, v))
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    group = H // Hkv
    scale = 1.0 / math.sqrt(D) if softmax_scale is None else softmax_scale
    ke, ve = xp.repeat(k, group, axis=2), xp.repeat(v, group, axis=2)
    s = xp.einsum("bqhd,bkhd->bhqk", q, ke) * scale
    visible = xp.ones((Sq, Sk), dtype=bool)
    if causal:  # bottom-right aligned: query i sees key j iff j <= i + Sk - Sq
        visible = xp.arange(Sk)[None, :] <= xp.arange(Sq)[:, None] + (Sk - Sq)
    s = xp.where(visible, s, -xp.inf)
    m = s.max(axis=-1, keepdims=True) if Sk else xp.full(s.shape[:-1] + (1,), -xp.inf)
    m = xp.where(xp.isfinite(m), m, 0.0)
    p = xp.exp(s - m)
    denom = p.sum(axis=-1, keepdims=True)
    with_keys = denom > 0
    lse = xp.where(with_keys, xp.log(xp.where(with_keys, denom, 1.0)) + m, -xp.inf)[..., 0]
    p = p / xp.where(with_keys, denom, 1.0)
    out = xp.einsum("bhqk,bkhd->bqhd", p, ve)
    if dout is None:
        return out, lse
    do = dout.astype(xp.float64)
    dv = xp.einsum("bhqk,bqhd->bkhd", p, do)
    dp = xp.einsum("bqhd,bkhd->bhqk", do, ve)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = xp.einsum("bhqk,bkhd->bqhd", ds, ke) * scale
    dk = xp.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    fold = lambda g: g.reshape(B, Sk, Hkv, group, D).sum(axis=3)  # noqa: E731  (sum over the GQA group)
    return out, lse, dq, fold(dk), fold(dv)


def rel_error(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64 (inf if x has NaN where ref does not)."""
    xp = _xp(ref)
    x = x.astype(xp.float64)
    denom = float(xp.linalg.norm(ref.ravel()))
    num = float(xp.linalg.norm((x - ref).ravel()))
    if math.isnan(num):
        return math.inf
    return num / denom if denom > 0 else num
