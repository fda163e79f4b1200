"""flashrt: FlashAttention forward and backward, compiled at run time by NVRTC.

    out, lse = flashrt.forward(q, k, v, causal=True)
    dq, dk, dv = flashrt.backward(dout, q, k, v, out, lse, causal=True)
    out = flashrt.attention(q, k, v, causal=True)      # torch autograd (dropout_p=, softcap=, sinks=, masks ...)
    out = flashrt.torch.scaled_dot_product_attention(q, k, v, is_causal=True)  # torch's (B, H, S, D) SDPA API
    out = flashrt.decode(q, k_cache, v_cache, cache_seqlens=lens, k=k_new, v=v_new)  # KV-cache decoding
    out, lse = flashrt.combine(out_parts, lse_parts)  # merge attention over disjoint key ranges
    out = flashrt.distributed.ring_attention(q, k, v, causal=True)  # one sequence over several GPUs (torch)

Tensors are (batch, seqlen, heads, head_dim), bf16 or fp16, torch or CuPy.
"""
from ._version import __version__
from .api import backward, dropout_rng, forward
from .decoding import combine, decode


def synchronize() -> None:
    """Wait for the GPUs where flashrt has checked mask arrays (validate=True), and raise the first invalid
    array such a check found (a ValueError naming the argument), if none was raised yet. Without it, the
    report surfaces at the next flashrt call."""
    from . import launch, masks
    launch.synchronize_checked()
    masks.raise_reported()


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, impl="auto", deterministic=True,
              softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0, validate=True, **mask_args):
    """Differentiable attention for torch tensors (imports torch on first use).

    A torch custom op with an autograd formula: works under torch.compile(fullgraph=True),
    CUDA graphs, activation checkpointing and autocast. Takes flashrt.forward's mask
    arguments (window, seqlens_*, cu_seqlens_*, block_ids_*, segment_ids_*, mask_mod). For torch's
    SDPA layout and signature, see flashrt.torch.scaled_dot_product_attention. softcap: scores capped to
    softcap * tanh(score / softcap); alibi_slopes: (H,) or (B, H) ALiBi slopes (flashrt.forward) of any floating
    dtype, not differentiable (pass alibi_slopes.detach()); sinks: (H,) attention-sink logits (flashrt.forward), a
    differentiable tensor of any floating dtype. score_mod="..." (a CUDA float expression over s, the scaled score,
    and b, h, q, k, Lq, Lk), score_mod_grad (its derivative in s; default: derived automatically) and score_tensors
    (at most 4 float32 / int32 tensors it reads; a float32 one that requires grad gets its gradient), as
    flashrt.forward takes them; not with softcap or alibi_slopes. dropout_p: attention dropout, its mask drawn per call
    from torch's generator (flashrt.forward's dropout_p; pass 0.0 to evaluate).
    """
    try:
        from .torch_ops import attention as _attention
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise _torch_missing("flashrt.attention") from exc
    return _attention(q, k, v, causal=causal, softmax_scale=softmax_scale, return_lse=return_lse, impl=impl,
                      deterministic=deterministic, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                      dropout_p=dropout_p, validate=validate, **mask_args)


def _install_hint(extra: str) -> str:
    """The pip command that adds an extra, from a package index and from a flashrt checkout."""
    return f'pip install "flashrt[{extra}]" (from a flashrt checkout: pip install ".[{extra}]")'


def _torch_missing(what: str) -> ModuleNotFoundError:
    """The error for `what` needing torch where torch is not installed (a ModuleNotFoundError, so an ImportError)."""
    return ModuleNotFoundError(f"{what} needs torch, which is not installed: {_install_hint('torch')}. "
                               f"flashrt.forward and flashrt.backward take CuPy arrays without torch", name="torch")


def __getattr__(name):
    # flashrt.torch (torch's SDPA signature) and flashrt.distributed import torch, so they load on first use:
    # `import flashrt` stays torch-free. Inside torch.compile'd code, `import flashrt.torch` first.
    if name in ("torch", "distributed"):
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'flashrt' has no attribute {name!r}")


__all__ = ["__version__", "forward", "backward", "attention", "decode", "combine", "dropout_rng", "synchronize"]
