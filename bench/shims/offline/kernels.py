"""Stand-in for Hugging Face `kernels` (the real one downloads FlashAttention 3 over the network).

`get_kernel(...).flash_attn_interface` has FlashAttention's `flash_attn_varlen_func`
(causal, a left window) and `flash_attn_func`, computed with PyTorch's
`scaled_dot_product_attention` on chunks of queries with a boolean mask (documents from
`cu_seqlens`, causal, the window). Exact attention, slower than FlashAttention 3 and the same on both sides
of an A/B: step times measured with it are not the record's own; say so beside them.
"""

import types

import torch
import torch.nn.functional as F


# Queries are attended in chunks of CHUNK tokens, each against the keys its window can
# reach, so memory grows with tokens x (CHUNK + window), not tokens squared (modded-nanogpt's
# validation batch is 262,144 tokens a micro-step; its windows are at most 2,560 tokens).
CHUNK = 1024


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None, causal=True, softmax_scale=None, window_size=(-1, -1), **ignored):
    """Causal attention over packed documents.

    Takes: q, k, v: [total_tokens, heads, head_dim] (k, v heads dividing q's);
    cu_seqlens_q == cu_seqlens_k: int32 [documents + 1], each document's start, the last
    entry the total; causal: must be True; softmax_scale: float or None; window_size:
    (left, right) in tokens, left -1 for none (a key j is seen from i when
    i - left <= j <= i). Returns [total_tokens, heads, head_dim], q's dtype.
    Raises NotImplementedError for non-causal attention.
    """
    if not causal:
        raise NotImplementedError("kernels stand-in: causal attention only")
    total, heads, dim = q.shape
    left = int(window_size[0])
    document = torch.bucketize(torch.arange(total, device=q.device), cu_seqlens_q[1:].to(torch.int64), right=True)
    chunk = min(CHUNK, total) if left >= 0 else total
    reach = -(-left // chunk) * chunk if left >= 0 else 0  # keys before a chunk's first query
    n = -(-total // chunk) * chunk
    pad, chunks, span = n - total, n // chunk, chunk + reach
    # Padding: keys before the start belong to no document (-2); queries and keys past the
    # end to one of their own (-1), so that no row is empty (an empty row's NaN would reach
    # the gradients of k and v).
    q_doc = torch.cat([document, document.new_full((pad,), -1)])
    k_doc = torch.cat([document.new_full((reach,), -2), q_doc])
    q4 = F.pad(q, (0, 0, 0, 0, 0, pad)).view(chunks, chunk, heads, dim).transpose(1, 2)
    k4, v4 = (F.pad(t, (0, 0, 0, 0, reach, pad)).unfold(0, span, chunk).permute(0, 1, 3, 2) for t in (k, v))
    q_pos = torch.arange(n, device=q.device).view(chunks, chunk)[:, :, None]
    k_pos = (torch.arange(reach + n, device=q.device) - reach).unfold(0, span, chunk)[:, None, :]
    mask = (q_doc.view(chunks, chunk)[:, :, None] == k_doc.unfold(0, span, chunk)[:, None, :]) & (k_pos <= q_pos)
    if left >= 0:
        mask &= k_pos >= q_pos - left
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask[:, None], scale=softmax_scale, enable_gqa=k.shape[1] != heads)
    return out.transpose(1, 2).reshape(n, heads, dim)[:total]


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
