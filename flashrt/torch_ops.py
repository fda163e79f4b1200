"""flashrt.attention: a torch autograd function built on flashrt.forward / flashrt.backward."""
from __future__ import annotations

import torch

from . import api


def _kernel_ready(x: torch.Tensor) -> torch.Tensor:
    """x itself when the kernels can read it in place, else a contiguous copy.

    Upstream gradients are often views the kernels cannot read (out.sum() gives an
    expanded tensor with zero strides), so the backward pass normalises dout.
    """
    aligned = x.data_ptr() % 16 == 0 and x.stride(-1) == 1
    aligned = aligned and all(s % 8 == 0 for n, s in zip(x.shape[:-1], x.stride()[:-1]) if n > 1)
    return x if aligned else x.contiguous()


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale):
        out, lse = api.forward(q, k, v, causal=causal, softmax_scale=softmax_scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.softmax_scale = causal, softmax_scale
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = api.backward(_kernel_ready(dout), q, k, v, out, lse, causal=ctx.causal,
                                  softmax_scale=ctx.softmax_scale)
        return dq, dk, dv, None, None


def attention(q, k, v, *, causal: bool = False, softmax_scale: float | None = None, return_lse: bool = False):
    """Differentiable attention on torch tensors (B, S, H, D); see flashrt.forward for the semantics."""
    out, lse = _Attention.apply(q, k, v, bool(causal), softmax_scale)
    return (out, lse) if return_lse else out
