"""torch integration: custom ops, torch.compile, CUDA graphs, checkpointing, the SDPA entry, autocast, streams.

The module needs torch (it skips without it). Tests marked `gpu` need a GPU; the
others run on the CPU (meta tensors, argument errors raised before any CUDA call).
"""
import math

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import flashrt  # noqa: E402
import flashrt.torch  # noqa: E402  (flashrt.torch.scaled_dot_product_attention)
from flashrt import launch  # noqa: E402

gpu = pytest.mark.gpu
BF16, FP16 = torch.bfloat16, torch.float16


def make_inputs(B, Sq, Sk, H, Hkv, D, dtype, seed):
    """q, k, v (B, S, H, D) and an upstream gradient like q, on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Sk, Hkv, D, device="cuda", dtype=dtype, generator=g)
    do = torch.randn(B, Sq, H, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v, do


def leaves(*xs, dtype=None):
    return [x.detach().to(dtype or x.dtype).clone().requires_grad_() for x in xs]


def attention_grads(fn, q, k, v, do):
    """(out, dq, dk, dv) of fn(q, k, v) on fresh leaves."""
    ql, kl, vl = leaves(q, k, v)
    out = fn(ql, kl, vl)
    out.backward(do)
    return [out.detach(), ql.grad, kl.grad, vl.grad]


def rel_error(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def assert_compiled_matches_eager(got, eager):
    # Inductor's own kernels for the ops around attention (layer norm, the residual add) may round
    # a few bf16 elements the other way, so the outputs and gradients agree to bf16 rounding, not bitwise.
    for i, (a, b) in enumerate(zip(got, eager)):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert rel_error(a, b) < 1e-2, f"tensor {i}: rel err {rel_error(a, b):.2e} between compiled and eager"


class Block(torch.nn.Module):
    """Pre-norm causal attention block, x + o(attention(norm x)); k and v are views of one projection."""

    def __init__(self, dim, heads, kv_heads, head_dim):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.norm = torch.nn.LayerNorm(dim)
        self.q = torch.nn.Linear(dim, heads * head_dim, bias=False)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * head_dim, bias=False)
        self.o = torch.nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x):
        B, S, _ = x.shape
        h = self.norm(x)
        q = self.q(h).view(B, S, self.heads, self.head_dim)
        k, v = self.kv(h).view(B, S, 2, self.kv_heads, self.head_dim).unbind(2)
        return x + self.o(flashrt.attention(q, k, v, causal=True).reshape(B, S, -1))


# ---------------------------------------------------------------------------
# CPU: registration and argument checks
# ---------------------------------------------------------------------------
def test_fake_impls_and_autograd_formula_on_meta_tensors():
    q = torch.empty(2, 5, 8, 64, device="meta", dtype=BF16, requires_grad=True)
    k = torch.empty(2, 7, 2, 64, device="meta", dtype=BF16, requires_grad=True)
    v = torch.empty(2, 7, 2, 64, device="meta", dtype=BF16, requires_grad=True)
    out, lse = flashrt.attention(q, k, v, causal=True, return_lse=True)
    assert (out.shape, out.dtype, out.device.type) == (q.shape, BF16, "meta") and out.requires_grad
    assert (lse.shape, lse.dtype) == ((2, 8, 5), torch.float32) and not lse.requires_grad
    out.backward(torch.ones_like(out))  # register_autograd's formula into flashrt::bwd's fake impl
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
    assert q.grad.dtype == BF16


def test_v_head_dim_of_its_own_through_the_fake_impls():
    """out and dout take v's head_dim (MLA's 192 / 128)."""
    q = torch.empty(2, 5, 8, 192, device="meta", dtype=BF16, requires_grad=True)
    k = torch.empty(2, 7, 2, 192, device="meta", dtype=BF16, requires_grad=True)
    v = torch.empty(2, 7, 2, 128, device="meta", dtype=BF16, requires_grad=True)
    out = flashrt.attention(q, k, v, causal=True)
    assert out.shape == (2, 5, 8, 128)
    out.backward(torch.ones_like(out))
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)


def test_sinks_gradient_through_the_fake_impls():
    q = torch.empty(2, 5, 8, 64, device="meta", dtype=BF16, requires_grad=True)
    k = torch.empty(2, 7, 2, 64, device="meta", dtype=BF16, requires_grad=True)
    sinks = torch.empty(8, device="meta", dtype=BF16, requires_grad=True)
    out = flashrt.attention(q, k, k, causal=True, sinks=sinks)
    out.backward(torch.ones_like(out))
    assert sinks.grad is not None and (sinks.grad.shape, sinks.grad.dtype) == ((8,), BF16)
    q.grad = None
    flashrt.attention(q, k, k).backward(torch.ones_like(out))  # without sinks: dsinks is an empty output
    assert q.grad.shape == q.shape
    with pytest.raises(ValueError, match="sinks must be a floating-point tensor"):
        flashrt.attention(q, k, k, sinks=torch.zeros(8, dtype=torch.int32, device="meta"))


def test_alibi_slopes_through_the_fake_impls_and_their_errors():
    q = torch.empty(2, 5, 8, 64, device="meta", dtype=BF16, requires_grad=True)
    k = torch.empty(2, 7, 2, 64, device="meta", dtype=BF16, requires_grad=True)
    for slopes in (torch.empty(8, device="meta"), torch.empty(2, 8, device="meta", dtype=BF16)):
        out = flashrt.attention(q, k, k, causal=True, alibi_slopes=slopes)
        out.backward(torch.ones_like(out))  # the slopes take no gradient: None in the autograd formula
        assert q.grad.shape == q.shape
        q.grad = None
    with pytest.raises(ValueError, match=r"alibi_slopes get no gradient.*alibi_slopes\.detach\(\)"):
        flashrt.attention(q, k, k, alibi_slopes=torch.empty(8, device="meta", requires_grad=True))
    with pytest.raises(ValueError, match="alibi_slopes must be a floating-point tensor"):
        flashrt.attention(q, k, k, alibi_slopes=torch.zeros(8, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="alibi_slopes must be a floating-point tensor .* got list"):
        flashrt.attention(q, k, k, alibi_slopes=[0.5] * 8)
    with pytest.raises(ValueError, match="softcap and alibi_slopes together are not supported yet"):
        flashrt.attention(q, k, k, softcap=30.0, alibi_slopes=torch.empty(8, device="meta"))


def test_score_mod_through_the_fake_impls_and_its_errors():
    """score_mod's strings and tensors through the ops (their tensors after mask_mod's in the op's list), the
    autograd formula into flashrt::bwd's fake impl, and what is refused before any kernel."""
    q = torch.empty(2, 5, 8, 64, device="meta", dtype=BF16, requires_grad=True)
    k = torch.empty(2, 7, 2, 64, device="meta", dtype=BF16, requires_grad=True)
    bias = torch.empty(8 * 11, device="meta")  # (H, Sq + Sk - 1) relative-position table
    sel = torch.empty(4, dtype=torch.int32, device="meta")
    for kw in (dict(score_mod="s + bias[h * 11 + k - q + 4]", score_tensors={"bias": bias}),
               dict(score_mod="s * s / 8.f", score_mod_grad="s / 4.f"),
               dict(score_mod="s + bias[h * 11 + k - q + 4] * sel[k % 4]", score_tensors={"bias": bias, "sel": sel},
                    mask_mod="sel[q % 4] >= 0 || k <= q", mask_tensors={"sel": sel})):
        out, lse = flashrt.attention(q, k, k, causal=True, return_lse=True, **kw)
        assert out.shape == q.shape and lse.shape == (2, 8, 5) and out.requires_grad
        out.backward(torch.ones_like(out))
        assert q.grad.shape == q.shape and k.grad.shape == k.shape
        q.grad = k.grad = None
    learned = torch.empty(8 * 11, device="meta", requires_grad=True)  # (its gradient: the backward op's fake impl)
    flashrt.attention(q, k, k, score_mod="s + bias[k]", score_tensors={"bias": learned}).sum().backward()
    assert learned.grad.shape == learned.shape and q.grad.shape == q.shape
    q.grad = k.grad = None
    with pytest.raises(ValueError, match=r"score_tensors\['bias'\] requires grad: only float32 score tensors take "
                                         r"one, got torch\.float64"):
        flashrt.attention(q, k, k, score_mod="s + bias[k]", score_tensors={"bias": learned.double()})
    with torch.no_grad():  # (no gradient asked for: a learned table serves inference as it is)
        flashrt.attention(q, k, k, score_mod="s + bias[k]", score_tensors={"bias": learned})
    flashrt.attention(q, k, k, score_mod="s + bias[k]", score_tensors={"bias": learned.detach()})
    for kw, error, pattern in (
            (dict(score_mod=""), ValueError, r"score_mod must be a CUDA float expression, the new scaled score"),
            (dict(score_tensors={"bias": bias}), ValueError, r"score_mod must be a CUDA float expression"),
            (dict(score_mod="s", score_mod_grad=" "), ValueError, r"score_mod_grad must be a CUDA float expression"),
            (dict(score_mod="s", score_tensors={"s": bias}), ValueError, r"score_tensors key 's' must be a C ident"),
            (dict(score_mod="s", score_tensors=[bias]), TypeError, r"score_tensors must be a dict"),
            (dict(score_fn="s"), TypeError, r"attention\(\) got an unexpected keyword argument 'score_fn'")):
        with pytest.raises(error, match=pattern):
            flashrt.attention(q, k, k, **kw)


@pytest.mark.parametrize("compiled", [False, True], ids=["ops", "compiled"])
def test_score_mod_reaches_forward_and_backward_through_the_ops(monkeypatch, compiled):
    """The traced route's ops hand api.forward and api.backward the call's score_mod, derivative and tensors (split
    from mask_mod's in the op's tensor list), as the eager route passes its mask arguments (api stands in: CPU);
    under torch.compile(fullgraph=True) too (AOTAutograd's backend without a code generator: no compiler needed)."""
    from flashrt import api
    calls = []

    def forward(q, k, v, **kw):
        calls.append(kw)
        return torch.zeros_like(q), torch.zeros(q.shape[0], q.shape[2], q.shape[1])

    def backward(dout, q, k, v, out, lse, **kw):
        calls.append(kw)
        for name, g in (kw.get("score_grads") or {}).items():  # (a learned tensor: its gradient, all 3s)
            g.add_(3.0)
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(api, "forward", forward)
    monkeypatch.setattr(api, "backward", backward)
    q, k = torch.randn(2, 5, 8, 64, requires_grad=True), torch.randn(2, 7, 2, 64, requires_grad=True)
    doc, bias, on = torch.zeros(7, dtype=torch.int32), torch.randn(8 * 11), torch.ones(2, dtype=torch.int32)
    for grad in (None, "1.f"):
        calls.clear()

        def fn(q, k, grad=grad):
            return flashrt.attention(q, k, k, causal=True, mask_mod="doc[k] == 0", mask_tensors={"doc": doc},
                                     score_mod=" s + bias[h * 11 + k - q + 4] * on[b] ", score_mod_grad=grad,
                                     score_tensors={"bias": bias, "on": on})
        if compiled:
            fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
        fn(q, k).sum().backward()
        assert len(calls) == 2  # forward, then backward
        for kw in calls:
            assert kw["score_mod"] == "s + bias[h * 11 + k - q + 4] * on[b]" and kw["score_mod_grad"] == grad
            assert list(kw["score_tensors"]) == ["bias", "on"] and list(kw["mask_tensors"]) == ["doc"]
            for got, want in ((kw["score_tensors"]["bias"], bias), (kw["score_tensors"]["on"], on),
                              (kw["mask_tensors"]["doc"], doc)):
                assert got.data_ptr() == want.data_ptr() and got.dtype == want.dtype
    calls.clear()
    flashrt.attention(q, k, k, score_mod="s * 2.f")
    assert calls[0]["score_mod"] == "s * 2.f" and calls[0]["score_tensors"] == {} and "mask_mod" not in calls[0]
    # a learned table: the backward asks for its gradient (score_grads), and autograd hands it to the table
    table = bias.clone().requires_grad_()

    def learned(q, k):
        return flashrt.attention(q, k, k, score_mod="s + bias[k]", score_tensors={"bias": table, "on": on})
    calls.clear()
    (torch.compile(learned, fullgraph=True, backend="aot_eager") if compiled else learned)(q, k).sum().backward()
    assert list(calls[1]["score_grads"]) == ["bias"] and torch.equal(table.grad, torch.full_like(table, 3.0))


def _cpu_bhsd(Sq=4, Sk=4, H=2, Hkv=2):
    return torch.randn(1, H, Sq, 8), torch.randn(1, Hkv, Sk, 8), torch.randn(1, Hkv, Sk, 8)


@pytest.mark.parametrize("kwargs, match", [
    (dict(attn_mask=torch.ones(4, 4, dtype=torch.bool)), "boolean mask"),
    (dict(attn_mask=torch.zeros(4, 4)), "additive"),
    (dict(dropout_p=1.0), r"dropout_p must be a number in \[0, 1\)"),
], ids=["bool-mask", "float-mask", "dropout-1"])
def test_sdpa_entry_refuses_what_flashrt_does_not_compute(kwargs, match):
    # CPU tensors: the error must come from the argument check, before flashrt looks at the device.
    with pytest.raises(ValueError, match=match):
        flashrt.torch.scaled_dot_product_attention(*_cpu_bhsd(), **kwargs)


def test_sdpa_entry_mask_error_points_to_flashrt_attentions_masks():
    q, k, v = _cpu_bhsd()
    with pytest.raises(ValueError) as info:
        flashrt.torch.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(4, 4, dtype=torch.bool))
    msg = str(info.value)
    assert "full or causal attention only" not in msg
    for keyword in ("flashrt.attention", "window=", "seqlens_q=", "block_ids_q", "segment_ids_q", "mask_mod=",
                    "attn_mask=None", "is_causal=True", "torch.nn.attention.bias"):
        assert keyword in msg, keyword


def test_meta_and_host_tensors_are_named_as_such():
    q = torch.empty(2, 5, 8, 64, device="meta", dtype=BF16)
    lse = torch.empty(2, 8, 5, device="meta")
    with pytest.raises(ValueError, match=r"q is a meta tensor \(a shape and dtype with no data\); flashrt computes on "
                                         r"CUDA tensors"):
        flashrt.forward(q, q, q)
    with pytest.raises(ValueError, match=r"[a-z]+ is a meta tensor \(a shape and dtype with no data\)"):
        flashrt.backward(q, q, q, q, q, lse)
    cpu = torch.empty(2, 5, 8, 64, dtype=BF16)
    with pytest.raises(ValueError, match=r"q is in host memory; flashrt needs CUDA tensors: move it with q\.cuda\(\)"):
        flashrt.forward(cpu, cpu, cpu)


def test_sdpa_entry_checks_causal_biases():
    from torch.nn.attention.bias import causal_lower_right
    q, k, v = _cpu_bhsd(Sq=3, Sk=5)
    with pytest.raises(ValueError, match="causal bias for"):
        flashrt.torch.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(3, 6))
    with pytest.raises(ValueError, match="not both"):
        flashrt.torch.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(3, 5), is_causal=True)


def test_sdpa_entry_shape_errors():
    q, k, v = _cpu_bhsd(H=4, Hkv=2)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        flashrt.torch.scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="query must be 4-D"):
        flashrt.torch.scaled_dot_product_attention(q[0], k[0], v[0], enable_gqa=True)


def test_upstream_gradient_made_readable_only_when_needed():
    from flashrt.torch_ops import _kernel_ready
    x = torch.randn(2, 16, 4, 64)
    assert _kernel_ready(x) is x  # contiguous and aligned: read in place
    for view in (x.transpose(1, 2), x[:, ::2]):  # strided, but in 16-byte steps: read in place
        assert _kernel_ready(view) is view
    for view in (torch.ones(()).expand(2, 16, 4, 64),    # all strides 0 (out.sum()'s gradient)
                 x[..., ::2],                           # head_dim not contiguous
                 torch.randn(2 * 16 * 4 * 64 + 1)[1:].view(2, 16, 4, 64)):  # contiguous, base not 16-byte aligned
        got = _kernel_ready(view)
        assert got.is_contiguous() and got.data_ptr() % 16 == 0 and torch.equal(got, view)


# ---------------------------------------------------------------------------
# GPU: the custom ops under torch's checkers and compilers
# ---------------------------------------------------------------------------
_NO_SCORE_MODS = (None, None, None, 0.0, None)  # the ops' softcap, alibi_slopes, sinks, dropout_p and dropout_rng
_NO_SCORE_MOD = ("", "", "", "", [])  # ... after score_mod, its derivative, its tensor names, the learned ones' names
# and those tensors
_NO_MODS = ("", "", *_NO_SCORE_MOD, *_NO_SCORE_MODS)  # ... after mask_mod and its tensor names
# (B, Sq, Sk, H, Hkv, D, causal, softmax_scale, dtype)
OPCHECK_CASES = [
    (2, 128, 160, 4, 4, 64, True, None, BF16),
    (2, 96, 96, 8, 2, 128, False, 0.2, FP16),   # GQA, explicit scale
    (1, 64, 200, 8, 1, 256, True, None, BF16),  # MQA at the seed head_dim
]


@gpu
@pytest.mark.parametrize("case", OPCHECK_CASES, ids=lambda c: f"B{c[0]}-Sq{c[1]}-Sk{c[2]}-H{c[3]}-Hkv{c[4]}-D{c[5]}")
def test_opcheck(case):
    B, Sq, Sk, H, Hkv, D, causal, scale, dtype = case
    q, k, v, do = make_inputs(B, Sq, Sk, H, Hkv, D, dtype, seed=Sq)
    options = ("bottom_right" if causal else "none", scale, "auto", True, None, None, None)
    # schema (no mutation, no aliasing), autograd registration, fake impl vs real outputs (shapes, strides),
    # and AOTAutograd (static and dynamic shapes) against eager, gradients included.
    torch.library.opcheck(torch.ops.flashrt.fwd.default, (*leaves(q, k, v), *options, True, [None] * 8, *_NO_MODS))
    out, lse = flashrt.forward(q, k, v, causal=causal, softmax_scale=scale)
    torch.library.opcheck(torch.ops.flashrt.bwd.default, (do, q, k, v, out, lse, *options, [None] * 8, *_NO_MODS))


@gpu
def test_opcheck_with_masks_and_varlen():
    """The ops' mask arguments: padding + window + block ids, and packed varlen (lse (H, total))."""
    B, S, H, D = 2, 96, 4, 64
    q, k, v, do = make_inputs(B, S, S, H, H, D, BF16, seed=1)
    lengths = torch.tensor([96, 40], dtype=torch.int32, device="cuda")
    ids = torch.cat([torch.zeros(50, dtype=torch.int32), torch.ones(46, dtype=torch.int32)]).cuda().expand(B, S)
    tensors = [lengths, lengths, None, None, ids.contiguous(), ids.contiguous(), None, None]
    options = ("none", None, "split", True, [16, 16], None, None)
    torch.library.opcheck(torch.ops.flashrt.fwd.default, (*leaves(q, k, v), *options, True, tensors, *_NO_MODS))
    # mask_mod with a tensor of its own (after the built-in ones), per head and batch entry
    doc = torch.randint(0, 3, (B, S), dtype=torch.int32, device="cuda")
    mod = ("doc[b * 96 + q] == doc[b * 96 + k] || h == 1", "doc")
    torch.library.opcheck(torch.ops.flashrt.fwd.default,
                          (*leaves(q, k, v), *options, True, tensors + [doc], *mod, *_NO_SCORE_MOD, *_NO_SCORE_MODS))
    masked = dict(window=(16, 16), seqlens_q=lengths, seqlens_k=lengths, block_ids_q=tensors[4], block_ids_k=tensors[5],
                  mask_mod=mod[0], mask_tensors={"doc": doc})
    out, lse = flashrt.forward(q, k, v, **masked)
    torch.library.opcheck(torch.ops.flashrt.bwd.default,
                          (do, q, k, v, out, lse, *options, tensors + [doc], *mod, *_NO_SCORE_MOD, *_NO_SCORE_MODS))
    # score_mod with a float32 table and an int32 tensor of its own, after mask_mod's (automatic derivative)
    table = torch.randn(H * (2 * S - 1), device="cuda")
    on = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
    score = (f"s + table[h * {2 * S - 1} + k - q + {S - 1}] * on[b]", "", "table,on", "", [])
    torch.library.opcheck(torch.ops.flashrt.fwd.default,
                          (*leaves(q, k, v), *options, True, tensors + [doc, table, on], *mod, *score, *_NO_SCORE_MODS))
    out, lse = flashrt.forward(q, k, v, **masked, score_mod=score[0], score_tensors={"table": table, "on": on})
    torch.library.opcheck(torch.ops.flashrt.bwd.default,
                          (do, q, k, v, out, lse, *options, tensors + [doc, table, on], *mod, *score, *_NO_SCORE_MODS))
    # the table learned (no mask_mod: score_grads takes none yet): the backward op returns its gradient, exact sums
    param = table.clone().requires_grad_()
    torch.library.opcheck(torch.ops.flashrt.fwd.default, (*leaves(q, k, v), *options, True, tensors + [param, on],
                                                          "", "", score[0], "", "table,on", "table", [param],
                                                          *_NO_SCORE_MODS))
    out, lse = flashrt.forward(q, k, v, **dict(masked, mask_mod=None, mask_tensors=None), score_mod=score[0],
                               score_tensors={"table": table, "on": on})
    torch.library.opcheck(torch.ops.flashrt.bwd.default, (do, q, k, v, out, lse, *options, tensors + [table, on],
                                                          "", "", score[0], "", "table,on", "table", [table],
                                                          *_NO_SCORE_MODS))
    cu = torch.tensor([0, 30, 96], dtype=torch.int32, device="cuda")
    pq, pk, pv = (x[0] for x in (q, k, v))  # (96, H, D) packed: sequences of 30 and 66
    options = ("bottom_right", None, "auto", True, None, 66, 66)
    varlen = [None, None, cu, cu, None, None, None, None]
    torch.library.opcheck(torch.ops.flashrt.fwd.default, (*leaves(pq, pk, pv), *options, True, varlen, *_NO_MODS))
    out, lse = flashrt.forward(pq, pk, pv, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu)
    assert lse.shape == (H, 96)
    torch.library.opcheck(torch.ops.flashrt.bwd.default, (do[0], pq, pk, pv, out, lse, *options, varlen, *_NO_MODS))
    # ALiBi slopes per packed sequence (a tensor the ops take no gradient of)
    slopes = torch.rand(2, H, device="cuda")
    alibi = ("", "", *_NO_SCORE_MOD, None, slopes, None, 0.0, None)
    torch.library.opcheck(torch.ops.flashrt.fwd.default, (*leaves(pq, pk, pv), *options, True, varlen, *alibi))
    out, lse = flashrt.forward(pq, pk, pv, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, alibi_slopes=slopes)
    torch.library.opcheck(torch.ops.flashrt.bwd.default, (do[0], pq, pk, pv, out, lse, *options, varlen, *alibi))
    # dropout: its rng a tensor the ops take no gradient of
    rng = flashrt.dropout_rng(pq)
    drop = ("", "", *_NO_SCORE_MOD, None, None, None, 0.2, rng)
    torch.library.opcheck(torch.ops.flashrt.fwd.default, (*leaves(pq, pk, pv), *options, True, varlen, *drop))
    out, lse = flashrt.forward(pq, pk, pv, causal=True, cu_seqlens_q=cu, cu_seqlens_k=cu, dropout_p=0.2,
                               dropout_rng=rng)
    torch.library.opcheck(torch.ops.flashrt.bwd.default, (do[0], pq, pk, pv, out, lse, *options, varlen, *drop))


def _block_grads(model, x, dy):
    model.zero_grad(set_to_none=True)
    x.grad = None
    y = model(x)
    y.backward(dy)
    return [y.detach(), x.grad] + [p.grad for p in model.parameters()]


@gpu
def test_learned_score_table_under_compile_matches_eager():
    """A learned relative-position table (score_tensors that requires grad) under torch.compile(fullgraph=True): out,
    dq, dk, dv and the table's gradient bitwise the eager call's (deterministic=True: exact sums)."""
    B, S, H, D = 2, 256, 4, 64
    q, k, v, do = make_inputs(B, S, S, H, 2, D, BF16, seed=5)
    table = torch.randn(H, 2 * S - 1, device="cuda")

    def fn(q, k, v, t):
        return flashrt.attention(q, k, v, causal=True, score_mod=f"s + bias[h * {2 * S - 1} + k - q + {S - 1}]",
                                 score_tensors={"bias": t})

    def grads(f):
        inputs = leaves(q, k, v, table)
        out = f(*inputs)
        return [out.detach(), *torch.autograd.grad(out, inputs, do)]
    eager = grads(fn)
    assert eager[4].abs().sum() > 0
    for i, (a, b) in enumerate(zip(grads(torch.compile(fn, fullgraph=True)), eager)):
        assert torch.equal(a, b), f"tensor {i}: compiled and eager differ"


@gpu
def test_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    block = Block(dim=256, heads=4, kv_heads=2, head_dim=64).to("cuda", BF16)
    x = torch.randn(2, 300, 256, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn_like(x)
    eager = _block_grads(block, x, dy)
    compiled = torch.compile(block, fullgraph=True)  # fullgraph: any graph break raises
    got = _block_grads(compiled, x, dy)
    assert_compiled_matches_eager(got, eager)


@gpu
def test_compile_reduce_overhead_runs_as_a_cuda_graph():
    from torch._dynamo.utils import counters
    counters.clear()
    torch.manual_seed(1)
    block = Block(dim=256, heads=8, kv_heads=1, head_dim=128).to("cuda", BF16)
    params = list(block.parameters())
    x = torch.randn(2, 256, 256, device="cuda", dtype=BF16)
    dy = torch.randn_like(x)
    y_ref = block(x)
    ref = [y_ref.detach(), *torch.autograd.grad(y_ref, params, dy)]
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):  # warm-up, record, replay
        y = compiled(x)
        got = [y.detach().clone(), *(g.clone() for g in torch.autograd.grad(y, params, dy))]
    assert counters["inductor"]["cudagraph_skips"] == 0, "torch.compile fell back from CUDA graphs"
    assert_compiled_matches_eager(got, ref)


@gpu
def test_cuda_graph_captures_forward_and_backward():
    import cupy
    q, k, v, do = make_inputs(2, 256, 256, 8, 2, 128, BF16, seed=11)
    ql, kl, vl = leaves(q, k, v)

    def step():
        out = flashrt.attention(ql, kl, vl, causal=True)
        return (out, *torch.autograd.grad(out, (ql, kl, vl), do))

    pool = cupy.get_default_memory_pool()
    cupy_bytes = pool.total_bytes()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up, as torch.cuda.graph's docs ask: loads the kernels
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # global capture mode: a host sync or cudaMalloc would fail it
        static = step()
    assert pool.total_bytes() == cupy_bytes, "flashrt allocated through CuPy, outside torch's allocator"

    for _ in range(2):  # twice: each replay must find the forward's work-item counter at zero
        with torch.no_grad():  # replay must read the new contents of the captured inputs
            for x in (ql, kl, vl):
                x.copy_(torch.randn_like(x))
        graph.replay()
        expected = step()
        torch.cuda.synchronize()
        for name, a, b in zip(("out", "dq", "dk", "dv"), static, expected):
            assert torch.equal(a, b), f"{name} of the replayed graph differs from eager"


@gpu
def test_cuda_graph_captures_the_mask_check():
    """Masked calls at default settings (validate=True) read no array data on the host, so they capture; each
    replay checks the arrays' current data on the GPU, and a bad replay is reported at flashrt.synchronize()."""
    q, k, v, do = make_inputs(2, 256, 256, 8, 1, 256, BF16, seed=14)
    ql, kl, vl = leaves(q, k, v)
    ids = torch.cat([torch.zeros(192, dtype=torch.int32), torch.ones(64, dtype=torch.int32)]).cuda().repeat(2, 1)

    def step():
        out = flashrt.attention(ql, kl, vl, block_ids_q=ids, block_ids_k=ids)
        return (out, *torch.autograd.grad(out, (ql, kl, vl), do))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # a host copy of ids (the old validation) would fail the capture
        static = step()
    graph.replay()
    expected = step()
    flashrt.synchronize()
    for name, a, b in zip(("out", "dq", "dk", "dv"), static, expected):
        assert torch.equal(a, b), f"{name} of the replayed graph differs from eager"
    ids[1, 100] = -1
    graph.replay()
    with pytest.raises(ValueError, match=r"block_ids_q must be non-decreasing.*batch 1 at position 100"):
        flashrt.synchronize()
    assert static[0].isnan().all()


@gpu
def test_capture_before_the_kernels_are_loaded_raises_a_clear_error(monkeypatch):
    monkeypatch.setattr(launch, "_functions", {})  # as in a fresh process: no kernel loaded yet
    q, k, v, _ = make_inputs(1, 128, 128, 2, 2, 64, BF16, seed=12)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(launch.LaunchError, match="not loaded yet.*warm-up"):
        with torch.cuda.graph(graph):
            flashrt.attention(q * 2, k, v)
    assert not launch._functions, "a kernel was compiled or loaded during capture"

    flashrt.attention(q, k, v)  # the warm-up the message asks for; then capture works
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = flashrt.attention(q, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static, flashrt.attention(q, k, v))


# ---------------------------------------------------------------------------
# GPU: activation checkpointing
# ---------------------------------------------------------------------------
def _two_attentions(q, k, v):
    h = flashrt.attention(q, k, v, causal=True)
    return flashrt.attention(h * 1.5, k, v)  # the recomputed h feeds the second op's backward


@gpu
@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
def test_checkpoint_gives_bitwise_equal_gradients(reentrant):
    from torch.utils.checkpoint import checkpoint
    q, k, v, do = make_inputs(2, 384, 384, 8, 2, 128, BF16, seed=13)
    plain = attention_grads(_two_attentions, q, k, v, do)
    ckpt = attention_grads(lambda *xs: checkpoint(_two_attentions, *xs, use_reentrant=reentrant), q, k, v, do)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ckpt, plain):
        assert torch.equal(a, b), f"{name} differs under checkpointing"


@gpu
def test_checkpointed_18_layer_stack_at_the_seed_shape_trains():
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(0)
    # The seed's attention shape: B=2, S=1024, H=8, Hkv=1, head_dim=256; fp32 weights under bf16 autocast.
    layers = torch.nn.ModuleList(Block(dim=512, heads=8, kv_heads=1, head_dim=256) for _ in range(18)).cuda()
    opt = torch.optim.Adam(layers.parameters(), lr=1e-4)
    x = torch.randn(2, 1024, 512, device="cuda")
    target = torch.randn_like(x)
    losses = []
    for _ in range(5):
        with torch.autocast("cuda", dtype=BF16):
            h = x
            for layer in layers:
                h = checkpoint(layer, h, use_reentrant=False)
        loss = F.mse_loss(h.float(), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < losses[0], f"loss did not decrease: {losses}"
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in layers.parameters())


# ---------------------------------------------------------------------------
# GPU: flashrt.torch.scaled_dot_product_attention against torch's SDPA
# ---------------------------------------------------------------------------
# (B, H, Hkv, Sq, Sk, D, mask, scale, dtype); mask: None, "is_causal" or "lower_right"
SDPA_CASES = [
    (2, 8, 8, 256, 256, 64, "is_causal", None, BF16),
    (2, 8, 2, 200, 333, 128, None, None, BF16),            # GQA through enable_gqa
    (1, 4, 4, 100, 300, 256, "lower_right", None, FP16),   # bottom-right causal through causal_lower_right
    (2, 6, 3, 128, 128, 96, None, 0.2, FP16),
    (1, 4, 2, 300, 200, 64, "is_causal", None, BF16),      # top-left causal (SDPA's is_causal), Sq > Sk
    (1, 4, 4, 100, 300, 128, "is_causal", None, BF16),     # and Sq < Sk
]


@gpu
@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: f"H{c[1]}-Hkv{c[2]}-Sq{c[3]}-Sk{c[4]}-D{c[5]}-{c[6]}")
def test_sdpa_entry_matches_torch_sdpa(case):
    from torch.nn.attention.bias import causal_lower_right
    B, H, Hkv, Sq, Sk, D, mask, scale, dtype = case
    g = torch.Generator(device="cuda").manual_seed(Sq * Sk)
    q = torch.randn(B, H, Sq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype, generator=g)
    do = torch.randn(B, H, Sq, D, device="cuda", dtype=dtype, generator=g)
    kwargs = dict(scale=scale, enable_gqa=H != Hkv, is_causal=mask == "is_causal")
    if mask == "lower_right":
        kwargs["attn_mask"] = causal_lower_right(Sq, Sk)

    def run(fn, dt):
        ql, kl, vl = leaves(q, k, v, dtype=dt)
        out = fn(ql, kl, vl, **kwargs)
        out.backward(do.to(dt))
        return [out, ql.grad, kl.grad, vl.grad]

    ref = run(F.scaled_dot_product_attention, torch.float64)
    theirs = run(F.scaled_dot_product_attention, dtype)
    ours = run(flashrt.torch.scaled_dot_product_attention, dtype)
    assert ours[0].shape == (B, H, Sq, D) and ours[0].dtype == dtype
    for name, o, t, r in zip(("out", "dq", "dk", "dv"), ours, theirs, ref):
        e, et = rel_error(o, r), rel_error(t, r)
        assert e <= max(2 * et, 1e-3), f"{name}: rel err {e:.2e} > 2x torch SDPA's ({et:.2e})"


@gpu
@pytest.mark.parametrize("D,Dv", [(192, 128), (64, 96)])
def test_v_head_dim_of_its_own_through_sdpa_and_the_ops(D, Dv):
    """value's head_dim may differ from query's (as torch's SDPA allows): the SDPA entry against float64 SDPA, and
    opcheck of both ops (fake impls against the real outputs' shapes and strides, autograd, AOTAutograd)."""
    g = torch.Generator(device="cuda").manual_seed(D + Dv)
    q = torch.randn(2, 8, 200, D, device="cuda", dtype=BF16, generator=g)
    k = torch.randn(2, 2, 333, D, device="cuda", dtype=BF16, generator=g)
    v = torch.randn(2, 2, 333, Dv, device="cuda", dtype=BF16, generator=g)
    do = torch.randn(2, 8, 200, Dv, device="cuda", dtype=BF16, generator=g)

    def run(fn, dt):
        ql, kl, vl = leaves(q, k, v, dtype=dt)
        out = fn(ql, kl, vl, is_causal=True, enable_gqa=True)
        out.backward(do.to(dt))
        return [out, ql.grad, kl.grad, vl.grad]

    ref = run(F.scaled_dot_product_attention, torch.float64)
    ours = run(flashrt.torch.scaled_dot_product_attention, BF16)
    assert ours[0].shape == (2, 8, 200, Dv)
    for name, o, r in zip(("out", "dq", "dk", "dv"), ours, ref):
        assert rel_error(o, r) < 2e-2, name
    q, k, v, do = (x.transpose(1, 2).contiguous() for x in (q, k, v, do))
    options = ("bottom_right", None, "auto", True, None, None, None)
    torch.library.opcheck(torch.ops.flashrt.fwd.default, (*leaves(q, k, v), *options, True, [None] * 8, *_NO_MODS))
    out, lse = flashrt.forward(q, k, v, causal=True)
    torch.library.opcheck(torch.ops.flashrt.bwd.default, (do, q, k, v, out, lse, *options, [None] * 8, *_NO_MODS))


@gpu
def test_sdpa_entry_reads_bhsd_tensors_in_place():
    B, H, S, D = 2, 16, 1024, 128
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=BF16) for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = flashrt.torch.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    outputs = out.numel() * out.element_size() + B * H * S * 4  # out and the fp32 lse
    assert extra < outputs + q.numel() * q.element_size() // 2, f"an input was copied: {extra} bytes allocated"
    assert out.shape == (B, H, S, D) and out.transpose(1, 2).is_contiguous()
    dense = flashrt.attention(*(x.transpose(1, 2).contiguous() for x in (q, k, v)), causal=True)
    assert torch.equal(out, dense.transpose(1, 2))


# ---------------------------------------------------------------------------
# GPU: autocast, dtypes and streams
# ---------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("dtype", [BF16, FP16], ids=["bf16", "fp16"])
def test_autocast_casts_fp32_inputs_as_sdpa_does(dtype):
    q, k, v, do = make_inputs(2, 256, 256, 4, 2, 64, torch.float32, seed=17)
    q32, k32, v32 = leaves(q, k, v)
    with torch.autocast("cuda", dtype=dtype):
        out = flashrt.attention(q32, k32, v32, causal=True)
    out.backward(do.to(dtype))
    assert out.dtype == dtype and out.device == q.device
    assert all(x.grad.dtype == torch.float32 and x.grad.device == x.device for x in (q32, k32, v32))
    by_hand = attention_grads(lambda *xs: flashrt.attention(*xs, causal=True), q.to(dtype), k.to(dtype),
                              v.to(dtype), do.to(dtype))
    assert torch.equal(out.detach(), by_hand[0])
    for x, g in zip((q32, k32, v32), by_hand[1:]):
        assert torch.equal(x.grad, g.float())

    # torch's SDPA, and flashrt's SDPA entry, give the same dtypes under autocast.
    for fn in (F.scaled_dot_product_attention, flashrt.torch.scaled_dot_product_attention):
        xs = leaves(q, k, v)
        with torch.autocast("cuda", dtype=dtype):
            o = fn(*(x.transpose(1, 2) for x in xs), is_causal=True, enable_gqa=True)
        o.backward(do.transpose(1, 2).to(dtype))
        assert o.dtype == dtype and all(x.grad.dtype == torch.float32 for x in xs), fn.__module__


@gpu
def test_mixed_streams_with_events():
    q, k, v, do = make_inputs(2, 512, 512, 8, 2, 128, BF16, seed=19)
    expected = attention_grads(lambda *xs: flashrt.attention(*xs, causal=True), q, k, v, do)

    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    producer.wait_stream(torch.cuda.current_stream())
    consumer.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(producer):
        torch.cuda._sleep(50_000_000)  # a launch on any other stream would now read the inputs before they exist
        ql, kl, vl = leaves(q, k, v)   # inputs produced on the side stream
        out = flashrt.attention(ql, kl, vl, causal=True)
        ready = producer.record_event()
    with torch.cuda.stream(consumer):
        consumer.wait_event(ready)
        out.record_stream(consumer)
        got = [out.detach().clone()]   # consumed on another stream
        out.backward(do)               # autograd runs the backward on the forward's stream, synced to this one
        got += [x.grad.clone() for x in (ql, kl, vl)]
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        assert torch.equal(a, b), f"{name} differs across streams"


@gpu
def test_calls_from_a_thread_that_made_no_cuda_call():
    """A thread whose tensors all come from torch's cache makes no CUDA runtime call of its own, so no context is
    current on it (autograd's backward thread is one): flashrt's launches must still run there."""
    import threading
    q, k, v, do = make_inputs(2, 128, 128, 4, 2, 64, BF16, seed=15)
    out, lse = flashrt.forward(q, k, v)
    expected = flashrt.backward(do, q, k, v, out, lse)  # plans made, blocks in torch's cache
    torch.cuda.synchronize()
    got, errors = [], []

    def worker():
        try:
            got.append(flashrt.backward(do, q, k, v, out, lse))
            got.append(flashrt.forward(q, k, v)[0])
        except Exception as exc:  # noqa: BLE001  (reported below)
            errors.append(exc)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert not errors, errors
    torch.cuda.synchronize()
    for a, b in zip(got[0], expected):
        assert torch.equal(a, b)
    assert torch.equal(got[1], out)


@gpu
def test_eager_autograd_carries_mask_arguments():
    """flashrt.attention's gradients under masks are flashrt.backward's, bitwise (deterministic split)."""
    B, S, H, D = 2, 130, 4, 64
    q, k, v, do = make_inputs(B, S, S, H, 2, D, BF16, seed=2)
    ids = torch.cat([torch.zeros(64, dtype=torch.int32), torch.ones(66, dtype=torch.int32)]).cuda().expand(B, S)
    mask = dict(window=(32, 8), seqlens_k=torch.tensor([130, 100], dtype=torch.int32, device="cuda"),
                block_ids_q=ids.contiguous(), block_ids_k=ids.contiguous(),
                mask_mod="sel[(q + k) % 4] != h", mask_tensors={"sel": torch.tensor([0, 1, 2, 5], dtype=torch.int32,
                                                                                     device="cuda")})
    ql, kl, vl = leaves(q, k, v)
    out = flashrt.attention(ql, kl, vl, causal="top_left", impl="split", **mask)
    out.backward(do)
    ref_out, lse = flashrt.forward(q, k, v, causal="top_left", **mask)
    ref = flashrt.backward(do, q, k, v, ref_out, lse, causal="top_left", impl="split", **mask)
    assert torch.equal(out, ref_out)
    for got, want in zip((ql.grad, kl.grad, vl.grad), ref):
        assert torch.equal(got, want)


@gpu
@pytest.mark.parametrize("which", ["block_ids_k", "mask_tensors"])
def test_mask_tensor_modified_in_place_before_the_backward_raises(which):
    """The eager path keeps the mask tensors on ctx, not as saved tensors: their versions stand in for
    save_for_backward's check, so a backward never runs on values the forward did not use."""
    B, S, H, D = 1, 96, 2, 64
    q, k, v, do = make_inputs(B, S, S, H, H, D, BF16, seed=3)
    ids = torch.cat([torch.zeros(40, dtype=torch.int32), torch.ones(56, dtype=torch.int32)]).cuda().expand(B, S)
    sel = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    mask = dict(block_ids_q=ids.contiguous(), block_ids_k=ids.contiguous(), mask_mod="sel[(q + k) % 2] >= 0",
                mask_tensors={"sel": sel})
    ql, kl, vl = leaves(q, k, v)
    out = flashrt.attention(ql, kl, vl, **mask)
    target = mask["block_ids_k"] if which == "block_ids_k" else sel
    target.add_(0)  # a version bump without a change of value still counts, as for saved tensors
    with pytest.raises(RuntimeError, match="modified in place after the forward"):
        out.backward(do)
    unchanged = flashrt.attention(*leaves(q, k, v), **mask)  # and a fresh call after it runs
    unchanged.backward(do)


@gpu
def test_alibi_slopes_modified_in_place_before_the_backward_raises():
    """ALiBi's slopes travel with the mask arguments on the eager path (fp32 contiguous slopes are the caller's own
    tensor): a version bump before the backward raises, as for the mask tensors."""
    q, k, v, do = make_inputs(2, 64, 64, 4, 2, 64, BF16, seed=4)
    slopes = torch.rand(2, 4, device="cuda")
    out = flashrt.attention(*leaves(q, k, v), causal=True, alibi_slopes=slopes)
    slopes.mul_(1)
    with pytest.raises(RuntimeError, match="modified in place after the forward"):
        out.backward(do)
    flashrt.attention(*leaves(q, k, v), causal=True, alibi_slopes=slopes).backward(do)
