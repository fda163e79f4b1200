"""flashrt.decode / flashrt.combine: attention of a few new tokens against a KV cache, and merging partial results.

decode runs kernels_cu/sm80/decode.cu: the query heads that share a KV head are packed into one tile (each K/V byte
is read once), each sequence's keys are split over several blocks when the batch alone would leave SMs idle, and
kernels_cu/helpers/combine.cu merges the splits in a fixed order (bitwise reproducible), or on Hopper, for few short
splits, their thread block cluster does (tiles.decode_cluster). Nothing is copied to the
host and nothing is allocated outside the caller's library: a decode step can be captured into a CUDA graph and
replayed with new cache_seqlens.
"""
from __future__ import annotations

import math

from . import interop, launch, params, tiles
from .params import MASK_BITS
from .api import _LOG2E, _Alloc, _check_layout, _check_tensor, _Plan, _planned, _scale, _strides

MAX_NEW_TOKENS = 16
COMBINE_MAX_PARTS = 256  # kernels_cu/helpers/combine.cu: PARTS_PER_LANE x 32 (decode takes at most 128)


def _check_int32(a: interop.Array, name: str, shape: tuple, q: interop.Array) -> None:
    if a.lib != q.lib or a.device != q.device:
        raise ValueError(f"{name} must be a {q.lib} array on cuda:{q.device} like q, got {a.lib} on cuda:{a.device}")
    if a.dtype != "int32" or a.shape != shape:
        raise ValueError(f"{name} must be int32 of shape {shape}, got {a.dtype} {a.shape}")
    if len(shape) and shape[-1] > 1 and a.strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last axis, got strides {a.strides}; pass "
                         f"{name}.contiguous()")


def decode(q, k_cache, v_cache, *, cache_seqlens, k=None, v=None, page_table=None, causal=True, window=(-1, -1),
           softmax_scale: float | None = None, num_splits: int = 0, sinks=None, softcap: float | None = None,
           alibi_slopes=None, return_lse: bool = False):
    """Attention of q's new tokens against a KV cache. Returns out (like q), or (out, lse) with return_lse.

    q: (B, Sq, H, D), Sq from 1 to 16 (speculative decoding), bf16 or fp16; head_dim a multiple of 8 up to 256.
    k_cache, v_cache: (B, S_max, Hkv, D), or paged (num_pages, page_size, Hkv, D) with page_table (B, max_pages)
      int32: token t of sequence b is row t % page_size of page page_table[b, t // page_size]. H a multiple of Hkv.
    cache_seqlens: (B,) int32 on the device: tokens in the cache before this call.
    k, v: optional (B, Sq, Hkv, D) keys and values of the new tokens: written into the cache in place at
      positions cache_seqlens[b] .. + Sq - 1 (cache_seqlens is not changed), and attended to. Without them the
      new tokens' keys must already be in the cache: the first cache_seqlens[b] tokens are attended to.
    causal: among the new tokens, bottom-right aligned: query i sees keys up to L - Sq + i (L: the tokens
      attended to). window=(left, right): query i sees keys L - Sq + i - left .. L - Sq + i + right (-1: unbounded).
    num_splits: blocks over each sequence's keys (0: chosen from batch, heads, the cache's capacity and the SMs).
    sinks: optional (H,) float32 attention-sink logits (as flashrt.forward's: each joins its head's rows' softmax
      denominator; lse includes it, and a query that sees no key gets out = 0 and lse = its sink).
    softcap: c > 0 caps every scaled score x to c * tanh(x / c) before the softmax (Gemma 2, Grok), as
      flashrt.forward's.
    alibi_slopes: optional float32 (H,) or (B, H) slopes: the scaled score of new token i and key j becomes
      x - slope * |j - (L - Sq + i)| (ALiBi, bottom-right aligned as the causal mask; L: the tokens attended to), as
      flashrt.forward's. Not with softcap.
    lse: fp32 (B, H, Sq), natural log; -inf for a query that sees no key (its out is 0; with sinks, lse = the sink).

    Bad values are found on the GPU (no host copy): a cache_seqlens entry outside [0, capacity - Sq with k / v]
    or a page id outside [0, num_pages) is never used for an access; the rows it concerns get NaN, and a
    ValueError names it at the next flashrt call (or flashrt.synchronize()).
    Under torch.compile it is the custom op flashrt::decode (no graph break; the caches declared mutated).
    """
    if _compiling(q):  # torch.compile: the custom op flashrt::decode (torch_ops.py), which calls back here
        from .torch_ops import decode_traced
        out, lse = decode_traced(q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal, window, softmax_scale,
                                 num_splits, sinks, softcap, alibi_slopes)
        return (out, lse) if return_lse else out
    alibi_kind = 0
    if alibi_slopes is not None:  # (not on the plain call's path)
        from .api import _alibi_kind  # (api imports this module)
        alibi_kind = _alibi_kind(alibi_slopes)
    result = _planned("decode", _present(q, k_cache, v_cache, cache_seqlens, k, v, page_table, sinks, alibi_slopes),
                      (k is not None, page_table is not None, causal, tuple(window) if isinstance(window, (tuple, list))
                       else window, softmax_scale, num_splits, sinks is not None, softcap, alibi_kind),
                      {}, 0,
                      lambda tensors: _decode_plan(tensors, k is not None, page_table is not None, causal, window,
                                                   softmax_scale, num_splits, sinks is not None, softcap,
                                                   alibi_slopes is not None))
    return (result[0], result[1]) if return_lse else result[0]


def _compiling(q) -> bool:
    """Whether q is a torch tensor being traced by torch.compile (torch is imported only if q's module is torch)."""
    if not interop.is_torch(q):
        return False
    import torch
    return torch.compiler.is_compiling()


def _present(*tensors) -> tuple:
    return tuple(t for t in tensors if t is not None)


def _decode_plan(tensors, new: bool, paged: bool, causal, window, softmax_scale, num_splits,
                 sinks: bool = False, softcap=None, alibi: bool = False) -> _Plan:
    names = ["q", "k_cache", "v_cache", "cache_seqlens"] + (["k_new", "v_new"] if new else []) + \
        (["page_table"] if paged else []) + (["sinks"] if sinks else []) + (["alibi_slopes"] if alibi else [])
    if len(tensors) != len(names):
        raise ValueError("k and v must be given together")
    A = dict(zip(names, (interop.describe(t, n) for t, n in zip(tensors, names))))
    Q, KC, VC = A["q"], A["k_cache"], A["v_cache"]
    for a, name in ((Q, "q"), (KC, "k_cache"), (VC, "v_cache")):
        _check_tensor(a, name, 4)
        if a.lib != Q.lib or a.device != Q.device:
            raise ValueError(f"{name} must be a {Q.lib} array on cuda:{Q.device} like q, got {a.lib} on "
                             f"cuda:{a.device}")
    if Q.dtype not in ("bf16", "fp16"):
        raise TypeError(f"q has dtype {Q.dtype}; flashrt supports bfloat16 and float16")
    if KC.dtype != Q.dtype or VC.dtype != Q.dtype:
        raise TypeError(f"q, k_cache, v_cache must share one dtype, got {Q.dtype}, {KC.dtype}, {VC.dtype}")
    B, Sq, H, D = Q.shape
    if not 1 <= Sq <= MAX_NEW_TOKENS:
        raise ValueError(f"decode takes 1 to {MAX_NEW_TOKENS} new tokens per sequence (q's axis 1), got {Sq}; "
                         f"use flashrt.forward for a prefill")
    if D % 8 or not 8 <= D <= 256:
        raise ValueError(f"head_dim must be a multiple of 8 between 8 and 256, got {D}")
    if KC.shape != VC.shape:
        raise ValueError(f"k_cache and v_cache must have the same shape, got {KC.shape} and {VC.shape}"
                         + ("; flashrt.decode does not take a v head_dim of its own yet (flashrt.forward does)"
                            if KC.shape[:-1] == VC.shape[:-1] else ""))
    slots, S_cache, Hkv, Dk = KC.shape
    if Dk != D:
        raise ValueError(f"k_cache's head_dim (axis 3) is {Dk}, q's is {D}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q's heads ({H}) must be a multiple of the cache's heads ({Hkv}) (GQA/MQA)")
    if paged:
        PT = A["page_table"]
        if len(PT.shape) != 2 or PT.shape[0] != B:
            raise ValueError(f"page_table must be (batch, max_pages) = ({B}, max_pages), got shape {PT.shape}")
        _check_int32(PT, "page_table", PT.shape, Q)
        capacity, page_size = PT.shape[1] * S_cache, S_cache
    else:
        if slots != B:
            raise ValueError(f"k_cache must be (batch, S_max, Hkv, D) with batch {B} (q's), got {KC.shape}; "
                             f"a paged cache (num_pages, page_size, Hkv, D) needs page_table")
        capacity, page_size = S_cache, 0
    _check_int32(A["cache_seqlens"], "cache_seqlens", (B,), Q)
    from .api import _check_alibi, _check_score_mods, _check_sinks, _check_softcap  # (api imports this module)
    softcap = _check_softcap(softcap)
    _check_score_mods(softcap, A.get("alibi_slopes"))
    if sinks:
        _check_sinks(A["sinks"], Q, H)
    bstride = _check_alibi(A["alibi_slopes"], Q, H, B) if alibi else 0
    if new:
        for n in ("k_new", "v_new"):
            a, name = A[n], n[0]
            _check_tensor(a, name, 4)
            if a.shape != (B, Sq, Hkv, D) or a.dtype != Q.dtype or a.lib != Q.lib or a.device != Q.device:
                raise ValueError(f"{name} must be {Q.lib} {Q.dtype} of shape {(B, Sq, Hkv, D)} (batch, q's new "
                                 f"tokens, the cache's heads, head_dim) on cuda:{Q.device}, got {a.lib} {a.dtype} "
                                 f"{a.shape} on cuda:{a.device}")
        if Sq > capacity:
            raise ValueError(f"{Sq} new tokens do not fit a cache of {capacity} tokens per sequence")
    for name in ("q", "k_cache", "v_cache", *(("k_new", "v_new") if new else ())):
        _check_layout(A[name], name)
    # One offset serves both caches (decode.cu: load_kv): their strides must agree, as do k's and v's.
    for a, b in (("k_cache", "v_cache"), ("k_new", "v_new")):
        if a in A and _strides(A[a]) != _strides(A[b]):
            raise ValueError(f"{a} and {b} must have the same strides, got {A[a].strides} and {A[b].strides}; "
                             f"pass {b}.contiguous() with a contiguous {a} (or views of one tensor that agree)")
    if not (isinstance(window, (tuple, list)) and len(window) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)):
        raise ValueError(f"window must be (left, right), integers >= -1 (-1: unbounded), got {window!r}")
    if causal not in (True, False):
        raise ValueError(f"causal must be True or False (decode aligns to the bottom-right), got {causal!r}")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 0:
        raise ValueError(f"num_splits must be an integer >= 0 (0: chosen), got {num_splits!r}")
    return _plan(A, names, capacity, page_size, slots if paged else 0, causal, window, _scale(softmax_scale, D),
                 num_splits, softcap, alibi, bstride)


FORWARD_MAX_ROWS = 32  # query rows per KV head (query heads per KV head x Sq) up to which flashrt.forward takes decode


def forward_applies(m, Q: interop.Array, K: interop.Array, V: interop.Array) -> bool:
    """Whether flashrt.forward runs decode's kernels (api._forward_plan): at most FORWARD_MAX_ROWS query rows per KV
    head (each K/V byte is read once per KV head, the keys split over blocks), no mask but a bottom-right causal one
    and a window, no score_mod, k and v of one layout (docs/perf-notes.md, Decode: flashrt.forward)."""
    return (m.Sq * (Q.shape[2] // K.shape[2]) <= FORWARD_MAX_ROWS and not m.varlen and not m.mask_mod
            and not m.score_mod and not m.bits & ~MASK_BITS["window"] and not m.fields.get("top_left")
            and _strides(K) == _strides(V))


def forward_plan(Q, K, V, m, scale: float, sinks: bool = False, softcap: float = 0.0, alibi: bool = False,
                 alibi_bstride: int = 0) -> _Plan:
    """flashrt.forward's plan through decode.cu (forward_applies): k and v as a full contiguous cache (and the
    call's sinks, softcap and ALiBi slopes, checked by api._forward_plan)."""
    window = (m.fields.get("win_left", -1), m.fields.get("win_right", -1))
    names = ["q", "k", "v"] + (["sinks"] if sinks else []) + (["alibi_slopes"] if alibi else [])
    return _plan({"q": Q, "k_cache": K, "v_cache": V}, names, K.shape[1], 0, 0, bool(m.causal), window, scale, 0,
                 softcap, alibi, alibi_bstride)


def _plan(A: dict, names: list, capacity: int, page_size: int, num_pages: int, causal: bool, window, scale: float,
          num_splits: int, softcap: float = 0.0, alibi: bool = False, alibi_bstride: int = 0) -> _Plan:
    """The plan of checked arrays A (q, k_cache, v_cache [, cache_seqlens, k_new, v_new, page_table]), named by
    `names` as the call's tensors are (without cache_seqlens, every sequence holds `capacity` tokens); softcap: the
    checked cap (0: none); alibi: the call's tensors include alibi_slopes, alibi_bstride its batch stride."""
    Q, KC = A["q"], A["k_cache"]
    B, Sq, H, D = Q.shape
    Hkv = KC.shape[2]
    paged = "page_table" in A
    out_shape, lse_shape = (B, Sq, H, D), (B, H, Sq)
    allocs = [_Alloc(("o",), out_shape, "like"), _Alloc(("lse",), lse_shape, "f32")]
    if B * H == 0:
        return _Plan([], (), allocs, [], None)
    dev = launch.device(Q.device)
    rows = H // Hkv * Sq
    spec = tiles.decode_spec(D, Q.dtype, rows, dev.arch, dev.smem_optin, bool(softcap), alibi)
    splits = tiles.decode_splits(spec, B, Hkv, rows, capacity, dev.sm_count, dev.smem_optin, num_splits)
    shift = page_size.bit_length() - 1 if page_size and page_size & (page_size - 1) == 0 else -1
    p = dict(B=B, H=H, Hkv=Hkv, Sq=Sq, capacity=capacity, seqlen=capacity, page_size=page_size, page_shift=shift,
             num_pages=num_pages, splits=splits, causal=int(causal), win_left=window[0], win_right=window[1],
             scale_log2=scale * _LOG2E, softcap=softcap / scale, alibi_bstride=alibi_bstride,
             report=launch.report_words(dev),
             pt_sb=A["page_table"].strides[0] if paged else 0)
    for prefix, name in (("q", "q"), ("kc", "k_cache"), ("kn", "k_new")):
        if name in A:
            p[f"{prefix}_sb"], p[f"{prefix}_ss"], p[f"{prefix}_sh"] = _strides(A[name])
    p["o_sb"], p["o_ss"], p["o_sh"] = Sq * H * D, H * D, D
    links = {"k_cache": "k", "v_cache": "v"} if "k" in names else {}  # (flashrt.forward's names)
    if alibi:
        links["alibi"] = "alibi_slopes"
    structs = [(params.DECODE, p, links)]
    # (the splits merge in their cluster: no parts, no combine)
    cluster = tiles.decode_cluster(spec, B, Hkv, rows, capacity, splits, dev.sm_count, dev.smem_optin)
    p["cluster"] = int(cluster)
    launches = [(spec, launch.grid(spec, B, H, Hkv, Sq, 0, dev.sm_count, splits), 0, splits if cluster else 1)]
    if splits > 1 and not cluster:
        allocs.append(_Alloc.parts([("o_part", splits * B * Sq * H * D), ("lse_part", splits * B * H * Sq)], "f32"))
        combiner = tiles.kernel_for("decode_combine", D, Q.dtype, False, dev)
        rw = tiles.combine_row_warps(splits, B * Sq * H, dev.sm_count, combiner.warps)
        structs.append((params.COMBINE, dict(n=splits, B=B, Sq=Sq, H=H, D=D, row_warps=rw), {}))
        launches.append((combiner, launch.grid(combiner, B, H, Hkv, Sq, 0, dev.sm_count, row_warps=rw), 1))
    return _Plan(structs, tuple(names), allocs, launches, dev)


def combine(out_parts, lse_parts):
    """Merge attention results over disjoint key ranges (split-KV, shared-prefix / cascade decoding, context
    parallelism): returns (out, lse) as if attention had seen all the keys at once.

    out_parts: (n, B, Sq, H, D) bf16, fp16 or fp32 (or a list of n (B, Sq, H, D) arrays), each part normalised
    over its own keys, as flashrt.forward and flashrt.decode return; lse_parts: (n, B, H, Sq) fp32 (or a list),
    their natural-log lse (-inf: the part saw no key for that row, and adds nothing). out has the parts' dtype,
    lse is fp32 (B, H, Sq). The parts are added in order: the result is bitwise reproducible (on one GPU model: which
    of combine.cu's two kernels merges depends on the rows per SM, tiles.combine_rows).
    """
    Op, Lp = _stacked(out_parts, "out_parts"), _stacked(lse_parts, "lse_parts")
    # (planned once per signature, as forward / decode: ~20 us less host time a call than a plan built each time)
    return tuple(_planned("combine", (Op.obj, Lp.obj), (), {}, 0, lambda tensors: _combine_plan(Op, Lp)))


def _combine_plan(Op, Lp) -> _Plan:
    """combine's plan for parts laid out as Op, Lp (checked here, once per signature)."""
    for a, name in ((Op, "out_parts"), (Lp, "lse_parts")):
        if a.device < 0:
            raise ValueError(f"{name} is in host memory; flashrt needs CUDA tensors")
    if len(Op.shape) != 5:
        raise ValueError(f"out_parts must be (n, B, Sq, H, D), got shape {Op.shape}")
    n, B, Sq, H, D = Op.shape
    if Lp.shape != (n, B, H, Sq) or Lp.dtype != "float32" or Lp.lib != Op.lib or Lp.device != Op.device:
        raise ValueError(f"lse_parts must be {Op.lib} float32 of shape {(n, B, H, Sq)} on cuda:{Op.device} (out_parts "
                         f"{Op.shape}), got {Lp.lib} {Lp.dtype} {Lp.shape}")
    if Op.dtype not in ("bf16", "fp16", "float32"):
        raise TypeError(f"out_parts must be bfloat16, float16 or float32, got {Op.dtype}")
    if D % 8 or not 8 <= D <= 256:
        raise ValueError(f"head_dim must be a multiple of 8 between 8 and 256, got {D}")
    if not 1 <= n <= COMBINE_MAX_PARTS:
        raise ValueError(f"combine takes 1 to {COMBINE_MAX_PARTS} parts, got {n}; combine them in groups, then the "
                         f"groups' results")
    allocs = [_Alloc(("o",), (B, Sq, H, D), "like"), _Alloc(("lse",), (B, H, Sq), "f32")]
    if B * Sq * H == 0:
        return _Plan([], (), allocs, [], None)
    dev = launch.device(Op.device)
    rows = tiles.combine_rows(n, B * Sq * H, dev.sm_count)  # (combine.cu: a thread per 8 columns, or warps a row)
    family = ("combine_rows" if rows else "combine") + ("_f32" if Op.dtype == "float32" else "")
    spec = tiles.kernel_for(family, D, "bf16" if Op.dtype == "float32" else Op.dtype, False, dev)
    rw = 1 if rows else tiles.combine_row_warps(n, B * Sq * H, dev.sm_count, spec.warps)
    return _Plan([(params.COMBINE, dict(n=n, B=B, Sq=Sq, H=H, D=D, row_warps=rw), {})], ("o_part", "lse_part"),
                 allocs, [(spec, launch.grid(spec, B, H, H, Sq, 0, dev.sm_count, row_warps=rw), 0)], dev)


def _stacked(x, name: str) -> interop.Array:
    """A contiguous array of the parts: x itself when it already is one, else a stacked / contiguous copy."""
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError(f"{name} is empty")
        first = interop.describe(x[0], f"{name}[0]")
        if first.lib == "torch":
            import torch
            x = torch.stack(list(x))
        else:
            import cupy
            x = cupy.stack(list(x))
    a = interop.describe(x, name)
    contiguous = tuple(int(math.prod(a.shape[i + 1:])) for i in range(len(a.shape)))
    if any(n > 1 and s != c for n, s, c in zip(a.shape, a.strides, contiguous)) or a.ptr % 16:
        if a.lib == "torch":
            import torch
            x = x.clone(memory_format=torch.contiguous_format)
        else:
            import cupy
            x = cupy.array(x, copy=True, order="C")
        a = interop.describe(x, name)
    return a
