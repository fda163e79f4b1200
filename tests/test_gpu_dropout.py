"""GPU tests of attention dropout (flashrt.forward / backward's dropout_p, dropout_rng; flashrt.attention and the SDPA
entry's dropout_p) against the float64 reference with the same mask (reference.dropout_mask), on every forward
family and the mma.sync backward, with masks, GQA, packed varlen; repeatability, fresh masks per call and per CUDA
graph replay.

Run on a GPU machine with `pytest -m gpu`; they skip elsewhere.
"""
import zlib

import pytest

import flashrt
from flashrt import reference

from test_gpu import f64, poison  # noqa: F401  (fixture)
from test_gpu_score_mods import CASES as SCORE_MOD_CASES
from test_gpu_score_mods import _f64, _id, _inputs, _mask, _reference

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


# (B, Sq, Sk, H, Hkv, D, causal, dtype, mask): the score modifications' shapes (the forward kernels at their head dims,
# GQA / MQA, Sq > Sk causal, one query row, which with dropout takes the forward kernels, not decode's, a window,
# padding, packed varlen) and head_dim 40.
CASES = SCORE_MOD_CASES + [(1, 96, 160, 2, 2, 40, False, "bf16", None)]


@pytest.mark.parametrize("p", [0.1, 0.5, 0.01])  # (8-bit draws; 0.01: 16-bit, spec.dropout_resolution)
@pytest.mark.parametrize("impl", ["split", "fused"])
@pytest.mark.parametrize("no_sm90", [False, True], ids=["default-kernels", "mma-sync"])
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_dropout_matches_float64_reference(torch, monkeypatch, case, no_sm90, impl, p):
    import cupy
    if no_sm90:
        monkeypatch.setenv("FLASHRT_NO_SM90", "1")
    B, Sq, Sk, H, Hkv, D, causal, dtype, mask = case
    seed = zlib.crc32(repr(case).encode())
    q, k, v, do, _ = _inputs(torch, B, Sq, Sk, H, Hkv, D, dtype, seed)
    kw, cu = _mask(torch, mask, Sq)
    rng = torch.tensor([seed * 7919 - 2**40, seed], device="cuda", dtype=torch.int64)
    packed = (lambda x: x[0]) if cu is not None else (lambda x: x)  # noqa: E731
    drop = dict(dropout_p=p, dropout_rng=rng)
    out, lse = flashrt.forward(*(packed(x) for x in (q, k, v)), causal=causal, **drop, **kw)
    dq, dk, dv = flashrt.backward(packed(do), *(packed(x) for x in (q, k, v)), out, lse, causal=causal, impl=impl,
                                  **drop, **kw)
    ro, rlse, rdq, rdk, rdv = _reference(torch, q, k, v, do, None, causal, mask, cu, drop=(rng.tolist(), p))
    if cu is not None:
        out, lse, dq, dk, dv = out[None], lse[None], dq[None], dk[None], dv[None]
    empty = ~cupy.isfinite(rlse)
    assert float(cupy.abs(cupy.where(empty, 0, _f64(lse) - rlse)).max()) < 2e-3, "lse (before dropout)"
    bound = {"bf16": 2e-2, "fp16": 5e-3}[dtype]
    for name, x, r in (("out", out, ro), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        e = reference.rel_error(_f64(x), r)
        assert e < bound, f"{name}: rel err {e:.2e}"
    # a wrong mask is no small error: the same inputs under another rng's mask are far off
    other = reference.dropout_mask((rng[0].item() + 1, rng[1].item()), p, B, H, Sq, Sk, xp=cupy)
    assert float(cupy.abs(other - reference.dropout_mask(rng.tolist(), p, B, H, Sq, Sk, xp=cupy)).max()) > 1


@pytest.mark.parametrize("mod", ["softcap", "alibi", "score_mod"])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_dropout_with_score_modifications_matches_reference(torch, D, mod):
    # dropout beside softcap / ALiBi (the wgmma backward) and a score_mod expression (the mma.sync backward)
    import cupy
    B, S, H, Hkv = 2, 160, 4, 2
    q, k, v, do, _ = _inputs(torch, B, S, S, H, Hkv, D, "bf16", D + len(mod))
    slopes = torch.rand(H, device="cuda")
    kw = {"softcap": dict(softcap=5.0), "alibi": dict(alibi_slopes=slopes),
          "score_mod": dict(score_mod="s - 0.5f * fabsf(kf - qf) * 0.1f")}[mod]
    ref_kw = {"softcap": dict(softcap=5.0), "alibi": dict(alibi_slopes=_f64(slopes)),
              "score_mod": dict(score_mod=lambda s, b, h, i, j, lq, lk: s - 0.05 * abs(j - i))}[mod]
    rng = flashrt.dropout_rng(q)
    out, lse = flashrt.forward(q, k, v, causal=True, dropout_p=0.2, dropout_rng=rng, **kw)
    grads = flashrt.backward(do, q, k, v, out, lse, causal=True, dropout_p=0.2, dropout_rng=rng, **kw)
    drop = reference.dropout_mask(rng.tolist(), 0.2, B, H, S, S, xp=cupy)
    ref = reference.attention(*(_f64(x) for x in (q, k, v)), causal=True, dout=_f64(do), dropout=drop, **ref_kw)
    for name, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref[0], *ref[2:])):
        e = reference.rel_error(_f64(x), r)
        assert e < 2e-2, f"{name}: rel err {e:.2e}"


def test_dropout_mask_is_bitwise_repeatable_and_new_per_rng(torch):
    q, k, v, do, _ = _inputs(torch, 2, 300, 300, 8, 2, 128, "bf16", 3)
    rng = flashrt.dropout_rng(q)
    runs = []
    for _ in range(2):
        out, lse = flashrt.forward(q, k, v, causal=True, dropout_p=0.2, dropout_rng=rng)
        runs.append((out, lse, *flashrt.backward(do, q, k, v, out, lse, causal=True, dropout_p=0.2, dropout_rng=rng)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    out2, lse2 = flashrt.forward(q, k, v, causal=True, dropout_p=0.2, dropout_rng=flashrt.dropout_rng(q))
    assert torch.equal(lse2, runs[0][1]) and not torch.equal(out2, runs[0][0])
    # without dropout_p the rng changes nothing
    plain = flashrt.forward(q, k, v, causal=True)
    assert torch.equal(plain[0], flashrt.forward(q, k, v, causal=True, dropout_rng=rng)[0])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_attention_dropout_gradients_match_reference(torch, compiled):
    q, k, v, do, _ = _inputs(torch, 2, 200, 200, 4, 2, 64, "bf16", 13)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    fn = lambda *a: flashrt.attention(*a, causal=True, dropout_p=0.25)  # noqa: E731
    if compiled:
        fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.manual_seed(1234)
    out = fn(*leaves)
    out.backward(do)
    torch.manual_seed(1234)  # the same draw from torch's generator: the call's rng
    rng = flashrt.dropout_rng(q).tolist()
    import cupy
    drop = reference.dropout_mask(rng, 0.25, 2, 4, 200, 200, xp=cupy)
    ref = reference.attention(*(_f64(x) for x in (q, k, v)), causal=True, dout=_f64(do), dropout=drop)
    for x, r in zip((out, *(t.grad for t in leaves)), (ref[0], *ref[2:])):
        assert reference.rel_error(_f64(x), r) < 2e-2


def test_sdpa_entry_takes_dropout(torch):
    q, k, v, _, _ = _inputs(torch, 1, 128, 128, 4, 4, 64, "bf16", 17)
    bhsd = [x.transpose(1, 2) for x in (q, k, v)]
    torch.manual_seed(5)
    out = flashrt.torch.scaled_dot_product_attention(*bhsd, dropout_p=0.3, is_causal=True)
    torch.manual_seed(5)
    rng = flashrt.dropout_rng(q).tolist()
    import cupy
    drop = reference.dropout_mask(rng, 0.3, 1, 4, 128, 128, xp=cupy)
    ref = reference.attention(*(_f64(x) for x in (q, k, v)), causal=True, dropout=drop)
    assert reference.rel_error(_f64(out.transpose(1, 2)), ref[0]) < 2e-2


def test_cuda_graph_replays_draw_new_masks(torch):
    q, k, v, _, _ = _inputs(torch, 2, 256, 256, 4, 2, 128, "bf16", 19)
    fn = lambda: flashrt.attention(q, k, v, causal=True, dropout_p=0.5)  # noqa: E731
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # (plans and compiles outside the capture)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    first = out.clone()
    graph.replay()
    assert torch.isfinite(out).all() and not torch.equal(first, out)


def test_dropout_keeps_the_expected_fraction(torch):
    # out = P V with V's column 0 all ones: each row's out[0] is its kept probabilities' sum times the scale, whose
    # mean over rows is 1; its spread shows the mask's rate (p = 0.5, 1024 keys: sd ~ 1 / sqrt(1024) per row)
    B, S, H, D = 2, 1024, 8, 64
    q = torch.zeros(B, S, H, D, device="cuda", dtype=torch.bfloat16)  # uniform probabilities
    v = torch.zeros(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    v[..., 0] = 1
    out, _ = flashrt.forward(q, q, v, dropout_p=0.5, dropout_rng=flashrt.dropout_rng(q))
    kept = out[..., 0].float()
    assert abs(kept.mean().item() - 1) < 0.01 and 0.02 < kept.std().item() < 0.04


def test_cupy_arrays_take_dropout(torch, poison):  # noqa: F811
    # CuPy inputs (views of torch memory) and a CuPy rng from flashrt.dropout_rng; outputs from the poisoned pool
    import cupy
    q, k, v, do, _ = _inputs(torch, 2, 150, 170, 4, 2, 128, "bf16", 23)
    cq, ck, cv, cdo = (cupy.from_dlpack(x) for x in (q, k, v, do))
    rng = flashrt.dropout_rng(cq)
    assert isinstance(rng, cupy.ndarray) and rng.dtype == cupy.int64 and rng.shape == (2,)
    out, lse = flashrt.forward(cq, ck, cv, causal=True, dropout_p=0.3, dropout_rng=rng)
    grads = flashrt.backward(cdo, cq, ck, cv, out, lse, causal=True, dropout_p=0.3, dropout_rng=rng)
    drop = reference.dropout_mask(rng.tolist(), 0.3, 2, 4, 150, 170, xp=cupy)
    ref = reference.attention(f64(q), f64(k), f64(v), causal=True, dout=f64(do), dropout=drop)
    for name, x, r in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref[0], *ref[2:])):
        assert isinstance(x, cupy.ndarray)
        e = reference.rel_error(f64(x), r)
        assert e < 2e-2, f"{name}: rel err {e:.2e}"
