"""GPU tests of every mask kind and of padded / packed batches against the float64 reference.

The reference applies reference.visible's dense mask (the specification); flashrt skips
tiles from bounds and masks elements only on partial tiles. Outputs come from a NaN-poisoned
CuPy pool, so an element a kernel forgets to write shows. Each case checks the forward,
every backward impl, bitwise determinism of the deterministic impls, and that rows with no
visible key give out 0, lse -inf and zero gradients.
"""
import zlib

import numpy as np
import pytest

import flashrt
from flashrt import reference

from test_gpu import f64, poison  # noqa: F401  (fixture)

pytestmark = pytest.mark.gpu

TOL = {"bf16": 2e-2, "fp16": 4e-3}


@pytest.fixture(scope="module")
def cupy():
    return pytest.importorskip("cupy")


def _rel(x, ref):
    """Relative error, floored for gradients that are (nearly) zero (dq with one visible key)."""
    import cupy
    num = float(cupy.linalg.norm((f64(x) - ref).ravel()))
    return num / max(float(cupy.linalg.norm(ref.ravel())), 1e-3 * (ref.size ** 0.5))


def _ids_blocks(lengths):
    return np.concatenate([np.full(n, i) for i, n in enumerate(lengths)]).astype(np.int32)


def _sorted_ids(rng, S, n_segments):
    return np.sort(rng.integers(0, n_segments, S)).astype(np.int32)


def _inputs(cupy, shape_q, shape_k, dtype, seed):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    q, do = (torch.randn(*shape_q, device="cuda", dtype=dt, generator=g) for _ in range(2))
    k, v = (torch.randn(*shape_k, device="cuda", dtype=dt, generator=g) for _ in range(2))
    return tuple(cupy.from_dlpack(x) for x in (q, k, v, do))


# (id, B, Sq, Sk, H, Hkv, D, dtype, kwargs builder(rng, B, Sq, Sk) -> (flashrt kwargs, reference kwargs))
def _padding(rng, B, Sq, Sk):
    lq = np.array([Sq, 77, 0][:B], np.int32)
    lk = np.array([1, Sk, 150][:B], np.int32)
    return dict(seqlens_q=lq, seqlens_k=lk), dict(seqlens_q=lq, seqlens_k=lk)


def _block_causal_seed(rng, B, Sq, Sk):
    ids = np.stack([_ids_blocks([768, 1, 255])] * B)  # prefix, state, action chunk
    return dict(block_ids_q=ids, block_ids_k=ids), dict(block_ids_q=ids, block_ids_k=ids)


def _prefix_lm(rng, B, Sq, Sk):
    ids = np.stack([np.concatenate([np.zeros(p, np.int32), np.arange(1, Sq - p + 1, dtype=np.int32)])
                    for p in (100, 7, 0, Sq)[:B]])
    return dict(block_ids_q=ids, block_ids_k=ids), dict(block_ids_q=ids, block_ids_k=ids)


def _segments(rng, B, Sq, Sk):
    iq = np.stack([_sorted_ids(rng, Sq, 5) for _ in range(B)])
    ik = np.stack([_sorted_ids(rng, Sk, 5) for _ in range(B)])
    return dict(segment_ids_q=iq, segment_ids_k=ik), dict(segment_ids_q=iq, segment_ids_k=ik)


def _random_blocks(rng, B, Sq, Sk):
    iq = np.stack([_sorted_ids(rng, Sq, 4) for _ in range(B)])
    ik = np.stack([_sorted_ids(rng, Sk, 4) for _ in range(B)])
    return dict(block_ids_q=iq, block_ids_k=ik), dict(block_ids_q=iq, block_ids_k=ik)


def _segments_many(rng, B, Sq, Sk):  # short documents: query tiles hold many ids (the per-row searches)
    iq = np.stack([_sorted_ids(rng, Sq, Sq // 6) for _ in range(B)])
    ik = np.stack([_sorted_ids(rng, Sk, Sk // 6) for _ in range(B)])
    return dict(segment_ids_q=iq, segment_ids_k=ik), dict(segment_ids_q=iq, segment_ids_k=ik)


def _blocks_many(rng, B, Sq, Sk):
    iq = np.stack([_sorted_ids(rng, Sq, Sq // 4) for _ in range(B)])
    ik = np.stack([_sorted_ids(rng, Sk, Sk // 4) for _ in range(B)])
    return dict(block_ids_q=iq, block_ids_k=ik), dict(block_ids_q=iq, block_ids_k=ik)


def _window(left, right):
    def make(rng, B, Sq, Sk):
        return dict(window=(left, right)), dict(window=(left, right))
    return make


def _both(*makers):
    def make(rng, B, Sq, Sk):
        a, r = {}, {}
        for m in makers:
            x, y = m(rng, B, Sq, Sk)
            a.update(x), r.update(y)
        return a, r
    return make


# mask_mod expressions, each with its Python form for reference.visible (same broadcasting arrays).
def _mod_sink(rng, B, Sq, Sk):  # causal (bottom-right) plus the first 64 keys ("attention sinks")
    return (dict(mask_mod="k <= q + (Lk - Lq) || k < 64"),
            dict(mask_mod=lambda b, h, q, k, Lq, Lk: (k <= q + (Lk - Lq)) | (k < 64)))


def _mod_heads(rng, B, Sq, Sk):  # differs per head: many partial tiles
    return dict(mask_mod="((q - k) & 7) != h"), dict(mask_mod=lambda b, h, q, k, Lq, Lk: ((q - k) & 7) != h)


def _mod_docs(rng, B, Sq, Sk):  # unsorted document ids per batch entry, through tensors
    import cupy
    dq, dk = rng.integers(0, 3, (B, Sq)).astype(np.int32), rng.integers(0, 3, (B, Sk)).astype(np.int32)
    return (dict(mask_mod=f"dq[b * {Sq} + q] == dk[b * {Sk} + k]", mask_tensors=dict(dq=dq, dk=dk)),
            dict(mask_mod=lambda b, h, q, k, Lq, Lk: cupy.asarray(dq)[b, q] == cupy.asarray(dk)[b, k]))


def _mod_nearly_empty(rng, B, Sq, Sk):  # one visible pair: every other row sees no key
    return (dict(mask_mod="k > q + 100000 || (q == 5 && k == 7)"),
            dict(mask_mod=lambda b, h, q, k, Lq, Lk: (k > q + 100000) | ((q == 5) & (k == 7))))


CASES = [
    ("padding", 3, 200, 300, 4, 4, 64, "bf16", False, _padding),
    ("padding-causal-gqa", 3, 200, 300, 4, 2, 128, "bf16", True, _padding),
    ("top_left-sq>sk", 2, 300, 200, 2, 1, 64, "bf16", "top_left", None),
    ("top_left-sq<sk", 2, 130, 333, 2, 2, 96, "fp16", "top_left", None),
    # whole 128-row tiles on the diagonal (fwd_sm90_ws's diagonal loop at head_dim 64 and 128), Sq < Sk, Sq > Sk
    # (its first rows see no key) and Sq = Sk, both alignments
    ("diagonal-tiles-sq<sk", 2, 256, 640, 4, 2, 128, "bf16", True, None),
    ("diagonal-tiles-top_left-d64", 2, 256, 640, 4, 2, 64, "fp16", "top_left", None),
    ("diagonal-tiles-sq>sk-d64", 1, 640, 256, 4, 1, 64, "bf16", True, None),
    ("diagonal-tiles-sq=sk", 2, 1024, 1024, 2, 2, 128, "fp16", "top_left", None),
    ("window-causal", 2, 513, 513, 2, 1, 128, "bf16", True, _window(64, 0)),
    ("window-both", 2, 257, 300, 2, 2, 96, "bf16", False, _window(32, 16)),
    ("window-left-only-d256", 1, 300, 300, 2, 2, 256, "bf16", False, _window(40, -1)),
    ("block-causal-seed", 2, 1024, 1024, 8, 1, 256, "bf16", False, _block_causal_seed),
    ("prefix-lm", 3, 300, 300, 4, 1, 64, "bf16", False, _prefix_lm),
    ("segments", 2, 333, 333, 4, 2, 128, "bf16", False, _segments),
    ("segments-causal-fp16", 2, 200, 200, 2, 2, 64, "fp16", True, _segments),
    ("padding-blocks-window", 3, 200, 300, 2, 2, 64, "bf16", False, _both(_padding, _window(50, 50), _random_blocks)),
    ("segments-many-padding-window-d256", 3, 333, 290, 4, 2, 256, "bf16", "top_left",
     _both(_padding, _window(90, 30), _segments_many)),
    ("blocks-segments-many-causal", 2, 517, 517, 4, 1, 128, "bf16", True, _both(_blocks_many, _segments_many)),
    ("blocks-many-sq>sk-fp16", 2, 400, 170, 2, 2, 64, "fp16", False, _blocks_many),
    ("blocks-causal-window-fused", 2, 400, 400, 4, 4, 128, "bf16", True, _both(_window(100, -1), _random_blocks)),
    # more work items than SMs: the warp-specialised forward's producer searches an item's key intervals into
    # one Q slot while its consumers read the other's
    ("blocks-segments-many-items", 3, 1000, 1000, 8, 2, 128, "bf16", True, _both(_padding, _random_blocks, _segments)),
    ("mod-sink-padding-gqa", 3, 200, 300, 4, 2, 64, "bf16", False, _both(_padding, _mod_sink)),
    ("mod-per-head-mqa-causal", 2, 257, 257, 8, 1, 128, "bf16", True, _mod_heads),
    ("mod-docs-tensors-fp16", 2, 333, 300, 4, 2, 96, "fp16", False, _mod_docs),
    # head_dim 128: the warp-specialised forward's mask_mod bits, inside the sequence and at its ends
    ("mod-docs-padding-window", 3, 200, 300, 4, 2, 128, "bf16", False, _both(_padding, _window(90, 20), _mod_docs)),
    ("mod-nearly-empty-d256", 2, 300, 300, 2, 2, 256, "bf16", False, _mod_nearly_empty),
    # rows of key tiles longer than one map block holds: the lists come from their own launches
    ("mod-docs-long-rows", 2, 260, 1300, 4, 2, 128, "bf16", False, _mod_docs),
    ("mod-window-blocks-causal", 2, 400, 400, 4, 4, 64, "bf16", True, _both(_window(100, -1), _random_blocks,
                                                                          _mod_sink)),
]


def _on_device(kw: dict) -> dict:
    """The mask keyword arguments with their host arrays (mask_tensors' too) as CuPy arrays."""
    import cupy
    device = lambda x: cupy.asarray(x) if isinstance(x, np.ndarray) else x  # noqa: E731
    return {n: {t: device(x) for t, x in a.items()} if isinstance(a, dict) else device(a) for n, a in kw.items()}


def _impls(kwargs):
    impls = [("split", True), ("fused", False)]
    if "segment_ids_q" not in kwargs and "mask_mod" not in kwargs:
        impls.append(("fused", True))
    return impls


def _check(cupy, name, got, ref, tol):
    assert not bool(cupy.isnan(f64(got)).any()), f"{name} has NaN: unwritten (poisoned) elements"
    err = _rel(got, ref)
    assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_mask_matches_float64_reference(cupy, poison, case):  # noqa: F811
    cid, B, Sq, Sk, H, Hkv, D, dtype, causal, make = case
    rng = np.random.default_rng(zlib.crc32(cid.encode()))
    kw, rkw = make(rng, B, Sq, Sk) if make else ({}, {})
    kw = _on_device(kw)
    q, k, v, do = _inputs(cupy, (B, Sq, H, D), (B, Sk, Hkv, D), dtype, zlib.crc32(cid.encode()))

    out, lse = flashrt.forward(q, k, v, causal=causal, **kw)
    align = "top_left" if causal == "top_left" else "bottom_right"
    keep = reference.visible(B, Sq, Sk, causal=bool(causal), align=align, xp=cupy, heads=H,
                             **{n: cupy.asarray(a) if isinstance(a, np.ndarray) else a for n, a in rkw.items()})
    ro, rlse, rdq, rdk, rdv = reference.attention(f64(q), f64(k), f64(v), dout=f64(do), mask=keep)
    tol = TOL[dtype]
    _check(cupy, "out", out, ro, tol)
    empty_rows = ~cupy.isfinite(rlse)
    assert bool((lse[empty_rows] == -cupy.inf).all()), "rows with no visible key must have lse = -inf"
    assert float(cupy.abs(cupy.where(empty_rows, 0, f64(lse) - rlse)).max()) < 1e-3
    for impl, det in _impls(kw):
        runs = [flashrt.backward(do, q, k, v, out, lse, causal=causal, impl=impl, deterministic=det, **kw)
                for _ in range(2 if det else 1)]
        for name, x, r in zip(("dq", "dk", "dv"), runs[0], (rdq, rdk, rdv)):
            _check(cupy, f"{impl}{' det' if det else ''} {name}", x, r, tol)
        if det:
            assert all(bool((a == b).all()) for a, b in zip(*runs)), f"{impl} deterministic: runs differ"
    # A query row that sees nothing has zero gradient.
    dq = runs[0][0]
    rows = cupy.asarray(empty_rows.transpose(0, 2, 1))  # (B, Sq, H)
    assert float(cupy.abs(f64(dq)[rows]).sum()) == 0.0


@pytest.mark.parametrize("D,causal,no_sm90", [(64, False, "0"), (128, True, "0"), (128, False, "1"), (256, True, "0")])
def test_padding_reads_nothing_past_the_lengths(cupy, poison, monkeypatch, D, causal, no_sm90):  # noqa: F811
    """Padded positions (past seqlens_q / seqlens_k) may hold anything, NaN included (a KV cache from torch.empty):
    the forward and every backward impl give what they give on clean inputs, zeros past the lengths: the
    warp-specialised forward (tiles by TMA, the key tile at a length by cp.async; at head_dim 256 80-key tiles and one
    Q slot), and the mma.sync kernels with FLASHRT_NO_SM90=1."""
    monkeypatch.setenv("FLASHRT_NO_SM90", no_sm90)
    B, Sq, Sk, H, Hkv = 3, 300, 333, 4, 2
    lq, lk = np.array([300, 129, 1], np.int32), np.array([333, 200, 65], np.int32)
    kw = _on_device(dict(seqlens_q=lq, seqlens_k=lk))
    q, k, v, do = _inputs(cupy, (B, Sq, H, D), (B, Sk, Hkv, D), "bf16", 7 + D)
    keep = reference.visible(B, Sq, Sk, causal=causal, xp=cupy, heads=H, **kw)
    ro, rlse, rdq, rdk, rdv = reference.attention(f64(q), f64(k), f64(v), dout=f64(do), mask=keep)
    for x, lengths in ((q, lq), (do, lq), (k, lk), (v, lk)):
        for b in range(B):
            x.view(cupy.uint16)[b, lengths[b]:] = 0x7FC0  # bf16 NaN
    out, lse = flashrt.forward(q, k, v, causal=causal, **kw)
    _check(cupy, "out", out, ro, TOL["bf16"])
    for impl, det in _impls(kw):
        got = flashrt.backward(do, q, k, v, out, lse, causal=causal, impl=impl, deterministic=det, **kw)
        for name, x, r in zip(("dq", "dk", "dv"), got, (rdq, rdk, rdv)):
            _check(cupy, f"{impl}{' det' if det else ''} {name}", x, r, TOL["bf16"])


def _pack(cupy, x, lengths):
    return cupy.concatenate([x[b, :n] for b, n in enumerate(lengths)])


# mask_mod on packed sequences: positions are within each sequence
_VARLEN_MOD = ("(k % 5) != 1 || q == k", lambda b, h, q, k, Lq, Lk: ((k % 5) != 1) | (q == k))


@pytest.mark.parametrize("causal,window,with_segments,mod", [(True, None, False, None), (False, (20, 5), False, None),
                                                              ("top_left", None, True, None),
                                                              (True, None, False, _VARLEN_MOD)])
def test_varlen_matches_per_sequence_reference(cupy, poison, causal, window, with_segments, mod):  # noqa: F811
    lq, lk = [100, 1, 0, 257, 64], [50, 300, 7, 257, 64]
    B, H, Hkv, D, S = len(lq), 4, 2, 64, 300
    q, k, v, do = _inputs(cupy, (B, S, H, D), (B, S, Hkv, D), "bf16", 5 + with_segments)
    pq, pk, pv, pdo = (_pack(cupy, x, n) for x, n in ((q, lq), (k, lk), (v, lk), (do, lq)))
    cu_q = cupy.asarray(np.concatenate([[0], np.cumsum(lq)]).astype(np.int32))
    cu_k = cupy.asarray(np.concatenate([[0], np.cumsum(lk)]).astype(np.int32))
    rng = np.random.default_rng(3)
    seg_q = [_sorted_ids(rng, n, 3) for n in lq]
    seg_k = [_sorted_ids(rng, n, 3) for n in lk]
    kw = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lq), max_seqlen_k=max(lk), window=window)
    if with_segments:
        kw.update(segment_ids_q=cupy.asarray(np.concatenate(seg_q)), segment_ids_k=cupy.asarray(np.concatenate(seg_k)))
    if mod:
        kw.update(mask_mod=mod[0])
    out, lse = flashrt.forward(pq, pk, pv, causal=causal, **kw)
    assert out.shape == pq.shape and lse.shape == (H, sum(lq))
    grads = {(impl, det): flashrt.backward(pdo, pq, pk, pv, out, lse, causal=causal, impl=impl, deterministic=det,
                                           **kw) for impl, det in _impls(kw)}
    align = "top_left" if causal == "top_left" else "bottom_right"
    for b in range(B):
        rq, rk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ids = dict(segment_ids_q=seg_q[b][None], segment_ids_k=seg_k[b][None]) if with_segments else {}
        keep = reference.visible(1, lq[b], lk[b], causal=bool(causal), align=align, window=window or (-1, -1),
                                 mask_mod=mod[1] if mod else None, **ids)
        if lq[b] == 0:
            continue
        ro, rlse, rdq, rdk, rdv = reference.attention(f64(q[b:b + 1, :lq[b]]), f64(k[b:b + 1, :lk[b]]),
                                                      f64(v[b:b + 1, :lk[b]]), dout=f64(do[b:b + 1, :lq[b]]),
                                                      mask=cupy.asarray(keep))
        _check(cupy, f"seq {b} out", out[rq][None], ro, TOL["bf16"])
        got_lse = lse[:, rq][None]
        assert bool((got_lse[~cupy.isfinite(rlse)] == -cupy.inf).all())
        for (impl, det), (dq, dk, dv) in grads.items():
            for name, x, r in (("dq", dq[rq][None], rdq), ("dk", dk[rk][None], rdk), ("dv", dv[rk][None], rdv)):
                _check(cupy, f"seq {b} {impl}{' det' if det else ''} {name}", x, r, TOL["bf16"])


def _i32(cupy, values):
    return cupy.asarray(values, dtype=cupy.int32)


def test_mask_input_errors_name_the_argument(cupy):
    """Bad array data (validate=True, the default) is found on the GPU without a host copy: the call's outputs
    become NaN and a ValueError naming the argument comes at the next flashrt call, at flashrt.synchronize(),
    or (validate="sync") from the call itself."""
    q = cupy.ones((2, 64, 2, 64), dtype=cupy.float16)
    ids = cupy.zeros((2, 64), dtype=cupy.int32)
    bad = ids.copy()
    bad[1, 10] = -1  # decreases
    out, lse = flashrt.forward(q, q, q, block_ids_q=ids, block_ids_k=bad)  # no host copy: nothing raised yet
    with pytest.raises(ValueError, match=r"block_ids_k must be non-decreasing.*decreases in batch 1 at position 10 "
                                         r"\(-1 after 0\).*earlier flashrt forward call"):
        flashrt.synchronize()
    assert bool(cupy.isnan(out).all()) and bool(cupy.isnan(lse).all()), "a failed check leaves NaN outputs"
    flashrt.synchronize()  # reported once
    flashrt.forward(q, q, q, block_ids_q=ids, block_ids_k=bad)
    cupy.cuda.Device().synchronize()
    with pytest.raises(ValueError, match=r"block_ids_k must be non-decreasing"):  # at the next call, any call
        flashrt.forward(q, q, q)
    good, _ = flashrt.forward(q, q, q, block_ids_q=ids, block_ids_k=ids, validate="sync")
    assert bool(cupy.isfinite(good).all())
    dout = cupy.ones_like(q)
    out, lse = flashrt.forward(q, q, q, block_ids_q=ids, block_ids_k=ids)
    grads = flashrt.backward(dout, q, q, q, out, lse, block_ids_q=bad, block_ids_k=ids)
    with pytest.raises(ValueError, match=r"block_ids_q must be non-decreasing.*earlier flashrt backward call"):
        flashrt.synchronize()
    assert all(bool(cupy.isnan(g).all()) for g in grads)

    def raises(match, *args, **kw):
        with pytest.raises(ValueError, match=match):
            flashrt.forward(*args, validate="sync", **kw)

    raises(r"seqlens_k must lie in \[0, 64\] .*got 65 for batch entry 1", q, q, q, seqlens_k=_i32(cupy, [64, 65]))
    raises(r"seqlens_q must lie in \[0, 64\]", q, q, q, seqlens_q=_i32(cupy, [-1, 3]))
    packed = cupy.ones((100, 2, 64), dtype=cupy.float16)
    cu = _i32(cupy, [0, 50, 100])
    raises(r"cu_seqlens_q must start at 0.*it starts at 1", packed, packed, packed,
           cu_seqlens_q=_i32(cupy, [1, 50, 100]), cu_seqlens_k=cu)
    raises(r"cu_seqlens_k must start at 0, be non-decreasing and end at most at the packed length; entry 2 \(50\) is "
           r"below entry 1 \(60\)", packed, packed, packed, cu_seqlens_q=cu, cu_seqlens_k=_i32(cupy, [0, 60, 50]))
    raises(r"cu_seqlens_q must start at 0.*packed length \(100\); it ends at 101", packed, packed, packed,
           cu_seqlens_q=_i32(cupy, [0, 50, 101]), cu_seqlens_k=cu)
    raises(r"max_seqlen_k=40 is below the length of sequence 0 in cu_seqlens_k \(50\)", packed, packed, packed,
           cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=50, max_seqlen_k=40)
    seq_ids = cupy.zeros(100, dtype=cupy.int32)
    seq_ids[50:] = 7
    seq_ids[60] = 3
    raises(r"segment_ids_k must be non-decreasing.*decreases in sequence 1 at position 10 \(3 after 7\)", packed,
           packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu, segment_ids_q=cupy.sort(seq_ids), segment_ids_k=seq_ids)
    seq_ids[60] = 7
    seq_ids[50] = 0  # a sequence may start lower than the previous one ended
    flashrt.forward(packed, packed, packed, cu_seqlens_q=cu, cu_seqlens_k=cu, segment_ids_q=seq_ids,
                    segment_ids_k=seq_ids, validate="sync")
    with pytest.raises(ValueError, match=r"validate must be True, False or 'sync'"):
        flashrt.forward(q, q, q, validate="yes")
    with pytest.raises(ValueError, match=r"impl='fused' with deterministic=True"):
        out, lse = flashrt.forward(q, q, q, segment_ids_q=ids, segment_ids_k=ids)
        flashrt.backward(q, q, q, q, out, lse, segment_ids_q=ids, segment_ids_k=ids, impl="fused")
    with pytest.raises(ValueError, match=r"impl='fused' with deterministic=True"):
        out, lse = flashrt.forward(q, q, q, mask_mod="k <= q")
        flashrt.backward(q, q, q, q, out, lse, mask_mod="k <= q", impl="fused")
    with pytest.raises(ValueError, match=r'(?s)mask_mod does not compile.*identifier "kk" is undefined.*\^'):
        flashrt.forward(q, q, q, mask_mod="k <= q && kk > 1")
    with pytest.raises(TypeError, match=r"mask_tensors\['doc'\] must be int32"):
        flashrt.forward(q, q, q, mask_mod="doc[k] == 0", mask_tensors={"doc": ids.astype(cupy.int64)})


def _mod_window(rng, B, Sq, Sk):  # a pure expression: its plan keeps its tile lists
    return (dict(mask_mod="k <= q + (Lk - Lq) && k >= q + (Lk - Lq) - 40"),
            dict(mask_mod=lambda b, h, q, k, Lq, Lk: (k <= q + (Lk - Lq)) & (k >= q + (Lk - Lq) - 40)))


@pytest.mark.parametrize("make", [_padding, _segments, _random_blocks, _mod_window, _mod_heads, _mod_docs,
                                  _both(_padding, _mod_sink), "varlen"],
                         ids=["padding", "segments", "blocks", "mod-window", "mod-heads", "mod-docs-tensors",
                              "mod-padding", "varlen"])
@pytest.mark.parametrize("validate", [True, False], ids=["validated", "unchecked"])
def test_reused_plan_reads_each_calls_mask_data(cupy, poison, make, validate):  # noqa: F811
    """A second call of the same signature runs the first call's plan (no new plan is made) and reads
    its own arrays: new lengths, ids, mask_mod tensors and inputs, not the first call's (a mask_mod
    over tensors or arrays classifies its tiles again; over neither it keeps the first call's lists).
    validate=True (the device check) reuses plans too."""
    from flashrt import api
    B, Sq, Sk, H, Hkv, D = 3, 200, 300, 4, 2, 64
    lens = ([120, 30, 150], [150, 90, 60])  # same total: the packed tensors keep their shape
    new_plans = []
    for call in range(2):
        rng = np.random.default_rng(100 + call)
        q, k, v, do = _inputs(cupy, (B, Sq, H, D), (B, Sk, Hkv, D), "bf16", 100 + call)
        if make == "varlen":
            lq = lens[call]
            q, k, v, do = (_pack(cupy, x, lq) for x in (q, k, v, do))
            cu = cupy.asarray(np.concatenate([[0], np.cumsum(lq)]).astype(np.int32))
            kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=150, max_seqlen_k=150)
        else:
            kw, rkw = make(rng, B, Sq, Sk)
            kw = _on_device(kw)
        before = set(api._PLANS)
        out, lse = flashrt.forward(q, k, v, causal=True, validate=validate, **kw)
        dq, dk, dv = flashrt.backward(do, q, k, v, out, lse, causal=True, validate=validate, **kw)
        new_plans.append(len(set(api._PLANS) - before))
        if make == "varlen":
            for b in range(B):
                r = slice(int(cu[b]), int(cu[b + 1]))
                ro, _, rdq, rdk, rdv = reference.attention(*(f64(x[r])[None] for x in (q, k, v)),
                                                           dout=f64(do[r])[None], causal=True)
                for name, x, ref in (("out", out, ro), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
                    _check(cupy, f"call {call} seq {b} {name}", x[r][None], ref, TOL["bf16"])
            continue
        keep = reference.visible(B, Sq, Sk, causal=True, xp=cupy, heads=H,
                                 **{n: cupy.asarray(a) if isinstance(a, np.ndarray) else a for n, a in rkw.items()})
        ro, _, rdq, rdk, rdv = reference.attention(f64(q), f64(k), f64(v), dout=f64(do), mask=keep)
        for name, x, ref in (("out", out, ro), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
            _check(cupy, f"call {call} {name}", x, ref, TOL["bf16"])
    assert new_plans == [2, 0], f"plans made by the two calls (forward + backward each): {new_plans}, expected [2, 0]"


def test_no_array_data_reaches_outside_the_tensors(cupy):
    """validate=False with arrays that break every rule: lengths past the tensor or negative, cu_seqlens
    out of range, decreasing, or longer than max_seqlen, ids in any order. The kernels stay inside their
    tensors (mask.cuh clamps; scripts/sanitize_workload.py runs the same under compute-sanitizer memcheck),
    and every impl finishes."""
    rng = np.random.default_rng(5)
    q = cupy.asarray(rng.standard_normal((2, 96, 4, 64)), dtype=cupy.float16)
    kv = cupy.asarray(rng.standard_normal((2, 80, 2, 64)), dtype=cupy.float16)
    packed_q, packed_k = q.reshape(192, 4, 64), kv.reshape(160, 2, 64)
    shuffled = _i32(cupy, rng.integers(-5, 5, (2, 96)))
    cases = [
        (q, kv, dict(seqlens_q=_i32(cupy, [1000, -7]), seqlens_k=_i32(cupy, [-1, 2**30]))),
        (q, kv, dict(block_ids_q=shuffled, block_ids_k=shuffled[:, :80].copy(), window=(3, 5))),
        (q, kv, dict(segment_ids_q=shuffled, segment_ids_k=_i32(cupy, rng.integers(-5, 5, (2, 80))),
                     seqlens_k=_i32(cupy, [80, 10**6]))),
        (packed_q, packed_k, dict(cu_seqlens_q=_i32(cupy, [0, 10**6, -50]),
                                  cu_seqlens_k=_i32(cupy, [-10, 5, 2**31 - 1]), max_seqlen_q=300, max_seqlen_k=40)),
        (packed_q, packed_k, dict(cu_seqlens_q=_i32(cupy, [150, 20, 192]), cu_seqlens_k=_i32(cupy, [0, 160, 100]),
                                  max_seqlen_q=64, max_seqlen_k=200, block_ids_q=_i32(cupy, rng.integers(0, 9, 192)),
                                  block_ids_k=_i32(cupy, rng.integers(0, 9, 160)))),
    ]
    for q_, kv_, kw in cases:
        for causal in (False, True):
            out, lse = flashrt.forward(q_, kv_, kv_, causal=causal, validate=False, **kw)
            for impl, det in (("split", True), ("fused", True), ("fused", False)):
                if impl == "fused" and det and "segment_ids_q" in kw:
                    continue
                flashrt.backward(q_, q_, kv_, kv_, out, lse, causal=causal, impl=impl, deterministic=det,
                                 validate=False, **kw)
            cupy.cuda.Device().synchronize()  # (an access outside memory would fail here)
