"""flashrt.forward / flashrt.backward: validate, plan, launch.

Layout: q (B, Sq, H, D), k and v (B, Sk, Hkv, D), with any strides on the
first three axes and a contiguous last axis; lse is fp32 (B, H, Sq). H must be
a multiple of Hkv (GQA/MQA); dK/dV are summed over each KV head's group.

Causal masking is aligned to the bottom-right corner when Sq != Sk, as in
FlashAttention >= 2.1: query i sees key j iff j <= i + Sk - Sq. Query rows that
see no key (possible when Sq > Sk) get out = 0, lse = -inf and zero gradients.
"""
from __future__ import annotations

import ctypes
import dataclasses
import math
import numbers
import re
import struct

from . import _env, cache, interop, launch, masks, nvrtc, params, tiles, tma
from .interop import Array
from .spec import ELEMENTWISE, V_DIM_FAMILIES, KernelSpec, dropout_resolution

_LOG2E = 1.4426950408889634


def _check_tensor(a: Array, name: str, rank: int) -> None:
    if a.device < 0:
        raise ValueError(f"{name} is in host memory; flashrt needs CUDA tensors: move it with {name}.cuda()")
    if len(a.shape) != rank:
        raise ValueError(f"{name} must have {rank} dimensions (batch, seqlen, heads, head_dim), got shape {a.shape}")


def _check_layout(a: Array, name: str) -> None:
    """Kernels read 16-byte vectors: contiguous last axis, 8-element-aligned strides, 16-byte-aligned base."""
    if a.shape[-1] > 1 and a.strides[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last (head_dim) axis, got strides {a.strides}; "
                         f"pass {name}.contiguous()")
    for axis, (size, stride) in enumerate(zip(a.shape[:-1], a.strides[:-1])):
        if size > 1 and stride % 8:
            raise ValueError(f"{name} has stride {stride} on axis {axis} (strides {a.strides}); flashrt needs "
                             f"strides that are multiples of 8 elements (16 bytes); pass {name}.contiguous()")
    if a.ptr % 16:
        raise ValueError(f"{name}'s data pointer 0x{a.ptr:x} is not 16-byte aligned (a view with a storage offset "
                         f"that is not a multiple of 8 elements?); pass {name}.clone() to get an aligned copy")


def _strides(a: Array) -> tuple[int, int, int]:
    # An axis of size 1 is never stepped along; its stride may be anything, so pass 0.
    return tuple(s if n > 1 else 0 for n, s in zip(a.shape[:3], a.strides[:3]))


def _scale(softmax_scale, head_dim: int) -> float:
    scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale must be a finite positive number, got {softmax_scale!r}")
    return scale


def _check_qkv(Q: Array, K: Array, V: Array) -> dict:
    """Every rule q, k, v must meet before a kernel sees them; returns the problem's dimensions."""
    for a, name in ((Q, "q"), (K, "k"), (V, "v")):
        _check_tensor(a, name, 4)
    if len({Q.lib, K.lib, V.lib}) > 1:
        raise TypeError(f"q, k, v must all come from one library, got q: {Q.lib}, k: {K.lib}, v: {V.lib}")
    if len({Q.device, K.device, V.device}) > 1:
        raise ValueError(f"q, k, v must be on one device, got cuda:{Q.device}, cuda:{K.device}, cuda:{V.device}")
    if Q.dtype not in ("bf16", "fp16"):
        raise TypeError(f"q has dtype {Q.dtype}; flashrt supports bfloat16 and float16: cast with "
                        f"q.to(torch.bfloat16) / q.astype(ml_dtypes.bfloat16)")
    if K.dtype != Q.dtype or V.dtype != Q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got q: {Q.dtype}, k: {K.dtype}, v: {V.dtype}")
    B, Sq, H, D = Q.shape
    Bk, Sk, Hkv, Dk = K.shape
    Dv = V.shape[-1]
    if K.shape[:-1] != V.shape[:-1]:
        raise ValueError(f"k and v must agree on every axis but head_dim (v's may differ), got k: {K.shape}, "
                         f"v: {V.shape}")
    if Bk != B or Dk != D:
        raise ValueError(f"q {Q.shape} and k {K.shape} must agree on batch (axis 0) and head_dim (axis 3)")
    for d, what in ((D, "head_dim"), (Dv, "v's head_dim")):
        if d % 8 or not 8 <= d <= 256:
            raise ValueError(f"{what} must be a multiple of 8 between 8 and 256, got {d}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q's heads ({H}) must be a multiple of k/v's heads ({Hkv}) (GQA/MQA)")
    for a, name in ((Q, "q"), (K, "k"), (V, "v")):
        _check_layout(a, name)
    return dict(B=B, Sq=Sq, Sk=Sk, H=H, Hkv=Hkv, D=D, Dv=Dv)


def _check_grad_inputs(Q: Array, dO: Array, O: Array, L: Array, lse_shape: tuple, o_shape: tuple) -> None:
    """The rules for backward's dout, out and lse, given a valid q; out's shape is `o_shape` (q's with v's head_dim)."""
    for a, name in ((dO, "dout"), (O, "out")):
        _check_tensor(a, name, len(Q.shape))
        if a.shape != o_shape or a.dtype != Q.dtype or a.lib != Q.lib or a.device != Q.device:
            raise ValueError(f"{name} must match q (with v's head_dim): expected {Q.lib} {Q.dtype} {o_shape} on "
                             f"cuda:{Q.device}, got {a.lib} {a.dtype} {a.shape} on cuda:{a.device}")
        _check_layout(a, name)
    if L.shape != lse_shape or L.dtype != "float32" or L.lib != Q.lib or L.device != Q.device:
        raise ValueError(f"lse must be {Q.lib} float32 of shape {lse_shape} on cuda:{Q.device} (as returned by "
                         f"flashrt.forward), got {L.lib} {L.dtype} {L.shape} on cuda:{L.device}")
    contiguous = tuple(int(math.prod(lse_shape[i + 1:])) for i in range(len(lse_shape)))
    # (an axis of size 1 is never stepped along: its stride may be anything, as torch's is_contiguous() has it)
    if math.prod(lse_shape) and any(n > 1 and s != c for n, s, c in zip(lse_shape, L.strides, contiguous)):
        raise ValueError(f"lse must be contiguous, got strides {L.strides}; pass lse.contiguous()")


def _tensor_fields(p: dict, **arrays: Array) -> None:
    """Pointer and (batch, seq, head) strides of each array into the params dict `p`."""
    for prefix, a in arrays.items():
        p[f"{prefix}_sb"], p[f"{prefix}_ss"], p[f"{prefix}_sh"] = _strides(a)


def _out_shape(Q: Array, V: Array) -> tuple:
    """out's (and dout's) shape: q's with v's head_dim."""
    return (*Q.shape[:-1], V.shape[-1])


def _as_batch(a: Array) -> Array:
    """A packed (total, H, D) array as one batch entry (1, total, H, D) with batch stride 0."""
    return dataclasses.replace(a, shape=(1, *a.shape), strides=(0, *a.strides)) if len(a.shape) == 3 else a


def _kernel_for(family: str, D: int, Q: Array, m: masks.Masking, dev, softcap: bool = False, alibi: bool = False,
                dropout: int = 0, head_dims: tuple = ()):
    """tiles.kernel_for with this call's dtype, mask, softcap, ALiBi, score_mod, dropout (its bits: _drop_bits) and
    query length (tiles.long_rows); `head_dims`: q's and v's head_dims, which a spec.V_DIM_FAMILIES kernel takes
    where they differ, and fwd_sm90_ws where its instance pads them (tiles.qk_width, v_width)."""
    spec = tiles.kernel_for(family, D, Q.dtype, m.causal, dev, m.bits, m.mask_mod, m.mod_tensors, softcap, alibi,
                            tiles.long_rows(family, D, m.Sq, m.causal), m.score_mod, dropout)
    if family in V_DIM_FAMILIES and head_dims and head_dims[0] != head_dims[1]:
        spec = dataclasses.replace(spec, head_dims=tuple(head_dims))
    if head_dims and family == "fwd_sm90_ws":  # (at a head_dim its instance pads: S and O over its own columns)
        spec = dataclasses.replace(spec, qk_width=tiles.qk_width(family, D, head_dims[0]),
                                   v_width=tiles.v_width(family, D, head_dims[1]))
    return spec


def _check_score_mod(m: masks.Masking, softcap: float, alibi: bool) -> None:
    """score_mod's combinations that the kernels have."""
    if m.score_mod and (softcap or alibi):
        raise ValueError("score_mod with softcap or alibi_slopes is not supported: write the cap or the bias into the "
                         "expression, e.g. score_mod=\"30.f * tanhf(s / 30.f)\"")


def _compiled_score_mod(m: masks.Masking, specs) -> None:
    """A score_mod call's kernels compiled before its plan is made, so that an expression NVRTC rejects raises
    masks.score_mod_error (the fault marked in the user's text; a mask_mod's fault, masks.mask_mod_error), not the
    kernel's compile error."""
    from .spec import MOD_FILE, SCORE_DUAL_FILE, SCORE_FILE, SCORE_GRAD_FILE, SCORE_TGRAD_FILE
    try:
        cache.prefetch(spec for spec in specs if spec.score_mod)  # (at once: a backward has two or three)
    except nvrtc.CompileError as exc:
        lines = exc.log.splitlines()  # (a message starts "file(line)")
        if any(ln.startswith((SCORE_FILE + "(", SCORE_GRAD_FILE + "(", SCORE_DUAL_FILE + "(", SCORE_TGRAD_FILE + "("))
               for ln in lines):
            raise masks.score_mod_error(m.score_mod, exc.log) from None
        if m.mask_mod and any(ln.startswith(MOD_FILE + "(") for ln in lines):
            raise masks.mask_mod_error(m.mask_mod, m.mod_tensors, exc.log) from None
        raise


def _check_softcap(softcap) -> float:
    """softcap as a float (0.0: none)."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real) or not (math.isfinite(softcap)
                                                                                   and softcap > 0):
        raise ValueError(f"softcap must be a finite positive number (scores become softcap * tanh(score / softcap)) "
                         f"or None, got {softcap!r}")
    return float(softcap)


def _check_score_mods(softcap: float, alibi_slopes) -> None:
    """The score modifications' combinations that the kernels have (softcap: _check_softcap's float)."""
    if softcap and alibi_slopes is not None:
        raise ValueError("softcap and alibi_slopes together are not supported yet")


def _alibi_kind(alibi_slopes) -> int:
    """What a plan depends on of alibi_slopes besides its layout: 0 none, 1 (H,), 2 (B, H), -1 another (its plan's
    build raises)."""
    if alibi_slopes is None:
        return 0
    ndim = getattr(alibi_slopes, "ndim", -1)
    return ndim if ndim in (1, 2) else -1


def _check_alibi(A: Array, Q: Array, H: int, B: int) -> int:
    """ALiBi slopes for q's H heads and B batch entries (packed varlen: sequences); returns the kernels'
    alibi_bstride (H for (B, H) slopes, 0 for (H,))."""
    if A.shape not in ((H,), (B, H)):
        raise ValueError(f"alibi_slopes must have shape ({H},) or ({B}, {H}) (a slope per query head, or per batch "
                         f"entry{' (sequence)' if len(Q.shape) == 3 else ''} and query head), got {A.shape}")
    interop.check_beside(A, Q, "alibi_slopes")
    if A.dtype != "float32":
        raise ValueError(f"alibi_slopes must be float32, got {A.dtype}: pass alibi_slopes.float() / "
                         f"alibi_slopes.astype(cupy.float32)")
    interop.check_contiguous(A, "alibi_slopes")
    return H if len(A.shape) == 2 else 0


def _check_dropout(dropout_p, dropout_rng) -> float:
    """dropout_p as a float (0.0: none); with p > 0 a dropout_rng must come with it."""
    p = _dropout_p(dropout_p)
    if p and dropout_rng is None:
        raise ValueError("dropout_p > 0 needs dropout_rng, the (seed, offset) int64 pair on q's device that the "
                         "backward regenerates the mask from: rng = flashrt.dropout_rng(q), then pass the same rng to "
                         "forward and backward (flashrt.attention draws its own)")
    return p


def _dropout_p(dropout_p) -> float:
    """dropout_p as a float in [0, 1) that leaves some probability kept (0.0: none)."""
    if dropout_p.__class__ is float and dropout_p == 0.0:  # (every call without dropout: no ABC check, ~1-2 us)
        return 0.0
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0 <= dropout_p < 1:
        raise ValueError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    p = float(dropout_p)
    if p and dropout_resolution(p)[1] < 1:
        raise ValueError(f"dropout_p={p!r} would drop every probability (p is resolved in steps of 2^-16 at most): "
                         f"pass at most {1 - 2**-16}")
    return p


def _check_dropout_rng(R: Array, Q: Array) -> None:
    if R.dtype != "int64" or R.shape != (2,):
        raise ValueError(f"dropout_rng must be an int64 array of shape (2,) (seed, offset), got {R.dtype} {R.shape}; "
                         f"flashrt.dropout_rng(q) draws one")
    interop.check_beside(R, Q, "dropout_rng")
    interop.check_contiguous(R, "dropout_rng")


def _drop_bits(p: float) -> int:
    """The bits of a dropout draw each element takes at probability p (spec.dropout_resolution), 0 for none: the
    kernels' FRT_DROPOUT."""
    return dropout_resolution(p)[0] if p else 0


def _dropout_fields(p: float) -> dict:
    """The kernels' keep threshold and the kept probabilities' scale (2^bits / threshold: the expectation exact)."""
    if not p:
        return {}
    bits, keep = dropout_resolution(p)
    return {"drop_keep": keep, "drop_scale": (1 << bits) / keep}


def _first_turn_stores(m: masks.Masking) -> bool:
    """The ordered wgmma fused backward's query tiles each take a first turn of dQ where every query row sees a key
    (no mask arrays, window or mask_mod; causal aligned so that row 0 sees key 0): that turn stores its dQ, so that
    bwd_preprocess need not zero dq_accum (BwdParams::dq_first_store; docs/perf-notes.md: Ordered grid). Not with
    FLASHRT_NO_DQ_FIRST_STORE=1."""
    if m.bits or m.varlen or m.mask_mod or m.Sk == 0 or _env.no_dq_first_store():
        return False
    return not m.causal or bool(m.fields.get("top_left")) or m.Sq <= m.Sk


def dropout_rng(like):
    """A fresh dropout (seed, offset) pair for flashrt.forward / backward's dropout_rng: an int64 array of 2 on
    `like`'s device, in its library. For torch, drawn on the device from torch's generator (torch.manual_seed makes it
    reproducible, and a CUDA graph's replays draw new ones); for CuPy, from cupy.random."""
    if interop.is_torch(like):
        import torch
        return torch.randint(0, 2**62, (2,), dtype=torch.int64, device=like.device)
    import cupy
    with cupy.cuda.Device(interop.describe(like, "like").device):
        return cupy.random.randint(0, 2**62, size=2, dtype=cupy.int64)


def _classify(p: dict, m: masks.Masking, H: int, dev, *needs) -> tuple:
    """mask_mod: how to make the tile lists that each (consumer kernel, "mask_rows" | "mask_cols") in
    `needs` walks, as plan pieces: (one _Alloc for the maps, lists and counts; params structs; launches
    of kernels_cu/helpers/mask_classify.cu, indexing those structs). One map per tiling (the expression on
    every pair), then the lists; a rows list whose row of key tiles one map block holds comes from that
    block (tiles.map_slots), without a launch of its own. The lists' pointers are the _Alloc's parts,
    named like their fields; a map launch's struct gets a list's pointer only when it writes that list.
    """
    heads, batches = m.mod_lists(H)
    unset = dict.fromkeys(("mod_rows", "mod_rows_count", "mod_cols", "mod_cols_count"), "")  # (no such source)
    by_tiling: dict = {}
    for consumer, family in needs:
        by_tiling.setdefault((consumer.block_m, consumer.block_n), []).append((consumer, family))
    parts, structs, launches = [], [], []
    for k, ((bm, bn), users) in enumerate(by_tiling.items()):
        tiles_mn = (-(-m.Sq // bm), -(-m.Sk // bn))
        mapper = tiles.classifier_spec(users[0][0], "mask_map")
        try:  # the map kernel is the smallest with the expression in it: its compile checks it
            launch.function(mapper, dev)
        except nvrtc.CompileError as exc:
            raise masks.mask_mod_error(m.mask_mod, m.mod_tensors, exc.log) from None
        name = f"mod_map{k}"
        parts.append((name, -(-batches * heads * tiles_mn[0] * tiles_mn[1] // 4)))  # a byte per tile
        grid = launch.grid(mapper, batches, heads, 0, m.Sq, m.Sk)
        rows_by_map = grid[0] == 1 and any(family == "mask_rows" for _, family in users)
        links = {**unset, "mod_map": name}
        if rows_by_map:
            links.update(mod_rows="mod_rows", mod_rows_count="mod_rows_count")
        structs.append((params.FWD, p, links))
        launches.append((mapper, grid, len(structs) - 1))
        for consumer, family in users:
            outer = tiles_mn[0] if family == "mask_rows" else tiles_mn[1]
            lists = family.replace("mask", "mod")
            parts += [(lists, batches * heads * tiles_mn[0] * tiles_mn[1]), (lists + "_count", batches * heads * outer)]
            if family == "mask_rows" and rows_by_map:
                continue
            spec = tiles.classifier_spec(consumer, family)
            structs.append((params.FWD, p, {"mod_map": name}))
            launches.append((spec, launch.grid(spec, batches, heads, 0, m.Sq, m.Sk), len(structs) - 1))
    return _Alloc.parts(parts, "i32"), structs, launches


def _with_lists(m: masks.Masking, tensors: tuple, inputs: tuple, structs: list, allocs: list, launches: list, dev,
                classify: tuple) -> tuple:
    """A mask_mod plan's pieces with _classify's: its classifier launches first, every call; or, when the
    lists depend on nothing but the call's signature (m.static_lists), made once here and kept, their
    pointers written into the structs. Returns (structs, allocs, launches, keep)."""
    alloc, cstructs, claunches = classify
    if m.static_lists:
        made = _Plan(cstructs, inputs, [alloc], claunches, dev).run(tensors)
        base = interop.data_ptr(made[0])
        for _, values, _ in structs:
            values.update({f: base + off for f, off in zip(alloc.fields, alloc.offsets)})
        return structs, allocs, launches, made
    n = len(structs)
    return (structs + cstructs, allocs + [alloc], [(sp, g, i + n) for sp, g, i in claunches] + launches, ())


def _prepare(q, k, v, mask_args: dict):
    """Descriptors of q, k, v (as 4-D), the problem's dimensions, and the parsed masking."""
    Q, K, V = interop.describe(q, "q"), interop.describe(k, "k"), interop.describe(v, "v")
    for a, name in ((Q, "q"), (K, "k"), (V, "v")):
        if a.device < 0:
            raise ValueError(f"{name} is in host memory; flashrt needs CUDA tensors: move it with {name}.cuda()")
    m = masks.Masking.parse(Q, K, **mask_args)
    Q4, K4, V4 = (_as_batch(a) if m.varlen else a for a in (Q, K, V))
    s = _check_qkv(Q4, K4, V4)
    return Q, K, V, Q4, K4, V4, s, m


MASK_DOC = """
    Masks (every kind composes with the others; flashrt.reference.visible is the specification):
      causal: False, True (= "bottom_right": the last query sees the last key, as in
        FlashAttention >= 2.1; query i sees key j iff j <= i + Sk - Sq) or "top_left" (j <= i).
      window=(left, right): query i sees keys i + shift - left .. i + shift + right (-1 = unbounded),
        shift as chosen by `causal`'s alignment (bottom-right unless causal="top_left").
      seqlens_q, seqlens_k: (B,) int32 on the device, valid rows per batch entry (padding); rows past
        them are neither attended to nor from: their out and gradients are 0 and lse -inf.
      cu_seqlens_q, cu_seqlens_k: (B+1,) int32 row offsets of packed sequences (varlen): q is
        (total_q, H, D), k and v (total_k, Hkv, D), lse (H, total_q); max_seqlen_q/k are the longest
        lengths (computed with a host copy of cu_seqlens when not given).
      block_ids_q, block_ids_k: (B, S) int32 (or (total,) when varlen), non-decreasing: key j is
        visible to query i iff block_ids_k[j] <= block_ids_q[i] (block-causal, prefix-LM).
      segment_ids_q, segment_ids_k: the same shapes, non-decreasing: visible iff equal (documents).
      mask_mod: a CUDA boolean expression over int b (batch entry / sequence), h (query head), q, k
        (query and key positions in the sequence) and Lq, Lk (the sequence's lengths), such as
        "k <= q || k < 256"; mask_tensors={"name": int32 device array, ...} (at most 4, contiguous)
        gives it arrays to read, as `const int* name` (it indexes them itself: "doc[b * 4096 + q] ==
        doc[b * 4096 + k]"). It is compiled into the kernels (cached like any variant; a compile error
        shows the expression with the fault marked). A small kernel evaluates it on every pair first
        and lists the tiles to visit, per head only when it names h, per batch entry only when it
        names b or a tensor (or a built-in mask differs by batch entry).
      A query that sees no key gets out = 0, lse = -inf and zero gradients.
      validate=True (the default) checks the data of the id/length arrays (non-decreasing ids, lengths
        within the tensor, well-formed cu_seqlens, no sequence longer than max_seqlen) on the GPU, after
        the call's kernels: no host copy and no synchronisation (CUDA graphs capture it). A failure sets
        the call's outputs to NaN and raises a ValueError naming the argument at the next flashrt call
        or at flashrt.synchronize(); validate="sync" waits for the check and raises in the call itself;
        validate=False skips it (a bad array then gives wrong answers, never an access outside the tensors).
"""


def forward(q, k, v, *, causal=False, softmax_scale: float | None = None, softcap: float | None = None,
            alibi_slopes=None, sinks=None, dropout_p: float = 0.0, dropout_rng=None, validate=True, **mask_args):
    """Attention forward. Returns (out, lse): out like q, lse fp32 (B, H, Sq), in the caller's library.

    softcap: c > 0 caps every scaled score x (softmax_scale * q.k) to c * tanh(x / c) before the softmax (Gemma 2,
    Grok); pass the same to backward.
    alibi_slopes: optional float32 (H,) or (B, H) slopes (packed varlen: B = the sequences, len(cu_seqlens_q) - 1),
    contiguous, on q's device: the scaled score x of query i and key j becomes x - slope[b, h] * |j - i - shift|,
    shift the causal alignment's offset of that sequence (Lk - Lq, its own lengths with seqlens / varlen; 0 with
    causal="top_left"), causal or not (ALiBi, as FlashAttention-2's alibi_slopes). Not with softcap; pass the same to
    backward.
    sinks: optional (H,) float32 attention-sink logits, one per query head in the scaled scores' units: each joins
    every row's softmax denominator and adds no value (gpt-oss). lse includes it; a row that sees no key then gets
    out = 0 and lse = its head's sink (padding rows past seqlens_q too; packed varlen rows outside every sequence
    keep lse -inf). Pass the same sinks to backward, which returns their gradient.
    score_mod: a CUDA float expression, the new scaled score, over float s (softmax_scale * q.k), int b, h, q, k, Lq,
    Lk (as mask_mod's), float qf, kf (q and k as floats, cheaper than converting them per score) and the names of
    score_tensors={"name": float32 or int32 device array} (at most 4, contiguous, read as const float* / const int*),
    such as "s - slopes[h] * fabsf(kf - qf)"; applied before the masks. score_mod_grad: its derivative in s (default:
    derived automatically, the expression evaluated over dual numbers). In the expression tanh, exp, exp2, log and log2
    of a float are the hardware's approximations and divisions approximate (write s * (1.f / c) for s / c). Not with
    softcap or alibi_slopes; pass the same to backward (whose score_grads gives float32 tensors their gradients).
    dropout_p: attention dropout, 0 <= p < 1: each probability is kept with probability 1 - p and scaled to keep its
    expectation, or dropped (lse is that of the probabilities before dropout). The mask is a function of
    dropout_rng (required with p > 0: an int64 array of 2, seed and offset, on q's device; dropout_rng(q) draws one)
    and of each pair's sequence, query head and positions, the same in every kernel and on every GPU; pass the same
    dropout_p and dropout_rng to backward. p is resolved in steps of 2^-8 where that gives its drop rate within 2.5%
    of itself (every p from 0.078 on: 0.1 drops 26 in 256, 0.1016), else 2^-16 (kept where an 8- or 16-bit draw is
    under round((1 - p) 2^bits): spec.dropout_resolution), and the kept probabilities are scaled by 2^bits / that (the
    expectation exact).
    reference.dropout_mask gives the mask.
    """
    masks.check_names(mask_args, "forward")
    mode = masks.validate_mode(validate)
    cap = _check_softcap(softcap)
    _check_score_mods(cap, alibi_slopes)
    drop = _check_dropout(dropout_p, dropout_rng)
    tensors = ((q, k, v) + (() if sinks is None else (sinks,)) + (() if alibi_slopes is None else (alibi_slopes,))
               + ((dropout_rng,) if drop else ()))
    alibi = _alibi_kind(alibi_slopes)
    result = _planned("forward", tensors, (causal, softmax_scale, cap, sinks is not None, alibi, drop), mask_args,
                      mode, lambda tensors: _forward_plan(tensors, causal, softmax_scale, mode, mask_args,
                                                          sinks is not None, cap, bool(alibi), drop))
    return result[0], result[1]  # (mask_mod's tile lists follow out and lse)


def _check_sinks(S: Array, Q: Array, H: int) -> None:
    if (S.lib != Q.lib or S.device != Q.device or S.dtype != "float32" or S.shape != (H,)
            or (H > 1 and S.strides[0] != 1)):
        raise ValueError(f"sinks must be a contiguous {Q.lib} float32 array of shape ({H},) (one logit per query head) "
                         f"on cuda:{Q.device}, got {S.lib} {S.dtype} {S.shape} with strides {S.strides} on "
                         f"cuda:{S.device}")


def _forward_plan(tensors, causal, softmax_scale, mode: int, mask_args: dict, sinks: bool = False,
                  softcap: float = 0.0, alibi: bool = False, dropout: float = 0.0) -> "_Plan":
    q, k, v = tensors[:3]
    Q, K, V, Q4, K4, V4, s, m = _prepare(q, k, v, dict(mask_args, causal=causal))
    H, Hkv, D, Dv = s["H"], s["Hkv"], s["D"], s["Dv"]
    Dm, o_shape = max(D, Dv), _out_shape(Q, V)  # (the kernels' head_dim: the larger of q's and v's, or above it)
    _check_score_mod(m, softcap, alibi)
    if sinks:
        _check_sinks(interop.describe(tensors[3], "sinks"), Q, H)
    bstride = _check_alibi(interop.describe(tensors[3 + sinks], "alibi_slopes"), Q, H, m.B) if alibi else 0
    if dropout:  # (after q, k, v, sinks and the slopes; the mask arrays follow)
        _check_dropout_rng(interop.describe(tensors[3 + sinks + alibi], "dropout_rng"), Q)
    scale = _scale(softmax_scale, D)
    # Varlen: rows outside every sequence are not written by the kernel: zeros, lse -inf. Nothing to
    # attend to: out = 0, lse = -inf, no launch.
    empty = m.B * m.Sq * H == 0 or m.Sk == 0
    fill = (0.0, -math.inf) if m.varlen or empty else (None, None)
    allocs = [_Alloc(("o",), o_shape, "like", fill[0]), _Alloc(("lse",), m.lse_shape(H), "f32", fill[1])]
    if empty:
        if sinks and m.Sk == 0 and m.B * m.Sq * H:  # every row sees the sink alone: lse = the sink
            raise ValueError("sinks with no keys (k has 0 tokens): every row would see its sink alone; pass at least "
                             "one key")
        return _Plan([], (), allocs, [], None)
    from . import decoding  # (it imports this module)
    if not dropout and Dv == D and not _env.no_decode_forward() and decoding.forward_applies(m, Q4, K4, V4):
        return decoding.forward_plan(Q4, K4, V4, m, scale, sinks, softcap, alibi, bstride)
    dev = launch.device(Q.device)
    family = tiles.forward_family(Dm, dev.arch, dev.smem_optin, m.bits, bool(dropout))
    spec = _kernel_for(family, tiles.sm90_head_dim(family, Dm), Q, m, dev, bool(softcap), alibi, _drop_bits(dropout),
                       (D, Dv))
    _compiled_score_mod(m, [spec])
    p = dict(H=H, Hkv=Hkv, head_dim=D, head_dim_v=Dv, scale_log2=scale * _LOG2E, softcap=softcap / scale,
             alibi_bstride=bstride, **_dropout_fields(dropout), **m.kernel_fields(H),
             **_contiguous_fields("o", o_shape))
    _tensor_fields(p, q=Q4, k=K4, v=V4)
    if spec.family in ("fwd_sm90", "fwd_sm90_ws"):
        p["sched_pairs"] = tiles.item_chunk(dev, m.B, m.Sk, Dm, H, Hkv)
    maps, counter = [], None
    if spec.family == "fwd_sm90_ws":  # its work-item counter (launch.sched_counter); its TMA maps of q, k, v
        counter = (0, "sched")
        if not _env.no_tma():
            p["use_tma"] = 1
            maps = [(0, f"{n}_map", n, tma.TileMap(n, a.shape, a.strides, rows))
                    for n, a, rows in (("q", Q4, spec.block_m), ("k", K4, spec.block_n), ("v", V4, spec.block_n))]
    inputs = ("q", "k", "v", *(("sinks",) if sinks else ()), *(("alibi",) if alibi else ()),
              *(("drop_rng",) if dropout else ()), *(f for f, _ in _mask_arrays(mask_args)))
    structs, launches, keep = [(params.FWD, p, {})], [(spec, launch.grid(spec, m.B, H, Hkv, m.Sq, m.Sk, dev.sm_count),
                                                                                 0)], ()
    if m.mask_mod:
        structs, allocs, launches, keep = _with_lists(m, tensors, inputs, structs, allocs, launches, dev,
                                                      _classify(p, m, H, dev, (spec, "mask_rows")))
    if mode and m.checked:
        _add_check(structs, launches, m, dev, False, (("o", o_shape, Q.itemsize), ("lse", m.lse_shape(H), 4)))
    return _Plan(structs, inputs, allocs, launches, dev, reusable=not (keep and launch._capturing(dev)), keep=keep,
                 maps=maps, counter=counter)


def _add_check(structs: list, launches: list, m: masks.Masking, dev, backward: bool, outputs: tuple) -> None:
    """validate: kernels_cu/helpers/mask_check.cu after the call's kernels, on its mask arrays; on a failure it writes
    launch.report_words and sets the call's `outputs` ((alloc field, shape, itemsize) each, at most 3) to NaN."""
    values, links = dict(m.check_fields(backward), report=launch.report_words(dev)), {}
    for i, (field, shape, itemsize) in enumerate(outputs):
        values[f"poison_bytes{i}"], links[f"poison{i}"] = math.prod(shape) * itemsize, field
    structs.append((params.CHECK, values, links))
    launches.append((tiles.check_spec(dev.arch), (1, 1, 1), len(structs) - 1))


forward.__doc__ += MASK_DOC
IMPLS = ("auto", "split", "fused")


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale: float | None = None, impl: str = "auto",
             deterministic: bool = True, softcap: float | None = None, alibi_slopes=None, sinks=None,
             dropout_p: float = 0.0, dropout_rng=None, validate=True, score_grads: dict | None = None, **mask_args):
    """Attention backward from forward's (out, lse). Returns (dq, dk, dv) shaped like (q, k, v), and with
    `sinks` (the forward's) their gradient too: (dq, dk, dv, dsinks), dsinks (H,) fp32.

    Pass the same mask arguments, softcap, alibi_slopes, sinks, dropout_p and dropout_rng as to forward (the slopes
    get no gradient).
    impl="split": a dQ kernel over query tiles and a dK/dV kernel over key tiles, no atomics.
    impl="fused": one kernel over key tiles that also adds dQ up in an fp32 buffer with
    atomics (5 matmuls instead of 7). With deterministic=True the key tiles add in a fixed
    order (a counter per query tile), else in whatever order they finish.
    impl="auto": the faster of the two for this shape (tiles.backward_impl).
    With deterministic=True (the default) dq, dk and dv are bitwise identical for
    identical inputs, run after run and process after process, for every impl.
    score_grads={name: array}: the gradients of score_mod's float32 tensors (score_tensors[name]) are added into
    these fp32 arrays, contiguous and shaped like the tensors (zero them first for the gradient alone): a pass of the
    dQ kernel evaluates the expression's derivative in every element it reads and adds it up: with deterministic=True
    into an exact fixed-point sum per element (64 bytes each, for the call; bits under 2^-96 rounded to that unit),
    then rounded to fp32 within an ulp, bitwise reproducible (NaN where a term was not finite or 2^71 or more);
    else by fp32 atomics, in no fixed order. Not with a mask_mod yet. A read outside a tensor adds nothing.
    """
    masks.check_names(mask_args, "backward")
    sums = {}
    if score_grads:
        _check_score_grads(score_grads, mask_args, deterministic)
        if deterministic:  # exact fixed-point sums (score_mod.cuh: tensor_grad_add), turned into floats after
            sums = {n: interop.new_many(g, [((math.prod(g.shape), _TGRAD_LIMBS), "i64", 0)])[0]
                    for n, g in score_grads.items()}
        mask_args = dict(mask_args, score_grads=sums or score_grads)  # (a plan's pointers: _mask_arrays)
    mode = masks.validate_mode(validate)
    if sinks is not None:
        Q = interop.describe(q, "q")
        _check_sinks(interop.describe(sinks, "sinks"), Q, Q.shape[-2] if len(Q.shape) > 1 else 0)
    cap = _check_softcap(softcap)
    _check_score_mods(cap, alibi_slopes)
    drop = _check_dropout(dropout_p, dropout_rng)
    tensors = ((dout, q, k, v, out, lse) + (() if alibi_slopes is None else (alibi_slopes,))
               + ((dropout_rng,) if drop else ()))
    alibi = _alibi_kind(alibi_slopes)
    result = _planned("backward", tensors, (causal, softmax_scale, impl, deterministic, cap, alibi, drop), mask_args,
                      mode, lambda tensors: _backward_plan(tensors, causal, softmax_scale, impl, deterministic, mode,
                                                           mask_args, cap, bool(alibi), drop))
    for name, limbs in sums.items():
        _add_exact_sums(score_grads[name], limbs)
    if sinks is None:
        return result[0], result[1], result[2]  # (the scratch arrays follow)
    return result[0], result[1], result[2], _sink_grad(sinks, lse, result[3] if len(result) > 3 else None)


_TGRAD_LIMBS = 8  # int64 limbs of an exact sum (kernels_cu/attention/score_mod.cuh: kTgradLimbs, tensor_grad_add)
_TGRAD_MAX_BYTES = 4 << 30  # the most those sums may take per tensor


def _check_score_grads(score_grads, mask_args: dict, deterministic: bool) -> None:
    """score_grads names float tensors of score_tensors, each with an fp32 array of its shape, on its device."""
    tensors = mask_args.get("score_tensors") or {}
    if not isinstance(score_grads, dict):
        raise ValueError(f"score_grads must be a dict {{name: fp32 array}} for tensors of score_tensors, got "
                         f"{type(score_grads).__name__}")
    if not isinstance(tensors, dict):
        raise TypeError(f"score_tensors must be a dict {{name: array}}, got {type(tensors).__name__}")
    if mask_args.get("mask_mod") is not None:
        raise ValueError("score_grads with a mask_mod are not computed yet (the gradient pass would need tile lists "
                         "of its own): write the mask into score_mod (-INFINITY for a hidden pair), or detach the "
                         "tensors")
    for name, g in score_grads.items():
        if name not in tensors:
            raise ValueError(f"score_grads[{name!r}]: no such score tensor (score_tensors: {', '.join(tensors)})")
        T = interop.describe(tensors[name], f"score_tensors[{name!r}]")
        G = interop.describe(g, f"score_grads[{name!r}]")
        if T.dtype != "float32":
            raise ValueError(f"score_grads[{name!r}]: score_tensors[{name!r}] is {T.dtype}; only float32 tensors take "
                             f"a gradient")
        if G.dtype != "float32" or G.shape != T.shape:
            raise ValueError(f"score_grads[{name!r}] must be a float32 array of score_tensors[{name!r}]'s shape "
                             f"{tuple(T.shape)}, got {G.dtype} {tuple(G.shape)}")
        interop.check_beside(G, T, f"score_grads[{name!r}]")
        interop.check_contiguous(G, f"score_grads[{name!r}]")
        if deterministic and math.prod(T.shape) * _TGRAD_LIMBS * 8 > _TGRAD_MAX_BYTES:
            raise ValueError(f"score_grads[{name!r}]: deterministic=True sums each element's gradient exactly in "
                             f"{_TGRAD_LIMBS * 8} bytes, {math.prod(T.shape) * _TGRAD_LIMBS * 8 / 2**30:.1f} GiB for "
                             f"this tensor (at most {_TGRAD_MAX_BYTES >> 30} GiB): pass deterministic=False (fp32 "
                             f"atomics, in no fixed order)")


def _add_exact_sums(out, limbs) -> None:
    """out (fp32) += the exact fixed-point sums in limbs (n, _TGRAD_LIMBS) int64 (score_mod.cuh: tensor_grad_add),
    in the array library's ops: the carries moved up so that every limb but the top one is in [0, 2^24), then the
    float64 sum of nonnegative terms (of the value or of its negation, whichever has a nonnegative top limb: no
    cancellation), then to fp32 (two roundings: within an ulp of the exact sum); NaN where a term could not be held.
    Deterministic."""
    torch_lib = interop.is_torch(out)
    if torch_lib:
        import torch as xp
    elif type(out).__module__.split(".")[0] == "numpy":  # (host arrays: the CPU tests)
        import numpy as xp
    else:
        import cupy as xp
    n = _TGRAD_LIMBS - 1

    def normalised(raw):
        parts = [raw[:, i] for i in range(n)]
        for i in range(n - 1):
            carry = parts[i] >> 24
            parts[i] = parts[i] - (carry << 24)
            parts[i + 1] = parts[i + 1] + carry
        return parts

    def value(parts):
        total = 0.0
        for i in reversed(range(n)):  # (largest first)
            total = total + (parts[i].double() if torch_lib else parts[i].astype(xp.float64)) * 2.0 ** (24 * i - 96)
        return total

    up, down = normalised(limbs), normalised(-limbs)
    exact = xp.where(up[n - 1] >= 0, value(up), -value(down))
    exact = xp.where(limbs[:, n] != 0, math.nan, exact)
    out += (exact.float() if torch_lib else exact.astype(xp.float32)).reshape(out.shape)


def _sink_grad(sinks, lse, scratch):
    """dsinks (H,) fp32 from the backward's scratch, whose delta (after lse2) holds rowsum(dout o out) of every row
    with a finite lse (_sink_grad_of); scratch None: no rows (dsinks 0)."""
    if scratch is None:
        return interop.new_many(sinks, [(sinks.shape, "f32", 0.0)])[0]
    rows = math.prod(lse.shape)
    start = _Alloc.parts([("lse2", rows), ("delta", rows)], "f32").offsets[1] // 4  # (as _backward_plan lays it out)
    return _sink_grad_of(sinks, lse, scratch[start:start + rows])


def _sink_grad_of(sinks, lse, delta):
    """dsinks (H,) of rows laid out as lse ((B, H, S), or (H, total) packed) with delta = rowsum(dout o out) in the
    same order: minus the sum over each head's rows of the sink's probability exp(sink - lse) times delta. A row with
    lse -inf (no row: packed padding) adds nothing, whatever its delta. In the array library's ops (torch or CuPy,
    as `sinks`): a fixed reduction order, deterministic."""
    if interop.is_torch(sinks):
        import torch as xp
    else:
        import cupy as xp
    H = sinks.shape[0]
    lse3 = lse.reshape(-1, H, lse.shape[-1])
    term = xp.exp(sinks.reshape(1, H, 1) - lse3) * delta.reshape(lse3.shape)
    return -xp.where(lse3 == -math.inf, 0.0, term).sum((0, 2))


def _backward_plan(tensors, causal, softmax_scale, impl: str, deterministic: bool, mode: int,
                   mask_args: dict, softcap: float = 0.0, alibi: bool = False, dropout: float = 0.0) -> "_Plan":
    _check_impl(impl)
    dout, q, k, v, out, lse = tensors[:6]
    score_grads, arrays = mask_args.get("score_grads"), _mask_arrays(mask_args)  # (the plan's pointer fields)
    mask_args = {n: a for n, a in mask_args.items() if n != "score_grads"}
    Q, K, V, Q4, K4, V4, s, m = _prepare(q, k, v, dict(mask_args, causal=causal))
    H, Hkv, D, Dv = s["H"], s["Hkv"], s["D"], s["Dv"]
    Dm = max(D, Dv)  # (the kernels' head_dim: the larger of q's and v's, or above it)
    _check_score_mod(m, softcap, alibi)
    scale = _scale(softmax_scale, D)
    dO, O, L = interop.describe(dout, "dout"), interop.describe(out, "out"), interop.describe(lse, "lse")
    _check_grad_inputs(Q, dO, O, L, m.lse_shape(H), _out_shape(Q, V))
    bstride = _check_alibi(interop.describe(tensors[6], "alibi_slopes"), Q, H, m.B) if alibi else 0
    if dropout:  # (after dout, q, k, v, out, lse and the slopes; the mask arrays follow)
        _check_dropout_rng(interop.describe(tensors[6 + alibi], "dropout_rng"), Q)
    if impl == "fused" and deterministic and not m.ordered_dq_ok:
        raise ValueError("impl='fused' with deterministic=True cannot order its dQ additions under segment_ids "
                         "or mask_mod masks; use impl='split' (or 'auto'), or deterministic=False")

    # Varlen: rows outside every sequence are not written by the kernels. Nothing to attend to: zeros.
    empty = m.B * m.Sq * H == 0 or m.Sk == 0
    fill = 0.0 if m.varlen or empty else None
    allocs = [_Alloc((n,), shape, "like", fill) for n, shape in (("dq", Q.shape), ("dk", K.shape), ("dv", V.shape))]
    if empty:
        return _Plan([], (), allocs, [], None)
    rows = math.prod(m.lse_shape(H))
    scratch = [("lse2", rows), ("delta", rows)]  # fp32, in one allocation (_Alloc.parts)
    p = dict(H=H, Hkv=Hkv, head_dim=D, head_dim_v=Dv, scale_log2=scale * _LOG2E, scale=scale, softcap=softcap / scale,
             alibi_bstride=bstride,
             **_dropout_fields(dropout), **m.kernel_fields(H), **_contiguous_fields("dq", Q.shape),
             **_contiguous_fields("dk", K.shape), **_contiguous_fields("dv", V.shape))
    dO4 = _as_batch(dO)
    _tensor_fields(p, q=Q4, k=K4, v=V4, o=_as_batch(O), do=dO4)

    dev = launch.device(Q.device)
    drop = _drop_bits(dropout)
    dq_family, dkdv_family = tiles.split_families(Dm, dev.arch, dev.smem_optin, m.bits, drop)
    fused_family = tiles.fused_family(Dm, dev.arch, dev.smem_optin, m.bits, bool(softcap), alibi, m.score_mod)
    if drop and m.score_mod:  # (the wgmma backward has no variant with both: spec.DROPOUT_FAMILIES)
        dq_family, dkdv_family, fused_family = "bwd_dq", "bwd_dkdv", "bwd_fused"

    def rotated(spec: KernelSpec, splits: int) -> bool:  # (the ordered wgmma fused kernel's query tiles)
        return spec.family == "bwd_fused_sm90" and tiles.rotate_ordered_dq(dev, -(-m.Sk // spec.block_n), splits,
                                                                           bool(m.causal))

    def splits_of(spec: KernelSpec) -> int:  # varlen: one (a block past its sequence's end has no partials to write)
        return 1 if m.varlen else tiles.dkdv_splits(spec, m.B, H, Hkv, m.Sq, m.Sk, dev.sm_count)

    if impl == "auto":
        fused = _kernel_for(fused_family, tiles.sm90_head_dim(fused_family, Dm), Q, m, dev, bool(softcap), alibi, drop)
        impl = tiles.backward_impl(tiles.sm90_head_dim(dkdv_family, Dm), bool(deterministic), m.ordered_dq_ok,
                                   dkdv_family == "bwd_dkdv_sm90", fused_family == "bwd_fused_sm90", bool(m.causal),
                                   m.Sq, m.bits, fused.block_m, bool(softcap or alibi or m.score_mod or drop),
                                   m.B * Hkv * -(-m.Sk // fused.block_n) / dev.sm_count,
                                   rotated(fused, splits_of(fused)))
    # The kernels' head_dim: the tensors' D, or the wgmma instance a family pads it to (tiles.sm90_head_dim); the
    # helper kernels (spec.ELEMENTWISE) take the main kernel's, DK: the layout of the fp32 buffers it shares with them.
    DK = tiles.sm90_head_dim(fused_family if impl == "fused" else dkdv_family, Dm)
    main = _kernel_for(fused_family if impl == "fused" else dkdv_family, DK, Q, m, dev, bool(softcap), alibi, drop,
                       (D, Dv))
    splits = splits_of(main)
    p["splits"] = splits
    if m.causal:  # the causal blocks' order (kernels_cu/attention/params.cuh: query_block, key_block)
        p["sched_pairs"] = tiles.item_chunk(dev, m.B, m.Sk, Dm, H, Hkv)
        p["sched_key_pairs"] = tiles.key_item_chunk(dev, m.B, m.Sq, Dm, H, Hkv, splits)
        if impl == "fused" and deterministic and main.family == "bwd_fused_sm90":  # its key-tile-major grid's chunks
            p["sched_key_pairs"] = tiles.ordered_key_chunk(dev, m.B * Hkv, splits)
    if splits > 1:
        scratch.append(("dkv_partial", 2 * splits * m.B * Hkv * m.Sk * DK))
    allocs.append(None)  # the scratch, allocs[3] (backward's _sink_grad reads its delta)
    maps = []
    if main.family == "bwd_fused_sm90" and not _env.no_tma():  # its TMA maps of q, dout, k, v
        p["use_tma"] = 1
        maps = [(0, f"{n}_map", src, tma.TileMap(n, a.shape, a.strides, rows)) for n, src, a, rows in
                (("q", "q", Q4, main.block_m), ("do", "dout", dO4, main.block_m), ("k", "k", K4, main.block_n),
                 ("v", "v", V4, main.block_n))]
    if impl == "fused":
        scratch.append(("dq_accum", m.total_q * H * DK))  # zeroed by bwd_preprocess
        p["dq_swizzle"] = int(fused_family == "bwd_fused_sm90")
        if deterministic:  # a counter per query tile
            allocs.append(_Alloc(("dq_sem",), (m.B, H, -(-m.Sq // main.block_m)), "i32", 0))
            p["dq_rotate"] = int(rotated(main, splits))
            p["dq_first_store"] = int(main.family == "bwd_fused_sm90" and _first_turn_stores(m))
        # (bwd_preprocess right before the fused kernel: bwd_fused_sm90, its programmatic dependent, reads the
        # caller's K and V before it waits for the kernel ahead of it: spec.KernelSpec.programmatic)
        families = ["bwd_preprocess", fused_family, "bwd_dq_convert"]
    elif dq_family == "bwd_dq_sm90":  # it computes delta and lse2 (bwd_preprocess's work) for the dK/dV pass
        families = [dq_family, dkdv_family]
    else:
        families = ["bwd_preprocess", dq_family, dkdv_family]
    allocs[3] = _Alloc.parts(scratch, "f32")
    if splits > 1:
        families.append("bwd_dkdv_reduce")
    rowwise = m.elementwise_fields(H)
    launches = []
    specs = {family: _kernel_for(family, DK if family in ELEMENTWISE else tiles.sm90_head_dim(family, Dm), Q, m, dev,
                                 bool(softcap), alibi, drop, (D, Dv)) for family in families}
    if score_grads:  # the dQ kernel's tensor-gradient pass, after lse2 and delta are made (spec.KernelSpec.score_grads)
        expr, _, typed = m.score_mod
        names = [n for n, _ in typed]
        reads = sum(len(re.findall(rf"\b{n}\s*\[", expr)) for n in score_grads)  # (at most, per pair)
        if deterministic and m.B * H * m.Sq * m.Sk * max(reads, 1) >= 1 << 39:
            raise ValueError(f"score_grads with deterministic=True: {m.B} x {H} x {m.Sq} x {m.Sk} pairs with "
                             f"{reads} read(s) each may add more terms to one element than its exact sum holds "
                             f"(2^39): pass deterministic=False (fp32 atomics)")
        for n in score_grads:  # (the tensors' sizes: with deterministic=True score_grads holds their limbs)
            p[f"score_n{names.index(n)}"] = math.prod(interop.describe(mask_args["score_tensors"][n], n).shape)
        kind = "float_grad_exact" if deterministic else "float_grad"
        grads = dataclasses.replace(m, score_mod=(expr, "", tuple((n, kind if n in score_grads else t)
                                                                  for n, t in typed)))
        families.append("score_grads")
        specs["score_grads"] = _kernel_for("bwd_dq", Dm, Q, grads, dev, dropout=drop, head_dims=(D, Dv))
    _compiled_score_mod(m, list(specs.values()))
    for family in families:
        spec = specs[family]
        if family in ELEMENTWISE:
            dims = (rowwise.get("B", m.B), H, Hkv, rowwise.get("Sq", m.Sq), rowwise.get("Sk", m.Sk))
            launches.append((spec, launch.grid(spec, *dims, dev.sm_count, splits), 1 if rowwise else 0))
        else:
            launches.append((spec, launch.grid(spec, m.B, H, Hkv, m.Sq, m.Sk, dev.sm_count, splits), 0))
    inputs = ("dout", "q", "k", "v", "o", "lse", *(("alibi",) if alibi else ()), *(("drop_rng",) if drop else ()),
              *(f for f, _ in arrays))
    # The row-wise families read their own copy of the struct (masks.Masking.elementwise_fields).
    structs, keep = [(params.BWD, p, {})] + ([(params.BWD, {**p, **rowwise}, {})] if rowwise else []), ()
    if m.mask_mod:
        needs = [(main, "mask_cols")]
        if impl != "fused":
            needs.append((specs[dq_family], "mask_rows"))
        structs, allocs, launches, keep = _with_lists(m, tensors, inputs, structs, allocs, launches, dev,
                                                      _classify(p, m, H, dev, *needs))
    if mode and m.checked:
        _add_check(structs, launches, m, dev, True, tuple((n, shape, Q.itemsize) for n, shape in
                                                         (("dq", Q.shape), ("dk", K.shape), ("dv", V.shape))))
    return _Plan(structs, inputs, allocs, launches, dev, reusable=not (keep and launch._capturing(dev)), keep=keep,
                 maps=maps)


# ---------------------------------------------------------------------------
# Plans: what one call allocates and launches, everything but the pointers
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Alloc:
    fields: tuple          # params pointer fields that take the new array's address
    shape: tuple
    kind: str              # interop.new_many: "like" (the inputs' dtype), "f32", "i32"
    fill: float | None = None  # None: uninitialised
    offsets: tuple = ()    # byte offset of each field's part of the array (default: all 0)

    @classmethod
    def parts(cls, parts: list, kind: str) -> "_Alloc":
        """One uninitialised 1-D array for several (field, elements) parts: one allocation instead of several,
        each part starting on a 256-byte boundary."""
        align = 256 // 4  # elements of 4 bytes (f32 / i32)
        offsets, n = [], 0
        for _, count in parts:
            offsets.append(n * 4)
            n += -(-count // align) * align
        return cls(tuple(f for f, _ in parts), (n,), kind, None, tuple(offsets))


_PTR = struct.Struct("<Q")
# read as 16-byte vectors (_check_layout); lse is not
_ALIGNED = ("q", "k", "v", "o", "dout", "k_cache", "v_cache", "k_new", "v_new", "o_part")


class _Plan:
    """A call's allocations, params structs (params.pack) and launches, with the pointers left out.

    The first call of a signature (_plan_key: the tensors' shapes, strides, dtypes and devices, the
    mask arrays' too, and the options) checks its arguments and builds one; calls with the same
    signature allocate, write the pointers into this thread's copies of the packed structs
    (launch.Sequence) and launch, with no checks and no planning.

    structs: (params dtype, values, links) per params struct; a launch names its struct by index.
    Pointer fields are written at each call from the sources: the call's tensors (named by `inputs`,
    their params fields) and the allocations' parts (named by _Alloc.fields). A field takes the
    source of its own name unless `links` maps it to another (mask_classify's mod_map: one per tiling).
    maps: (struct index, field, input, tma.TileMap) of each TMA map, written at each call from its input's address.
    counter: (struct index, field) of fwd_sm90_ws's work-item counter, written at each call: the stream's
    (launch.sched_counter), or a zeroed one of the call's own while the stream is captured.
    """

    def __init__(self, structs: list, inputs: tuple, allocs: list, launches: list, dev, reusable: bool = True,
                 keep=(), maps=(), counter=None):
        sources = list(inputs)
        self.alloc_parts = []  # (array index, byte offset) of each source after the inputs
        for i, a in enumerate(allocs):
            for f, delta in zip(a.fields, a.offsets or (0,) * len(a.fields)):
                sources.append(f)
                self.alloc_parts.append((i, delta))
        index = {name: j for j, name in enumerate(sources)}
        templates, self.patches = [], []  # packed structs; (struct index, byte offset, source index)
        for b, (dtype, values, links) in enumerate(structs):
            templates.append(params.pack(dtype, values).tobytes())
            self.patches += [(b, dtype.fields[f][1], index[links.get(f, f)]) for f in dtype.names
                             if links.get(f, f) in index]
        self.maps = [(b, structs[b][0].fields[field][1], index[source], tile_map) for b, field, source, tile_map in maps]
        self.counter = None if counter is None else (counter[0], structs[counter[0]][0].fields[counter[1]][1])
        self.aligned = tuple(i for i, n in enumerate(inputs) if n in _ALIGNED)
        self.like = inputs.index("q") if "q" in inputs else 0  # outputs follow q's library and device
        self.allocs = [(a.shape, a.kind, a.fill) for a in allocs]  # interop.new_many's specs
        self.launches = launch.Sequence(dev, launches, templates) if launches else None
        self.dev, self.reusable, self.keep = dev, reusable, keep

    def run(self, tensors: tuple) -> list | None:
        """The outputs (allocs in order), after enqueueing the launches; None if a pointer lost its alignment."""
        ptrs = interop.data_ptrs(tensors)  # one library: the plan's signature says so
        for i in self.aligned:
            if ptrs[i] % 16:
                return None
        like = tensors[self.like]
        arrays = interop.new_many(like, self.allocs)
        if self.launches is None:
            return arrays
        bases = interop.data_ptrs(arrays)
        ptrs += [bases[i] + delta for i, delta in self.alloc_parts]
        structs = self.launches.buffers()
        for b, off, j in self.patches:
            _PTR.pack_into(structs[b], off, ptrs[j])
        for b, off, j, tile_map in self.maps:
            tile_map.write(ptrs[j], ctypes.addressof(structs[b]) + off)
        stream = interop.stream(like)
        if self.counter is not None:
            counter = launch.sched_counter(self.dev, stream)
            if counter is None:  # captured: freed with `own` in the stream's order, after the launch
                own = interop.new_many(like, [((1,), "i32", 0)])[0]
                counter = interop.data_ptr(own)
            _PTR.pack_into(structs[self.counter[0]], self.counter[1], counter)
        self.launches.launch(stream)
        return arrays


_PLANS: dict = {}
_MAX_PLANS = 256
_ARRAY_ARGS = frozenset(masks.ARRAY_ARGS)


def _signatures(tensors: tuple) -> tuple | None:
    """What a plan depends on of its arguments: their layouts, not their data or addresses (None: one of
    them is not a tensor of the first one's library; the build path says what is wrong)."""
    if interop.is_torch(tensors[0]):
        import torch
        for x in tensors:
            if not isinstance(x, torch.Tensor):
                return None
        return tuple([(x.shape, x.stride(), x.dtype, x.device) for x in tensors])
    if type(tensors[0]).__module__.split(".")[0] == "cupy":
        import cupy
        for x in tensors:
            if not isinstance(x, cupy.ndarray):
                return None
        return tuple([(x.shape, x.strides, x.dtype, x.device.id) for x in tensors])
    return None


def _mask_arrays(mask_args: dict) -> list:
    """(params field, array) of each mask array given (masks.ARRAY_ARGS order, then mask_tensors'): a
    reused plan writes their pointers like the tensors'."""
    if not mask_args:
        return []
    mod = mask_args.get("mask_tensors") or {}
    score = mask_args.get("score_tensors") or {}
    grads = mask_args.get("score_grads") or {}  # (backward: api._check_score_grads checked them)
    return [(masks.ARRAY_FIELDS[n], mask_args[n]) for n in masks.ARRAY_ARGS if mask_args.get(n) is not None] + \
        ([(f"mod_t{i}", x) for i, x in enumerate(mod.values())] if isinstance(mod, dict) else []) + \
        ([(f"score_t{i}", x) for i, x in enumerate(score.values())] if isinstance(score, dict) else []) + \
        [(f"score_g{list(score).index(n)}", g) for n, g in grads.items()]  # (score: a dict where grads are given)


def _plan_key(kind: str, tensors: tuple, options: tuple, mask_args: dict, mode: int):
    """The plan cache's key of a call (tensors: with its _mask_arrays), or None when its plan cannot be reused.

    Not reused: packed varlen without both max_seqlen (the grid comes from the data). A mask_mod plan over
    no arrays keeps its tile lists (masks.Masking.static_lists), so its key holds the stream: the lists were
    made on it, and the caching allocator reclaims them in that stream's order when the plan is dropped.
    """
    rest = ()
    if mask_args:
        if mask_args.get("cu_seqlens_q") is not None and (mask_args.get("max_seqlen_q") is None
                                                         or mask_args.get("max_seqlen_k") is None):
            return None
        mod, score = mask_args.get("mask_tensors"), mask_args.get("score_tensors")
        if (mod is not None and not isinstance(mod, dict)) or (score is not None and not isinstance(score, dict)):
            return None  # the build path says what is wrong with it
        # (an array: whether it is given, its layout being in the tensors' signatures; mask_tensors: the names)
        rest = tuple([(n, a is not None) if n in _ARRAY_ARGS else (n, tuple(a) if isinstance(a, (list, dict)) else a)
                      for n, a in mask_args.items()])
        if mask_args.get("mask_mod") is not None and not mod and all(mask_args.get(n) is None for n in _ARRAY_ARGS):
            rest += (interop.stream(tensors[0]),)
    sig = _signatures(tensors)
    return None if sig is None else (kind, sig, options, rest, mode if mask_args else 0, _env.no_sm90(),
                                     _env.no_tma(), _env.no_decode_forward(), _env.no_dq_first_store())


def _planned(kind: str, tensors: tuple, options: tuple, mask_args: dict, mode: int, build) -> list:
    """Run the call's plan: the cached one of its signature, else build() (which checks the arguments and
    raises what is wrong with them, a misaligned pointer included) and keep it when it is reusable.
    First, what a device check of an earlier call reported (masks.raise_reported); with validate="sync"
    (mode 2), this call's check, once its kernels are done."""
    masks.raise_reported()
    if mask_args:
        tensors = (*tensors, *(x for _, x in _mask_arrays(mask_args)))
    key = _plan_key(kind, tensors, options, mask_args, mode)
    try:
        plan = _PLANS.get(key)
    except TypeError:  # an odd option value: its call is checked (and planned) every time
        plan = key = None
    result = plan.run(tensors) if plan is not None else None
    if result is None:
        plan = build(tensors)
        if key is not None and plan.reusable:
            if len(_PLANS) >= _MAX_PLANS:  # drop the oldest
                _PLANS.pop(next(iter(_PLANS)), None)
            _PLANS[key] = plan
        result = plan.run(tensors)
    if mode == 2 and mask_args:
        launch.synchronize_checked()
        masks.raise_reported()
    return result


def _contiguous_fields(prefix: str, shape: tuple) -> dict:
    """(batch, seq, head) strides of a new contiguous array of `shape` ((B, S, H, D), or (total, H, D) as one
    batch entry), as _tensor_fields gives them."""
    shape4 = (1, *shape) if len(shape) == 3 else shape
    strides = (shape4[1] * shape4[2] * shape4[3], shape4[2] * shape4[3], shape4[3])
    return {f"{prefix}_{axis}": st if n > 1 else 0 for axis, n, st in zip(("sb", "ss", "sh"), shape4[:3], strides)}
