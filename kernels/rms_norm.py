"""RMSNorm in one kernel launch (Qwen3 / Llama semantics).

Eager torch spends ~7 launches on one RMSNorm (upcast, square, mean, add, rsqrt, multiply, cast,
scale); a Qwen3-8B forward has 144 of them (plus per-head q/k norms), and at batch 1 those tiny
launches, not bytes, dominate the step even inside a CUDA graph.

Semantics (the reference): y = weight * (x32 * rsqrt(mean(x32²) + eps)).to(x.dtype), where x32 is
x in float32 (float64 stays float64) — the product with the weight is taken in the input dtype.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference
    triton = None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton on CUDA (or under TRITON_INTERPRET=1, for the tests); the reference otherwise."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if triton is not None and (x.is_cuda or interpret) and x.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return rms_norm_triton(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.to(torch.promote_types(dtype, torch.float32))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), dim, eps, BLOCK=block, num_warps=min(max(block // 256, 1), 16)
        )
    return out.view(*x.shape[:-1], dim)


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_row_stride, dim, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
        x32 = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / dim + eps)
        normed = (x32 * inv).to(x.dtype)  # cast back first, as the reference does
        w = tl.load(w_ptr + cols, mask=mask)
        y = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * dim + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual): a decoder layer's residual add and the next norm in one
    launch. The sum is taken in the input dtype, as `residual + hidden_states` is in transformers."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if triton is not None and (x.is_cuda or interpret) and x.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_reference(x, residual, weight, eps)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    summed = residual + x
    return rms_norm_reference(summed, weight, eps), summed


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    dim = x.shape[-1]
    rows, res_rows = x.reshape(-1, dim), residual.reshape(-1, dim)
    assert rows.stride(-1) == 1 and res_rows.stride(-1) == 1 and rows.shape == res_rows.shape
    summed = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(rows.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        _add_rms_norm_kernel[(rows.shape[0],)](
            rows, res_rows, weight, out, summed, rows.stride(0), res_rows.stride(0), dim, eps, BLOCK=block,
            num_warps=min(max(block // 256, 1), 16),
        )
    return out.view(*x.shape[:-1], dim), summed.view(*x.shape[:-1], dim)


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, x_row_stride, res_row_stride, dim, eps,
                             BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
        res = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0)
        summed = (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)  # rounded as torch's add in x.dtype
        tl.store(sum_ptr + row * dim + cols, summed, mask=mask)
        s32 = summed.to(tl.float32)
        inv = tl.rsqrt(tl.sum(s32 * s32, axis=0) / dim + eps)
        normed = (s32 * inv).to(x.dtype)
        w = tl.load(w_ptr + cols, mask=mask)
        y = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + row * dim + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
