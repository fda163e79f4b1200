"""torch.nn.functional.scaled_dot_product_attention's signature and (B, H, S, D) layout, on flashrt.

    from flashrt.torch import scaled_dot_product_attention   # instead of F.scaled_dot_product_attention

flashrt's native layout is (B, S, H, D) with any strides on the first three axes,
so SDPA's (B, H, S, D) tensors are read through a transposed view, never copied,
and the output is SDPA's shape (a transposed view of a (B, S, H, D) buffer, as
torch's own flash backend returns). What flashrt does not compute raises instead
of silently differing: explicit mask tensors. is_causal=True and
causal_upper_left are top-left aligned, as in SDPA; causal_lower_right is bottom-right.
"""
from typing import Optional

try:
    import torch
except ModuleNotFoundError as _exc:
    if _exc.name != "torch":
        raise
    from . import _torch_missing
    raise _torch_missing("flashrt.torch") from _exc

from . import torch_ops


def _causal_from_mask(attn_mask, is_causal: bool, Sq: int, Sk: int):
    """torch.nn.attention.bias causal biases map onto flashrt's causal modes; any other mask raises."""
    from torch.nn.attention.bias import CausalBias, CausalVariant
    if not isinstance(attn_mask, CausalBias):
        kind = "boolean" if attn_mask.dtype == torch.bool else f"{attn_mask.dtype} (additive)"
        raise ValueError(f"flashrt.torch.scaled_dot_product_attention takes no attn_mask tensor, got a {kind} mask "
                         f"of shape {tuple(attn_mask.shape)}: pass attn_mask=None (with is_causal=True for a causal "
                         f"mask) or a causal bias from torch.nn.attention.bias. flashrt.attention computes the other "
                         f"masks from their structure, on (B, S, H, D) tensors (query.transpose(1, 2)): window=(left, "
                         f"right) for a sliding window, seqlens_q=/seqlens_k= (or cu_seqlens_q/k=) for padding, "
                         f"block_ids_q/k= or segment_ids_q/k= for block-causal and document masks, mask_mod= (a CUDA "
                         f"boolean expression over b, h, q, k) for any other; or keep torch's "
                         f"scaled_dot_product_attention for a dense mask tensor")
    if is_causal:
        raise ValueError("pass either attn_mask (a CausalBias) or is_causal=True, not both (as torch's SDPA requires)")
    if (attn_mask.seq_len_q, attn_mask.seq_len_kv) != (Sq, Sk):
        raise ValueError(f"attn_mask is a causal bias for (Sq, Sk) = {(attn_mask.seq_len_q, attn_mask.seq_len_kv)} "
                         f"but query and key have (Sq, Sk) = {(Sq, Sk)}")
    return "top_left" if attn_mask.variant == CausalVariant.UPPER_LEFT else "bottom_right"


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                                 is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """torch.nn.functional.scaled_dot_product_attention on flashrt's kernels.

    query (B, H, Sq, D), key and value (B, Hkv, Sk, D), bf16 or fp16 (or any float dtype
    under torch.autocast, cast as SDPA casts); returns (B, H, Sq, D). attn_mask may only
    be None or a causal bias from torch.nn.attention.bias (causal_lower_right or
    causal_upper_left); is_causal=True is top-left aligned like SDPA's. Query rows that
    see no key give 0 (SDPA gives NaN). flashrt.attention takes the other mask kinds.
    dropout_p: attention dropout as SDPA applies it (whatever the module's training flag: pass 0.0 to evaluate),
    with flashrt's own mask from torch's generator (flashrt.attention), not the one SDPA would draw.
    """
    for name, x in (("query", query), ("key", key), ("value", value)):
        if x.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seqlen, head_dim), got shape {tuple(x.shape)}; "
                             f"add a batch axis with {name}.unsqueeze(0) or fold extra leading axes into batch")
    Sq, Sk = query.shape[2], key.shape[2]
    if attn_mask is not None:
        causal = _causal_from_mask(attn_mask, bool(is_causal), Sq, Sk)
    else:
        causal = "top_left" if is_causal else False
    if query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(f"query has {query.shape[1]} heads but key/value have {key.shape[1]}: pass enable_gqa=True "
                         f"for grouped-query attention (as torch's SDPA requires)")
    out = torch_ops.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=causal,
                              softmax_scale=scale, dropout_p=dropout_p)
    return out.transpose(1, 2)
