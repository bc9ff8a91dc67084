"""Stand-in for FlashAttention 3's `flash_attn_interface`, for `bench/gpu_train.py` only.

The 2026-04 parameter-golf records import `flash_attn_func` from FlashAttention 3,
which few machines have installed. For an A/B of the data path (original against
patched, both with this module) attention only has to be right and the same on both
sides, so this computes it with `torch.nn.functional.scaled_dot_product_attention`.
Step times measured with it are not the record's own: say so beside them.
"""

import torch.nn.functional as F


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), **ignored):
    """Attention in FlashAttention's layout.

    Takes: q: [batch, seq_len, heads, head_dim]; k, v: [batch, seq_len, kv_heads,
    head_dim], kv_heads dividing heads (grouped-query attention); softmax_scale: float
    or None (1/sqrt(head_dim)); causal: bool.
    Returns: [batch, seq_len, heads, head_dim], q's dtype and device.
    Raises NotImplementedError for a sliding window (`window_size` other than (-1, -1)).
    """
    if tuple(window_size) != (-1, -1):
        raise NotImplementedError("flash_attn_interface stand-in: no sliding window")
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale, enable_gqa=k.shape[2] != q.shape[2]
    )
    return out.transpose(1, 2)
