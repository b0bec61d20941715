"""SiLU(gate) · up of a merged gate-up projection, in one launch.

A Llama/Qwen MLP computes down(silu(gate(x)) * up(x)); with gate and up merged into one GEMM the
activation is one elementwise pass over its [T, 2I] output instead of three torch kernels.

Semantics (the reference): silu(gate) rounded to the input dtype, times up, rounded again — what
`act_fn(gate_proj(x)) * up_proj(x)` computes in that dtype.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference
    triton = None

BLOCK_COLS = 1024


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> [..., I]. Triton on CUDA (or under TRITON_INTERPRET=1)."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    if triton is not None and (gate_up.is_cuda or interpret) and gate_up.dtype in (
            torch.float16, torch.bfloat16, torch.float32):
        return silu_mul_triton(gate_up)
    return silu_mul_reference(gate_up)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    assert rows.stride(-1) == 1
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(width, BLOCK_COLS))](
            rows, out, rows.stride(0), width, BLOCK=BLOCK_COLS, num_warps=4,
        )
    return out.view(*gate_up.shape[:-1], width)


if triton is not None:

    @triton.jit
    def _silu_mul_kernel(x_ptr, out_ptr, x_row_stride, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_row_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu, rounded to the dtype
        tl.store(out_ptr + row * width + cols, (act * up).to(dtype), mask=mask)
