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

from . import api


def _kernel_ready(x: torch.Tensor) -> torch.Tensor:
    """x itself when the kernels can read it in place, else a contiguous copy.

    Upstream gradients are often views the kernels cannot read (out.sum() gives an
    expanded tensor with zero strides), so the backward op normalises dout. It runs
    inside the op's real impl: a fake tensor under torch.compile has no data pointer.
    """
    aligned = x.data_ptr() % 16 == 0 and x.stride(-1) == 1
    aligned = aligned and all(s % 8 == 0 for n, s in zip(x.shape[:-1], x.stride()[:-1]) if n > 1)
    return x if aligned else x.contiguous()


# impl and deterministic only matter to the backward; the forward op takes them so that
# setup_context can hand them on (an autograd formula sees only the op's own arguments).
@torch.library.custom_op("flashrt::fwd", mutates_args=())
def _fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: Optional[float],
         impl: str, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return api.forward(q, k, v, causal=causal, softmax_scale=softmax_scale)


@_fwd.register_fake
def _fwd_fake(q, k, v, causal, softmax_scale, impl, deterministic):
    B, Sq, H, _ = q.shape
    # api.forward allocates both outputs contiguous, whatever q's strides.
    return q.new_empty(q.shape), q.new_empty((B, H, Sq), dtype=torch.float32)


@torch.library.custom_op("flashrt::bwd", mutates_args=())
def _bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
         lse: torch.Tensor, causal: bool, softmax_scale: Optional[float], impl: str,
         deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # (the forward output is `o`: an argument named `out` reads as an out= variant in op schemas)
    return api.backward(_kernel_ready(dout), q, k, v, o, lse, causal=causal, softmax_scale=softmax_scale,
                        impl=impl, deterministic=deterministic)


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, o, lse, causal, softmax_scale, impl, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, impl, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.options = (causal, softmax_scale, impl, deterministic)
    # The kernels take no gradient of lse: a loss through it must fail, not silently miss a term.
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    # One read of saved_tensors: non-reentrant checkpointing unpacks each saved tensor once.
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = torch.ops.flashrt.bwd.default(dout, q, k, v, out, lse, *ctx.options)
    return dq, dk, dv, None, None, None, None


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
    (torch.compile), so eager calls come here.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, impl, deterministic):
        out, lse = api.forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
        _setup_context(ctx, (q, k, v, causal, softmax_scale, impl, deterministic), (out, lse))
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        causal, softmax_scale, impl, deterministic = ctx.options
        dq, dk, dv = api.backward(_kernel_ready(dout), q, k, v, out, lse, causal=causal,
                                  softmax_scale=softmax_scale, impl=impl, deterministic=deterministic)
        return dq, dk, dv, None, None, None, None


def attention(q, k, v, *, causal: bool = False, softmax_scale: Optional[float] = None, return_lse: bool = False,
              impl: str = "auto", deterministic: bool = True):
    """Differentiable attention on torch tensors (B, S, H, D); see flashrt.forward for the semantics.

    `impl` and `deterministic` choose the backward kernels (see flashrt.backward).
    lse is returned without a gradient.
    """
    api._check_impl(impl)  # here, not first in the backward pass
    q, k, v = _autocast(q, k, v)
    scale = None if softmax_scale is None else float(softmax_scale)
    args = (q, k, v, bool(causal), scale, impl, bool(deterministic))
    if q.is_cuda and not torch.compiler.is_compiling():
        out, lse = _Eager.apply(*args)
    else:  # traced (torch.compile), or fake/meta tensors: the custom ops and their fake impls
        out, lse = torch.ops.flashrt.fwd.default(*args)
    return (out, lse) if return_lse else out
