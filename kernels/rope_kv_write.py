"""A target layer's attention input in one launch: split the merged QKV projection, apply the
per-head q/k RMSNorm (Qwen3) and RoPE, and write the new keys and values into the paged cache.

transformers spends ~20 launches on this per layer (views, two norms, rotate-half, cos/sin casts,
two indexed cache writes); at batch 1 each is a few microseconds of a ~0.2 ms layer.

Semantics (the reference): torch's elementwise ops in the input dtype, as transformers computes them
(`weight * normed.to(dtype)`, then `q * cos + rotate_half(q) * sin` with cos/sin in that dtype); the
Triton kernel rounds after every step the same way, so the two agree to the last bit but for
float rounding order within the norm's sum.
"""

from __future__ import annotations

import os

import torch

from kernels.rms_norm import rms_norm_reference

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference
    triton = None

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def rope_kv_write(qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, *, num_heads, num_kv_heads,
                  q_norm_weight=None, k_norm_weight=None, eps=0.0) -> torch.Tensor:
    """qkv [T, (H + 2·KV)·D] (q heads, then k, then v) -> the rotated queries [T, H, D]; the rotated
    keys and the values go to flat slots `slot_mapping` [T] of one layer's k_cache / v_cache
    [num_blocks, block_size, KV, D]. cos, sin: [max_positions, D/2] in qkv's dtype (a rotate-half
    table's two halves are equal, so only one is kept). q/k norm weights [D], or None (Llama, Qwen2)."""
    args = (qkv, positions, cos, sin, slot_mapping, k_cache, v_cache)
    kwargs = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, q_norm_weight=q_norm_weight,
                  k_norm_weight=k_norm_weight, eps=eps)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if triton is not None and qkv.dtype in TRITON_DTYPES and (qkv.is_cuda or interpret):
        return rope_kv_write_triton(*args, **kwargs)
    return rope_kv_write_reference(*args, **kwargs)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def rope_kv_write_reference(qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, *, num_heads, num_kv_heads,
                            q_norm_weight=None, k_norm_weight=None, eps=0.0) -> torch.Tensor:
    head_dim = k_cache.shape[-1]
    heads = qkv.view(qkv.shape[0], num_heads + 2 * num_kv_heads, head_dim)
    q, k, v = heads.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    if q_norm_weight is not None:
        q = rms_norm_reference(q, q_norm_weight, eps)
    if k_norm_weight is not None:
        k = rms_norm_reference(k, k_norm_weight, eps)
    c = cos[positions].to(q.dtype)
    s = sin[positions].to(q.dtype)
    c, s = torch.cat([c, c], dim=-1)[:, None], torch.cat([s, s], dim=-1)[:, None]
    q = q * c + _rotate_half(q) * s
    k = k * c + _rotate_half(k) * s
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
    return q.contiguous()


def rope_kv_write_triton(qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, *, num_heads, num_kv_heads,
                         q_norm_weight=None, k_norm_weight=None, eps=0.0) -> torch.Tensor:
    """One program per (token, head) of q, k and v."""
    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert head_dim % 2 == 0 and k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and cos.dtype == sin.dtype == qkv.dtype
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    has_q_norm, has_k_norm = q_norm_weight is not None, k_norm_weight is not None
    _rope_kv_write_kernel[(num_tokens, num_heads + 2 * num_kv_heads)](
        qkv, positions, cos, sin, slot_mapping, k_cache, v_cache, q,
        q_norm_weight if has_q_norm else qkv, k_norm_weight if has_k_norm else qkv, eps,
        qkv.stride(0), cos.stride(0), sin.stride(0),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        PAGE_SIZE=k_cache.shape[1], BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        HAS_Q_NORM=has_q_norm, HAS_K_NORM=has_k_norm, num_warps=1,
    )
    return q


if triton is not None:

    @triton.jit
    def _rounded(x, dtype: tl.constexpr):
        """float32 x rounded to `dtype`, kept in float32 (torch rounds after each op in `dtype`)."""
        return x.to(dtype).to(tl.float32)

    @triton.jit
    def _head_rms_norm(first, second, weight_ptr, dims, mask, eps, dtype: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HALF: tl.constexpr):
        """One head's RMSNorm, given as its two halves (float32, rounded as the reference rounds)."""
        inv_rms = tl.math.rsqrt((tl.sum(first * first, 0) + tl.sum(second * second, 0)) / HEAD_DIM + eps)
        w_first = tl.load(weight_ptr + dims, mask=mask, other=0.0).to(tl.float32)
        w_second = tl.load(weight_ptr + HALF + dims, mask=mask, other=0.0).to(tl.float32)
        return (_rounded(w_first * _rounded(first * inv_rms, dtype), dtype),
                _rounded(w_second * _rounded(second * inv_rms, dtype), dtype))

    @triton.jit
    def _rope_kv_write_kernel(
        qkv_ptr, positions_ptr, cos_ptr, sin_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, q_out_ptr,
        q_norm_ptr, k_norm_ptr, eps,
        stride_qkv_token, stride_cos, stride_sin,
        NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_HALF: tl.constexpr, HAS_Q_NORM: tl.constexpr, HAS_K_NORM: tl.constexpr,
    ):
        HALF: tl.constexpr = HEAD_DIM // 2
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        dtype = qkv_ptr.dtype.element_ty
        dims = tl.arange(0, BLOCK_HALF)
        mask = dims < HALF
        src = qkv_ptr + token * stride_qkv_token + head * HEAD_DIM + dims
        slot = tl.load(slot_mapping_ptr + token)
        # The cache of one layer is [num_blocks, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM], contiguous: a
        # flat slot (block * PAGE_SIZE + offset) addresses a row of NUM_KV_HEADS heads.
        if head >= NUM_HEADS + NUM_KV_HEADS:  # a value head: copied as it is
            dst = v_cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + (head - NUM_HEADS - NUM_KV_HEADS) * HEAD_DIM + dims
            tl.store(dst, tl.load(src, mask=mask), mask=mask)
            tl.store(dst + HALF, tl.load(src + HALF, mask=mask), mask=mask)
        else:
            first = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            second = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
            is_q = head < NUM_HEADS
            if is_q:
                if HAS_Q_NORM:
                    first, second = _head_rms_norm(first, second, q_norm_ptr, dims, mask, eps, dtype, HEAD_DIM, HALF)
            else:
                if HAS_K_NORM:
                    first, second = _head_rms_norm(first, second, k_norm_ptr, dims, mask, eps, dtype, HEAD_DIM, HALF)
            position = tl.load(positions_ptr + token)
            cos = tl.load(cos_ptr + position * stride_cos + dims, mask=mask, other=0.0).to(tl.float32)
            sin = tl.load(sin_ptr + position * stride_sin + dims, mask=mask, other=0.0).to(tl.float32)
            rotated_first = _rounded(first * cos, dtype) - _rounded(second * sin, dtype)
            rotated_second = _rounded(second * cos, dtype) + _rounded(first * sin, dtype)
            if is_q:
                dst = q_out_ptr + token * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + dims
            else:
                dst = k_cache_ptr + slot * (NUM_KV_HEADS * HEAD_DIM) + (head - NUM_HEADS) * HEAD_DIM + dims
            tl.store(dst, rotated_first.to(dtype), mask=mask)
            tl.store(dst + HALF, rotated_second.to(dtype), mask=mask)
