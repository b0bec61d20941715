"""RMSNorm in one kernel launch, in both conventions of the families we fuse.

Eager torch spends ~7 launches on one RMSNorm (upcast, square, mean, add, rsqrt, multiply, cast,
scale); a Qwen3-8B forward has 144 of them (plus per-head q/k norms), and at batch 1 those tiny
launches, not bytes, dominate the step even inside a CUDA graph.

Semantics (the reference), with x32 = x in float32 (float64 stays float64) and n = x32 * rsqrt(mean(x32²) + eps):
- Llama / Qwen: y = weight * n.to(x.dtype) — the product with the weight taken in the input dtype;
- `scale_in_float32` (Gemma-3/4): y = (n * weight.float()).to(x.dtype) — the product in float32, cast
  last. Gemma-3's `1 + w` is folded into a float32 weight at load, which is what transformers
  computes on every call.
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


def _use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA (or under TRITON_INTERPRET=1, for the tests); the reference otherwise."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return triton is not None and (x.is_cuda or interpret) and x.dtype in TRITON_DTYPES


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_in_float32: bool = False) -> torch.Tensor:
    if _use_triton(x):
        return rms_norm_triton(x, weight, eps, scale_in_float32=scale_in_float32)
    return rms_norm_reference(x, weight, eps, scale_in_float32=scale_in_float32)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *,
                       scale_in_float32: bool = False) -> torch.Tensor:
    """`weight=None` (only with `scale_in_float32`): the norm alone, as Gemma-4's value norm."""
    dtype = x.dtype
    x = x.to(torch.promote_types(dtype, torch.float32))
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if scale_in_float32:
        return (x if weight is None else x * weight.to(torch.promote_types(x.dtype, torch.float32))).to(dtype)
    return weight * x.to(dtype)


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, scale_in_float32: bool) -> torch.dtype:
    # Llama's `weight * normed` promotes; Gemma's `.type_as(x)` keeps the input dtype.
    return x.dtype if scale_in_float32 else torch.promote_types(weight.dtype, x.dtype)


def _num_warps(block: int) -> int:
    return min(max(block // 256, 1), 16)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, *, scale_in_float32: bool = False
                    ) -> torch.Tensor:
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    out = torch.empty(rows.shape, dtype=_out_dtype(x, weight, scale_in_float32), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), dim, eps, BLOCK=block, SCALE_IN_FLOAT32=scale_in_float32,
            num_warps=_num_warps(block),
        )
    return out.view(*x.shape[:-1], dim)


if triton is not None:

    @triton.jit
    def _scaled(normed32, w_ptr, cols, mask, dtype: tl.constexpr, SCALE_IN_FLOAT32: tl.constexpr):
        """normed32 (float32) times the weight, rounded as the reference rounds -> float32."""
        w = tl.load(w_ptr + cols, mask=mask).to(tl.float32)
        if SCALE_IN_FLOAT32:
            return (normed32 * w).to(dtype).to(tl.float32)
        return w * normed32.to(dtype).to(tl.float32)  # cast back first, as the reference does

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, x_row_stride, dim, eps, BLOCK: tl.constexpr,
                         SCALE_IN_FLOAT32: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
        x32 = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / dim + eps)
        y = _scaled(x32 * inv, w_ptr, cols, mask, x.dtype, SCALE_IN_FLOAT32)
        tl.store(out_ptr + row * dim + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 x_norm_weight: torch.Tensor | None = None, scale_in_float32: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual): a decoder layer's residual add and the next norm in one
    launch. The sum is taken in the input dtype, as `residual + hidden_states` is in transformers.

    `x_norm_weight` (Gemma's sandwich norms, with `scale_in_float32`): x is first normed with it —
    the post-attention / post-feedforward norm of a sublayer's output before its residual add."""
    if _use_triton(x):
        return add_rms_norm_triton(x, residual, weight, eps, x_norm_weight=x_norm_weight,
                                   scale_in_float32=scale_in_float32)
    return add_rms_norm_reference(x, residual, weight, eps, x_norm_weight=x_norm_weight,
                                  scale_in_float32=scale_in_float32)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                           x_norm_weight: torch.Tensor | None = None, scale_in_float32: bool = False
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    if x_norm_weight is not None:
        x = rms_norm_reference(x, x_norm_weight, eps, scale_in_float32=scale_in_float32)
    summed = residual + x
    return rms_norm_reference(summed, weight, eps, scale_in_float32=scale_in_float32), summed


def add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                        x_norm_weight: torch.Tensor | None = None, scale_in_float32: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    dim = x.shape[-1]
    rows, res_rows = x.reshape(-1, dim), residual.reshape(-1, dim)
    assert rows.stride(-1) == 1 and res_rows.stride(-1) == 1 and rows.shape == res_rows.shape
    assert x_norm_weight is None or scale_in_float32, "the sandwich norm is Gemma's (scale_in_float32)"
    summed = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(rows.shape, dtype=_out_dtype(x, weight, scale_in_float32), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        has_x_norm = x_norm_weight is not None
        _add_rms_norm_kernel[(rows.shape[0],)](
            rows, res_rows, x_norm_weight if has_x_norm else weight, weight, out, summed,
            rows.stride(0), res_rows.stride(0), dim, eps, BLOCK=block, HAS_X_NORM=has_x_norm,
            SCALE_IN_FLOAT32=scale_in_float32, num_warps=_num_warps(block),
        )
    return out.view(*x.shape[:-1], dim), summed.view(*x.shape[:-1], dim)


if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(x_ptr, res_ptr, x_w_ptr, w_ptr, out_ptr, sum_ptr, x_row_stride, res_row_stride, dim,
                             eps, BLOCK: tl.constexpr, HAS_X_NORM: tl.constexpr, SCALE_IN_FLOAT32: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
        dtype = x.dtype
        x32 = x.to(tl.float32)
        if HAS_X_NORM:
            x_inv = tl.rsqrt(tl.sum(x32 * x32, axis=0) / dim + eps)
            x32 = _scaled(x32 * x_inv, x_w_ptr, cols, mask, dtype, SCALE_IN_FLOAT32)
        res = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0)
        summed = (x32 + res.to(tl.float32)).to(dtype)  # rounded as torch's add in x.dtype
        tl.store(sum_ptr + row * dim + cols, summed, mask=mask)
        s32 = summed.to(tl.float32)
        inv = tl.rsqrt(tl.sum(s32 * s32, axis=0) / dim + eps)
        y = _scaled(s32 * inv, w_ptr, cols, mask, dtype, SCALE_IN_FLOAT32)
        tl.store(out_ptr + row * dim + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
