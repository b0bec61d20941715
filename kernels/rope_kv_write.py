"""A target layer's attention input in one launch: split the merged QKV projection, apply the
per-head q/k RMSNorm (Qwen3, Gemma-3/4; Gemma-4's weightless value norm) and RoPE, and write the new keys and values into the paged cache.

transformers spends ~20 launches on this per layer (views, two norms, rotate-half, cos/sin casts,
two indexed cache writes); at batch 1 each is a few microseconds of a ~0.2 ms layer.

Semantics (the reference): torch's elementwise ops in the input dtype, as transformers computes them
(`weight * normed.to(dtype)`, or Gemma's `(normed * weight.float()).to(dtype)` with `scale_in_float32`,
then `q * cos + rotate_half(q) * sin` with cos/sin in that dtype); the
Triton kernel rounds after every step the same way, so the two agree to the last bit but for
float rounding order within the norm's sum.
"""

from __future__ import annotations

import os

import torch

from dflash_serve.kernels.rms_norm import rms_norm_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference
    triton = None

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rope_kv_write(qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, *, num_heads, num_kv_heads,
                  q_norm_weight=None, k_norm_weight=None, eps=0.0, scale_in_float32=False,
                  v_norm=False, values_from_keys=False, batch_invariant=False) -> torch.Tensor:
    """qkv [T, (H + 2·KV)·D] (q heads, then k, then v) -> the rotated queries [T, H, D]; the rotated
    keys and the values go to flat slots `slot_mapping` [T] of one layer's k_cache / v_cache
    [num_blocks, block_size, KV, D]. cos, sin: [max_positions, D/2] in qkv's dtype (a rotate-half
    table's two halves are equal, so only one is kept). q/k norm weights [D], or None (Llama, Qwen2);
    `scale_in_float32`: Gemma's norm (see dflash_serve.kernels.rms_norm); `v_norm`: values RMS-normed without a
    weight (Gemma-4).

    `values_from_keys` (Gemma-4's `attention_k_eq_v`): qkv is [T, (H + KV)·D] and the values are
    the key projection's raw heads (normed as values, not rotated); with k_cache None only they are
    written (the attention derives each key from its value: `paged_attention(keys_from_values=…)`).
    k_cache and v_cache None: qkv holds queries only (a layer reading an earlier layer's K/V) and
    nothing is written. `batch_invariant` (`engine.deterministic`): a token's outputs have the same
    bits whatever the number of tokens (the q/k norms' sums are laid out alike in every call)."""
    args = (qkv, positions, cos, sin, slot_mapping, k_cache, v_cache)
    kwargs = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, q_norm_weight=q_norm_weight,
                  k_norm_weight=k_norm_weight, eps=eps, scale_in_float32=scale_in_float32, v_norm=v_norm,
                  values_from_keys=values_from_keys)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if triton is not None and qkv.dtype in TRITON_DTYPES and (qkv.is_cuda or interpret):
        return rope_kv_write_triton(*args, **kwargs, batch_invariant=batch_invariant)
    return rope_kv_write_reference(*args, **kwargs)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _kv_head_sets(v_cache, values_from_keys: bool) -> int:
    """How many sets of KV heads follow the query heads in qkv: k and v, k alone, or none."""
    return 0 if v_cache is None else 1 if values_from_keys else 2


def rope_kv_write_reference(qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, *, num_heads, num_kv_heads,
                            q_norm_weight=None, k_norm_weight=None, eps=0.0, scale_in_float32=False,
                            v_norm=False, values_from_keys=False) -> torch.Tensor:
    head_dim = qkv.shape[1] // (num_heads + _kv_head_sets(v_cache, values_from_keys) * num_kv_heads)
    heads = qkv.view(qkv.shape[0], -1, head_dim)
    q = heads[:, :num_heads]
    if q_norm_weight is not None:
        q = rms_norm_reference(q, q_norm_weight, eps, scale_in_float32=scale_in_float32)
    c = cos[positions].to(q.dtype)
    s = sin[positions].to(q.dtype)
    c, s = torch.cat([c, c], dim=-1)[:, None], torch.cat([s, s], dim=-1)[:, None]
    q = q * c + _rotate_half(q) * s
    if v_cache is None:
        return q.contiguous()
    k = heads[:, num_heads:num_heads + num_kv_heads]
    v = k if values_from_keys else heads[:, num_heads + num_kv_heads:]
    if v_norm:
        v = rms_norm_reference(v, None, eps, scale_in_float32=True)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    if k_cache is not None:
        if k_norm_weight is not None:
            k = rms_norm_reference(k, k_norm_weight, eps, scale_in_float32=scale_in_float32)
        k = k * c + _rotate_half(k) * s
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    return q.contiguous()


# Heads of one token a program handles. At 512 tokens (a batch-32 verify) one program per (token,
# head) was 24,576 single-warp programs of 256 bytes each: 16.6 µs at Qwen3-8B shapes, 5.3 with tiles
# of 16 heads (2.3 -> 2.1 at 16 tokens). A lone decode token is the exception: its 48 one-head
# programs take 1.7 µs, one 16-head tile 2.0 (H100, BENCHMARKS).
HEADS_PER_PROGRAM = 16
FEW_TOKENS = 8  # below this, a program per head


def rope_kv_write_triton(qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, *, num_heads, num_kv_heads,
                         q_norm_weight=None, k_norm_weight=None, eps=0.0, scale_in_float32=False,
                         v_norm=False, values_from_keys=False, batch_invariant=False) -> torch.Tensor:
    """One program per (token, tile of HEADS_PER_PROGRAM heads) over the q, then k, then v heads
    (the v heads read the k heads' rows when `values_from_keys`); below FEW_TOKENS a program per
    head, unless `batch_invariant`: the tile's shape and warps set the order of a norm's sum, and
    a token normed in another order is off by a bit now and then (q at 1 of 80 Qwen3-8B tokens)."""
    num_tokens = qkv.shape[0]
    if v_cache is None:  # queries only: no KV head is a row of the grid, the cache pointers are never stored to
        num_kv_heads = 0
    head_dim = qkv.shape[1] // (num_heads + _kv_head_sets(v_cache, values_from_keys) * num_kv_heads)
    assert qkv.shape[1] == (num_heads + _kv_head_sets(v_cache, values_from_keys) * num_kv_heads) * head_dim
    assert qkv.stride(1) == 1 and head_dim % 2 == 0
    assert k_cache is not None or v_cache is None or values_from_keys, "values alone are written only from keys"
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    write_keys = k_cache is not None
    if v_cache is None:
        v_cache = q
    if k_cache is None:
        k_cache = v_cache
    assert k_cache.shape[-1] == head_dim and k_cache.shape == v_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.dtype == sin.dtype == qkv.dtype
    if num_tokens == 0:
        return q
    has_q_norm, has_k_norm = q_norm_weight is not None, k_norm_weight is not None
    total_heads = num_heads + 2 * num_kv_heads
    block_heads = 1 if num_tokens < FEW_TOKENS and not batch_invariant else min(HEADS_PER_PROGRAM, triton.next_power_of_2(total_heads))
    block_half = triton.next_power_of_2(head_dim // 2)
    _rope_kv_write_kernel[(num_tokens, triton.cdiv(total_heads, block_heads))](
        qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, q,
        q_norm_weight if has_q_norm else qkv, k_norm_weight if has_k_norm else qkv, eps,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, HAS_Q_NORM=has_q_norm, HAS_K_NORM=has_k_norm,
        HAS_V_NORM=v_norm, SCALE_IN_FLOAT32=scale_in_float32, VALUES_FROM_KEYS=values_from_keys, WRITE_KEYS=write_keys,
        num_warps=max(1, min(4, block_heads * block_half // 256)),
    )
    return q


if triton is not None:

    @triton.jit
    def _rounded(x, dtype: tl.constexpr):
        """float32 x rounded to `dtype`, kept in float32 (torch rounds after each op in `dtype`)."""
        return x.to(dtype).to(tl.float32)

    @triton.jit
    def _head_norm(first, second, inv_rms, rows, w_ptr, dims, dim_mask, HALF: tl.constexpr, dtype: tl.constexpr,
                   SCALE_IN_FLOAT32: tl.constexpr):
        """RMS-normed `rows` of both halves times the weight, rounded as the reference rounds."""
        w_first = tl.load(w_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
        w_second = tl.load(w_ptr + HALF + dims, mask=dim_mask, other=0.0).to(tl.float32)[None, :]
        if SCALE_IN_FLOAT32:
            normed_first = _rounded(w_first * (first * inv_rms), dtype)
            normed_second = _rounded(w_second * (second * inv_rms), dtype)
        else:
            normed_first = _rounded(w_first * _rounded(first * inv_rms, dtype), dtype)
            normed_second = _rounded(w_second * _rounded(second * inv_rms, dtype), dtype)
        return tl.where(rows, normed_first, first), tl.where(rows, normed_second, second)

    @triton.jit
    def _rope_kv_write_kernel(
        qkv_ptr, positions_ptr, cos_ptr, sin_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, q_out_ptr,
        q_norm_ptr, k_norm_ptr, eps,
        stride_qkv_token, stride_cos, stride_sin,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
        HAS_V_NORM: tl.constexpr, SCALE_IN_FLOAT32: tl.constexpr, VALUES_FROM_KEYS: tl.constexpr,
        WRITE_KEYS: tl.constexpr,
    ):
        HALF: tl.constexpr = HEAD_DIM // 2
        token = tl.program_id(0).to(tl.int64)
        dtype = qkv_ptr.dtype.element_ty
        # Rows are heads of the merged projection: q heads, then k heads, then v heads.
        head = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
        is_q = head < NUM_HEADS
        is_k = (head >= NUM_HEADS) & (head < NUM_HEADS + NUM_KV_HEADS)
        is_v = (head >= NUM_HEADS + NUM_KV_HEADS) & (head < NUM_HEADS + 2 * NUM_KV_HEADS)
        dims = tl.arange(0, BLOCK_HALF)
        mask = (is_q | is_k | is_v)[:, None] & (dims < HALF)[None, :]
        # With VALUES_FROM_KEYS the projection has no value heads: the v rows read the k heads.
        src_head = tl.where(is_v, head - NUM_KV_HEADS, head) if VALUES_FROM_KEYS else head
        src = qkv_ptr + token * stride_qkv_token + src_head[:, None] * HEAD_DIM + dims[None, :]
        first = tl.load(src, mask=mask, other=0.0).to(tl.float32)
        second = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)

        # Per-head RMSNorm (Qwen3's, Gemma's q_norm / k_norm; Gemma-4's v_norm), rounded as the reference rounds.
        if HAS_Q_NORM or HAS_K_NORM or HAS_V_NORM:
            inv_rms = tl.math.rsqrt((tl.sum(first * first, 1) + tl.sum(second * second, 1)) / HEAD_DIM + eps)[:, None]
            dim_mask = dims < HALF
            if HAS_Q_NORM:
                first, second = _head_norm(first, second, inv_rms, is_q[:, None], q_norm_ptr, dims, dim_mask, HALF,
                                           dtype, SCALE_IN_FLOAT32)
            if HAS_K_NORM:
                first, second = _head_norm(first, second, inv_rms, is_k[:, None], k_norm_ptr, dims, dim_mask, HALF,
                                           dtype, SCALE_IN_FLOAT32)
            if HAS_V_NORM:
                normed_v = is_v[:, None]
                first = tl.where(normed_v, _rounded(first * inv_rms, dtype), first)
                second = tl.where(normed_v, _rounded(second * inv_rms, dtype), second)

        # RoPE on q and k heads (rotate-half); value heads pass through unchanged.
        position = tl.load(positions_ptr + token)
        cos = tl.load(cos_ptr + position * stride_cos + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        sin = tl.load(sin_ptr + position * stride_sin + dims, mask=dims < HALF, other=0.0).to(tl.float32)[None, :]
        rotate = (is_q | is_k)[:, None]
        out_first = tl.where(rotate, _rounded(first * cos, dtype) - _rounded(second * sin, dtype), first).to(dtype)
        out_second = tl.where(rotate, _rounded(second * cos, dtype) + _rounded(first * sin, dtype), second).to(dtype)

        # The cache of one layer is [num_blocks, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM], contiguous: a
        # flat slot (block * PAGE_SIZE + offset) addresses a row of NUM_KV_HEADS heads. Each row
        # goes to exactly one of the three outputs; the others' offsets are clamped and masked.
        slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
        q_dst = q_out_ptr + token * (NUM_HEADS * HEAD_DIM) + tl.where(is_q, head, 0)[:, None] * HEAD_DIM + dims[None, :]
        kv_row = slot * (NUM_KV_HEADS * HEAD_DIM)
        k_dst = k_cache_ptr + kv_row + tl.where(is_k, head - NUM_HEADS, 0)[:, None] * HEAD_DIM + dims[None, :]
        v_dst = v_cache_ptr + kv_row + tl.where(is_v, head - NUM_HEADS - NUM_KV_HEADS, 0)[:, None] * HEAD_DIM + dims[None, :]
        q_mask, k_mask, v_mask = mask & is_q[:, None], mask & is_k[:, None], mask & is_v[:, None]
        tl.store(q_dst, out_first, mask=q_mask)
        tl.store(q_dst + HALF, out_second, mask=q_mask)
        if WRITE_KEYS:  # not where the attention derives the keys from the values
            tl.store(k_dst, out_first, mask=k_mask)
            tl.store(k_dst + HALF, out_second, mask=k_mask)
        tl.store(v_dst, out_first, mask=v_mask)
        tl.store(v_dst + HALF, out_second, mask=v_mask)
