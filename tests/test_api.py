"""Validation and layout rules of the public API that need no GPU (array descriptors are plain data)."""
import dataclasses
import importlib
import math
import re
import sys

import numpy as np
import pytest

from flashrt import api, masks, params
from flashrt.interop import Array
from flashrt.spec import MASK_BITS


def arr(shape, strides=None, ptr=0x10000, dtype="bf16", device=0, lib="torch"):
    if strides is None:
        strides, acc = [], 1
        for n in reversed(shape):
            strides.insert(0, acc)
            acc *= n
    return Array(None, lib, ptr, tuple(shape), tuple(strides), dtype, device, 2)


Q, KV = (2, 64, 8, 64), (2, 80, 2, 64)


# Each bad input of q, k, v: (changes to q, k, v descriptors) -> (error type, message pattern).
QKV_ERRORS = {
    "fp32": (dict(q=dict(dtype="float32"), k=dict(dtype="float32"), v=dict(dtype="float32")), TypeError,
             r"q has dtype float32; flashrt supports bfloat16 and float16: cast with q\.to\(torch\.bfloat16\)"),
    "int": (dict(q=dict(dtype="int32")), TypeError, r"q has dtype int32"),
    "mixed dtypes": (dict(k=dict(dtype="fp16")), TypeError, r"share one dtype, got q: bf16, k: fp16, v: bf16"),
    "host memory": (dict(q=dict(device=-1)), ValueError, r"q is in host memory.*q\.cuda\(\)"),
    "two devices": (dict(v=dict(device=1)), ValueError, r"one device, got cuda:0, cuda:0, cuda:1"),
    "torch and cupy": (dict(k=dict(lib="cupy")), TypeError, r"one library, got q: torch, k: cupy, v: torch"),
    "rank": (dict(q=dict(shape=(64, 8, 64))), ValueError, r"q must have 4 dimensions .* got shape \(64, 8, 64\)"),
    "batch": (dict(k=dict(shape=(3, 80, 2, 64)), v=dict(shape=(3, 80, 2, 64))), ValueError,
              r"agree on batch \(axis 0\) and head_dim"),
    "k vs v": (dict(v=dict(shape=(2, 81, 2, 64))), ValueError, r"k and v must agree on every axis but head_dim"),
    "v's head_dim 20": (dict(v=dict(shape=(2, 80, 2, 20))), ValueError,
                        r"v's head_dim must be a multiple of 8 between 8 and 256, got 20"),
    "head_dim 264": (dict(q=dict(shape=(2, 64, 8, 264)), k=dict(shape=(2, 80, 2, 264)),
                          v=dict(shape=(2, 80, 2, 264))), ValueError, r"multiple of 8 between 8 and 256, got 264"),
    "head_dim 12": (dict(q=dict(shape=(2, 64, 8, 12)), k=dict(shape=(2, 80, 2, 12)),
                         v=dict(shape=(2, 80, 2, 12))), ValueError, r"multiple of 8 between 8 and 256, got 12"),
    "GQA ratio": (dict(k=dict(shape=(2, 80, 3, 64)), v=dict(shape=(2, 80, 3, 64))), ValueError,
                  r"q's heads \(8\) must be a multiple of k/v's heads \(3\)"),
    "last axis": (dict(k=dict(strides=(80 * 2 * 64, 2 * 64, 1, 2))), ValueError, r"k must be contiguous in its last"),
    "stride": (dict(v=dict(strides=(80 * 2 * 68, 2 * 68, 68, 1))), ValueError, r"v has stride 68 on axis 2"),
    "alignment": (dict(q=dict(ptr=0x10008)), ValueError, r"q's data pointer 0x10008 is not 16-byte aligned"),
}


def test_v_may_have_its_own_head_dim():
    """v's head_dim may differ from q's and k's (out and dout take it); the kernels' head_dim is the larger."""
    dims = api._check_qkv(arr(shape=Q), arr(shape=KV), arr(shape=(*KV[:3], 128)))
    assert (dims["D"], dims["Dv"]) == (64, 128)
    assert api._out_shape(arr(shape=Q), arr(shape=(*KV[:3], 128))) == (*Q[:3], 128)


@pytest.mark.parametrize("case", QKV_ERRORS)
def test_every_bad_qkv_is_named_with_its_fix(case):
    changes, error, pattern = QKV_ERRORS[case]
    shapes = dict(q=Q, k=KV, v=KV)
    q, k, v = (arr(**{"shape": shapes[n], **changes.get(n, {})}) for n in ("q", "k", "v"))
    with pytest.raises(error, match=pattern):
        api._check_qkv(q, k, v)


def test_sinks_are_one_float32_logit_per_query_head():
    q = arr(Q)
    api._check_sinks(arr((8,), dtype="float32"), q, 8)
    for bad in (arr((4,), dtype="float32"), arr((8,), dtype="bf16"), arr((8,), strides=(2,), dtype="float32"),
                arr((8,), dtype="float32", device=1), arr((8,), dtype="float32", lib="cupy")):
        with pytest.raises(ValueError, match=r"sinks must be a contiguous torch float32 array of shape \(8,\)"):
            api._check_sinks(bad, q, 8)


def test_alibi_slopes_are_float32_per_head_or_per_batch_entry_and_head():
    q = arr(Q)
    assert api._check_alibi(arr((8,), dtype="float32"), q, 8, 2) == 0  # (H,): batch stride 0
    assert api._check_alibi(arr((2, 8), dtype="float32"), q, 8, 2) == 8  # (B, H): H
    assert api._check_alibi(arr((1, 8), strides=(3, 1), dtype="float32"), q, 8, 1) == 8  # (a size-1 axis' stride)
    expected = r"alibi_slopes must have shape \(8,\) or \(2, 8\) \(a slope per query head, or per batch entry and "
    for shape in ((4,), (3, 8), (8, 2), (2, 8, 1), ()):
        with pytest.raises(ValueError, match=expected + r"query head\), got " + re.escape(str(shape))):
            api._check_alibi(arr(shape, dtype="float32"), q, 8, 2)
    with pytest.raises(ValueError, match=r"\(3, 8\) \(a slope per query head, or per batch entry \(sequence\) and"):
        api._check_alibi(arr((2, 8), dtype="float32"), arr((100, 8, 64)), 8, 3)  # packed: B is the sequences
    device = r"alibi_slopes must be a torch array on cuda:0 like q, got "
    for bad, pattern in ((dict(dtype="bf16"), r"alibi_slopes must be float32, got bf16: pass alibi_slopes\.float\(\)"),
                         (dict(device=1), device + "torch on cuda:1"), (dict(device=-1), device + "torch on the host"),
                         (dict(lib="cupy"), device + "cupy"),
                         (dict(strides=(16, 1)), r"alibi_slopes must be contiguous, got strides \(16, 1\)"),
                         (dict(strides=(1, 2)), r"alibi_slopes must be contiguous.*alibi_slopes\.contiguous\(\)")):
        with pytest.raises(ValueError, match=pattern):
            api._check_alibi(arr((2, 8), **{"dtype": "float32", **bad}), q, 8, 2)


def test_softcap_with_alibi_is_refused_before_any_work():
    # Rejected before the inputs are even looked at (None would fail there).
    for call in (lambda **kw: api.forward(None, None, None, **kw),
                 lambda **kw: api.backward(None, None, None, None, None, None, **kw)):
        with pytest.raises(ValueError, match=r"^softcap and alibi_slopes together are not supported yet$"):
            call(softcap=30.0, alibi_slopes=object())
        with pytest.raises(ValueError, match="softcap must be a finite positive number"):
            call(softcap=-1.0, alibi_slopes=object())
    # a plan never reused across what alibi_slopes is: none, (H,), (B, H)
    assert [api._alibi_kind(x) for x in (None, np.zeros(4), np.zeros((2, 4)), np.zeros(()), [1.0])] == [0, 1, 2, -1, -1]


def test_valid_qkv_gives_the_dimensions():
    assert api._check_qkv(arr(Q), arr(KV), arr(KV)) == dict(B=2, Sq=64, Sk=80, H=8, Hkv=2, D=64, Dv=64)


@pytest.mark.parametrize("name,bad,pattern", [
    ("dout", dict(shape=(2, 64, 8, 32)), r"dout must match q \(with v's head_dim\): expected torch bf16 "
                                         r"\(2, 64, 8, 64\)"),
    ("dout", dict(dtype="fp16"), r"dout must match q"),
    ("out", dict(device=1), r"out must match q"),
    ("out", dict(ptr=0x10004), r"out's data pointer 0x10004 is not 16-byte aligned"),
    ("lse", dict(shape=(2, 64, 8), dtype="float32"), r"lse must be torch float32 of shape \(2, 8, 64\)"),
    ("lse", dict(dtype="bf16"), r"lse must be torch float32"),
    ("lse", dict(strides=(1, 2, 16), dtype="float32"), r"lse must be contiguous.*lse\.contiguous\(\)"),
])
def test_every_bad_backward_input_is_named(name, bad, pattern):
    good = dict(dout=dict(shape=Q), out=dict(shape=Q), lse=dict(shape=(2, 8, 64), dtype="float32"))
    descs = {n: arr(**{**kw, **(bad if n == name else {})}) for n, kw in good.items()}
    with pytest.raises(ValueError, match=pattern):
        api._check_grad_inputs(arr(Q), descs["dout"], descs["out"], descs["lse"], (2, 8, 64), Q)
    api._check_grad_inputs(arr(Q), *(arr(**good[n]) for n in ("dout", "out", "lse")), (2, 8, 64), Q)
    # with v's own head_dim, out and dout take it
    wide = {n: arr(**{**kw, "shape": (*Q[:3], 128)}) if n != "lse" else arr(**kw) for n, kw in good.items()}
    api._check_grad_inputs(arr(Q), wide["dout"], wide["out"], wide["lse"], (2, 8, 64), (*Q[:3], 128))
    with pytest.raises(ValueError, match=r"out must match q \(with v's head_dim\): expected .* \(2, 64, 8, 128\)"):
        api._check_grad_inputs(arr(Q), wide["dout"], arr(shape=Q), wide["lse"], (2, 8, 64), (*Q[:3], 128))


def test_contiguous_and_packed_layouts_pass():
    api._check_layout(arr((2, 128, 8, 64)), "q")
    api._check_layout(arr((2, 128, 8, 64), strides=(128 * 3 * 8 * 64, 3 * 8 * 64, 64, 1)), "q")  # from qkv
    api._check_layout(arr((2, 128, 8, 64), strides=(8 * 128 * 64, 64, 128 * 64, 1)), "q")  # (B,H,S,D).T


def test_layout_errors_name_the_argument_and_the_fix():
    with pytest.raises(ValueError, match=r"k must be contiguous in its last .*k\.contiguous\(\)"):
        api._check_layout(arr((2, 4, 2, 64), strides=(512, 128, 1, 2)), "k")
    with pytest.raises(ValueError, match=r"v has stride 68 on axis 2.*multiples of 8"):
        api._check_layout(arr((2, 4, 2, 64), strides=(544, 136, 68, 1)), "v")
    with pytest.raises(ValueError, match=r"q's data pointer 0x10002 is not 16-byte aligned.*q\.clone\(\)"):
        api._check_layout(arr((2, 4, 2, 64), ptr=0x10002), "q")


def test_size_one_axes_ignore_their_stride():
    a = arr((1, 1, 1, 64), strides=(3, 5, 7, 1))
    api._check_layout(a, "q")
    assert api._strides(a) == (0, 0, 0)
    q, lse = arr((1, 64, 4, 64)), arr((1, 4, 64), strides=(8 * 64, 64, 1), dtype="float32")  # lse[:, :4] of 8 heads
    api._check_grad_inputs(q, q, q, lse, (1, 4, 64), q.shape)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_softmax_scale_must_be_positive_and_finite(bad):
    with pytest.raises(ValueError, match="softmax_scale"):
        api._scale(bad, 64)
    assert api._scale(None, 64) == 0.125


def test_non_array_inputs_are_rejected():
    with pytest.raises(TypeError, match="q must be a torch CUDA tensor or a CuPy array"):
        api.forward([[1.0]], None, None)


def test_backward_impl_options_are_checked_before_any_work():
    # Rejected before the inputs are even looked at (None would fail there).
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'split', 'fused'\), got 'fast'"):
        api.backward(None, None, None, None, None, None, impl="fast")
    with pytest.raises(ValueError, match=r"impl must be one of"):
        api.backward(None, None, None, None, None, None, impl=None, deterministic=False)


def test_score_grads_are_checked_before_any_work():
    # score_grads: a dict of score tensors' names (checked before the inputs)
    with pytest.raises(ValueError, match=r"score_grads must be a dict \{name: fp32 array\}"):
        api.backward(None, None, None, None, None, None, deterministic=False, score_grads=["b"])
    with pytest.raises(ValueError, match=r"score_grads\['c'\]: no such score tensor \(score_tensors: b\)"):
        api.backward(None, None, None, None, None, None, deterministic=False, score_mod="s + b[k]",
                     score_tensors={"b": None}, score_grads={"c": None})


# mask_mod: what is checked before NVRTC sees the expression, and what the expression decides.
@pytest.mark.parametrize("expr,tensors,error,pattern", [
    ("", None, ValueError, r"mask_mod must be a CUDA boolean expression over b, h, q, k, Lq, Lk"),
    (None, {"doc": None}, ValueError, r"mask_mod must be a CUDA boolean expression"),
    (3, None, ValueError, r"mask_mod must be a CUDA boolean expression"),
    ("k <= q", ["doc"], TypeError, r"mask_tensors must be a dict"),
    ("k <= q", {"q": None}, ValueError,
     r"mask_tensors key 'q' must be a C identifier other than a C\+\+ keyword, b, h, q"),
    ("k <= q", {"t1": None}, ValueError, r"key 't1'"),
    ("k <= q", {"2x": None}, ValueError, r"key '2x'"),
    ("k <= q", {f"a{i}": None for i in range(5)}, ValueError, r"at most 4 arrays, got 5"),
    ("k <= q", {"int": None}, ValueError, r"key 'int' must be a C identifier other than a C\+\+ keyword"),
    ("k <= q", {"FRT_INF": None}, ValueError, r"key 'FRT_INF'"),
    ("k <= q \\", None, ValueError, r"must not end in a backslash"),
])
def test_bad_mask_mod_is_named(expr, tensors, error, pattern):
    with pytest.raises(error, match=pattern):
        masks.Masking.parse(arr(Q), arr(KV), mask_mod=expr, mask_tensors=tensors)


@pytest.mark.parametrize("expr,kw,heads,batches", [
    ("k <= q || k < 64", {}, 1, 1),                 # one list serves every head and batch entry
    ("(q + k + h) % 3 != 0", {}, 8, 1),             # names h: a list per head
    ("b == 0 || k < q", {}, 1, 2),                  # names b: per batch entry
    ("k <= q", dict(window=(8, 8)), 1, 1),          # a window is the same for every batch entry
    ("bh > 0", {}, 1, 1),                           # identifiers, not letters: "bh" is not b or h
])
def test_mask_mod_lists_per_head_and_batch_only_when_needed(expr, kw, heads, batches):
    m = masks.Masking.parse(arr(Q), arr(KV), mask_mod=expr, **kw)
    assert m.bits & MASK_BITS["mod"] and m.mask_mod == expr.strip() and not m.ordered_dq_ok
    assert m.mod_lists(8) == (heads, batches)
    assert m.kernel_fields(8)["mod_heads"] == heads and m.kernel_fields(8)["mod_batches"] == batches


def test_mask_mod_sees_the_same_names_in_every_kernel():
    """The expression is defined at global scope: names private to one kernel (mask_classify.cu's
    TILE_FULL, namespace frt) are not visible, so the map kernel's compile check speaks for all."""
    from flashrt import cache, nvrtc, tiles
    for family in ("fwd", "bwd_dkdv"):
        spec = tiles.tiling(family, 64, "bf16", False, "sm_80", 160 * 1024, MASK_BITS["mod"],
                            "k <= q || TILE_FULL == 2")
        for s in (spec, tiles.classifier_spec(spec, "mask_map")):
            with pytest.raises(nvrtc.CompileError, match='identifier "TILE_FULL" is undefined'):
                nvrtc.compile_cubin(s.translation_unit(), s.name, s.options(), cache.kernel_sources())


def test_mask_mod_compile_error_shows_the_expression():
    from flashrt import cache, nvrtc, tiles
    expr = "k <= q && kk > 1"
    spec = tiles.classifier_spec(tiles.tiling("fwd", 64, "bf16", False, "sm_80", 160 * 1024, MASK_BITS["mod"], expr),
                                 "mask_map")
    with pytest.raises(nvrtc.CompileError) as info:
        nvrtc.compile_cubin(spec.translation_unit(), spec.name, spec.options(), cache.kernel_sources())
    msg = str(masks.mask_mod_error(expr, ("doc",), info.value.log))
    assert msg.startswith("mask_mod does not compile as a CUDA boolean expression over b, h, q, k, Lq, Lk, "
                          "const int* doc")
    lines = msg.splitlines()
    at = next(i for i, ln in enumerate(lines) if 'mask_mod(1): error: identifier "kk" is undefined' in ln)
    assert lines[at + 1].strip() == expr and lines[at + 2].index("^") == lines[at + 1].index("kk")


# score_mod: what is checked before NVRTC sees the expression (its tensors: descriptors stand in for arrays).
@pytest.fixture
def described(monkeypatch):
    """interop.describe passes an Array descriptor through: tensor checks run on the CPU."""
    from flashrt import interop
    real = interop.describe
    monkeypatch.setattr(interop, "describe", lambda x, name: x if isinstance(x, Array) else real(x, name))


@pytest.mark.parametrize("kw,error,pattern", [
    (dict(score_mod=""), ValueError, r"score_mod must be a CUDA float expression, the new scaled score, over float "
                                     r"s \(softmax_scale \* q\.k\), int b, h, q, k, Lq, Lk, float qf, kf \(q and k "
                                     r"as floats\) and the names of score_tensors"),
    (dict(score_mod="  "), ValueError, r"score_mod must be a CUDA float expression"),
    (dict(score_mod=3.0), ValueError, r"score_mod must be a CUDA float expression.*got 3\.0"),
    (dict(score_mod_grad="1.f"), ValueError, r"score_mod must be a CUDA float expression.*got None"),
    (dict(score_tensors={"bias": None}), ValueError, r"score_mod must be a CUDA float expression"),
    (dict(score_mod="s", score_mod_grad=""), ValueError, r"score_mod_grad must be a CUDA float expression, the "
                                                         r"derivative of score_mod in s \(or None"),
    (dict(score_mod="s", score_mod_grad=1), ValueError, r"score_mod_grad must be"),
    (dict(score_mod="s * 2.f \\"), ValueError, r"score_mod must not end in a backslash"),
    (dict(score_mod="s", score_mod_grad="1.f \\ "), ValueError, r"score_mod_grad must not end in a backslash"),
    (dict(score_mod="s", score_tensors=["bias"]), TypeError, r"score_tensors must be a dict"),
    (dict(score_mod="s", score_tensors={f"a{i}": None for i in range(5)}), ValueError, r"at most 4 arrays, got 5"),
    (dict(score_mod="s", score_tensors={"t0": None}), ValueError, r"score_tensors key 't0'"),
    (dict(score_mod="s", score_tensors={"2x": None}), ValueError, r"score_tensors key '2x'"),
    (dict(score_mod="s", score_tensors={"float": None}), ValueError, r"key 'float' must be a C identifier other than "
                                                                     r"a C\+\+ keyword, s, b, h, q, k, Lq, Lk, qf, kf, t0-t3"),
    (dict(score_mod="s", score_tensors={"flashrt_s": None}), ValueError, r"key 'flashrt_s'"),
] + [(dict(score_mod="s", score_tensors={name: None}), ValueError, f"score_tensors key '{name}' must be a C identifier")
     for name in ("s", "b", "h", "q", "k", "Lq", "Lk")])
def test_bad_score_mod_is_named(kw, error, pattern):
    with pytest.raises(error, match=pattern):
        masks.Masking.parse(arr(Q), arr(KV), **kw)


@pytest.mark.parametrize("tensor,error,pattern", [
    (arr((8,), dtype="float64"), TypeError, r"score_tensors\['t'\] must be float32 \(read as const float\*\) or int32 "
                                            r"\(const int\*\), got float64"),
    (arr((8,), dtype="int64"), TypeError, r"must be float32 .* got int64"),
    (arr((8,), dtype="bf16"), TypeError, r"must be float32 .* got bf16"),
    (arr((4, 8), strides=(16, 1), dtype="float32"), ValueError,
     r"score_tensors\['t'\] must be contiguous, got strides \(16, 1\); pass score_tensors\['t'\]\.contiguous\(\)"),
    (arr((4, 8), strides=(1, 4), dtype="int32"), ValueError, r"must be contiguous"),
    (arr((8,), dtype="float32", device=1), ValueError, r"score_tensors\['t'\] must be a torch array on cuda:0 like q, "
                                                       r"got torch on cuda:1"),
    (arr((8,), dtype="float32", device=-1), ValueError, r"got torch on the host"),
    (arr((8,), dtype="float32", lib="cupy"), ValueError, r"must be a torch array on cuda:0 like q, got cupy"),
])
def test_bad_score_tensor_is_named(described, tensor, error, pattern):
    with pytest.raises(error, match=pattern):
        masks.Masking.parse(arr(Q), arr(KV), score_mod="s + t[k]", score_tensors={"t": tensor})


def test_score_mod_reaches_the_kernels_with_its_tensors_types(described):
    m = masks.Masking.parse(arr(Q), arr(KV), causal=True)
    assert m.score_mod == ()
    bias = arr((8, 143), ptr=0x20000, dtype="float32")
    ids = arr((2, 1, 1), strides=(1, 7, 3), ptr=0x30000, dtype="int32")
    m = masks.Masking.parse(arr(Q), arr(KV), score_mod=" s + bias[h * 143 + k - q + 71] * ids[b] ",
                            score_tensors={"bias": bias, "ids": ids}, mask_mod="k <= q")
    assert m.score_mod == ("s + bias[h * 143 + k - q + 71] * ids[b]", "", (("bias", "float"), ("ids", "int")))
    assert (m.fields["score_t0"], m.fields["score_t1"]) == (0x20000, 0x30000)  # (size-1 axes: any stride)
    assert m.mask_mod == "k <= q" and m.mod_tensors == ()  # (mask_mod's own, apart)
    m = masks.Masking.parse(arr(Q), arr(KV), score_mod="s * s", score_mod_grad=" 2.f * s ")
    assert m.score_mod == ("s * s", "2.f * s", ()) and "score_t0" not in m.fields
    for softcap, alibi in ((30.0, False), (0.0, True)):
        with pytest.raises(ValueError, match=r"score_mod with softcap or alibi_slopes is not supported: write the cap "
                                             r"or the bias into the expression"):
            api._check_score_mod(m, softcap, alibi)
    api._check_score_mod(m, 0.0, False)


def test_score_mod_compile_errors_show_the_expression():
    """NVRTC's message about the user's text, with its caret; where only the automatic derivative (dual numbers)
    fails, the error asks for score_mod_grad."""
    from flashrt import cache, nvrtc, tiles

    def message(family, score):
        spec = tiles.tiling(family, 64, "bf16", False, "sm_80", 160 * 1024, score_mod=score)
        with pytest.raises(nvrtc.CompileError) as info:
            nvrtc.compile_cubin(spec.translation_unit(), spec.name, spec.options(), cache.kernel_sources())
        return str(masks.score_mod_error(score, info.value.log))

    def caret_under(msg, where, text, word):
        lines = msg.splitlines()
        at = next(i for i, ln in enumerate(lines) if where in ln)
        assert lines[at + 1].strip() == text and lines[at + 2].index("^") == lines[at + 1].index(word), msg

    msg = message("fwd", ("s + bias[k] * kk", "", (("bias", "float"),)))
    assert msg.startswith("score_mod does not compile as a CUDA float expression over float s, b, h, q, k, Lq, Lk, "
                          "float qf, float kf, const float* bias:")
    caret_under(msg, 'score_mod(1): error: identifier "kk" is undefined', "s + bias[k] * kk", "kk")
    assert msg.endswith("(the expression: 's + bias[k] * kk')")
    msg = message("bwd_dq", ("s * s", "2.f * s + zz", ()))  # the derivative's fault, named as such
    caret_under(msg, 'score_mod_grad(1): error: identifier "zz" is undefined', "2.f * s + zz", "zz")
    assert msg.endswith("(the expression: 's * s', its derivative: '2.f * s + zz')")
    for expr, word in (("(float)s * 2.f", "s"), ("s + erfcf(s)", "s)")):  # a cast of s; a function dual.cuh lacks
        msg = message("bwd_dkdv", (expr, "", ()))
        assert msg.startswith("score_mod's automatic derivative does not compile") and 'score_mod_grad="..."' in msg
        caret_under(msg, "score_mod (its automatic derivative)(1): error:", expr, word)


# Without torch: the torch entry points say which extra to install.
NEEDS_TORCH = (r'needs torch, which is not installed: pip install "flashrt\[torch\]" '
               r'\(from a flashrt checkout: pip install "\.\[torch\]"\)')


@pytest.fixture
def without_torch(monkeypatch):
    """torch as if not installed (`import torch` raises ModuleNotFoundError); flashrt's torch modules load anew."""
    import flashrt
    monkeypatch.setitem(sys.modules, "torch", None)
    for name in ("torch", "torch_ops", "distributed"):
        monkeypatch.delitem(sys.modules, f"flashrt.{name}", raising=False)
        if name in vars(flashrt):  # (getattr would run flashrt's lazy import, which raises without torch)
            monkeypatch.delattr(flashrt, name)
    return flashrt


def test_attention_without_torch_names_the_extra(without_torch):
    with pytest.raises(ImportError, match=r"flashrt\.attention " + NEEDS_TORCH) as info:
        without_torch.attention(None, None, None, causal=True)
    assert info.value.name == "torch" and isinstance(info.value.__cause__, ModuleNotFoundError)


def test_import_flashrt_torch_without_torch_names_the_extra(without_torch):
    with pytest.raises(ImportError, match=r"flashrt\.torch " + NEEDS_TORCH):
        importlib.import_module("flashrt.torch")
    with pytest.raises(ImportError, match=r"flashrt\.torch " + NEEDS_TORCH):
        without_torch.torch  # noqa: B018  (the lazy attribute imports it)
    assert "flashrt.torch" not in sys.modules


def test_import_flashrt_distributed_without_torch_names_the_extra(without_torch):
    with pytest.raises(ImportError, match=r"flashrt\.distributed " + NEEDS_TORCH):
        importlib.import_module("flashrt.distributed")
    assert "flashrt.distributed" not in sys.modules


def test_flashrt_imports_and_forward_checks_without_torch(without_torch):
    with pytest.raises(TypeError, match="q must be a torch CUDA tensor or a CuPy array"):
        without_torch.forward([[1.0]], None, None)


def _limbs_of(values):
    """kernels_cu/attention/score_mod.cuh's tensor_grad_add (FRT_SCORE_TGRAD 2), in Python, into one element."""
    import math as m
    import struct as st
    limbs = [0] * api._TGRAD_LIMBS
    for v in values:
        v = st.unpack("f", st.pack("f", v))[0]
        if v == 0:
            continue
        fr, e = m.frexp(v)
        pos = e - 24 + 96
        if not m.isfinite(v) or pos >= 6 * 24:
            limbs[-1] += 1
            continue
        mant = int(fr * 16777216)
        if pos < 0:
            mant, pos = (0 if pos < -24 else (mant + (1 << (-pos - 1))) >> -pos), 0
            if mant == 0:
                continue
        x = mant << (pos % 24)
        hi, lo = x >> 24, x - ((x >> 24) << 24)
        limbs[pos // 24] += lo
        limbs[pos // 24 + 1] += hi
    return limbs


def test_exact_sums_are_the_exact_sum_rounded_once():
    """api._add_exact_sums over limbs made as the kernels make them: the exact sum of fp32 values (cancelling,
    tiny, large, of both signs; those under 2^-73 rounded to the window's unit 2^-96) within an fp32 ulp, whatever
    their order; NaN where a value could not be held."""
    import fractions
    import random
    import struct as st
    rng = random.Random(5)
    cases = [[1.0, -1.0, 2.0 ** -30], [1e-3] * 1000 + [-1.0], [3.5e20, -3.5e20, 1.25], [-2.0 ** -90, 2.0 ** -100],
             [-2.0 ** -100] * 100 + [2.0 ** -97 * 3] * 7, [1.0, 2.0 ** -24, 2.0 ** -80],
             [rng.uniform(-1, 1) * 10 ** rng.randint(-20, 20) for _ in range(300)], [1.0, float("inf")],
             [2.0 ** 72, 1.0], [-7.0], []]
    limbs = np.array([_limbs_of(c) for c in cases], dtype=np.int64)
    rev = np.array([_limbs_of(c[::-1]) for c in cases], dtype=np.int64)
    assert np.array_equal(limbs, rev)  # integer sums: any order
    out = np.zeros(len(cases), dtype=np.float32)
    api._add_exact_sums(out, limbs)
    for got, values in zip(out.tolist(), cases):
        if any(not math.isfinite(v) or abs(v) >= 2.0 ** 71 for v in values):
            assert math.isnan(got)
            continue
        unit = fractions.Fraction(1, 2 ** 96)
        terms = [fractions.Fraction(st.unpack("f", st.pack("f", v))[0]) for v in values]
        exact = sum((t if abs(t) >= 2 ** -73 else math.floor(t / unit + fractions.Fraction(1, 2)) * unit
                     for t in terms), fractions.Fraction(0))
        ulp = 2.0 ** (math.frexp(float(exact))[1] - 24) if exact else 2.0 ** -149
        assert abs(fractions.Fraction(got) - exact) <= fractions.Fraction(ulp), (values[:4], got, float(exact))


def test_dropout_arguments_are_checked_before_any_work():
    for call in (lambda **kw: api.forward(None, None, None, **kw),
                 lambda **kw: api.backward(None, None, None, None, None, None, **kw)):
        for bad in (-0.1, 1.0, 1.5, True, "0.1", 1 - 2**-18):
            with pytest.raises(ValueError, match=r"dropout_p"):
                call(dropout_p=bad, dropout_rng=object())
        with pytest.raises(ValueError, match=r"dropout_p > 0 needs dropout_rng.*flashrt\.dropout_rng\(q\)"):
            call(dropout_p=0.1)
    q = arr(Q)
    for bad, pattern in ((dict(shape=(3,), dtype="int64"), r"dropout_rng must be an int64 array of shape \(2,\)"),
                         (dict(shape=(2,), dtype="int32"), r"dropout_rng must be an int64 array"),
                         (dict(shape=(2,), dtype="int64", device=1), r"dropout_rng")):
        with pytest.raises(ValueError, match=pattern):
            api._check_dropout_rng(arr(**bad), q)
    assert api._dropout_fields(0.0) == {}
    assert api._dropout_fields(0.1) == {"drop_keep": 230, "drop_scale": 256 / 230}  # (spec.dropout_resolution)
    assert api._dropout_fields(0.01) == {"drop_keep": 64881, "drop_scale": 65536 / 64881}
    assert (api._drop_bits(0.0), api._drop_bits(0.1), api._drop_bits(0.01)) == (0, 8, 16)


def _plan_on(monkeypatch, arch: str):
    """api's plan makers on a device described, not present (sm_90a: an H100's limits; sm_80: an A100's), with
    descriptor-only arrays: what each call would launch, no kernel compiled or loaded."""
    from flashrt import cli, launch
    smem = cli.SMEM_OPTIN[90 if arch == "sm_90a" else 80]
    dev = launch.Device(0, "H100" if arch == "sm_90a" else "A100", arch, 132 if arch == "sm_90a" else 108, smem,
                        50 * 2**20)
    monkeypatch.setattr(launch, "device", lambda index: dev)
    monkeypatch.setattr(api.interop, "describe", lambda x, name: x)
    api._PLANS.clear()


def _planned(plan) -> list:
    return [spec for spec, *_ in plan.launches.launches]


def test_long_query_tiling_reaches_the_forward_plan(monkeypatch):
    """The forward's plan takes head_dim 64's 192-row tiles (tiles.long_rows) from 1536 query rows without a causal
    mask and from 4096 with one: api passes the call's causality to long_rows."""
    _plan_on(monkeypatch, "sm_90a")
    for S, causal, rows in ((1535, False, 128), (1536, False, 192), (2048, True, 128), (4096, True, 192)):
        q, k, v = arr((1, S, 8, 64)), arr((1, S, 8, 64)), arr((1, S, 8, 64))
        (spec,) = _planned(api._forward_plan((q, k, v), causal, None, 0, {}))
        assert (spec.family, spec.block_m) == ("fwd_sm90_ws", rows), (S, causal, spec.name)


def test_padded_and_v_head_dims_reach_the_plans(monkeypatch):
    """The kernels a call plans for a padded head_dim (the wgmma instance above it, with the helpers of the backward at
    the main kernel's instance: the fp32 buffers' width) and for a v head_dim of its own (out, dv shaped by it; the
    mma.sync kernels compiled for both head_dims), with the tensors' head_dims in the params."""
    _plan_on(monkeypatch, "sm_90a")
    q, k, v = arr((2, 512, 8, 72)), arr((2, 512, 2, 72)), arr((2, 512, 2, 72))
    fwd = api._forward_plan((q, k, v), False, None, 0, {})
    (spec,) = _planned(fwd)
    assert spec.name.startswith("flashrt_fwd_sm90_ws_hd128_") and fwd.allocs[0][0] == (2, 512, 8, 72)
    out, lse = arr((2, 512, 8, 72)), arr((2, 8, 512), dtype="float32")
    bwd = api._backward_plan((out, q, k, v, out, lse), True, None, "fused", False, 0, {})
    heads = {s.family: s.head_dim for s in _planned(bwd)}  # (bwd_dkdv_reduce too where dK/dV splits)
    assert {"bwd_preprocess", "bwd_fused_sm90", "bwd_dq_convert"} <= set(heads) and set(heads.values()) == {128}
    _plan_on(monkeypatch, "sm_80")
    q, k, v = arr((2, 512, 8, 192)), arr((2, 512, 2, 192)), arr((2, 512, 2, 128))
    fwd = api._forward_plan((q, k, v), True, None, 0, {})
    (spec,) = _planned(fwd)
    assert spec.head_dims == (192, 128) and "_qk192v128_" in spec.name and fwd.allocs[0][0] == (2, 512, 8, 128)
    out, lse = arr((2, 512, 8, 128)), arr((2, 8, 512), dtype="float32")
    bwd = api._backward_plan((out, q, k, v, out, lse), True, None, "split", True, 0, {})
    assert [a[0] for a in bwd.allocs[:3]] == [q.shape, k.shape, v.shape]
    assert all(s.head_dims == (192, 128) for s in _planned(bwd) if s.family in ("bwd_dq", "bwd_dkdv"))


def test_mask_mod_classifiers_ignore_the_consumers_head_dims():
    """mask_mod's classification kernels read no q/k/v: a consumer compiled for a v head_dim of its own gives them
    none (they have one variant per tiling)."""
    from flashrt import cli, tiles
    consumer = tiles.tiling("fwd", 192, "bf16", True, "sm_80", cli.SMEM_OPTIN[80], MASK_BITS["mod"], "k <= q", ())
    consumer = dataclasses.replace(consumer, head_dims=(192, 128))
    for family in ("mask_map", "mask_rows"):
        spec = tiles.classifier_spec(consumer, family)
        assert spec.head_dims == () and spec.head_dim == 64


def test_ordered_causal_backward_chunks_its_pairs(monkeypatch):
    """impl="auto", deterministic, causal, from tiles.FUSED_WGMMA_MIN_SQ's query length: the wgmma fused kernel at any
    number of (batch entry, KV head) pairs (GQA counts the KV heads), its key-tile-major grid in chunks of
    tiles.ordered_key_chunk's pairs; unordered, or on the split pair, the rule is not asked."""
    from flashrt import tiles
    _plan_on(monkeypatch, "sm_90a")
    asked = []
    rule = tiles.ordered_key_chunk
    monkeypatch.setattr(tiles, "ordered_key_chunk", lambda dev, pairs, splits: asked.append(pairs) or rule(dev, pairs,
                                                                                                         splits))

    def families(B, H, Hkv, S=4096, deterministic=True):
        q, k = arr((B, S, H, 128)), arr((B, S, Hkv, 128))
        lse = arr((B, H, S), dtype="float32")
        plan = api._backward_plan((q, q, k, k, q, lse), True, None, "auto", deterministic, 0, {})
        return {s.family for s in _planned(plan)}
    for B, H, Hkv in ((4, 16, 16), (8, 16, 16), (8, 32, 4), (64, 16, 16)):
        assert "bwd_fused_sm90" in families(B, H, Hkv) and asked[-1] == B * Hkv
    n = len(asked)
    assert "bwd_fused_sm90" in families(8, 16, 16, deterministic=False) and "bwd_dkdv_sm90" in families(8, 16, 16, 512)
    # key tiles of every pair under tiles.ORDERED_CAUSAL_MIN_WAVES blocks per SM (132 here): the split pair
    assert "bwd_dkdv_sm90" in families(1, 8, 8, 2048) and "bwd_fused_sm90" in families(1, 8, 8, 2048, False)
    assert "bwd_dkdv_sm90" in families(1, 16, 16, 2048) and "bwd_fused_sm90" in families(1, 32, 32, 2048)
    assert len(asked) == n + 1


def test_ordered_fused_backward_stores_first_turns_where_every_row_sees_a_key(monkeypatch):
    """The ordered wgmma fused backward stores each query tile's first dQ turn (p.dq_first_store; bwd_preprocess then
    leaves dq_accum unzeroed) only where every query row has a key tile: not with a window, lengths or ids, nor causal
    bottom-right with more queries than keys (its first rows see none), nor unordered."""
    _plan_on(monkeypatch, "sm_90a")

    def first_store(Sq, Sk, causal, deterministic=True, **mask):
        q, kv = arr((2, Sq, 8, 128)), arr((2, Sk, 8, 128))
        lse = arr((2, 8, Sq), dtype="float32")
        plan = api._backward_plan((q, q, kv, kv, q, lse), causal, None, "fused", deterministic, 0, mask)
        assert any(s.family == "bwd_fused_sm90" for s in _planned(plan))
        return {int(np.frombuffer(t, params.BWD)[0]["dq_first_store"]) for t in plan.launches.templates
                if len(t) == params.BWD.itemsize}

    assert first_store(1024, 1024, False) == {1}
    assert first_store(1024, 2048, True) == {1}                    # bottom-right, Sq <= Sk: row 0 sees keys
    assert first_store(2048, 1024, "top_left") == {1}
    assert first_store(2048, 1024, True) == {0}                    # bottom-right: rows 0-1023 see none
    assert first_store(1024, 1024, False, deterministic=False) == {0}
    assert first_store(1024, 1024, True, window=(128, 0)) == {0}
    assert first_store(1024, 1024, False, seqlens_k=arr((2,), dtype="int32")) == {0}


def test_ordered_non_causal_backward_rotates_where_its_key_tiles_fit(monkeypatch):
    """The ordered wgmma fused backward runs its query tiles rotated (p.dq_rotate, tiles.rotate_ordered_dq) only when
    not causal, in one split and with a row's key tiles on half the SMs; impl="auto" takes it at head_dim 64 from 1k
    query rows there (FUSED_WGMMA_MIN_SQ_ROTATED), the split pair below 4k elsewhere (an H100's 132 SMs)."""
    _plan_on(monkeypatch, "sm_90a")

    def planned(B, S, H, causal):
        q, lse = arr((B, S, H, 64)), arr((B, H, S), dtype="float32")
        plan = api._backward_plan((q, q, q, q, q, lse), causal, None, "auto", True, 0, {})
        fused = any(s.family == "bwd_fused_sm90" for s in _planned(plan))
        rotate = {int(np.frombuffer(t, params.BWD)[0]["dq_rotate"]) for t in plan.launches.templates
                  if len(t) == params.BWD.itemsize}
        return fused, rotate

    assert planned(16, 1024, 32, False) == (True, {1})      # 8 key tiles, one split
    assert planned(1, 1024, 2, False) == (False, {0})       # 16 blocks: dK/dV splits, not rotated: the split pair
    assert planned(1, 16384, 16, False) == (True, {0})      # 128 key tiles: more than half the SMs
    assert planned(4, 4096, 32, True)[1] == {0}             # causal
