"""flashrt.forward / flashrt.backward: validate, plan, launch.

Layout: q (B, Sq, H, D), k and v (B, Sk, Hkv, D), with any strides on the
first three axes and a contiguous last axis; lse is fp32 (B, H, Sq). H must be
a multiple of Hkv (GQA/MQA); dK/dV are summed over each KV head's group.

Causal masking is aligned to the bottom-right corner when Sq != Sk, as in
FlashAttention >= 2.1: query i sees key j iff j <= i + Sk - Sq. Query rows that
see no key (possible when Sq > Sk) get out = 0, lse = -inf and zero gradients.
"""
from __future__ import annotations

import math

from . import interop, launch, params, tiles
from .interop import Array

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


def _inputs(q, k, v) -> tuple[Array, Array, Array, dict]:
    Q, K, V = interop.describe(q, "q"), interop.describe(k, "k"), interop.describe(v, "v")
    return Q, K, V, _check_qkv(Q, K, V)


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
    if K.shape != V.shape:
        raise ValueError(f"k and v must have the same shape, got k: {K.shape}, v: {V.shape}")
    if Bk != B or Dk != D:
        raise ValueError(f"q {Q.shape} and k {K.shape} must agree on batch (axis 0) and head_dim (axis 3)")
    if D % 8 or not 8 <= D <= 256:
        raise ValueError(f"head_dim must be a multiple of 8 between 8 and 256, got {D}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"q's heads ({H}) must be a multiple of k/v's heads ({Hkv}) (GQA/MQA)")
    for a, name in ((Q, "q"), (K, "k"), (V, "v")):
        _check_layout(a, name)
    return dict(B=B, Sq=Sq, Sk=Sk, H=H, Hkv=Hkv, D=D)


def _check_grad_inputs(Q: Array, dO: Array, O: Array, L: Array) -> None:
    """The rules for backward's dout, out and lse, given a valid q."""
    B, Sq, H, _ = Q.shape
    for a, name in ((dO, "dout"), (O, "out")):
        _check_tensor(a, name, 4)
        if a.shape != Q.shape or a.dtype != Q.dtype or a.lib != Q.lib or a.device != Q.device:
            raise ValueError(f"{name} must match q: expected {Q.lib} {Q.dtype} {Q.shape} on cuda:{Q.device}, "
                             f"got {a.lib} {a.dtype} {a.shape} on cuda:{a.device}")
        _check_layout(a, name)
    if L.shape != (B, H, Sq) or L.dtype != "float32" or L.lib != Q.lib or L.device != Q.device:
        raise ValueError(f"lse must be {Q.lib} float32 of shape {(B, H, Sq)} on cuda:{Q.device} (as returned by "
                         f"flashrt.forward), got {L.lib} {L.dtype} {L.shape} on cuda:{L.device}")
    if B * H * Sq and L.strides != (H * Sq, Sq, 1):
        raise ValueError(f"lse must be contiguous, got strides {L.strides}; pass lse.contiguous()")


def _tensor_fields(p: dict, **arrays: Array) -> None:
    """Pointer and (batch, seq, head) strides of each array into the params dict `p`."""
    for prefix, a in arrays.items():
        p[f"{prefix}_sb"], p[f"{prefix}_ss"], p[f"{prefix}_sh"] = _strides(a)


def forward(q, k, v, *, causal: bool = False, softmax_scale: float | None = None):
    """Attention forward. Returns (out, lse): out like q, lse fp32 (B, H, Sq), in the caller's library."""
    Q, K, V, s = _inputs(q, k, v)
    B, Sq, Sk, H, Hkv, D = s["B"], s["Sq"], s["Sk"], s["H"], s["Hkv"], s["D"]
    scale = _scale(softmax_scale, D)
    if B * Sq * H == 0 or Sk == 0:
        # Defined results without a launch: nothing to attend to gives out = 0, lse = -inf.
        return interop.full(Q, (B, Sq, H, D), 0.0), interop.full(Q, (B, H, Sq), -math.inf, float32=True)
    out, O = interop.empty_like_layout(Q, (B, Sq, H, D))
    lse = interop.empty(Q, (B, H, Sq), float32=True)

    dev = launch.device(Q.device)
    spec = launch.pick("fwd", D, Q.dtype, bool(causal), dev)
    p = dict(q=Q.ptr, k=K.ptr, v=V.ptr, o=O.ptr, lse=interop.data_ptr(lse), B=B, H=H, Hkv=Hkv, Sq=Sq, Sk=Sk,
             scale_log2=scale * _LOG2E)
    _tensor_fields(p, q=Q, k=K, v=V, o=O)
    launch.launch(spec, dev, launch.grid(spec, B, H, Hkv, Sq, Sk), params.pack(params.FWD, p), interop.stream(Q))
    return out, lse


IMPLS = ("auto", "split", "fused")


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


def backward(dout, q, k, v, out, lse, *, causal: bool = False, softmax_scale: float | None = None,
             impl: str = "auto", deterministic: bool = True):
    """Attention backward from forward's (out, lse). Returns (dq, dk, dv) shaped like (q, k, v).

    impl="split": a dQ kernel over query tiles and a dK/dV kernel over key tiles, no atomics.
    impl="fused": one kernel over key tiles that also adds dQ up in an fp32 buffer with
    atomics (5 matmuls instead of 7). With deterministic=True the key tiles add in a fixed
    order (a counter per query tile), else in whatever order they finish.
    impl="auto": the faster of the two for this shape (tiles.backward_impl).
    With deterministic=True (the default) dq, dk and dv are bitwise identical for
    identical inputs, run after run and process after process, for every impl.
    """
    _check_impl(impl)
    Q, K, V, s = _inputs(q, k, v)
    B, Sq, Sk, H, Hkv, D = s["B"], s["Sq"], s["Sk"], s["H"], s["Hkv"], s["D"]
    scale = _scale(softmax_scale, D)
    dO, O, L = interop.describe(dout, "dout"), interop.describe(out, "out"), interop.describe(lse, "lse")
    _check_grad_inputs(Q, dO, O, L)

    if B * Sq * H == 0 or Sk == 0:
        return (interop.full(Q, Q.shape, 0.0), interop.full(Q, K.shape, 0.0), interop.full(Q, K.shape, 0.0))
    (dq, dQ), (dk, dK), (dv, dV) = (interop.empty_like_layout(Q, shape) for shape in (Q.shape, K.shape, K.shape))
    lse2, delta = interop.empty(Q, (B, H, Sq), float32=True), interop.empty(Q, (B, H, Sq), float32=True)

    p = dict(q=Q.ptr, k=K.ptr, v=V.ptr, o=O.ptr, dout=dO.ptr, lse=L.ptr, dq=dQ.ptr, dk=dK.ptr, dv=dV.ptr,
             lse2=interop.data_ptr(lse2), delta=interop.data_ptr(delta), B=B, H=H, Hkv=Hkv, Sq=Sq, Sk=Sk,
             scale_log2=scale * _LOG2E, scale=scale)
    _tensor_fields(p, q=Q, k=K, v=V, o=O, do=dO, dq=dQ, dk=dK, dv=dV)

    dev = launch.device(Q.device)
    stream = interop.stream(Q)
    if impl == "auto":
        impl = tiles.backward_impl(D, bool(deterministic))
    main = launch.pick("bwd_fused" if impl == "fused" else "bwd_dkdv", D, Q.dtype, bool(causal), dev)
    splits = launch.dkdv_splits(main, B, H, Hkv, Sq, Sk, dev.sm_count)
    p["splits"] = splits
    if splits > 1:
        partial = interop.empty(Q, (2 * splits * B * Hkv * Sk * D,), float32=True)
        p["dkv_partial"] = interop.data_ptr(partial)
    if impl == "fused":
        dq_accum = interop.empty(Q, (B, H, Sq, D), float32=True)  # zeroed by bwd_preprocess
        p["dq_accum"] = interop.data_ptr(dq_accum)
        if deterministic:
            sem = interop.full(Q, (B, H, -(-Sq // main.block_m)), 0, int32=True)
            p["dq_sem"] = interop.data_ptr(sem)
        families = ["bwd_preprocess", "bwd_fused", "bwd_dq_convert"]
    else:
        families = ["bwd_preprocess", "bwd_dq", "bwd_dkdv"]
    if splits > 1:
        families.append("bwd_dkdv_reduce")
    args = params.pack(params.BWD, p)
    for family in families:
        spec = launch.pick(family, D, Q.dtype, bool(causal), dev)
        launch.launch(spec, dev, launch.grid(spec, B, H, Hkv, Sq, Sk, dev.sm_count, splits), args, stream)
    return dq, dk, dv
