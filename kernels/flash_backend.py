"""Optional flash-attn backend for `paged_attention`, used when `flash_attn` is importable.

flash-attn cannot be installed on the machines this project is developed and tested on, so the
Triton kernel is the default and the tested path; this adapter only maps our arguments onto
`flash_attn_with_kvcache` (paged KV through `block_table`), and its mapping is tested against
flash-attn's documented semantics with a stand-in module. It takes a call only when flash-attn
can serve it as is: every sequence has the same number of queries (verify, decode, draft block),
and the KV block size is a multiple of 256 (flash-attn 2's paged-KV requirement; set
`kv_block_size: 256` to use it). Everything else goes to Triton.

flash-attn aligns queries to the end of the keys ("bottom-right"), as our layout does, and its
window (left, right) admits keys k with q - left <= k <= q + right.
"""

from __future__ import annotations

import torch

try:
    from flash_attn import flash_attn_with_kvcache
except ImportError:  # the default: not installed
    flash_attn_with_kvcache = None

PAGE_MULTIPLE = 256


def can_serve(q: torch.Tensor, k_cache: torch.Tensor, seq_lens: torch.Tensor, max_query_len: int | None) -> bool:
    if flash_attn_with_kvcache is None or not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    num_seqs = seq_lens.shape[0]
    if max_query_len is None or num_seqs == 0:
        return False  # uniformity cannot be known without a device sync
    # Each sequence has at most max_query_len queries, so equality of the total means all do.
    return k_cache.shape[1] % PAGE_MULTIPLE == 0 and q.shape[0] == num_seqs * max_query_len


def flash_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, *, scale, causal, window,
                          max_query_len) -> torch.Tensor:
    """Same contract as `paged_attention` for uniform query lengths; q [num_seqs*q_len, heads, d]."""
    num_seqs = seq_lens.shape[0]
    if window is None:
        window_size = (-1, -1)
    else:  # ours: q - k < W (and k - q < W when not causal)
        window_size = (window - 1, 0 if causal else window - 1)
    out = flash_attn_with_kvcache(
        q.reshape(num_seqs, max_query_len, *q.shape[1:]),
        k_cache,
        v_cache,
        cache_seqlens=seq_lens,
        block_table=block_tables,
        softmax_scale=scale,
        causal=causal,
        window_size=window_size,
    )
    return out.reshape(q.shape)
