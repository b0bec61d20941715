"""The drafter's context KV injection (dflash-spec §1.4 step 3, §3.3), fused into one launch.

For every committed context row, every draft layer's key is k_norm (per-head RMSNorm) then RoPE at
the row's absolute position, and its value is v_proj unchanged; both go straight into that layer's
paged KV cache. The caller computes k_proj/v_proj of all layers in one stacked GEMM.

`inject_context_kv_reference` is the plain-torch definition (CPU path and test oracle), equal bit for
bit to the draft model's RMSNorm + apply_rotary; `inject_context_kv_triton` is the GPU kernel;
`inject_context_kv` picks between them.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference
    triton = None

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def inject_context_kv(kv, k_norm_weight, cos, sin, slot_mapping, k_cache, v_cache, *, eps) -> None:
    """Write keys RoPE(RMSNorm(k)) and values v of T context rows into every layer's paged cache.

    kv [T, L, 2, num_kv_heads, head_dim] (k_proj, v_proj of all L layers); k_norm_weight [L, head_dim];
    cos, sin [T, head_dim] (neox rotate-half); slot_mapping int64 [T] flat slots (block * block_size
    + offset); k_cache, v_cache [L, num_blocks, block_size, num_kv_heads, head_dim], written in place.
    """
    args = (kv, k_norm_weight, cos, sin, slot_mapping, k_cache, v_cache)
    if _runs_triton(kv):
        inject_context_kv_triton(*args, eps=eps)
    else:
        inject_context_kv_reference(*args, eps=eps)


def _runs_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA, or on CPU under its interpreter (TRITON_INTERPRET=1, used by the tests)."""
    if triton is None or x.dtype not in TRITON_DTYPES:
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def inject_context_kv_reference(kv, k_norm_weight, cos, sin, slot_mapping, k_cache, v_cache, *, eps) -> None:
    """Plain torch: the model's RMSNorm (normalise in >= float32, cast back, times the weight in the
    input dtype) and RoPE in the input dtype, then an indexed write per layer."""
    dtype = kv.dtype
    k, v = kv.unbind(dim=2)  # [T, L, num_kv_heads, head_dim] each
    k_wide = k.to(torch.promote_types(dtype, torch.float32))
    normed = k_wide * torch.rsqrt(k_wide.pow(2).mean(-1, keepdim=True) + eps)
    k = k_norm_weight.to(dtype)[None, :, None, :] * normed.to(dtype)
    cos = cos.to(dtype)[:, None, None, :]
    sin = sin.to(dtype)[:, None, None, :]
    k = k * cos + rotate_half(k) * sin
    block_size = k_cache.shape[2]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_cache[:, blocks, offsets] = k.transpose(0, 1)
    v_cache[:, blocks, offsets] = v.transpose(0, 1)


def inject_context_kv_triton(kv, k_norm_weight, cos, sin, slot_mapping, k_cache, v_cache, *, eps) -> None:
    """The Triton path of `inject_context_kv`: one program per (context row, layer), all kv heads at once."""
    num_rows, num_layers, _, num_kv_heads, head_dim = kv.shape
    block_size = k_cache.shape[2]
    assert head_dim % 2 == 0 and k_cache.shape == v_cache.shape and k_cache.shape[-2:] == (num_kv_heads, head_dim)
    assert kv.stride(-1) == k_cache.stride(-1) == v_cache.stride(-1) == cos.stride(-1) == sin.stride(-1) == 1
    assert k_norm_weight.stride(-1) == 1
    if num_rows == 0:
        return
    block_h = triton.next_power_of_2(num_kv_heads)
    block_half = triton.next_power_of_2(head_dim // 2)
    _inject_context_kv_kernel[(num_rows, num_layers)](
        kv, k_norm_weight, cos, sin, slot_mapping, k_cache, v_cache, eps,
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        k_norm_weight.stride(0), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.stride(3),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), v_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=block_size, BLOCK_H=block_h, BLOCK_HALF=block_half,
        num_warps=max(1, min(8, block_h * block_half // 128)),
    )


if triton is not None:

    @triton.jit
    def _rounded(x, dtype: tl.constexpr):
        """float32 x rounded to `dtype`, kept in float32: rounding after every step reproduces torch's
        elementwise ops in `dtype` (computed in float32, rounded per op), so the kernel matches the reference."""
        return x.to(dtype).to(tl.float32)

    @triton.jit
    def _inject_context_kv_kernel(
        kv_ptr, k_norm_weight_ptr, cos_ptr, sin_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, eps,
        stride_kv_row, stride_kv_layer, stride_kv_kind, stride_kv_head,
        stride_weight_layer, stride_cos_row, stride_sin_row,
        stride_k_layer, stride_k_block, stride_k_offset, stride_k_head,
        stride_v_layer, stride_v_block, stride_v_offset, stride_v_head,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        HALF: tl.constexpr = HEAD_DIM // 2
        # int64: layer * stride_k_layer passes 2**31 in a real pool (a Qwen3-8B drafter's 5 layers
        # of 33k+ blocks on an H200), and an int32 product wraps to an address outside it.
        row = tl.program_id(0).to(tl.int64)
        layer = tl.program_id(1).to(tl.int64)
        dtype = kv_ptr.dtype.element_ty
        heads = tl.arange(0, BLOCK_H)[:, None]
        dims = tl.arange(0, BLOCK_HALF)[None, :]
        dim_mask = dims < HALF
        mask = (heads < NUM_KV_HEADS) & dim_mask

        # Rotate-half pairs dimension d with d + HALF, so each head is handled as its two halves.
        k_src = kv_ptr + row * stride_kv_row + layer * stride_kv_layer + heads * stride_kv_head + dims
        k_first = tl.load(k_src, mask=mask, other=0.0).to(tl.float32)
        k_second = tl.load(k_src + HALF, mask=mask, other=0.0).to(tl.float32)
        mean_square = (tl.sum(k_first * k_first, 1) + tl.sum(k_second * k_second, 1)) / HEAD_DIM
        inv_rms = tl.math.rsqrt(mean_square + eps)[:, None]
        weight = k_norm_weight_ptr + layer * stride_weight_layer + dims
        weight_first = _rounded(tl.load(weight, mask=dim_mask).to(tl.float32), dtype)
        weight_second = _rounded(tl.load(weight + HALF, mask=dim_mask).to(tl.float32), dtype)
        k_first = _rounded(weight_first * _rounded(k_first * inv_rms, dtype), dtype)
        k_second = _rounded(weight_second * _rounded(k_second * inv_rms, dtype), dtype)

        cos = cos_ptr + row * stride_cos_row + dims
        sin = sin_ptr + row * stride_sin_row + dims
        cos_first = _rounded(tl.load(cos, mask=dim_mask).to(tl.float32), dtype)
        cos_second = _rounded(tl.load(cos + HALF, mask=dim_mask).to(tl.float32), dtype)
        sin_first = _rounded(tl.load(sin, mask=dim_mask).to(tl.float32), dtype)
        sin_second = _rounded(tl.load(sin + HALF, mask=dim_mask).to(tl.float32), dtype)
        rotated_first = _rounded(k_first * cos_first, dtype) - _rounded(k_second * sin_first, dtype)
        rotated_second = _rounded(k_second * cos_second, dtype) + _rounded(k_first * sin_second, dtype)

        slot = tl.load(slot_mapping_ptr + row)
        block = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        k_dst = (k_cache_ptr + layer * stride_k_layer + block * stride_k_block + offset * stride_k_offset
                 + heads * stride_k_head + dims)
        tl.store(k_dst, rotated_first.to(dtype), mask=mask)
        tl.store(k_dst + HALF, rotated_second.to(dtype), mask=mask)

        v_src = kv_ptr + row * stride_kv_row + layer * stride_kv_layer + stride_kv_kind + heads * stride_kv_head + dims
        v_dst = (v_cache_ptr + layer * stride_v_layer + block * stride_v_block + offset * stride_v_offset
                 + heads * stride_v_head + dims)
        tl.store(v_dst, tl.load(v_src, mask=mask), mask=mask)
        tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=mask), mask=mask)
