"""Attention of packed variable-length queries over a paged KV cache.

One entry point serves every attention the server runs: target prefill chunks and verify/decode
(causal), and the drafter's block forward (non-causal, optionally sliding-window; dflash-spec §1.5).
Sequence i has seq_lens[i] keys at cache positions 0..seq_lens[i]-1, and its q_len_i queries are
the LAST q_len_i of those positions, so a query at position p sees key k when k < seq_lens[i] and
    causal: k <= p;    window W: p - k < W (and, when not causal, k - p < W).

A layer may store its values only and have its keys derived from them as they are read
(`keys_from_values`: Gemma-4's `attention_k_eq_v`, whose keys and values are one projection, the
keys k-normed and rotated, the values normed without a weight): key = RoPE(value · w) at the key's
position, rounded as the writing kernel rounds, so the cache holds that layer's K/V once.

`paged_attention_reference` is the plain-torch definition (test oracle), one sequence at a time;
`paged_attention_batched` is the same math over many sequences per call (the CPU path);
`paged_attention_triton` is the GPU kernel; `paged_attention` picks between them.
"""

from __future__ import annotations

import functools
import math
import os
from collections import defaultdict
from dataclasses import dataclass

import torch

from dflash_serve.kernels import flash_backend

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference
    triton = None

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start, *, scale, causal, window=None,
                    max_query_len=None, out=None, keys_from_values=None) -> torch.Tensor:
    """q [total_q, num_heads, head_dim] packed by sequence -> attention output, same shape and dtype.

    k_cache, v_cache: one layer, [num_blocks, block_size, num_kv_heads, head_dim].
    keys_from_values: (w [head_dim] float32, cos, sin [max_positions, head_dim/2] in the cache's
    dtype): k_cache is None and each key is RoPE(value · w) at its position.
    block_tables int32 [num_seqs, max_blocks]; seq_lens int32 [num_seqs] (keys per sequence, the
    queries' own included); query_start int32 [num_seqs + 1] (cumulative query counts).
    max_query_len: host bound on any q_len; given, the call makes no host sync (CUDA-graph safe).
    out: optional buffer shaped and typed like q to write into (a CUDA graph's static output).
    Rows of q past query_start[-1] (padding) get unspecified values.
    """
    if keys_from_values is None and flash_backend.can_serve(q, k_cache, seq_lens, max_query_len):
        result = flash_backend.flash_paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                                     causal=causal, window=window, max_query_len=max_query_len)
        return result if out is None else out.copy_(result)
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start)
    kwargs = dict(scale=scale, causal=causal, window=window, max_query_len=max_query_len, out=out,
                  keys_from_values=keys_from_values)
    if _runs_triton(q):
        return paged_attention_triton(*args, **kwargs)
    return paged_attention_batched(*args, **kwargs)


def _runs_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA, or on CPU under its interpreter (TRITON_INTERPRET=1, used by the tests)."""
    if triton is None or x.dtype not in TRITON_DTYPES:
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def visible_keys(query_positions: torch.Tensor, key_positions: torch.Tensor, *, causal: bool,
                 window: int | None) -> torch.Tensor:
    """bool [num_queries, num_keys]: which keys each query may attend to (keys are all < seq_len)."""
    q = query_positions[:, None]
    k = key_positions[None, :]
    visible = torch.ones(q.shape[0], k.shape[1], dtype=torch.bool, device=q.device)
    if causal:
        visible &= k <= q
    if window is not None:
        visible &= q - k < window
        if not causal:
            visible &= k - q < window
    return visible


def derive_keys(values: torch.Tensor, positions: torch.Tensor, keys_from_values) -> torch.Tensor:
    """Keys of a `keys_from_values` layer: values [..., keys, kv_heads, D] (the cache's dtype) at
    positions [..., keys] -> RoPE(values · w), rounded as `rope_kv_write` rounds a key it writes."""
    weight, cos, sin = keys_from_values
    normed = (values.to(torch.promote_types(values.dtype, torch.float32)) * weight).to(values.dtype)
    c, s = cos[positions].to(values.dtype), sin[positions].to(values.dtype)
    c, s = torch.cat([c, c], dim=-1)[..., None, :], torch.cat([s, s], dim=-1)[..., None, :]
    first, second = normed.chunk(2, dim=-1)
    return normed * c + torch.cat([-second, first], dim=-1) * s


def paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start, *, scale, causal,
                              window=None, max_query_len=None, out=None, keys_from_values=None) -> torch.Tensor:
    """Plain torch, one sequence at a time; softmax in float32 (float64 inputs stay float64).

    max_query_len is accepted for signature parity and not needed here.
    """
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    block_size, num_kv_heads = v_cache.shape[1], v_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    bounds = query_start.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        begin, end = bounds[i], bounds[i + 1]
        if begin == end:
            continue
        key_positions = torch.arange(seq_len, device=q.device)
        pages = block_tables[i, key_positions // block_size].long()
        values = v_cache[pages, key_positions % block_size]
        keys = (derive_keys(values, key_positions, keys_from_values) if keys_from_values is not None
                else k_cache[pages, key_positions % block_size])
        k = keys.to(compute_dtype).repeat_interleave(group, dim=1)
        v = values.to(compute_dtype).repeat_interleave(group, dim=1)
        query_positions = torch.arange(seq_len - (end - begin), seq_len, device=q.device)
        scores = torch.einsum("qhd,khd->hqk", q[begin:end].to(compute_dtype), k) * scale
        visible = visible_keys(query_positions, key_positions, causal=causal, window=window)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[begin:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


# Elements `paged_attention_batched` holds at once for a slice of sequences (their gathered keys
# and values, and the scores: 256 MiB in float32); a larger group is attended a slice at a time.
BATCHED_KEYS_BUDGET = 1 << 26


def paged_attention_batched(q, k_cache, v_cache, block_tables, seq_lens, query_start, *, scale, causal,
                            window=None, max_query_len=None, out=None, keys_from_values=None) -> torch.Tensor:
    """`paged_attention_reference`'s math over many sequences per call (the CPU path).

    Sequences with the same number of queries — every sequence of a round, prefill chunks of equal
    length — are attended together: their keys are gathered a whole block at a time up to the
    group's longest sequence, and torch's fused attention runs over all of them at once, with a
    mask for each one's visible keys (GQA heads share their kv head's keys, not copies).
    """
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q) if out is None else out
    bounds, lens = query_start.tolist(), seq_lens.tolist()
    by_query_len: dict[int, list[int]] = defaultdict(list)
    for i in range(len(lens)):
        if bounds[i + 1] > bounds[i]:
            by_query_len[bounds[i + 1] - bounds[i]].append(i)
    for q_len, seqs in by_query_len.items():
        # Per sequence: its gathered keys and values, and a score (or mask entry) per head and query.
        per_seq = max(lens[i] for i in seqs) * (2 * v_cache.shape[2] * v_cache.shape[3] + q.shape[1] * q_len)
        step = max(1, BATCHED_KEYS_BUDGET // per_seq)
        for first in range(0, len(seqs), step):
            part = seqs[first : first + step]
            rows = (torch.tensor([bounds[i] for i in part], device=q.device)[:, None]
                    + torch.arange(q_len, device=q.device)).flatten()
            out[rows] = _attend_equal_query_lens(
                q[rows].to(compute_dtype), k_cache, v_cache, block_tables[part].long(),
                torch.tensor([lens[i] for i in part], device=q.device), scale=scale, causal=causal, window=window,
                keys_from_values=keys_from_values,
            ).to(q.dtype)
    return out


def _attend_equal_query_lens(q, k_cache, v_cache, block_tables, seq_lens, *, scale, causal, window,
                             keys_from_values=None) -> torch.Tensor:
    """n sequences with the same number of queries: q [n*q_len, heads, d] -> output, same shape."""
    n = seq_lens.shape[0]
    q_len = q.shape[0] // n
    block_size, num_kv_heads, head_dim = v_cache.shape[1:]
    pages = block_tables[:, : -(-int(seq_lens.max()) // block_size)].flatten()
    num_keys = pages.shape[0] // n * block_size
    key_positions = torch.arange(num_keys, device=q.device)
    values = v_cache.index_select(0, pages).view(n, num_keys, num_kv_heads, head_dim)
    if keys_from_values is not None:  # positions past the table belong to no sequence: masked below
        keys = derive_keys(values, key_positions.clamp(max=keys_from_values[1].shape[0] - 1), keys_from_values)
    else:
        keys = k_cache.index_select(0, pages).view(n, num_keys, num_kv_heads, head_dim)
    k, v = keys.to(q.dtype), values.to(q.dtype)
    owned = key_positions < seq_lens[:, None]  # [n, keys]
    # Keys past a sequence's length belong to another sequence or none: masked, and zeroed too
    # (the copies here), since a masked score of a NaN key is still NaN and 0 · NaN is NaN.
    k.masked_fill_(~owned[:, :, None, None], 0.0)
    v.masked_fill_(~owned[:, :, None, None], 0.0)
    query_positions = seq_lens[:, None] - q_len + torch.arange(q_len, device=q.device)  # [n, q_len]
    visible = owned[:, None, :]
    if causal:
        visible = visible & (key_positions <= query_positions[:, :, None])
    if window is not None:
        visible = visible & (query_positions[:, :, None] - key_positions < window)
        if not causal:
            visible = visible & (key_positions - query_positions[:, :, None] < window)
    attended = torch.nn.functional.scaled_dot_product_attention(
        q.view(n, q_len, -1, head_dim).transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        attn_mask=visible.expand(n, q_len, num_keys)[:, None], scale=scale, enable_gqa=True,
    )
    return attended.transpose(1, 2).reshape(n * q_len, -1, head_dim)


# -- Triton ------------------------------------------------------------------------------------

# A split (flash-decoding) pays for its merge only when it keeps at least this many keys.
MIN_KEYS_PER_SPLIT = 128
MAX_KV_SPLITS = 32
# Two attention programs fit on an SM at once (their pipelined K/V tiles take ~100 KB of shared memory).
PROGRAMS_PER_SM = 2


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def choose_num_kv_splits(num_programs: int, max_keys: int, device: torch.device) -> int:
    """How many programs share one (query tile, sequence, kv head)'s keys: as many as still fit the
    GPU in one wave (verify/decode at small batch and long context), and never a partial second
    wave, which would leave the GPU mostly idle for a whole program's time."""
    slots = PROGRAMS_PER_SM * _num_sms(device)
    splits = max(1, min(slots // num_programs, max_keys // MIN_KEYS_PER_SPLIT, MAX_KV_SPLITS))
    # A power of two: the count is a compile-time constant of the kernel, and an eager forward's
    # shapes (a burst of prompts past the prefill graphs) would otherwise compile a new variant
    # for each count the start-up's graphs did not use, a stall of ~1 s each while requests wait.
    return 1 << (splits.bit_length() - 1)


@dataclass
class AttentionLaunch:
    """A paged attention call's shapes and arguments, checked once for both Triton paths (this
    module's and `invariant_attention`'s): with `keys_from_values` the key cache is the value
    cache (never read as keys) and the key weight and rope tables are the derived keys' inputs;
    without, they are placeholders the kernels do not read."""

    total_q: int
    num_heads: int
    head_dim: int
    block_size: int
    num_kv_heads: int
    num_seqs: int
    group: int
    k_cache: torch.Tensor
    key_weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    out: torch.Tensor
    max_query_len: int

    @classmethod
    def check(cls, q, k_cache, v_cache, seq_lens, query_start, window, max_query_len, out, keys_from_values
              ) -> AttentionLaunch:
        total_q, num_heads, head_dim = q.shape
        _, block_size, num_kv_heads, _ = v_cache.shape
        num_seqs = seq_lens.shape[0]
        group = num_heads // num_kv_heads
        if keys_from_values is None:
            key_weight, cos, sin = q, q, q  # not read
            assert k_cache.shape == v_cache.shape and k_cache.stride(-1) == 1
        else:
            key_weight, cos, sin = keys_from_values
            k_cache = v_cache  # not read
            assert head_dim % 2 == 0 and key_weight.dtype == torch.float32 and key_weight.is_contiguous()
            assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.dtype == sin.dtype == v_cache.dtype
        assert num_heads == group * num_kv_heads and v_cache.shape[-1] == head_dim
        assert q.stride(-1) == 1 and v_cache.stride(-1) == 1
        assert window is None or window >= 1
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        assert out.shape == q.shape and out.dtype == q.dtype and out.stride(-1) == 1
        if max_query_len is None:
            max_query_len = int((query_start[1:] - query_start[:-1]).max()) if num_seqs else 0
        return cls(total_q, num_heads, head_dim, block_size, num_kv_heads, num_seqs, group, k_cache, key_weight, cos,
                   sin, out, max_query_len)


def paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start, *, scale, causal, window=None,
                           max_query_len=None, out=None, num_kv_splits=None, keys_from_values=None) -> torch.Tensor:
    """The Triton path of `paged_attention`; num_kv_splits None chooses from the shapes alone.

    One program per (query tile, sequence, kv head, kv split). A query tile packs the queries of
    all `group` heads that share the kv head (rows = q_len × group), so each key tile is loaded
    once for the whole group and the M dimension of the dots is filled even at q_len 1. With
    `keys_from_values` each key tile is computed from its value tile.
    """
    a = AttentionLaunch.check(q, k_cache, v_cache, seq_lens, query_start, window, max_query_len, out, keys_from_values)
    total_q, num_heads, head_dim, block_size, num_kv_heads, num_seqs, group = (
        a.total_q, a.num_heads, a.head_dim, a.block_size, a.num_kv_heads, a.num_seqs, a.group)
    k_cache, key_weight, cos, sin, out, max_query_len = a.k_cache, a.key_weight, a.cos, a.sin, a.out, a.max_query_len
    if total_q == 0 or max_query_len == 0:
        return out

    block_d = max(16, triton.next_power_of_2(head_dim))
    # Rows = queries × group: at least 16 (the smallest dot) and at most 64 (one verify tile of 16
    # queries × 4 heads; as fast as 128 for prefill on H100) unless a single group needs more.
    block_m = min(max(16, triton.next_power_of_2(group * max_query_len)), max(64, triton.next_power_of_2(group)))
    block_n = 64 if block_d <= 128 else 32
    num_q_tiles = triton.cdiv(max_query_len, block_m // group)
    if num_kv_splits is None:
        max_keys = block_tables.shape[1] * block_size
        num_kv_splits = choose_num_kv_splits(num_q_tiles * num_seqs * num_kv_heads, max_keys, q.device)
    if num_kv_splits > 1:  # each split's normalised output and log2-sum-exp, merged by a second kernel
        partial_out = torch.empty(num_kv_splits, total_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
        partial_lse = torch.empty(num_kv_splits, total_q, num_heads, dtype=torch.float32, device=q.device)
    else:  # the kernel normalises and writes `out` itself
        partial_out = partial_lse = out

    _paged_attention_kernel[(num_q_tiles, num_seqs, num_kv_heads * num_kv_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start, out, partial_out, partial_lse, total_q * num_heads,
        num_heads, scale * math.log2(math.e), window or 0, key_weight, cos, sin,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1), cos.stride(0), sin.stride(0),
        HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE_SIZE=block_size, GROUP=group,
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=causal, HAS_WINDOW=window is not None,
        KEYS_FROM_VALUES=keys_from_values is not None,
        # float32 (a debugging dtype here) stays float32: no tf32 rounding in the dots.
        NUM_SPLITS=num_kv_splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3 if block_d <= 128 else 2,
    )
    if num_kv_splits > 1:
        _merge_kv_splits_kernel[(total_q, num_heads)](
            partial_out, partial_lse, out, total_q * num_heads, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=num_kv_splits,
            BLOCK_SPLITS=triton.next_power_of_2(num_kv_splits), num_warps=4,
        )
    return out


if triton is not None:

    @triton.jit
    def _key_from_value(v_cache_ptr, v_offsets, key_pos, kv_mask, dims, dim_valid, key_weight_ptr, cos_ptr, sin_ptr,
                        stride_cos, stride_sin, HEAD_DIM: tl.constexpr):
        """A key tile RoPE(v · w) from the value tile at `v_offsets`, rounded after each op in the
        cache dtype as `rope_kv_write` rounds the keys it writes."""
        HALF: tl.constexpr = HEAD_DIM // 2
        dtype = v_cache_ptr.dtype.element_ty
        # rotate_half(x)[d] = -x[d + HALF] for d < HALF, x[d - HALF] above.
        partner = (dims + HALF) % HEAD_DIM
        value = tl.load(v_cache_ptr + v_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        value_partner = tl.load(v_cache_ptr + v_offsets[:, None] + partner[None, :], mask=kv_mask, other=0.0)
        w = tl.load(key_weight_ptr + dims, mask=dim_valid, other=0.0)[None, :]
        w_partner = tl.load(key_weight_ptr + partner, mask=dim_valid, other=0.0)[None, :]
        normed = (value * w).to(dtype).to(tl.float32)
        normed_partner = (value_partner.to(tl.float32) * w_partner).to(dtype).to(tl.float32)
        half_dims = (dims % HALF)[None, :]
        cos = tl.load(cos_ptr + key_pos[:, None] * stride_cos + half_dims, mask=kv_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + key_pos[:, None] * stride_sin + half_dims, mask=kv_mask, other=0.0).to(tl.float32)
        sign = tl.where(dims < HALF, -1.0, 1.0)[None, :]
        rotated = (normed * cos).to(dtype).to(tl.float32) + sign * (normed_partner * sin).to(dtype).to(tl.float32)
        return rotated.to(dtype)

    @triton.jit
    def query_tile_keys(seq_lens_ptr, query_start_ptr, seq, tile, window, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr):
        """A query tile's rows and the keys any of them can see (both attention kernels' tiling).
        Row r of the tile is query tile_first + r // GROUP of head r % GROUP of the kv head's group;
        keys [key_begin, key_end): tiles outside the causal frontier or the window are skipped. A
        tile past the sequence's queries has tile_first >= q_len (nothing to do)."""
        QUERIES_PER_TILE: tl.constexpr = BLOCK_M // GROUP
        q_begin = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_begin
        seq_len = tl.load(seq_lens_ptr + seq)
        tile_first = tile * QUERIES_PER_TILE
        rows = tl.arange(0, BLOCK_M)
        query = tile_first + rows // GROUP
        row_valid = (rows < QUERIES_PER_TILE * GROUP) & (query < q_len)
        query_pos = seq_len - q_len + query
        first_pos = seq_len - q_len + tile_first
        last_pos = seq_len - q_len + tl.minimum(tile_first + QUERIES_PER_TILE, q_len) - 1
        key_begin = 0
        key_end = seq_len
        if CAUSAL:
            key_end = last_pos + 1
        if HAS_WINDOW:
            key_begin = tl.maximum(first_pos - window + 1, 0)
            if not CAUSAL:
                key_end = tl.minimum(last_pos + window, seq_len)
        return q_begin, q_len, tile_first, query, rows % GROUP, row_valid, query_pos, key_begin, key_end

    @triton.jit
    def attend_key_range(
        q_tile, m_i, l_i, acc, tiles_begin, key_begin, key_end, query_pos, window, scale_log2,
        k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, dims, dim_valid,
        stride_k_block, stride_k_offset, stride_k_head, stride_v_block, stride_v_offset, stride_v_head,
        key_weight_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin,
        HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_WINDOW: tl.constexpr, KEYS_FROM_VALUES: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        """Online softmax of a query tile over keys key_begin to key_end - 1 of one sequence (its block
        table row), BLOCK_N keys at a time from tiles_begin (<= key_begin), continuing the running max
        m_i (log2 units), sum l_i and unnormalised output acc; keys a row may not see count for
        nothing. Keys before key_begin (the start of the first tile, when tiles_begin is below it) are
        not read: no row sees them, a window slot's entry there may be stale (`BlockAllocator`), and a
        stale NaN value would reach acc through 0 · v. With KEYS_FROM_VALUES each key tile is derived
        from its value tile (`_key_from_value`)."""
        for tile_begin in range(tiles_begin, key_end, BLOCK_N):
            key_pos = tile_begin + tl.arange(0, BLOCK_N)
            key_valid = (key_pos >= key_begin) & (key_pos < key_end)
            page = tl.load(block_table_ptr + key_pos // PAGE_SIZE, mask=key_valid, other=0)
            page = page.to(tl.int64)
            kv_mask = key_valid[:, None] & dim_valid[None, :]
            v_offsets = page * stride_v_block + (key_pos % PAGE_SIZE) * stride_v_offset + kv_head * stride_v_head
            if KEYS_FROM_VALUES:
                k = _key_from_value(v_cache_ptr, v_offsets, key_pos, kv_mask, dims, dim_valid, key_weight_ptr, cos_ptr,
                                    sin_ptr, stride_cos, stride_sin, HEAD_DIM)
            else:
                k_offsets = page * stride_k_block + (key_pos % PAGE_SIZE) * stride_k_offset + kv_head * stride_k_head
                k = tl.load(k_cache_ptr + k_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)

            scores = tl.dot(q_tile, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            visible = key_valid[None, :]
            if CAUSAL:
                visible = visible & (key_pos[None, :] <= query_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (query_pos[:, None] - key_pos[None, :] < window)
                if not CAUSAL:
                    visible = visible & (key_pos[None, :] - query_pos[:, None] < window)
            scores = tl.where(visible, scores, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(scores, 1))
            # A row that has seen no visible key yet keeps max -inf; shift by 0 so exp2 gives 0, not NaN.
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(scores - m_shift[:, None])
            alpha = tl.exp2(m_i - m_shift)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + v_offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        return m_i, l_i, acc

    # Sizes that differ from one eager forward to the next are not specialized on (Triton compiles a
    # variant per value's divisibility by 16), so a new batch shape reuses the compiled kernel.
    @triton.jit(do_not_specialize=["partial_rows_per_split", "stride_block_tables"])
    def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
        out_ptr, partial_out_ptr, partial_lse_ptr, partial_rows_per_split, num_heads,
        scale_log2, window, key_weight_ptr, cos_ptr, sin_ptr,
        stride_q_token, stride_q_head,
        stride_k_block, stride_k_offset, stride_k_head,
        stride_v_block, stride_v_offset, stride_v_head,
        stride_block_tables,
        stride_out_token, stride_out_head, stride_cos, stride_sin,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        KEYS_FROM_VALUES: tl.constexpr, NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    ):
        tile = tl.program_id(0)
        seq = tl.program_id(1)
        kv_head = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS

        q_begin, q_len, tile_first, query, head_in_group, row_valid, query_pos, key_begin, key_end = query_tile_keys(
            seq_lens_ptr, query_start_ptr, seq, tile, window, GROUP, BLOCK_M, CAUSAL, HAS_WINDOW)
        if tile_first >= q_len:
            return
        head = kv_head * GROUP + head_in_group
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < HEAD_DIM
        split_keys = tl.cdiv(tl.cdiv(key_end - key_begin, NUM_SPLITS), BLOCK_N) * BLOCK_N
        split_begin = key_begin + split * split_keys
        split_end = tl.minimum(split_begin + split_keys, key_end)

        q_offsets = (q_begin + query)[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :]
        q_tile = tl.load(q_ptr + q_offsets, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, log2 units
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        m_i, l_i, acc = attend_key_range(
            q_tile, m_i, l_i, acc, split_begin, split_begin, split_end, query_pos, window, scale_log2,
            k_cache_ptr, v_cache_ptr, block_tables_ptr + seq * stride_block_tables, kv_head, dims, dim_valid,
            stride_k_block, stride_k_offset, stride_k_head, stride_v_block, stride_v_offset, stride_v_head,
            key_weight_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin,
            HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW,
            KEYS_FROM_VALUES=KEYS_FROM_VALUES, DOT_PRECISION=DOT_PRECISION,
        )

        token = q_begin + query
        store_mask = row_valid[:, None] & dim_valid[None, :]
        # Every valid row sees its own key, but not necessarily within this split (nor do padding rows).
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        if NUM_SPLITS == 1:
            out_offsets = token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :]
            tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=store_mask)
        else:
            # An empty split contributes weight 0 (lse -inf) and output 0 to the merge.
            lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            partial_row = split * partial_rows_per_split + token * num_heads + head
            tl.store(partial_out_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :], out, mask=store_mask)
            tl.store(partial_lse_ptr + partial_row, lse, mask=row_valid)

    @triton.jit(do_not_specialize=["partial_rows_per_split"])
    def _merge_kv_splits_kernel(
        partial_out_ptr, partial_lse_ptr, out_ptr, partial_rows_per_split, num_heads, stride_out_token, stride_out_head,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_SPLITS: tl.constexpr,
    ):
        token = tl.program_id(0)
        head = tl.program_id(1)
        splits = tl.arange(0, BLOCK_SPLITS)
        dims = tl.arange(0, BLOCK_D)
        partial_row = splits * partial_rows_per_split + token * num_heads + head
        lse = tl.load(partial_lse_ptr + partial_row, mask=splits < NUM_SPLITS, other=float("-inf"))
        weight = tl.exp2(lse - tl.max(lse, 0))  # the max is finite: some split saw the query's own key
        partial_mask = (splits < NUM_SPLITS)[:, None] & (dims < HEAD_DIM)[None, :]
        partial_offsets = partial_row[:, None] * HEAD_DIM + dims[None, :]
        partial = tl.load(partial_out_ptr + partial_offsets, mask=partial_mask, other=0.0)
        out = tl.sum(partial * weight[:, None], 0) / tl.sum(weight, 0)
        tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dims, out.to(out_ptr.dtype.element_ty),
                 mask=dims < HEAD_DIM)
