"""act(gate) · up of a merged gate-up projection, in one launch: SiLU (Llama, Qwen) or GELU with
the tanh approximation (Gemma's `gelu_pytorch_tanh`).

A gated MLP computes down(act(gate(x)) * up(x)); with gate and up merged into one GEMM the
activation is one elementwise pass over its [T, 2I] output instead of three torch kernels.

Semantics (the reference): act(gate) rounded to the input dtype, times up, rounded again — what
`act_fn(gate_proj(x)) * up_proj(x)` computes in that dtype.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference
    triton = None

BLOCK_COLS = 1024
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _use_triton(x: torch.Tensor) -> bool:
    """Triton on CUDA (or under TRITON_INTERPRET=1, for the tests); the reference otherwise."""
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return triton is not None and (x.is_cuda or interpret) and x.dtype in TRITON_DTYPES


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> silu(gate) * up [..., I]."""
    return _act_mul_triton(gate_up, gelu_tanh=False) if _use_triton(gate_up) else silu_mul_reference(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (gate first) -> gelu_tanh(gate) * up [..., I]."""
    return _act_mul_triton(gate_up, gelu_tanh=True) if _use_triton(gate_up) else gelu_tanh_mul_reference(gate_up)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    # contiguous: on a strided view torch's CPU GELU takes a scalar path an ulp off the vectorized
    # one that transformers' (contiguous) gate_proj output takes.
    return F.gelu(gate.contiguous(), approximate="tanh") * up


def silu_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    return _act_mul_triton(gate_up, gelu_tanh=False)


def gelu_tanh_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    return _act_mul_triton(gate_up, gelu_tanh=True)


def _act_mul_triton(gate_up: torch.Tensor, *, gelu_tanh: bool) -> torch.Tensor:
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    assert rows.stride(-1) == 1
    out = torch.empty(rows.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        _act_mul_kernel[(rows.shape[0], triton.cdiv(width, BLOCK_COLS))](
            rows, out, rows.stride(0), width, BLOCK=BLOCK_COLS, GELU_TANH=gelu_tanh, num_warps=4,
        )
    return out.view(*gate_up.shape[:-1], width)


# gelu_tanh(x) = x/2 · (1 + tanh(c·(x + 0.044715·x³))) = x · sigmoid(2c·(x + 0.044715·x³)), c = sqrt(2/π):
# the sigmoid form needs no tanh and has no cancellation near 0.

if triton is not None:
    # A global a kernel reads must be a constexpr (the interpreter does not check it; the compiler does).
    TWO_SQRT_2_OVER_PI = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi))

    @triton.jit
    def _act_mul_kernel(x_ptr, out_ptr, x_row_stride, width, BLOCK: tl.constexpr, GELU_TANH: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < width
        gate = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * x_row_stride + width + cols, mask=mask, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        act = gate_activation(gate, GELU_TANH).to(dtype).to(tl.float32)  # rounded to the dtype, as torch's is
        tl.store(out_ptr + row * width + cols, (act * up).to(dtype), mask=mask)

    @triton.jit
    def gate_activation(gate, GELU_TANH: tl.constexpr):
        """SiLU or GELU-tanh of a float32 gate, in float32 (also the MoE experts' kernel's)."""
        exponent = gate
        if GELU_TANH:
            exponent = TWO_SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        return gate / (1.0 + tl.exp(-exponent))
