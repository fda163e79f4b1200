"""GPU tests of flashrt.decode and flashrt.combine: float64 references per sequence, paged caches, appends, splits,
CUDA graphs, bad values. Run on a GPU machine with `pytest -m gpu`; they skip elsewhere."""
import math

import pytest

import flashrt
from flashrt import api, interop, tiles

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


@pytest.fixture
def poisoned(monkeypatch):
    """flashrt's own uninitialised allocations (outputs, partials) start as NaN, so an unwritten element shows."""
    real = interop.new_many

    def new_many(x, specs):
        out = real(x, specs)
        for a, (_, kind, fill) in zip(out, specs):
            if fill is None and kind != "i32":
                a.fill_(float("nan")) if interop.is_torch(a) else a.fill(float("nan"))
        return out
    monkeypatch.setattr(interop, "new_many", new_many)


def _dt(torch, dtype):
    return {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def make_case(torch, B, Sq, H, Hkv, D, cap, dtype="bf16", page_size=0, new=True, seed=0, lens=None):
    """Random q, caches (contiguous, or paged with a shuffled page table), new k / v and ragged lengths
    (0 and a full cache among them)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = _dt(torch, dtype)
    n_new = Sq if new else 0
    if lens is None:
        lens = torch.randint(0, cap - n_new + 1, (B,), generator=g, device="cuda", dtype=torch.int32)
        lens[0] = 0 if n_new else min(cap, 1)  # (without new keys, a sequence of 0 sees nothing: checked apart)
        if B > 1:
            lens[1] = cap - n_new
    q = torch.randn(B, Sq, H, D, generator=g, device="cuda", dtype=dt)
    kn = torch.randn(B, Sq, Hkv, D, generator=g, device="cuda", dtype=dt) if new else None
    vn = torch.randn(B, Sq, Hkv, D, generator=g, device="cuda", dtype=dt) if new else None
    if page_size:
        pages_per = -(-cap // page_size)
        num_pages = B * pages_per + 3
        perm = torch.randperm(num_pages, generator=g, device="cuda")[: B * pages_per]
        table = perm.view(B, pages_per).to(torch.int32)
        kc = torch.randn(num_pages, page_size, Hkv, D, generator=g, device="cuda", dtype=dt)
        vc = torch.randn(num_pages, page_size, Hkv, D, generator=g, device="cuda", dtype=dt)
    else:
        table = None
        kc = torch.randn(B, cap, Hkv, D, generator=g, device="cuda", dtype=dt)
        vc = torch.randn(B, cap, Hkv, D, generator=g, device="cuda", dtype=dt)
    return q, kc, vc, kn, vn, lens, table


def logical_cache(kc, table, b, n):
    """Sequence b's first n cache rows, (n, Hkv, D), through the page table if any."""
    if table is None:
        return kc[b, :n]
    ps = kc.shape[1]
    idx = [int(table[b, t // ps]) * ps + t % ps for t in range(n)]
    return kc.reshape(-1, *kc.shape[2:])[idx]


def reference(torch, q, kc, vc, kn, vn, lens, table, causal=True, window=(-1, -1), scale=None, sinks=None,
              softcap=None, alibi=None):
    """float64 out (B, Sq, H, D) and lse (B, H, Sq) of decode's definition (sinks (H,): one more logit per head's
    rows, with no value; softcap c: each scaled score x becomes c tanh(x / c); alibi (H,) or (B, H) slopes: x less
    slope |key - position|)."""
    B, Sq, H, D = q.shape
    Hkv = kc.shape[2]
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = torch.zeros(B, Sq, H, D, dtype=torch.float64, device="cuda")
    lse = torch.full((B, H, Sq), -math.inf, dtype=torch.float64, device="cuda")
    for b in range(B):
        L0 = int(lens[b])
        k = logical_cache(kc, table, b, L0).double()
        v = logical_cache(vc, table, b, L0).double()
        if kn is not None:
            k, v = torch.cat([k, kn[b].double()]), torch.cat([v, vn[b].double()])
        L = k.shape[0]
        if L == 0:
            if sinks is not None:
                lse[b] = sinks.double()[:, None]
            continue
        pos = (L - Sq + torch.arange(Sq, device="cuda"))[:, None]
        key = torch.arange(L, device="cuda")[None, :]
        vis = torch.ones(Sq, L, dtype=torch.bool, device="cuda")
        if causal:
            vis &= key <= pos
        if window[0] >= 0:
            vis &= key >= pos - window[0]
        if window[1] >= 0:
            vis &= key <= pos + window[1]
        kk = k.repeat_interleave(H // Hkv, dim=1)  # (L, H, D)
        vv = v.repeat_interleave(H // Hkv, dim=1)
        s = torch.einsum("ihd,jhd->hij", q[b].double(), kk) * scale
        if softcap is not None:
            s = softcap * torch.tanh(s / softcap)
        if alibi is not None:
            slopes = (alibi if alibi.dim() == 1 else alibi[b]).double()
            s = s - slopes[:, None, None] * (key - pos).abs()[None]
        s = s.masked_fill(~vis[None], -math.inf)
        if sinks is not None:
            s = torch.cat([s, sinks.double()[:, None, None].expand(H, Sq, 1)], -1)
        m = s.amax(-1, keepdim=True)
        m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True)
        o = torch.einsum("hij,jhd->ihd", p[..., :L] / torch.where(denom > 0, denom, torch.ones_like(denom)), vv)
        out[b] = o
        lse[b] = torch.where(denom[..., 0] > 0, (m[..., 0] + torch.log(denom[..., 0])), -math.inf)
    return out, lse


def check(torch, out, lse, ref_out, ref_lse, dtype):
    tol = 2e-2 if dtype == "bf16" else 4e-3
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    err = (out.double() - ref_out).abs().max().item()
    assert err < tol, f"max |out - ref| = {err}"
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-3


CASES = [  # B, Sq, H, Hkv, D, capacity, page_size, new, num_splits, dtype
    (4, 1, 32, 8, 128, 1000, 0, True, 0, "bf16"),
    (3, 1, 8, 1, 64, 3000, 0, True, 0, "fp16"),
    (2, 4, 32, 8, 128, 700, 0, True, 3, "bf16"),
    (2, 16, 8, 1, 128, 513, 0, True, 0, "bf16"),  # 128 packed rows: two row tiles of 64
    (2, 16, 4, 4, 256, 300, 0, True, 1, "bf16"),
    (3, 2, 6, 2, 72, 257, 0, False, 0, "bf16"),
    (2, 1, 16, 2, 256, 2048, 0, False, 5, "fp16"),
    (3, 1, 32, 8, 128, 1000, 16, True, 0, "bf16"),
    (2, 3, 8, 2, 64, 900, 64, True, 2, "bf16"),
    (2, 8, 8, 8, 128, 600, 256, True, 0, "fp16"),
    (1, 1, 8, 1, 128, 20000, 0, True, 0, "bf16"),  # one sequence over many splits
    # rows whose 16-byte chunks do not divide the threads (decode.cu's loader takes a tile's chunks in order):
    # contiguous, pages of 16 and 64 keys, and at 240 / 208 a last partial round (32-key tiles)
    (3, 1, 16, 2, 192, 1500, 0, True, 0, "bf16"),
    (2, 2, 12, 4, 96, 1100, 16, True, 0, "bf16"),
    (2, 1, 8, 2, 160, 900, 64, True, 3, "fp16"),
    (2, 4, 16, 2, 240, 700, 0, True, 2, "bf16"),
    (2, 8, 16, 2, 208, 600, 16, True, 0, "bf16"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_decode_matches_float64_reference(torch, poisoned, case):
    B, Sq, H, Hkv, D, cap, ps, new, splits, dtype = case
    q, kc, vc, kn, vn, lens, table = make_case(torch, B, Sq, H, Hkv, D, cap, dtype, ps, new, seed=hash(case) % 1000)
    kc0, vc0 = kc.clone(), vc.clone()
    ref_out, ref_lse = reference(torch, q, kc, vc, kn, vn, lens, table)
    out, lse = flashrt.decode(q, kc, vc, cache_seqlens=lens, k=kn, v=vn, page_table=table, num_splits=splits,
                              return_lse=True)
    check(torch, out, lse, ref_out, ref_lse, dtype)
    # the append: exactly the new rows changed, to k / v
    expect_k, expect_v = kc0.clone(), vc0.clone()
    if new:
        for b in range(B):
            for i in range(Sq):
                t = int(lens[b]) + i
                if table is None:
                    expect_k[b, t], expect_v[b, t] = kn[b, i], vn[b, i]
                else:
                    page = int(table[b, t // ps])
                    expect_k[page, t % ps], expect_v[page, t % ps] = kn[b, i], vn[b, i]
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)


@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (100, -1)), (False, (37, 2)), (True, (0, 0))])
def test_decode_masks(torch, poisoned, causal, window):
    q, kc, vc, kn, vn, lens, table = make_case(torch, 3, 5, 8, 2, 128, 800, page_size=32, seed=7)
    ref_out, ref_lse = reference(torch, q, kc, vc, kn, vn, lens, table, causal, window)
    out, lse = flashrt.decode(q, kc, vc, cache_seqlens=lens, k=kn, v=vn, page_table=table, causal=causal,
                              window=window, num_splits=3, return_lse=True)
    check(torch, out, lse, ref_out, ref_lse, "bf16")


@pytest.mark.parametrize("splits", [1, 4])
@pytest.mark.parametrize("paged", [False, True])
def test_decode_with_sinks_matches_float64_reference(torch, poisoned, splits, paged):
    # one block per sequence (decode.cu joins the sink) and several (combine.cu does); a sequence that sees no key
    # (out 0, lse = its sink); a sink that outweighs the keys
    q, kc, vc, _, _, lens, table = make_case(torch, 3, 2, 8, 2, 128, 640, page_size=64 if paged else 0, new=False,
                                             seed=21 + splits + paged)
    lens[0] = 0
    sinks = torch.randn(8, device="cuda") * 2
    sinks[1] = 8.0
    ref_out, ref_lse = reference(torch, q, kc, vc, None, None, lens, table, sinks=sinks)
    out, lse = flashrt.decode(q, kc, vc, cache_seqlens=lens, page_table=table, num_splits=splits, sinks=sinks,
                              return_lse=True)
    check(torch, out, lse, ref_out, ref_lse, "bf16")
    # (decode.cu's lse goes through log2 units: within an ulp or two of the sink)
    assert torch.all(out[0] == 0) and (lse[0] - sinks[:, None]).abs().max() < 1e-5


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("D,rows", [(128, 1), (64, 4), (256, 16)])
def test_decode_with_softcap_matches_float64_reference(torch, poisoned, splits, D, rows):
    """softcap (kernels_cu/sm80/decode.cu: Softcap before the mask) at every packed-row tile size, paged, with new
    tokens, a window, sinks and splits; a cap of 5 bends the scores of these inputs (|x| up to ~4); tanh.approx
    (relative error 2^-11) keeps the output within the bf16 tolerance."""
    q, kc, vc, kn, vn, lens, table = make_case(torch, 3, rows, 8, 2, D, 900, page_size=64, seed=50 + D + splits)
    q = q * 2
    sinks = torch.randn(8, device="cuda")
    ref_out, ref_lse = reference(torch, q, kc, vc, kn, vn, lens, table, True, (300, -1), sinks=sinks, softcap=5.0)
    plain, _ = reference(torch, q, kc, vc, kn, vn, lens, table, True, (300, -1), sinks=sinks)
    assert (plain - ref_out).abs().max() > 0.05, "the cap must change the answer"
    out, lse = flashrt.decode(q, kc, vc, cache_seqlens=lens, k=kn, v=vn, page_table=table, window=(300, -1),
                              num_splits=splits, sinks=sinks, softcap=5.0, return_lse=True)
    check(torch, out, lse, ref_out, ref_lse, "bf16")
    # flashrt.forward with few query rows takes decode.cu with its softcap too, and its lse feeds the backward
    k, v = (torch.randn(2, 700, 2, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q2 = torch.randn(2, rows, 8, D, device="cuda", dtype=torch.bfloat16) * 2
    out, lse = flashrt.forward(q2, k, v, causal=True, softcap=5.0)
    ref_out, ref_lse = reference(torch, q2, k, v, None, None, torch.full((2,), 700, dtype=torch.int32, device="cuda"),
                                 None, softcap=5.0)
    check(torch, out, lse, ref_out, ref_lse, "bf16")
    with pytest.raises(ValueError, match="softcap must be a finite positive number"):
        flashrt.decode(q, kc, vc, cache_seqlens=lens, page_table=table, softcap=float("inf"))


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("D,rows,splits", [(128, 1, 1), (64, 4, 3), (256, 16, 2)])
def test_decode_with_alibi_matches_float64_reference(torch, poisoned, per_batch, D, rows, splits):
    """ALiBi in decode.cu (each packed row's head's slope, its token's position L - Sq + i): (H,) and (B, H) slopes,
    every packed-row tile size, paged, new tokens, causal; and flashrt.forward's decode route with the same slopes
    against its forward kernels."""
    B, H, Hkv = 3, 8, 2
    q, kc, vc, kn, vn, lens, table = make_case(torch, B, rows, H, Hkv, D, 900, page_size=64, seed=70 + D + per_batch)
    slopes = 2.0 ** -torch.arange(1, H + 1, device="cuda", dtype=torch.float32)  # (the ALiBi paper's, 8 heads)
    if per_batch:
        slopes = slopes[None].repeat(B, 1) * torch.tensor([[1.0], [0.5], [2.0]], device="cuda")
    ref_out, ref_lse = reference(torch, q, kc, vc, kn, vn, lens, table, alibi=slopes)
    plain, _ = reference(torch, q, kc, vc, kn, vn, lens, table)
    assert (plain - ref_out).abs().max() > 0.05, "the slopes must change the answer"
    out, lse = flashrt.decode(q, kc, vc, cache_seqlens=lens, k=kn, v=vn, page_table=table, num_splits=splits,
                              alibi_slopes=slopes, return_lse=True)
    check(torch, out, lse, ref_out, ref_lse, "bf16")
    k, v = (torch.randn(B, 700, Hkv, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    q2 = torch.randn(B, rows, H, D, device="cuda", dtype=torch.bfloat16)
    out, lse = flashrt.forward(q2, k, v, causal=True, alibi_slopes=slopes)
    ref_out, ref_lse = reference(torch, q2, k, v, None, None, torch.full((B,), 700, dtype=torch.int32, device="cuda"),
                                 None, alibi=slopes)
    check(torch, out, lse, ref_out, ref_lse, "bf16")
    with pytest.raises(ValueError, match="softcap and alibi_slopes together are not supported yet"):
        flashrt.decode(q, kc, vc, cache_seqlens=lens, page_table=table, softcap=30.0, alibi_slopes=slopes)
    with pytest.raises(ValueError, match="alibi_slopes must have shape"):
        flashrt.decode(q, kc, vc, cache_seqlens=lens, page_table=table, alibi_slopes=slopes[..., :3])


def test_decode_empty_sequence_sees_nothing(torch, poisoned):
    q, kc, vc, _, _, _, _ = make_case(torch, 2, 1, 8, 2, 64, 256, new=False)
    lens = torch.tensor([0, 100], dtype=torch.int32, device="cuda")
    out, lse = flashrt.decode(q, kc, vc, cache_seqlens=lens, return_lse=True)
    assert torch.all(out[0] == 0) and torch.all(lse[0] == -math.inf)
    ref_out, _ = reference(torch, q, kc, vc, None, None, lens, None)
    assert (out[1].double() - ref_out[1]).abs().max() < 2e-2


def test_decode_splits_are_deterministic(torch):
    q, kc, vc, _, _, lens, _ = make_case(torch, 2, 2, 32, 8, 128, 8000, new=False, seed=3)
    runs = [flashrt.decode(q, kc, vc, cache_seqlens=lens, num_splits=7, return_lse=True) for _ in range(3)]
    for out, lse in runs[1:]:
        assert torch.equal(out, runs[0][0]) and torch.equal(lse, runs[0][1])


def test_decode_cupy_inputs_agree_bitwise(torch, poisoned):
    import cupy
    q, kc, vc, kn, vn, lens, table = make_case(torch, 2, 2, 8, 2, 128, 512, page_size=64, seed=5)
    kc2, vc2 = kc.clone(), vc.clone()
    out = flashrt.decode(q, kc, vc, cache_seqlens=lens, k=kn, v=vn, page_table=table)
    cp = [cupy.from_dlpack(x) for x in (q, kc2, vc2, kn, vn, lens, table)]
    out2 = flashrt.decode(cp[0], cp[1], cp[2], cache_seqlens=cp[5], k=cp[3], v=cp[4], page_table=cp[6])
    assert isinstance(out2, cupy.ndarray)
    assert torch.equal(out, torch.from_dlpack(out2)) and torch.equal(kc, kc2)


def test_decode_cuda_graph_replays_with_new_lengths(torch):
    B, H, Hkv, D, cap = 4, 16, 4, 128, 2048
    q, kc, vc, kn, vn, lens, table = make_case(torch, B, 1, H, Hkv, D, cap, page_size=64, seed=11)
    lens.copy_(torch.tensor([5, 700, 1500, 30], dtype=torch.int32, device="cuda"))
    flashrt.decode(q, kc, vc, cache_seqlens=lens, k=kn, v=vn, page_table=table)  # warm-up: compile, plan
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashrt.decode(q, kc, vc, cache_seqlens=lens, k=kn, v=vn, page_table=table)
    for step in range(3):
        new_lens = torch.tensor([6 + step, 701 + step, 1501 + step, 31 + step], dtype=torch.int32, device="cuda")
        lens.copy_(new_lens)
        q.normal_(), kn.normal_(), vn.normal_()
        ref_out, _ = reference(torch, q, kc, vc, kn, vn, lens, table)  # (before the replay appends)
        graph.replay()
        torch.cuda.synchronize()
        assert (out.double() - ref_out).abs().max() < 2e-2


def test_bad_values_give_nan_and_an_error(torch):
    q, kc, vc, kn, vn, lens, table = make_case(torch, 2, 1, 8, 2, 64, 512, page_size=64, seed=2)
    lens.copy_(torch.tensor([10, 512], dtype=torch.int32, device="cuda"))  # 512 + 1 new > 512
    kc0 = kc.clone()
    out = flashrt.decode(q, kc, vc, cache_seqlens=lens, k=kn, v=vn, page_table=table)
    with pytest.raises(ValueError, match=r"cache_seqlens\[1\] = 512"):
        flashrt.synchronize()
    assert torch.isnan(out[1]).all() and not torch.isnan(out[0]).any()
    expect = kc0.clone()
    expect[int(table[0, 0]), 10] = kn[0, 0]  # sequence 0 appended; sequence 1 (bad) wrote nothing
    assert torch.equal(kc, expect)
    lens.copy_(torch.tensor([10, 100], dtype=torch.int32, device="cuda"))
    table[0, 0] = 10_000
    out = flashrt.decode(q, kc, vc, cache_seqlens=lens, k=kn, v=vn, page_table=table)
    with pytest.raises(ValueError, match="page id 10000"):
        flashrt.synchronize()
    assert torch.isnan(out[0]).all() and not torch.isnan(out[1]).any()


def test_argument_errors_are_clear(torch):
    q, kc, vc, kn, _, lens, table = make_case(torch, 2, 1, 8, 2, 64, 256, page_size=64)
    with pytest.raises(ValueError, match="1 to 16 new tokens"):
        flashrt.decode(torch.zeros(2, 17, 8, 64, dtype=torch.bfloat16, device="cuda"), kc, vc, cache_seqlens=lens,
                       page_table=table)
    with pytest.raises(ValueError, match="page_table must be int32"):
        flashrt.decode(q, kc, vc, cache_seqlens=lens, page_table=table.long())
    with pytest.raises(ValueError, match="cache_seqlens must be int32"):
        flashrt.decode(q, kc, vc, cache_seqlens=lens[:1], page_table=table)
    with pytest.raises(ValueError, match="needs page_table"):
        flashrt.decode(q, kc, vc, cache_seqlens=lens)
    with pytest.raises(ValueError, match="k and v must be given together"):
        flashrt.decode(q, kc, vc, cache_seqlens=lens, k=kn, page_table=table)


def test_combine_of_key_halves_is_the_whole(torch):
    g = torch.Generator(device="cuda").manual_seed(0)
    B, Sq, Sk, H, D = 2, 64, 1000, 4, 128
    q, k, v = (torch.randn(B, s, H, D, generator=g, device="cuda", dtype=torch.bfloat16) for s in (Sq, Sk, Sk))
    whole, whole_lse = flashrt.forward(q, k, v)
    parts = [flashrt.forward(q, k[:, a:b], v[:, a:b]) for a, b in ((0, 300), (300, 1000))]
    out, lse = flashrt.combine([p[0] for p in parts], [p[1] for p in parts])
    assert out.dtype == torch.bfloat16 and lse.shape == (B, H, Sq)
    assert (out.double() - whole.double()).abs().max() < 2e-2
    assert (lse - whole_lse).abs().max() < 1e-4
    out32, lse32 = flashrt.combine(torch.stack([p[0].float() for p in parts]), torch.stack([p[1] for p in parts]))
    assert out32.dtype == torch.float32 and torch.equal(lse32, lse)
    again, _ = flashrt.combine([p[0] for p in parts], [p[1] for p in parts])
    assert torch.equal(again, out)


@pytest.mark.parametrize("n,D,dtype", [(1, 64, "bf16"), (2, 128, "bf16"), (3, 72, "fp16"), (5, 256, "bf16"),
                                       (2, 128, "float32"), (40, 64, "bf16")])
@pytest.mark.parametrize("kernel", ["warps", "rows"])
def test_combine_kernels_agree_with_a_float64_merge(torch, monkeypatch, n, D, dtype, kernel):
    """combine.cu's two kernels (warps per row; combine_rows' thread per 8 columns), forced in turn: the lse-weighted
    sum in float64 within the output dtype's rounding, rows a part did not see (-inf), a row no part saw (0 and
    -inf), a NaN lse (the row NaN), and bitwise repeatable."""
    g = torch.Generator(device="cuda").manual_seed(n * D)
    B, Sq, H = 2, 37, 3
    t = {"bf16": torch.bfloat16, "fp16": torch.float16, "float32": torch.float32}[dtype]
    o = torch.randn(n, B, Sq, H, D, generator=g, device="cuda").to(t)
    lse = torch.randn(n, B, H, Sq, generator=g, device="cuda") * 4
    lse[0, 0, 0, :10] = -torch.inf
    lse[:, 1, 2, 5] = -torch.inf
    lse[n - 1, 1, 0, 7] = torch.nan
    monkeypatch.setattr(tiles, "combine_rows", lambda *a: kernel == "rows")
    api._PLANS.clear()  # (a plan of this signature made with the other kernel)
    out, out_lse = flashrt.combine(o, lse)
    again = flashrt.combine(o, lse)
    assert all(torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(again, (out, out_lse)))
    every = lse.double()
    whole = torch.logsumexp(every, 0)
    w = torch.exp(every - torch.where(whole == -torch.inf, 0.0, whole)).permute(0, 1, 3, 2)[..., None]
    want = (w * o.double()).sum(0)
    nan = torch.zeros(B, Sq, H, dtype=torch.bool, device="cuda")
    nan[1, 7, 0] = True
    assert torch.isnan(out[nan]).all() and torch.isnan(out_lse[1, 0, 7])
    assert not torch.isnan(out[~nan]).any()
    tol = {"bf16": 2e-2, "fp16": 4e-3, "float32": 1e-5}[dtype]
    assert (out[~nan].double() - want[~nan]).abs().max() < tol
    assert (out[1, 5, 2] == 0).all() and out_lse[1, 2, 5] == -torch.inf
    finite = ~torch.isnan(out_lse) & (whole != -torch.inf)
    assert (out_lse[finite].double() - whole[finite]).abs().max() < 1e-5


@pytest.mark.parametrize("Sq,causal,window", [(1, True, (-1, -1)), (5, True, (-1, -1)), (16, False, (-1, -1)),
                                              (7, True, (50, -1)), (12, False, (20, 3)), (16, True, (0, 0))])
def test_forward_with_few_queries_runs_decode_kernels(torch, poisoned, monkeypatch, Sq, causal, window):
    """flashrt.forward with few query rows per KV head takes decode.cu (bottom-right causal, windows): the same answer
    as the reference, and as the forward kernels (FLASHRT_NO_DECODE_FORWARD=1), and its lse feeds the backward."""
    g = torch.Generator(device="cuda").manual_seed(Sq)
    B, Sk, H, Hkv, D = 2, 1500, 4, 2, 128  # (up to 32 rows per KV head: decoding.FORWARD_MAX_ROWS)
    q = torch.randn(B, Sq, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Sk, Hkv, D, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    kw = dict(causal=causal) if window == (-1, -1) else dict(causal=causal, window=window)
    out, lse = flashrt.forward(q, k, v, **kw)
    lens = torch.full((B,), Sk, dtype=torch.int32, device="cuda")
    ref_out, ref_lse = reference(torch, q, k, v, None, None, lens, None, causal, window)
    check(torch, out, lse, ref_out, ref_lse, "bf16")
    monkeypatch.setenv("FLASHRT_NO_DECODE_FORWARD", "1")
    out2, lse2 = flashrt.forward(q, k, v, **kw)
    assert (out.float() - out2.float()).abs().max() < 2e-2 and (lse - lse2).abs().max() < 1e-3
    do = torch.randn_like(out)
    grads = flashrt.backward(do, q, k, v, out, lse, **kw)
    grads2 = flashrt.backward(do, q, k, v, out2, lse2, **kw)
    for a, b in zip(grads, grads2):
        assert (a.float() - b.float()).abs().max() < 5e-2


def test_decode_under_torch_compile(torch):
    """torch.compile(fullgraph=True) traces flashrt.decode as the custom op flashrt::decode: the same outputs and
    the same appended caches as eager."""
    q, kc, vc, kn, vn, lens, table = make_case(torch, 2, 2, 8, 2, 128, 512, page_size=64, seed=9)
    kc2, vc2 = kc.clone(), vc.clone()

    def step(q, kc, vc, lens, kn, vn, table):
        out, lse = flashrt.decode(q, kc, vc, cache_seqlens=lens, k=kn, v=vn, page_table=table, return_lse=True)
        return out * 2, lse

    compiled = torch.compile(step, fullgraph=True)
    out, lse = compiled(q, kc, vc, lens, kn, vn, table)
    ref, ref_lse = step(q, kc2, vc2, lens, kn, vn, table)
    assert torch.equal(out, ref) and torch.equal(lse, ref_lse)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    torch.library.opcheck(torch.ops.flashrt.decode.default, (q, kc, vc, lens, kn, vn, table, True, [-1, -1], None, 0))
    sinks = torch.randn(8, device="cuda")
    torch.library.opcheck(torch.ops.flashrt.decode.default,
                          (q, kc, vc, lens, kn, vn, table, True, [-1, -1], None, 0, sinks))
    torch.library.opcheck(torch.ops.flashrt.decode.default,
                          (q, kc, vc, lens, kn, vn, table, True, [-1, -1], None, 0, sinks, 30.0))
    slopes = torch.rand(8, device="cuda")
    torch.library.opcheck(torch.ops.flashrt.decode.default,
                          (q, kc, vc, lens, kn, vn, table, True, [-1, -1], None, 0, sinks, None, slopes))
