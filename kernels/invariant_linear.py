"""y = x @ weight.T (+ bias) whose every row has the same bits whatever the number of rows beside it.

The batch-invariant GEMM of `engine.deterministic`. cuBLAS (and `SkinnyLinear`, which hands more
than 16 rows to it) picks tiles, instructions and split-K by the row count M, so a token's logits
differ in their last bits between a decode of 1 sequence, a verify of 16 tokens and a batch of 32,
and greedy decoding flips at a near-tie. Here the kernel and its launch settings depend on the
weight's shape and the dtype only: M changes the number of programs, never what one computes.
Each output element is one program's chain of tensor-core dots over K, BLOCK_K at a time from
k = 0, accumulated in float32 in place (`tl.dot(x, w, acc)`), with no split-K; a row's products
do not mix with other rows', and rows past M are masked loads of zeros.

`invariant_linear_reference` is the CPU path and the test oracle: each row through its own
F.linear of one row, so a row's result cannot depend on the others either (a CPU BLAS also picks
kernels by M). `InvariantLinear` holds a weight, its bias and launch settings, as `SkinnyLinear`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference
    triton = None

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Layers at least this wide (a merged gate-up, an LM head) take tiles of 128 weight rows; narrower
# ones 64, so that a decode's few rows still spread over enough programs to stream the weight.
WIDE_N = 16384


@dataclass(frozen=True)
class InvariantSettings:
    """Launch settings: chosen from the weight's shape alone, never from the number of rows.
    Not yet tuned on a GPU (the mode's cost is still to be measured)."""

    block_m: int = 64  # the smallest tile that takes Hopper's warp-group MMA, for every M
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8  # row tiles visited together, so a weight tile is read from L2 by all of them
    num_warps: int = 4
    num_stages: int = 3

    @classmethod
    def for_shape(cls, n: int, k: int) -> InvariantSettings:
        return cls(block_n=128 if n >= WIDE_N else 64)


class InvariantLinear:
    """A linear layer (weight [N, K], optional bias) computed by `invariant_linear_triton` on CUDA
    (or under TRITON_INTERPRET=1) and by `invariant_linear_reference` otherwise. `weight` and
    `bias` are kept as given (views of the HF modules' parameters stay shared)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 settings: InvariantSettings | None = None):
        self.weight, self.bias = weight, bias
        self.settings = settings or InvariantSettings.for_shape(*weight.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if _runs_triton(x):
            return invariant_linear_triton(x, self.weight, self.bias, self.settings)
        return invariant_linear_reference(x, self.weight, self.bias)


def _runs_triton(x: torch.Tensor) -> bool:
    if triton is None or x.dtype not in TRITON_DTYPES:
        return False
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def invariant_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                               ) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = rows.new_empty(rows.shape[0], weight.shape[0])
    for i in range(rows.shape[0]):
        # A fresh copy: every row reaches the BLAS at the same alignment, which its vectorized
        # loops may depend on, not at whatever offset it has inside the batch.
        out[i] = F.linear(rows[i : i + 1].clone(), weight, bias)[0]
    return out.view(*x.shape[:-1], weight.shape[0])


def invariant_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            settings: InvariantSettings) -> torch.Tensor:
    k = x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    assert weight.shape[1] == k and weight.stride(1) == 1
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, settings.block_m) * triton.cdiv(n, settings.block_n),)
        _invariant_linear_kernel[grid](
            rows, weight, out if bias is None else bias, out, m, n, k, rows.stride(0), weight.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=settings.block_m, BLOCK_N=settings.block_n,
            BLOCK_K=settings.block_k, GROUP_M=settings.group_m,
            # float32 stays float32 (no TF32 rounding of the products), as in paged attention.
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=settings.num_warps, num_stages=settings.num_stages,
        )
    return out.view(*x.shape[:-1], n)


if triton is not None:

    # M changes with every batch: not specialized on, so a new row count reuses the compiled kernel.
    @triton.jit(do_not_specialize=["M", "stride_xm"])
    def _invariant_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
        # Program -> (row tile, column tile), GROUP_M row tiles per column tile in turn.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(N, BLOCK_N)
        per_group = GROUP_M * tiles_n
        first_m = (pid // per_group) * GROUP_M
        group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
        tile_m = first_m + (pid % per_group) % group_rows
        tile_n = (pid % per_group) // group_rows

        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_offsets = rows.to(tl.int64)[:, None] * stride_xm
        col_offsets = cols.to(tl.int64)[None, :] * stride_wn  # an LM head's N * K can pass 2**31
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            x = tl.load(x_ptr + row_offsets + kk[None, :], mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + col_offsets + kk[:, None], mask=(cols[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out_offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        out_mask = (rows[:, None] < M) & (cols[None, :] < N)
        tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
