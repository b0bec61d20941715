"""Paged attention whose every query row has the same bits whatever else is in the call.

The batch-invariant attention of `engine.deterministic`; same contract as `paged_attention`.
`paged_attention_triton` splits a tile's keys evenly over a number of programs chosen from the
batch (more splits when fewer sequences fill the GPU), picks its query tile by the longest query
count, and starts its key loop at the tile's first query's window: so a token's attention output
changes with the number of sequences, with decode (1 query), verify (k + 1) or prefill (a chunk),
and with its place in the tile. Here the arithmetic of a row depends on its key positions alone:

- keys fall into chunks of KEYS_PER_CHUNK positions ([0, 512), [512, 1024), ...); within a chunk,
  the online softmax walks BLOCK_N-key tiles aligned to the chunk, from a fresh state, so a chunk's
  partial result (running max, sum, unnormalised output) is the same for the row however the
  programs are laid out (a tile of keys the row may not see leaves the state as it was);
- the partials are folded in chunk order by one formula (`_fold_chunk`), either in the program that
  computed them (one program per query tile, when the batch fills the GPU) or, when the tiles are
  few, by a merge kernel over partials that separate programs wrote: the same values, the same
  fold, so the split only changes speed;
- the query tile's size (BLOCK_M), key tile, warps and stages are fixed by the head shape.

With `keys_from_values` (Gemma-4's k_eq_v layers) each key is derived from its cached value as
`paged_attention` derives it (`derive_keys`; in the kernel, `_key_from_value`): element by element,
so a key has the same bits whatever else is read beside it.

`paged_attention_invariant_reference` is the CPU path and the test oracle: each query row by itself
over exactly the keys it sees, so nothing else in the batch can reach it.
"""

from __future__ import annotations

import math

import torch

from dflash_serve.kernels.paged_attention import PROGRAMS_PER_SM, AttentionLaunch, _num_sms, _runs_triton, derive_keys

try:
    import triton
    import triton.language as tl

    from dflash_serve.kernels.paged_attention import attend_key_range, query_tile_keys
except ImportError:  # CPU-only installs run the reference
    triton = None

# Keys per chunk: a multiple of every key tile. Fewer would split short contexts over more
# programs at small batch, and cost more partials to write and fold. Not yet tuned on a GPU.
KEYS_PER_CHUNK = 512
# The most bytes of partial results the split path may hold (they scale with the rows of the call
# times the chunks its block table can address); past it a call runs one program per query tile.
PARTIALS_BUDGET = 64 << 20


def paged_attention_invariant(q, k_cache, v_cache, block_tables, seq_lens, query_start, *, scale, causal,
                              window=None, max_query_len=None, out=None, keys_from_values=None) -> torch.Tensor:
    """`paged_attention`'s contract (see there), `keys_from_values` included, computed batch-invariantly."""
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start)
    kwargs = dict(scale=scale, causal=causal, window=window, max_query_len=max_query_len, out=out,
                  keys_from_values=keys_from_values)
    if _runs_triton(q):
        return paged_attention_invariant_triton(*args, **kwargs)
    return paged_attention_invariant_reference(*args, **kwargs)


def paged_attention_invariant_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start, *, scale, causal,
                                        window=None, max_query_len=None, out=None,
                                        keys_from_values=None) -> torch.Tensor:
    """Plain torch, one query row at a time over the keys it sees (softmax in float32, float64
    stays float64): the calls that compute a row depend on its position and its sequence's keys
    only. max_query_len is accepted for signature parity and not needed here."""
    compute_dtype = torch.promote_types(q.dtype, torch.float32)
    block_size, num_kv_heads, head_dim = v_cache.shape[1:]
    group = q.shape[1] // num_kv_heads
    out = torch.empty_like(q) if out is None else out
    bounds = query_start.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        begin, end = bounds[i], bounds[i + 1]
        for row in range(begin, end):
            position = seq_len - (end - row)
            first = max(0, position - window + 1) if window is not None else 0
            if causal:
                last = position + 1
            else:
                last = seq_len if window is None else min(seq_len, position + window)
            keys = torch.arange(first, last, device=q.device)
            pages = block_tables[i, keys // block_size].long()
            values = v_cache[pages, keys % block_size]  # [keys, kv_heads, d]
            k = (derive_keys(values, keys, keys_from_values) if keys_from_values is not None
                 else k_cache[pages, keys % block_size]).to(compute_dtype)
            v = values.to(compute_dtype)
            query = q[row].to(compute_dtype).view(num_kv_heads, group, head_dim)
            probs = (torch.einsum("hgd,khd->hgk", query, k) * scale).softmax(dim=-1)
            out[row] = torch.einsum("hgk,khd->hgd", probs, v).reshape(-1, head_dim).to(q.dtype)
    return out


def tile_shape(group: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_D) from the head shape alone: a query tile of 64 rows (16 queries of
    4 heads; the smallest tile of Hopper's warp-group MMA), or one whole GQA group."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    return max(64, triton.next_power_of_2(group)), 64 if block_d <= 128 else 32, block_d


def choose_num_splits(num_tiles: int, max_chunks: int, partial_bytes: int, device: torch.device) -> int:
    """Programs per query tile: 1 when the tiles alone fill half a wave or the partials would pass
    PARTIALS_BUDGET; otherwise enough to fill one wave, at most one per chunk, a power of two (the
    count is a compile-time constant: few variants). Any count gives the same bits."""
    slots = PROGRAMS_PER_SM * _num_sms(device)
    if max_chunks == 1 or 2 * num_tiles > slots or partial_bytes > PARTIALS_BUDGET:
        return 1
    splits = max(1, min(slots // num_tiles, max_chunks))
    return 1 << (splits.bit_length() - 1)


def paged_attention_invariant_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start, *, scale, causal,
                                     window=None, max_query_len=None, out=None, num_splits=None,
                                     keys_from_values=None) -> torch.Tensor:
    """The Triton path of `paged_attention_invariant`; num_splits None chooses from the shapes."""
    a = AttentionLaunch.check(q, k_cache, v_cache, seq_lens, query_start, window, max_query_len, out, keys_from_values)
    total_q, num_heads, head_dim, block_size, num_kv_heads, num_seqs, group = (
        a.total_q, a.num_heads, a.head_dim, a.block_size, a.num_kv_heads, a.num_seqs, a.group)
    k_cache, key_weight, cos, sin, out, max_query_len = a.k_cache, a.key_weight, a.cos, a.sin, a.out, a.max_query_len
    if total_q == 0 or max_query_len == 0:
        return out

    block_m, block_n, block_d = tile_shape(group, head_dim)
    num_q_tiles = triton.cdiv(max_query_len, block_m // group)
    max_chunks = triton.cdiv(block_tables.shape[1] * block_size, KEYS_PER_CHUNK)
    if num_splits is None:
        partial_bytes = 4 * max_chunks * total_q * num_heads * (head_dim + 2)
        num_splits = choose_num_splits(num_q_tiles * num_seqs * num_kv_heads, max_chunks, partial_bytes, q.device)
    if num_splits > 1:  # each chunk's max, sum and unnormalised output, folded by the merge kernel
        partial_out = torch.empty(max_chunks, total_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
        partial_max = torch.empty(max_chunks, total_q, num_heads, dtype=torch.float32, device=q.device)
        partial_sum = torch.empty_like(partial_max)
    else:  # the kernel folds its chunks itself and writes `out`
        partial_out = partial_max = partial_sum = out

    common = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, GROUP=group, BLOCK_M=block_m, CAUSAL=causal,
                  HAS_WINDOW=window is not None, KEYS_PER_CHUNK=KEYS_PER_CHUNK)
    _invariant_attention_kernel[(num_q_tiles, num_seqs, num_kv_heads * num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start, out, partial_out, partial_max, partial_sum,
        total_q * num_heads, num_heads, scale * math.log2(math.e), window or 0,
        q.stride(0), q.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        key_weight, cos, sin, cos.stride(0), sin.stride(0),
        **common, PAGE_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        KEYS_FROM_VALUES=keys_from_values is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3 if block_d <= 128 else 2,
    )
    if num_splits > 1:
        _fold_partials_kernel[(num_q_tiles, num_seqs, num_kv_heads)](
            seq_lens, query_start, out, partial_out, partial_max, partial_sum, total_q * num_heads, num_heads,
            window or 0, out.stride(0), out.stride(1), **common, num_warps=4,
        )
    return out


if triton is not None:

    @triton.jit
    def _query_tile(seq_lens_ptr, query_start_ptr, seq, tile, window, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, KEYS_PER_CHUNK: tl.constexpr):
        """A query tile's rows (query q_begin + query of head `head_in_group` of the kv head's group)
        and the chunks any of them sees; q_len 0 past the sequence's queries (nothing to do)."""
        q_begin, q_len, tile_first, query, head_in_group, row_valid, query_pos, key_begin, key_end = query_tile_keys(
            seq_lens_ptr, query_start_ptr, seq, tile, window, GROUP, BLOCK_M, CAUSAL, HAS_WINDOW)
        first_chunk = key_begin // KEYS_PER_CHUNK
        end_chunk = tl.cdiv(key_end, KEYS_PER_CHUNK)
        return q_begin, q_len, tile_first, query, head_in_group, row_valid, query_pos, key_begin, key_end, \
            first_chunk, end_chunk

    @triton.jit
    def _fold_chunk(m_run, l_run, acc_run, m_chunk, l_chunk, acc_chunk):
        """The running (max, sum, output) after one more chunk's partial, in log2 units; a chunk
        whose keys the row does not see (max -inf, sum 0, output 0) leaves it as it was."""
        m_new = tl.maximum(m_run, m_chunk)
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        old = tl.exp2(m_run - m_shift)
        new = tl.exp2(m_chunk - m_shift)
        return m_new, l_run * old + l_chunk * new, acc_run * old[:, None] + acc_chunk * new[:, None]

    @triton.jit
    def _store_normalised(out_ptr, token, head, dims, mask, l_run, acc_run, stride_out_token, stride_out_head):
        out = acc_run / tl.where(l_run > 0, l_run, 1.0)[:, None]
        offsets = token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :]
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit(do_not_specialize=["partial_rows_per_chunk", "stride_block_tables"])
    def _invariant_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr,
        out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr, partial_rows_per_chunk, num_heads,
        scale_log2, window,
        stride_q_token, stride_q_head, stride_block_tables, stride_out_token, stride_out_head,
        stride_k_block, stride_k_offset, stride_k_head, stride_v_block, stride_v_offset, stride_v_head,
        key_weight_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, KEYS_PER_CHUNK: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, KEYS_FROM_VALUES: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        """NUM_SPLITS 1: a query tile's chunks, each computed and folded in order, then its rows
        written. Otherwise program `split` computes chunks first + split, + 2 * split, ... of its tile
        and writes their partials, which `_fold_partials_kernel` folds in order."""
        tile = tl.program_id(0)
        seq = tl.program_id(1)
        kv_head = tl.program_id(2) // NUM_SPLITS
        split = tl.program_id(2) % NUM_SPLITS
        q_begin, q_len, tile_first, query, head_in_group, row_valid, query_pos, key_begin, key_end, first_chunk, \
            end_chunk = _query_tile(seq_lens_ptr, query_start_ptr, seq, tile, window, GROUP, BLOCK_M, CAUSAL,
                                    HAS_WINDOW, KEYS_PER_CHUNK)
        if tile_first >= q_len:
            return
        head = kv_head * GROUP + head_in_group
        token = q_begin + query
        dims = tl.arange(0, BLOCK_D)
        dim_valid = dims < HEAD_DIM
        mask = row_valid[:, None] & dim_valid[None, :]
        q_offsets = token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :]
        q_tile = tl.load(q_ptr + q_offsets, mask=mask, other=0.0)
        block_table_ptr = block_tables_ptr + seq * stride_block_tables

        m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_run = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for chunk in range(first_chunk + split, end_chunk, NUM_SPLITS):
            # Key tiles from the chunk's start (or the first tile the window reaches), so a key's
            # tile is fixed by its position, whatever the tile's other queries see; that tile's keys
            # before the window are not read (no row sees them).
            tiles_begin = tl.maximum(chunk * KEYS_PER_CHUNK, key_begin // BLOCK_N * BLOCK_N)
            chunk_begin = tl.maximum(chunk * KEYS_PER_CHUNK, key_begin)
            chunk_end = tl.minimum((chunk + 1) * KEYS_PER_CHUNK, key_end)
            m_chunk = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_chunk = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc_chunk = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
            m_chunk, l_chunk, acc_chunk = attend_key_range(
                q_tile, m_chunk, l_chunk, acc_chunk, tiles_begin, chunk_begin, chunk_end, query_pos, window,
                scale_log2, k_cache_ptr, v_cache_ptr, block_table_ptr, kv_head, dims, dim_valid,
                stride_k_block, stride_k_offset, stride_k_head, stride_v_block, stride_v_offset, stride_v_head,
                key_weight_ptr, cos_ptr, sin_ptr, stride_cos, stride_sin,
                HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, BLOCK_N=BLOCK_N, CAUSAL=CAUSAL, HAS_WINDOW=HAS_WINDOW,
                KEYS_FROM_VALUES=KEYS_FROM_VALUES, DOT_PRECISION=DOT_PRECISION,
            )
            if NUM_SPLITS == 1:
                m_run, l_run, acc_run = _fold_chunk(m_run, l_run, acc_run, m_chunk, l_chunk, acc_chunk)
            else:
                partial_row = chunk * partial_rows_per_chunk + token * num_heads + head
                tl.store(partial_out_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :], acc_chunk, mask=mask)
                tl.store(partial_max_ptr + partial_row, m_chunk, mask=row_valid)
                tl.store(partial_sum_ptr + partial_row, l_chunk, mask=row_valid)
        if NUM_SPLITS == 1:
            _store_normalised(out_ptr, token, head, dims, mask, l_run, acc_run, stride_out_token, stride_out_head)

    @triton.jit(do_not_specialize=["partial_rows_per_chunk"])
    def _fold_partials_kernel(
        seq_lens_ptr, query_start_ptr, out_ptr, partial_out_ptr, partial_max_ptr, partial_sum_ptr,
        partial_rows_per_chunk, num_heads, window, stride_out_token, stride_out_head,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, KEYS_PER_CHUNK: tl.constexpr,
    ):
        """The same query tile's chunks as `_invariant_attention_kernel` with one split folds, in the
        same order and by the same formula, from the partials the split programs wrote."""
        tile = tl.program_id(0)
        seq = tl.program_id(1)
        kv_head = tl.program_id(2)
        q_begin, q_len, tile_first, query, head_in_group, row_valid, query_pos, key_begin, key_end, first_chunk, \
            end_chunk = _query_tile(seq_lens_ptr, query_start_ptr, seq, tile, window, GROUP, BLOCK_M, CAUSAL,
                                    HAS_WINDOW, KEYS_PER_CHUNK)
        if tile_first >= q_len:
            return
        head = kv_head * GROUP + head_in_group
        token = q_begin + query
        dims = tl.arange(0, BLOCK_D)
        mask = row_valid[:, None] & (dims < HEAD_DIM)[None, :]
        m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_run = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc_run = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for chunk in range(first_chunk, end_chunk):
            partial_row = chunk * partial_rows_per_chunk + token * num_heads + head
            acc_chunk = tl.load(partial_out_ptr + partial_row[:, None] * HEAD_DIM + dims[None, :], mask=mask, other=0.0)
            m_chunk = tl.load(partial_max_ptr + partial_row, mask=row_valid, other=float("-inf"))
            l_chunk = tl.load(partial_sum_ptr + partial_row, mask=row_valid, other=0.0)
            m_run, l_run, acc_run = _fold_chunk(m_run, l_run, acc_run, m_chunk, l_chunk, acc_chunk)
        _store_normalised(out_ptr, token, head, dims, mask, l_run, acc_run, stride_out_token, stride_out_head)
