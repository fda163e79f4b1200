"""Small forward+backward runs that touch every kernel family and edge path; the workload
that scripts/sanitize.sh runs under compute-sanitizer."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import flashrt  # noqa: E402

# (B, Sq, Sk, H, Hkv, D, causal, dtype): ragged tiles, padded head dims, GQA, Sq != Sk both ways.
CASES = [
    (1, 70, 45, 2, 1, 64, True, torch.bfloat16),
    (1, 300, 300, 4, 1, 64, False, torch.bfloat16),  # head_dim 64: the pipelined dK/dV's stages wrap, splits
    (1, 45, 70, 2, 2, 72, False, torch.float16),
    (1, 33, 97, 4, 2, 256, True, torch.bfloat16),
    (2, 130, 130, 2, 1, 128, False, torch.bfloat16),
    (1, 17, 9, 2, 1, 8, True, torch.float16),
    (2, 200, 200, 8, 1, 96, True, torch.bfloat16),  # MQA, small grid: split dK/dV with partials
    (1, 200, 150, 8, 1, 256, False, torch.bfloat16),  # the same at 256 (sm_90a: one warpgroup per gradient)
    (1, 100, 150, 4, 2, 192, True, torch.float16),
    # more work items than SMs: the warp-specialised forward's blocks claim items from a counter
    (3, 260, 260, 24, 8, 128, True, torch.bfloat16),
    (2, 600, 500, 16, 4, 64, False, torch.float16),
    # whole tiles on the diagonal: fwd_sm90_ws's diagonal loop (head_dim 64 here; 128 in the case above)
    (2, 256, 256, 4, 2, 64, True, torch.bfloat16),
    # key tiles wholly below the diagonal where key and query tiles differ: fwd_sm90_ws's unmasked causal loop at 192
    # (112-key tiles) and 256 (80), ragged last tiles
    (1, 390, 380, 2, 1, 192, True, torch.float16),
    (1, 384, 400, 2, 2, 256, True, torch.bfloat16),
    # long query sequences: fwd_sm90_ws's 192-row tiles and three consumer warpgroups at head_dim 64 (tiles.long_rows)
    (1, 4200, 4200, 2, 1, 64, True, torch.bfloat16),
    (1, 4160, 4300, 2, 2, 64, False, torch.float16),
]


def score_mod_cases():
    """Attention sinks (softmax.cuh: add_sink), softcap, ALiBi (score_mod.cuh; (H,) and (B, H) slopes) and score_mod
    expressions (a bias table read per pair, padding lengths, the table's gradient; one with sinks and an automatic
    derivative): sm_80 and sm_90a kernels, split and fused backward, rows that see no key, the sinks' gradient."""
    for B, Sq, Sk, H, Hkv, D, causal in ((1, 70, 45, 4, 2, 64, True), (1, 130, 200, 2, 1, 128, False),
                                         (1, 33, 97, 2, 2, 256, True), (2, 40, 40, 2, 1, 72, True)):
        q, k, v, do = (torch.randn(B, s, h, D, device="cuda", dtype=torch.bfloat16)
                       for s, h in ((Sq, H), (Sk, Hkv), (Sk, Hkv), (Sq, H)))
        sinks = torch.randn(H, device="cuda")
        slopes = torch.rand(B, H, device="cuda")
        bias = torch.randn(H, Sq + Sk - 1, device="cuda")
        lengths = dict(seqlens_q=torch.tensor([Sq - 7] * B, device="cuda", dtype=torch.int32),
                       seqlens_k=torch.tensor([Sk - 5] * B, device="cuda", dtype=torch.int32))
        rel = dict(score_mod=f"s + bias[h * {Sq + Sk - 1} + k - q + {Sq - 1}]", score_tensors={"bias": bias})
        for kw in (dict(sinks=sinks), dict(softcap=5.0), dict(softcap=5.0, sinks=sinks), dict(alibi_slopes=slopes[0]),
                   dict(alibi_slopes=slopes, sinks=sinks), rel, dict(rel, **lengths),
                   dict(score_mod="s > 0.f ? s : 0.25f * s", sinks=sinks)):
            out, lse = flashrt.forward(q, k, v, causal=causal, **kw)
            for impl in ("split", "fused"):
                flashrt.backward(do, q, k, v, out, lse, causal=causal, impl=impl, **kw)
        # the bias table's gradient (bwd_dq.cu's tensor-gradient pass), with padding lengths
        out, lse = flashrt.forward(q, k, v, causal=causal, **rel, **lengths)
        for det in (False, True):  # (fp32 atomics; exact sums)
            flashrt.backward(do, q, k, v, out, lse, causal=causal, deterministic=det, **rel, **lengths,
                             score_grads={"bias": torch.zeros_like(bias)})
    torch.cuda.synchronize()


def dropout_cases():
    """Attention dropout (kernels_cu/attention/dropout.cuh): every forward family (sm_90a: the warp-specialised one to
    head_dim 192, fwd_sm90 at 256; mma.sync at 72), the mma.sync split and fused backward, with padding lengths and
    packed varlen, GQA; draws of 8 bits (p = 0.2, 0.3) and 16 (0.01 with the lengths)."""
    for B, Sq, Sk, H, Hkv, D, causal in ((1, 70, 45, 4, 2, 64, True), (1, 130, 200, 2, 1, 128, False),
                                         (1, 33, 97, 2, 2, 256, True), (2, 40, 40, 2, 1, 72, True),
                                         (1, 100, 150, 4, 2, 192, False)):
        q, k, v, do = (torch.randn(B, s, h, D, device="cuda", dtype=torch.bfloat16)
                       for s, h in ((Sq, H), (Sk, Hkv), (Sk, Hkv), (Sq, H)))
        rng = flashrt.dropout_rng(q)
        lengths = dict(seqlens_q=torch.tensor([Sq - 7] * B, device="cuda", dtype=torch.int32),
                       seqlens_k=torch.tensor([Sk - 5] * B, device="cuda", dtype=torch.int32))
        for kw, p in (({}, 0.2), (lengths, 0.01)):  # (8- and 16-bit draws: spec.dropout_resolution)
            out, lse = flashrt.forward(q, k, v, causal=causal, dropout_p=p, dropout_rng=rng, **kw)
            for impl in ("split", "fused"):
                flashrt.backward(do, q, k, v, out, lse, causal=causal, impl=impl, dropout_p=p, dropout_rng=rng, **kw)
    cu = torch.tensor([0, 37, 37, 120], device="cuda", dtype=torch.int32)
    q, k, v, do = (torch.randn(120, 4, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    varlen = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=83, max_seqlen_k=83, causal=True, dropout_p=0.3,
                  dropout_rng=flashrt.dropout_rng(q))
    out, lse = flashrt.forward(q, k, v, **varlen)
    flashrt.backward(do, q, k, v, out, lse, **varlen)
    torch.cuda.synchronize()


def padded_cases():
    """Head_dims the wgmma kernels pad to the next instance (tiles.sm90_head_dim): q, k, v, dout as views of wider
    tensors (the columns past head_dim never read), by TMA and by cp.async (FLASHRT_NO_TMA=1); ragged, GQA, lengths;
    the forward, the split backward (dK/dV splits at MQA), the fused one ordered and not; v with a head_dim of its
    own."""
    import os
    for no_tma in ("0", "1"):
        os.environ["FLASHRT_NO_TMA"] = no_tma
        for B, Sq, Sk, H, Hkv, D, causal in ((1, 70, 150, 4, 2, 72, True), (2, 130, 100, 2, 1, 160, False),
                                             (1, 200, 200, 2, 2, 224, True), (1, 90, 140, 2, 1, 40, False),
                                             (1, 300, 300, 8, 1, 96, True), (1, 100, 130, 2, 1, 24, True)):
            q, k, v, do = (torch.randn(B, s, h, D + 24, device="cuda", dtype=torch.bfloat16)[..., :D]
                           for s, h in ((Sq, H), (Sk, Hkv), (Sk, Hkv), (Sq, H)))
            lengths = dict(seqlens_k=torch.tensor([Sk - 5] * B, device="cuda", dtype=torch.int32))
            out, lse = flashrt.forward(q, k, v, causal=causal, **lengths)
            for impl, det in (("split", True), ("fused", False), ("fused", True)):
                flashrt.backward(do, q, k, v, out, lse, causal=causal, impl=impl, deterministic=det, **lengths)
        # v's head_dim of its own (MLA's 192 / 128; and the reverse): v, dout as views of wider tensors
        for D, Dv in ((192, 128), (64, 96)):
            q, k = (torch.randn(1, 150, h, D, device="cuda", dtype=torch.bfloat16) for h in (4, 2))
            v = torch.randn(1, 150, 2, Dv + 24, device="cuda", dtype=torch.bfloat16)[..., :Dv]
            do = torch.randn(1, 150, 4, Dv + 24, device="cuda", dtype=torch.bfloat16)[..., :Dv]
            out, lse = flashrt.forward(q, k, v, causal=True)
            for impl, det in (("split", True), ("fused", False), ("fused", True)):
                flashrt.backward(do, q, k, v, out, lse, causal=True, impl=impl, deterministic=det)
    os.environ.pop("FLASHRT_NO_TMA")
    torch.cuda.synchronize()


def ordered_chunk_cases():
    """The ordered causal fused backward's key-tile-major grid in chunks of pairs (tiles.ordered_key_chunk), here 2
    of 3 x 2 (batch entry, KV head) pairs, one split each (with splits: one chunk), at head_dim 64 and 128."""
    from flashrt import api, tiles
    rule = tiles.ordered_key_chunk
    tiles.ordered_key_chunk = lambda dev, pairs, splits: 0 if splits > 1 else 2
    api._PLANS.clear()
    for D in (64, 128):
        q, k, v, do = (torch.randn(3, 1536, h, D, device="cuda", dtype=torch.bfloat16) for h in (4, 2, 2, 4))
        out, lse = flashrt.forward(q, k, v, causal=True)
        flashrt.backward(do, q, k, v, out, lse, causal=True, impl="fused", deterministic=True)
    tiles.ordered_key_chunk = rule
    api._PLANS.clear()
    torch.cuda.synchronize()


def i32(values):
    return torch.tensor(values, dtype=torch.int32, device="cuda")


# Decoding (kernels_cu/sm80/decode.cu, helpers/combine.cu): contiguous and paged caches with appends, one and
# several splits, 16-row to 64-row tiles, windows; then bad lengths and page ids, which must read and write nothing
# outside the cache (the rows get NaN and a report).
def decode_case(B, Sq, H, Hkv, D, cap, page, splits, lens, **kw):
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=torch.bfloat16)
    kn, vn = (torch.randn(B, Sq, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if page:
        pages = -(-cap // page)
        kc, vc = (torch.randn(B * pages + 1, page, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        table = torch.randperm(B * pages + 1, device="cuda")[:B * pages].view(B, pages).to(torch.int32)
    else:
        kc, vc = (torch.randn(B, cap, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        table = None
    flashrt.decode(q, kc, vc, cache_seqlens=i32(lens), k=kn, v=vn, page_table=table, num_splits=splits, **kw)
    flashrt.decode(q, kc, vc, cache_seqlens=i32(lens), page_table=table, num_splits=splits, **kw)
    return q, kc, vc, kn, vn, table


def decode_cases():
    decode_case(2, 1, 32, 8, 128, 300, 0, 0, [0, 299])
    decode_case(2, 3, 8, 2, 72, 200, 16, 3, [50, 197], window=(40, 0))
    decode_case(1, 16, 8, 1, 256, 150, 64, 2, [100], causal=False)
    decode_case(2, 4, 16, 2, 64, 500, 32, 1, [10, 480])
    decode_case(1, 16, 8, 2, 64, 300, 0, 2, [250], causal=True)  # 64 rows at head_dim 64: Q in the last stage
    decode_case(2, 1, 8, 1, 128, 2000, 0, 12, [1500, 1999])  # 12 splits: combine.cu's batches of parts
    decode_case(2, 2, 8, 2, 128, 300, 0, 1, [0, 250], sinks=torch.randn(8, device="cuda"))  # sinks: decode.cu joins
    decode_case(2, 2, 8, 2, 128, 300, 32, 3, [0, 250], sinks=torch.randn(8, device="cuda"))  # and combine.cu does
    decode_case(2, 2, 8, 2, 128, 300, 32, 3, [0, 250], softcap=20.0)  # softcap and ALiBi ((H,) and (B, H)
    decode_case(2, 3, 8, 2, 64, 200, 0, 2, [7, 190], alibi_slopes=torch.rand(8, device="cuda"))  # slopes): decode.cu
    decode_case(2, 1, 16, 4, 128, 300, 16, 0, [0, 280], alibi_slopes=torch.rand(2, 16, device="cuda"))
    decode_case(2, 1, 16, 2, 192, 400, 0, 2, [130, 399])  # rows whose chunks do not divide the threads: in order,
    decode_case(2, 4, 16, 2, 240, 300, 16, 0, [64, 290])  # paged, and a last partial round (32-key tiles)
    q, kc, vc, kn, vn, table = decode_case(2, 2, 8, 2, 128, 256, 64, 2, [10, 20])
    flat_k, flat_v = (torch.randn(2, 256, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    table[1, 1] = 1 << 20
    for bad_lens, caches, tbl in (([255, -3], (kc, vc), table), ([5, 70], (kc, vc), table),
                                  ([2**31 - 1, 0], (flat_k, flat_v), None)):
        flashrt.decode(q, *caches, cache_seqlens=i32(bad_lens), k=kn, v=vn, page_table=tbl, num_splits=2)
        try:
            flashrt.synchronize()
            raise SystemExit("decode did not report a bad value")
        except ValueError:
            pass
    parts = [flashrt.forward(q, flat_k[:, a:b], flat_v[:, a:b]) for a, b in ((0, 100), (100, 256))]
    flashrt.combine([p[0] for p in parts], [p[1] for p in parts])
    flashrt.combine(torch.stack([p[0].float() for p in parts]), torch.stack([p[1] for p in parts]))
    torch.cuda.synchronize()


def rotated_cases():
    """The ordered non-causal wgmma fused backward with each key tile's query tiles rotated (tiles.rotate_ordered_dq):
    more key tiles than query tiles, fewer, and padding lengths, at head_dim 64 and 128 (grids of key tiles that fill
    the GPU: one split)."""
    for D in (64, 128):
        for B, Sq, Sk, H, Hkv, lengths in ((2, 300, 1100, 4, 4, False), (4, 1100, 300, 6, 6, False),
                                          (3, 600, 800, 4, 4, True)):
            q, k, v, do = (torch.randn(B, s, h, D, device="cuda", dtype=torch.bfloat16)
                           for s, h in ((Sq, H), (Sk, Hkv), (Sk, Hkv), (Sq, H)))
            mask = {}
            if lengths:
                mask = dict(seqlens_q=torch.tensor([Sq - 70, Sq, 1], device="cuda", dtype=torch.int32),
                            seqlens_k=torch.tensor([Sk, Sk - 200, 130], device="cuda", dtype=torch.int32))
            out, lse = flashrt.forward(q, k, v, **mask)
            flashrt.backward(do, q, k, v, out, lse, impl="fused", deterministic=True, **mask)
    torch.cuda.synchronize()


if sys.argv[1:] == ["ordered"]:  # (that part alone)
    ordered_chunk_cases()
    sys.exit(0)
if sys.argv[1:] == ["rotated"]:  # (that part alone)
    rotated_cases()
    sys.exit(0)
if sys.argv[1:] == ["padded"]:  # (that part alone)
    padded_cases()
    sys.exit(0)
if sys.argv[1:] == ["dropout"]:  # (that part alone)
    dropout_cases()
    sys.exit(0)
if sys.argv[1:] == ["decode"]:  # (that part alone)
    decode_cases()
    sys.exit(0)
if sys.argv[1:] == ["score_mods"]:  # (that part alone)
    score_mod_cases()
    raise SystemExit(0)


def ids(*lengths):
    return torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(lengths)]).cuda()


def run(q, k, v, causal, **mask):
    out, lse = flashrt.forward(q, k, v, causal=causal, **mask)
    for _ in range(2):  # with validate=False a mask's plan is kept, then reused (its pointers refilled)
        out, lse = flashrt.forward(q, k, v, causal=causal, validate=False, **mask)
    do = torch.randn_like(out)
    for _ in range(2):
        flashrt.backward(do, q, k, v, out, lse, causal=causal, impl="split", validate=False, **mask)
    flashrt.backward(do, q, k, v, out, lse, causal=causal, impl="fused", deterministic=False, **mask)
    if "segment_ids_q" not in mask and "mask_mod" not in mask:
        flashrt.backward(do, q, k, v, out, lse, causal=causal, impl="fused", deterministic=True, **mask)


for B, Sq, Sk, H, Hkv, D, causal, dt in CASES:
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dt)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dt)
    run(q, k, v, causal)

# Masks (kernels_cu/attention/mask.cuh): padding + window + block ids, segments, top-left causal, packed varlen.
q, k, v = (torch.randn(2, 150, 2, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
run(q, k, v, False, seqlens_q=torch.tensor([150, 33], dtype=torch.int32, device="cuda"),
    seqlens_k=torch.tensor([0, 140], dtype=torch.int32, device="cuda"), window=(20, 40),
    block_ids_q=torch.stack([ids(70, 80)] * 2), block_ids_k=torch.stack([ids(100, 50)] * 2))
run(q, k, v, True, segment_ids_q=torch.stack([ids(70, 80)] * 2), segment_ids_k=torch.stack([ids(30, 120)] * 2))
run(q[:, :90], k, v, "top_left", window=(-1, 10))
q256, k256, v256 = (torch.randn(2, 150, 2, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3))
run(q256, k256, v256, True, window=(40, 0), seqlens_k=torch.tensor([150, 77], dtype=torch.int32, device="cuda"))
# ids with many short runs: query tiles whose rows search their key intervals (TileIntervals)
short = torch.randint(0, 30, (2, 150), dtype=torch.int32, device="cuda").sort(-1).values
run(q, k, v, True, segment_ids_q=short, segment_ids_k=short, window=(60, -1),
    seqlens_q=torch.tensor([150, 101], dtype=torch.int32, device="cuda"))
run(q256, k256, v256, False, block_ids_q=short, block_ids_k=short.flip(0))
cu = torch.tensor([0, 50, 51, 150], dtype=torch.int32, device="cuda")
pq, pk, pv = (x.reshape(300, 2, 64)[:150] for x in (q, k, v))
run(pq, pk, pv, True, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=99, max_seqlen_k=99)
# mask_mod: tile lists per head and batch entry (tensor, padding), and shared ones (varlen aside)
doc = torch.randint(0, 3, (2, 150), dtype=torch.int32, device="cuda")
run(q, k, v, True, mask_mod="doc[b * 150 + q] == doc[b * 150 + k] || h == 1", mask_tensors={"doc": doc},
    seqlens_k=torch.tensor([150, 90], dtype=torch.int32, device="cuda"))
run(q, k, v, False, mask_mod="(q ^ k) % 3 != 0")
run(pq, pk, pv, False, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=99, max_seqlen_k=99, mask_mod="k < 20 || q < k")
# head_dim 128 (the warp-specialised forward): a window and lengths (each row's key interval), and with a
# mask_mod too (its bits loop, inside the sequence and at its ends)
q128, k128, v128 = (torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
lens = torch.tensor([300, 170], dtype=torch.int32, device="cuda")
run(q128, k128, v128, True, window=(100, 0), seqlens_q=lens, seqlens_k=lens)
run(q128, k128, v128, False, window=(-1, 30), seqlens_k=lens, mask_mod="doc[b * 300 + k] != 1 || k > q - 50",
    mask_tensors={"doc": torch.randint(0, 3, (2, 300), dtype=torch.int32, device="cuda")})
# ids with more work items than SMs (head_dim 64: the warp-specialised forward, whose producer searches each
# item's key intervals into its Q slot while the consumers read the other slot's)
qi = torch.randn(2, 600, 32, 64, device="cuda", dtype=torch.bfloat16)
ki, vi = (torch.randn(2, 600, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
runs = torch.randint(0, 40, (2, 600), dtype=torch.int32, device="cuda").sort(-1).values
run(qi, ki, vi, True, block_ids_q=runs, block_ids_k=runs, segment_ids_q=runs // 8, segment_ids_k=runs // 8,
    seqlens_q=torch.tensor([600, 413], dtype=torch.int32, device="cuda"))

# head_dim 192 / 256 with more work items than SMs (fwd_sm90_ws's one Q slot goes back at each warpgroup's last S,
# EARLY_Q, and the next item's Q lands in it while O is stored from registers), dense, causal, and a ragged last key
# tile; softcap at head_dim 64 (exponentials on the FMA units, online_row's POLY)
for dw in (192, 256):
    qw = torch.randn(1, 260, 96, dw, device="cuda", dtype=torch.bfloat16)
    kw2, vw2 = (torch.randn(1, 260, 8, dw, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for causal_w, mask_w in ((True, {}), (False, {}), (False, dict(seqlens_k=i32([200])))):
        flashrt.forward(qw, kw2, vw2, causal=causal_w, **mask_w)
flashrt.forward(qi, ki, vi, causal=True, softcap=20.0, seqlens_k=i32([600, 0]))
# head_dim 128 not causal: 176-key tiles with one Q slot (tiles._DENSE_PREFERENCES), more items than SMs
qd = torch.randn(1, 300, 96, 128, device="cuda", dtype=torch.bfloat16)
kd, vd = (torch.randn(1, 300, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
flashrt.forward(qd, kd, vd)
flashrt.forward(qd, kd, vd, seqlens_k=i32([250]))


# Arrays that break every rule, with validate=False: the kernels stay inside their tensors whatever the arrays
# hold (kernels_cu/attention/mask.cuh clamps lengths and offsets); at head_dim 64 (the warp-specialised forward, TMA)
# and 256.
def run_unchecked(q, k, v, causal, **mask):  # (the forward, and the split and unordered fused backward)
    out, lse = flashrt.forward(q, k, v, causal=causal, validate=False, **mask)
    do = torch.randn_like(out)
    for impl in ("split", "fused"):
        flashrt.backward(do, q, k, v, out, lse, causal=causal, impl=impl, deterministic=False, validate=False, **mask)


shuffled = torch.randint(-5, 5, (2, 150), dtype=torch.int32, device="cuda")
for qx, kx, vx in ((q, k, v), (q256, k256, v256)):
    run_unchecked(qx, kx, vx, True, seqlens_q=i32([1000, -7]), seqlens_k=i32([-1, 2**30]))
    run_unchecked(qx, kx, vx, False, block_ids_q=shuffled, block_ids_k=shuffled.flip(1), window=(3, 5))
    run_unchecked(qx, kx, vx, True, segment_ids_q=shuffled, segment_ids_k=shuffled.flip(0), seqlens_k=i32([150, 10**6]))
    px, pkx, pvx = (x.reshape(300, *x.shape[2:])[:150] for x in (qx, kx, vx))
    run_unchecked(px, pkx, pvx, False, cu_seqlens_q=i32([0, 10**6, -50]), cu_seqlens_k=i32([-10, 5, 2**31 - 1]),
                  max_seqlen_q=300, max_seqlen_k=40)
    run_unchecked(px, pkx, pvx, True, cu_seqlens_q=i32([140, 20, 150]), cu_seqlens_k=i32([0, 150, 100]),
                  max_seqlen_q=64, max_seqlen_k=200, block_ids_q=shuffled[0].sort().values, block_ids_k=shuffled[1])
# The device check on bad data (kernels_cu/helpers/mask_check.cu): it reports and sets the outputs to NaN.
out, lse = flashrt.forward(q, k, v, block_ids_q=shuffled, block_ids_k=shuffled)
try:
    flashrt.synchronize()
    raise SystemExit("the device check did not report decreasing block ids")
except ValueError:
    pass
torch.cuda.synchronize()
print(f"sanitize workload: {len(CASES) + 22 + 10 + 1} cases ran")

decode_cases()
torch.cuda.synchronize()
score_mod_cases()
padded_cases()
ordered_chunk_cases()
rotated_cases()
dropout_cases()
torch.cuda.synchronize()
print("sanitize workload: every part ran")
