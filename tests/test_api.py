"""Validation and layout rules of the public API that need no GPU (array descriptors are plain data)."""
import importlib
import re
import sys

import numpy as np
import pytest

from flashrt import api, masks
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
    "k vs v": (dict(v=dict(shape=(2, 81, 2, 64))), ValueError, r"k and v must have the same shape"),
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
    assert api._check_qkv(arr(Q), arr(KV), arr(KV)) == dict(B=2, Sq=64, Sk=80, H=8, Hkv=2, D=64)


@pytest.mark.parametrize("name,bad,pattern", [
    ("dout", dict(shape=(2, 64, 8, 32)), r"dout must match q: expected torch bf16 \(2, 64, 8, 64\)"),
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
        api._check_grad_inputs(arr(Q), descs["dout"], descs["out"], descs["lse"], (2, 8, 64))
    api._check_grad_inputs(arr(Q), *(arr(**good[n]) for n in ("dout", "out", "lse")), (2, 8, 64))


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
    api._check_grad_inputs(q, q, q, lse, (1, 4, 64))


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
