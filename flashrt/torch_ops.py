"""flashrt.attention on torch tensors: torch custom ops (flashrt::fwd, flashrt::bwd) with a
registered autograd formula for torch.compile, and the same computation as a plain
autograd.Function for eager calls (where the custom-op dispatch costs as much as the
kernels at small shapes).

Custom ops are opaque to torch.compile (no graph break: their fake impls give
Dynamo/AOTAutograd the output shapes). Both paths work under CUDA graphs (kernels launch
on torch's current stream, outputs come from torch's caching allocator, no host sync) and
activation checkpointing (the forward is deterministic, so recomputed activations are
bitwise the same).
"""
from typing import Optional

import torch

from . import api, masks


def _kernel_ready(x: torch.Tensor) -> torch.Tensor:
    """x itself when the kernels can read it in place, else a contiguous copy.

    Upstream gradients are often views the kernels cannot read (out.sum() gives an
    expanded tensor with zero strides), so the backward op normalises dout. It runs
    inside the op's real impl: a fake tensor under torch.compile has no data pointer.
    """
    if x.data_ptr() % 16:  # (contiguous() would return a contiguous x itself)
        return x.clone(memory_format=torch.contiguous_format)
    if x.is_contiguous() and x.shape[-1] % 8 == 0:  # the common case, checked first (host time)
        return x
    aligned = x.stride(-1) == 1 and all(s % 8 == 0 for n, s in zip(x.shape[:-1], x.stride()[:-1]) if n > 1)
    return x if aligned else x.contiguous()


# The mask arguments travel through the ops as a list of optional tensors (masks.ARRAY_ARGS order,
# then mask_mod's tensors, then score_mod's), the window, the varlen maximum lengths, mask_mod's expression
# and comma-separated tensor names, and score_mod's expression, derivative and tensor names ("" when none:
# op schemas take no list of strings, nor a dict); `causal` as "none" | "bottom_right" | "top_left".
_CAUSAL = {False: "none", True: "bottom_right", "bottom_right": "bottom_right", "top_left": "top_left"}


def _mask_kwargs(causal: str, window, max_seqlen_q, max_seqlen_k, tensors, mask_mod: str, mod_names: str,
                 score_mod: str, score_mod_grad: str, score_names: str) -> dict:
    n = len(masks.ARRAY_ARGS)
    kw = {name: t for name, t in zip(masks.ARRAY_ARGS, tensors[:n]) if t is not None}
    mod = mod_names.split(",") if mod_names else []
    if mask_mod or mod_names:
        kw["mask_mod"] = mask_mod or None
        kw["mask_tensors"] = dict(zip(mod, tensors[n:n + len(mod)]))
    if score_mod or score_mod_grad or score_names:
        kw["score_mod"], kw["score_mod_grad"] = score_mod or None, score_mod_grad or None
        kw["score_tensors"] = dict(zip(score_names.split(","), tensors[n + len(mod):])) if score_names else {}
    if window is not None:
        kw["window"] = tuple(window)
    if max_seqlen_q is not None:
        kw["max_seqlen_q"] = max_seqlen_q
    if max_seqlen_k is not None:
        kw["max_seqlen_k"] = max_seqlen_k
    return dict(kw, causal=False if causal == "none" else causal)


# validate travels through the op as its mode (masks.VALIDATE_MODES: 0, 1, 2; op schemas take no Union).
_VALIDATE_OF_MODE = {mode: v for v, mode in masks.VALIDATE_MODES.items()}


# impl and deterministic only matter to the backward; the forward op takes them so that
# setup_context can hand them on (an autograd formula sees only the op's own arguments).
@torch.library.custom_op("flashrt::fwd", mutates_args=())
def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: str, softmax_scale: Optional[float],
         impl: str, deterministic: bool, window: Optional[list[int]], max_seqlen_q: Optional[int],
         max_seqlen_k: Optional[int], validate: int, mask_tensors: list[Optional[torch.Tensor]], mask_mod: str,
         mod_names: str, score_mod: str, score_mod_grad: str, score_names: str, score_learned: str,
         learned: list[torch.Tensor], softcap: Optional[float], alibi_slopes: Optional[torch.Tensor],
         sinks: Optional[torch.Tensor], dropout_p: float, dropout_rng: Optional[torch.Tensor]
         ) -> tuple[torch.Tensor, torch.Tensor]:
    # (learned: the score tensors named in score_learned, which are in mask_tensors too: an argument of tensors
    # alone, whose gradients autograd takes as a list; the forward reads them from mask_tensors)
    return api.forward(q, k, v, softmax_scale=softmax_scale, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                       dropout_p=dropout_p, dropout_rng=dropout_rng, validate=_VALIDATE_OF_MODE[validate],
                       **_mask_kwargs(causal, window, max_seqlen_q, max_seqlen_k, mask_tensors, mask_mod, mod_names,
                                      score_mod, score_mod_grad, score_names))


def _lse_shape(q, mask_tensors):
    if mask_tensors[masks.ARRAY_ARGS.index("cu_seqlens_q")] is not None:  # packed: (total, H, D) -> (H, total)
        return (q.shape[1], q.shape[0])
    B, Sq, H, _ = q.shape
    return (B, H, Sq)


@_fwd.register_fake
def _fwd_fake(q, k, v, causal, softmax_scale, impl, deterministic, window, max_seqlen_q, max_seqlen_k, validate,
              mask_tensors, mask_mod, mod_names, score_mod, score_mod_grad, score_names, score_learned, learned,
              softcap, alibi_slopes, sinks, dropout_p, dropout_rng):
    # api.forward allocates both outputs contiguous, whatever q's strides; out has v's head_dim.
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(_lse_shape(q, mask_tensors), dtype=torch.float32)


@torch.library.custom_op("flashrt::bwd", mutates_args=())
def _bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
         lse: torch.Tensor, causal: str, softmax_scale: Optional[float], impl: str, deterministic: bool,
         window: Optional[list[int]], max_seqlen_q: Optional[int], max_seqlen_k: Optional[int],
         mask_tensors: list[Optional[torch.Tensor]], mask_mod: str, mod_names: str, score_mod: str,
         score_mod_grad: str, score_names: str, score_learned: str, learned: list[torch.Tensor],
         softcap: Optional[float], alibi_slopes: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
         dropout_p: float, dropout_rng: Optional[torch.Tensor]
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """(dq, dk, dv, dsinks, the gradients of the score tensors named in score_learned); dsinks is empty (0,)
    without sinks (an op returns no None)."""
    # (the forward output is `o`: an argument named `out` reads as an out= variant in op schemas)
    mask = _mask_kwargs(causal, window, max_seqlen_q, max_seqlen_k, mask_tensors, mask_mod, mod_names, score_mod,
                        score_mod_grad, score_names)
    names = score_learned.split(",") if score_learned else []
    score_grads = {n: torch.zeros_like(t) for n, t in zip(names, learned)}
    grads = api.backward(_kernel_ready(dout), q, k, v, o, lse, softmax_scale=softmax_scale, impl=impl,
                         deterministic=deterministic, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                         dropout_p=dropout_p, dropout_rng=dropout_rng, validate=False,  # (the forward validated them)
                         **({"score_grads": score_grads} if learned else {}), **mask)
    return (*grads, *(() if sinks is not None else (lse.new_empty((0,)),)), list(score_grads.values()))


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, o, lse, causal, softmax_scale, impl, deterministic, window, max_seqlen_q,
              max_seqlen_k, mask_tensors, mask_mod, mod_names, score_mod, score_mod_grad, score_names, score_learned,
              learned, softcap, alibi_slopes, sinks, dropout_p, dropout_rng):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            lse.new_empty((0,) if sinks is None else sinks.shape), [t.new_empty(t.shape) for t in learned])


def _setup_context(ctx, inputs, output):
    (q, k, v, causal, softmax_scale, impl, deterministic, window, max_seqlen_q, max_seqlen_k, _, tensors, mask_mod,
     mod_names, score_mod, score_mod_grad, score_names, score_learned, learned, softcap, alibi_slopes, sinks,
     dropout_p, dropout_rng) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks, dropout_rng, *learned, *tensors)
    ctx.learned = len(learned)
    ctx.dropout_p = dropout_p
    ctx.options = (causal, softmax_scale, impl, deterministic, window, max_seqlen_q, max_seqlen_k)
    ctx.mod = (mask_mod, mod_names, score_mod, score_mod_grad, score_names, score_learned, softcap)
    # The kernels take no gradient of lse: a loss through it must fail, not silently miss a term.
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    # One read of saved_tensors: non-reentrant checkpointing unpacks each saved tensor once.
    q, k, v, out, lse, alibi_slopes, sinks, dropout_rng, *saved = ctx.saved_tensors
    learned, tensors = saved[:ctx.learned], saved[ctx.learned:]
    dq, dk, dv, dsinks, grads = torch.ops.flashrt.bwd.default(dout, q, k, v, out, lse, *ctx.options, tensors,
                                                              *ctx.mod[:6], learned, ctx.mod[6], alibi_slopes, sinks,
                                                              ctx.dropout_p, dropout_rng)
    # the forward op's arguments between v and sinks take none but the learned score tensors (its `learned` list)
    return (dq, dk, dv, *(None,) * 15, list(grads), None, None, None if sinks is None else dsinks, None, None)


_fwd.register_autograd(_backward, setup_context=_setup_context)


def _autocast(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under CUDA autocast, floating inputs in the autocast dtype, as torch's SDPA does.

    Custom ops get no autocast treatment of their own, and fp32 inputs (the norm for
    mixed-precision training) would otherwise be refused by the kernels.
    """
    if not torch.is_autocast_enabled("cuda"):
        return xs
    dtype = torch.get_autocast_dtype("cuda")
    return tuple(x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x for x in xs)


class _Eager(torch.autograd.Function):
    """The same forward and backward as the custom ops, without the custom-op dispatch.

    Dispatching the torch.library custom ops from Python cost 0.1-0.2 ms per forward+backward
    on the H100 host (scripts/host_overhead.py: 1233 us per call before, 1024-1145 after),
    as much as the kernels at small shapes; the ops are only needed where torch traces
    (torch.compile), so eager calls come here. The options and the mask arguments travel as one
    tuple, the mask tensors (and ALiBi's slopes) inside it and on ctx, not as arguments of apply or
    saved tensors: each of those costs host time on every call (docs/perf-notes.md: Host time per
    call). Their versions are kept instead, so that one modified in place before the backward raises,
    as a saved tensor would.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, call, *learned):  # learned: the score tensors that take a gradient (call[8])
        causal, softmax_scale, _, _, validate, mask, softcap, alibi_slopes, _, dropout_p, dropout_rng = call
        out, lse = api.forward(q, k, v, causal=causal, softmax_scale=softmax_scale, softcap=softcap,
                               alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p, dropout_rng=dropout_rng,
                               validate=validate, **mask)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.call = call
        if mask or alibi_slopes is not None:
            ctx.versions = _versions(mask, alibi_slopes)
        # The kernels take no gradient of lse: a loss through it must fail, not silently miss a term.
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)  # no zero-filled lse gradient per backward (an allocation and a fill)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        causal, softmax_scale, impl, deterministic, _, mask, softcap, alibi_slopes, learned, dropout_p, rng = ctx.call
        if dout is None:  # out took no part in the loss
            return (None,) * (5 + len(learned))
        q, k, v, out, lse, sinks = ctx.saved_tensors
        if (mask or alibi_slopes is not None) and _versions(mask, alibi_slopes) != ctx.versions:
            raise RuntimeError("a mask tensor, score tensor or alibi_slopes given to flashrt attention was modified "
                               "in place after the forward; the backward needs the values the forward used (pass a "
                               "copy, or modify a clone)")
        score_grads = {n: torch.zeros_like(mask["score_tensors"][n]) for n in learned}
        grads = api.backward(_kernel_ready(dout), q, k, v, out, lse, causal=causal, softmax_scale=softmax_scale,
                             impl=impl, deterministic=deterministic, softcap=softcap, alibi_slopes=alibi_slopes,
                             sinks=sinks, dropout_p=dropout_p, dropout_rng=rng, validate=False,
                             **({"score_grads": score_grads} if learned else {}),
                             **mask)  # (the forward validated the masks)
        return (*grads, *((None,) if sinks is not None else (None, None)), *score_grads.values())


def _versions(mask: dict, alibi_slopes=None) -> tuple:
    """The in-place version counters of a call's mask tensors (the arrays, mask_tensors' and score_tensors' values)
    and slopes."""
    found = [] if alibi_slopes is None else [alibi_slopes._version]
    for a in mask.values():
        if isinstance(a, torch.Tensor):
            found.append(a._version)
        elif isinstance(a, dict):
            found += [t._version for t in a.values() if isinstance(t, torch.Tensor)]
    return tuple(found)


def attention(q, k, v, *, causal=False, softmax_scale: Optional[float] = None, return_lse: bool = False,
              impl: str = "auto", deterministic: bool = True, softcap: Optional[float] = None,
              alibi_slopes: Optional[torch.Tensor] = None, sinks: Optional[torch.Tensor] = None,
              dropout_p: float = 0.0, validate=True, **mask_args):
    """Differentiable attention on torch tensors (B, S, H, D); see flashrt.forward for the semantics
    and the mask arguments.

    `impl` and `deterministic` choose the backward kernels (see flashrt.backward).
    softcap: scores capped to softcap * tanh(score / softcap) (flashrt.forward).
    alibi_slopes: (H,) or (B, H) ALiBi slopes (flashrt.forward), computed in fp32 whatever their floating dtype; not
    differentiable (one that requires grad is refused: pass alibi_slopes.detach()).
    sinks: (H,) attention-sink logits (flashrt.forward), computed in fp32 whatever their dtype; differentiable.
    score_mod, score_mod_grad, score_tensors: a CUDA expression that replaces each scaled score (flashrt.forward),
    its derivative (optional: derived automatically), and the float32 / int32 tensors it reads; a float32 one that
    requires grad gets its gradient (flashrt.backward's score_grads: exact and reproducible with deterministic=True,
    fp32 atomics else), eager and under torch.compile.
    dropout_p: attention dropout (flashrt.forward), its (seed, offset) drawn per call on the device from torch's
    generator (flashrt.dropout_rng: torch.manual_seed reproduces it, a CUDA graph's replays draw new masks) and kept
    for the backward. Pass dropout_p=0.0 for evaluation (nothing here looks at module.training).
    lse is returned without a gradient.
    """
    api._check_impl(impl)  # here, not first in the backward pass
    learned = ()
    if mask_args:
        masks.check_names(mask_args, "attention")
        if isinstance(mask_args.get("score_tensors"), dict):
            learned = _learned_score_tensors(mask_args["score_tensors"])
    if causal not in _CAUSAL or isinstance(causal, (int, float)) and not isinstance(causal, bool):
        raise ValueError(f"causal must be one of {masks.CAUSAL_MODES}, got {causal!r}")
    q, k, v = _autocast(q, k, v)
    softcap = api._check_softcap(softcap) or None  # here, not first in the backward pass
    api._check_score_mods(softcap, alibi_slopes)
    if alibi_slopes is not None:  # (a strided or 16-bit tensor: an fp32 contiguous copy)
        if not isinstance(alibi_slopes, torch.Tensor) or not alibi_slopes.is_floating_point():
            got = alibi_slopes.dtype if isinstance(alibi_slopes, torch.Tensor) else type(alibi_slopes).__name__
            raise ValueError(f"alibi_slopes must be a floating-point tensor (a slope per query head, or per batch "
                             f"entry and query head), got {got}")
        if alibi_slopes.requires_grad:
            raise ValueError("alibi_slopes get no gradient from flashrt.attention, and this tensor requires one: pass "
                             "alibi_slopes.detach() (fixed slopes), or compute the slopes' gradient elsewhere")
        alibi_slopes = alibi_slopes.float().contiguous()
    if sinks is not None:  # (a strided or 16-bit parameter: an fp32 contiguous copy, differentiable)
        if not sinks.is_floating_point():
            raise ValueError(f"sinks must be a floating-point tensor (one logit per query head), got {sinks.dtype}")
        sinks = sinks.float().contiguous()
    scale = None if softmax_scale is None else float(softmax_scale)
    dropout_p = api._dropout_p(dropout_p)
    rng = api.dropout_rng(q) if dropout_p else None
    if q.is_cuda and not torch.compiler.is_compiling():
        out, lse = _eager(q, k, v, causal, scale, impl, deterministic, validate, mask_args, softcap, alibi_slopes,
                          sinks, learned, dropout_p, rng)
    else:  # traced (torch.compile), or fake/meta tensors: the custom ops and their fake impls
        out, lse = _traced(q, k, v, causal, scale, impl, deterministic, validate, mask_args, softcap, alibi_slopes,
                           sinks, learned, dropout_p, rng)
    return (out, lse) if return_lse else out


def _learned_score_tensors(tensors: dict) -> tuple:
    """The names of the score tensors that autograd expects a gradient of (float32, requiring grad, grad mode on):
    the backward computes them (api.backward's score_grads), eager and traced."""
    if not torch.is_grad_enabled():
        return ()
    names = tuple(n for n, x in tensors.items() if isinstance(x, torch.Tensor) and x.requires_grad)
    for name in names:
        if tensors[name].dtype != torch.float32:
            raise ValueError(f"score_tensors[{name!r}] requires grad: only float32 score tensors take one, got "
                             f"{tensors[name].dtype}")
    return names


def _eager(q, k, v, causal, scale, impl, deterministic, validate, mask_args, softcap=None, alibi_slopes=None,
           sinks=None, learned=(), dropout_p=0.0, dropout_rng=None):
    return _Eager.apply(q, k, v, sinks, (causal, scale, impl, bool(deterministic), validate, mask_args, softcap,
                                         alibi_slopes, learned, dropout_p, dropout_rng),
                        *(mask_args["score_tensors"][n] for n in learned))


def _traced(q, k, v, causal, scale, impl, deterministic, validate, mask_args, softcap=None, alibi_slopes=None,
            sinks=None, learned=(), dropout_p=0.0, dropout_rng=None):
    window = mask_args.get("window")
    window = None if window is None else [int(w) for w in window]
    mask_mod, mod_tensors = mask_args.get("mask_mod"), mask_args.get("mask_tensors") or {}
    if mask_mod is not None or mod_tensors:  # checked here: the op carries "" for "no expression"
        mask_mod, _ = masks._check_mask_mod(mask_mod, mod_tensors)
    score_mod, score_grad = mask_args.get("score_mod"), mask_args.get("score_mod_grad")
    score_tensors = mask_args.get("score_tensors") or {}
    if score_mod is not None or score_grad is not None or score_tensors:  # (as mask_mod: "" for none)
        score_mod, score_grad = masks._check_score_mod(score_mod, score_grad, score_tensors)
    tensors = [mask_args.get(n) for n in masks.ARRAY_ARGS] + list(mod_tensors.values()) + list(score_tensors.values())
    args = (q, k, v, _CAUSAL[causal], scale, impl, bool(deterministic), window, mask_args.get("max_seqlen_q"),
            mask_args.get("max_seqlen_k"), masks.validate_mode(validate), tensors, mask_mod or "",
            ",".join(mod_tensors), score_mod or "", score_grad or "", ",".join(score_tensors), ",".join(learned),
            [score_tensors[n] for n in learned], softcap, alibi_slopes, sinks, float(dropout_p), dropout_rng)
    return torch.ops.flashrt.fwd.default(*args)


# flashrt.decode under torch.compile: one custom op that writes the new keys and values into the caches (declared
# mutated, so that the compiled graph orders it against their other readers and writers), with a fake impl for the
# output shapes. Eager calls go straight to decoding.decode (the op's dispatch would cost host time for nothing).
@torch.library.custom_op("flashrt::decode", mutates_args=("k_cache", "v_cache"))
def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
            k: Optional[torch.Tensor], v: Optional[torch.Tensor], page_table: Optional[torch.Tensor], causal: bool,
            window: list[int], softmax_scale: Optional[float], num_splits: int,
            sinks: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
            alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    from . import decoding
    return decoding.decode(q, k_cache, v_cache, cache_seqlens=cache_seqlens, k=k, v=v, page_table=page_table,
                           causal=causal, window=tuple(window), softmax_scale=softmax_scale, num_splits=num_splits,
                           sinks=sinks, softcap=softcap, alibi_slopes=alibi_slopes, return_lse=True)


@_decode.register_fake
def _decode_fake(q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal, window, softmax_scale, num_splits,
                 sinks=None, softcap=None, alibi_slopes=None):
    B, Sq, H, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, H, Sq), dtype=torch.float32)


def decode_traced(q, k_cache, v_cache, cache_seqlens, k, v, page_table, causal, window, softmax_scale, num_splits,
                  sinks=None, softcap=None, alibi_slopes=None):
    """flashrt.decode's torch.compile path (decoding.decode calls it while compiling): (out, lse)."""
    return torch.ops.flashrt.decode(q, k_cache, v_cache, cache_seqlens, k, v, page_table, bool(causal),
                                    list(window), softmax_scale, int(num_splits), sinks,
                                    None if softcap is None else float(softcap), alibi_slopes)
