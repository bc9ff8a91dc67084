"""Stand-in for Hugging Face `kernels` (the real one downloads FlashAttention 3 over the network).

`get_kernel(...).flash_attn_interface` has FlashAttention's `flash_attn_varlen_func`
(causal, a left window) and `flash_attn_func`, computed with PyTorch's
`scaled_dot_product_attention` and a boolean mask (documents from `cu_seqlens`, causal,
the window). Exact attention, slower than FlashAttention 3 and the same on both sides
of an A/B: step times measured with it are not the record's own; say so beside them.
"""

import types

import torch
import torch.nn.functional as F


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=True, softmax_scale=None, window_size=(-1, -1), **ignored):
    """Attention over packed documents.

    Takes: q, k, v: [total_tokens, heads, head_dim] (k, v heads dividing q's);
    cu_seqlens_q == cu_seqlens_k: int32 [documents + 1], each document's start, the last
    entry the total; causal: bool; softmax_scale: float or None; window_size:
    (left, right) in tokens, -1 for none (a key j is seen from i when i - left <= j <=
    i + right). Returns [total_tokens, heads, head_dim], q's dtype.
    """
    total = q.shape[0]
    positions = torch.arange(total, device=q.device)
    document = torch.bucketize(positions, cu_seqlens_q[1:].to(positions.dtype), right=True)
    i, j = positions[:, None], positions[None, :]
    mask = document[:, None] == document[None, :]
    left, right = (int(w) for w in window_size)
    if causal:
        right = 0
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=softmax_scale, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out[0].transpose(0, 1)


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), **ignored):
    """Attention in FlashAttention's batched layout: q, k, v [batch, seq_len, heads, head_dim]."""
    b, t = q.shape[:2]
    cu = torch.arange(0, (b + 1) * t, t, device=q.device, dtype=torch.int32)
    out = flash_attn_varlen_func(q.reshape(b * t, *q.shape[2:]), k.reshape(b * t, *k.shape[2:]), v.reshape(b * t, *v.shape[2:]), cu, cu, causal=causal, softmax_scale=softmax_scale, window_size=window_size)
    return out.reshape(q.shape)


flash_attn_interface = types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func, flash_attn_func=flash_attn_func)


def get_kernel(name, version=None, **ignored):
    return types.SimpleNamespace(flash_attn_interface=flash_attn_interface)


def has_kernel(name, version=None, **ignored):
    return True
