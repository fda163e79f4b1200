"""flashrt: FlashAttention forward and backward, compiled at run time by NVRTC.

    out, lse = flashrt.forward(q, k, v, causal=True)
    dq, dk, dv = flashrt.backward(dout, q, k, v, out, lse, causal=True)
    out = flashrt.attention(q, k, v, causal=True)      # torch autograd

Tensors are (batch, seqlen, heads, head_dim), bf16 or fp16, torch or CuPy.
"""
from ._version import __version__
from .api import backward, forward


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False):
    """Differentiable attention for torch tensors (imports torch on first use)."""
    from .torch_ops import attention as _attention
    return _attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse)


__all__ = ["__version__", "forward", "backward", "attention"]
