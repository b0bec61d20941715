"""y = x @ weight.T (+ bias) whose every row has the same bits whatever the number of rows beside it.

The batch-invariant GEMM of `engine.deterministic`. cuBLAS (and `SkinnyLinear`, which hands more
than 16 rows to it) picks tiles, instructions and split-K by the row count M, so a token's logits
differ in their last bits between a decode of 1 sequence, a verify of 16 tokens and a batch of 32,
and greedy decoding flips at a near-tie. Here the reduction order depends on the weight's shape
and the dtype only. Each output element is one chain of tensor-core dots over K, BLOCK_K at a time
from k = 0, accumulated in float32 in place (`tl.dot(x, w, acc)`); or, for a narrow layer of long K
(`split_k`), one such chain per fixed range of K, the float32 partials then added in range order,
by a second launch or, from MANY_ROWS rows on, by the program that computed them. M changes the
number of programs and, from MANY_ROWS on, the tile (which rows and columns one program covers),
never an element's chain: on the H200 a row has the same bits under either tile (the GPU tests).
A row's products do not mix with other rows', and rows past M are masked loads of zeros.

`invariant_linear_reference` is the CPU path and the test oracle: each row through its own
F.linear of one row, so a row's result cannot depend on the others either (a CPU BLAS also picks
kernels by M). `InvariantLinear` holds a weight, its bias and launch settings, as `SkinnyLinear`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs run the reference
    triton = None

TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# Layers at least this wide (a merged gate-up, an LM head) fill the GPU with column tiles alone.
WIDE_N = 16384
# Narrower layers with at least this much K split it, one range per SPLIT_K_RANGE of K: a decode's
# one row tile then runs enough programs to stream the weight (an H200 has 132 multiprocessors).
SPLIT_MIN_K = 2048
SPLIT_K_RANGE = 1024
MAX_SPLIT_K = 8


# From this many rows on, a layer with `many_rows` tiles takes them.
MANY_ROWS = 128


class Tile(NamedTuple):
    """How a launch covers the output. Changing it moves a row to other programs, never changes the
    chain of dots that computes it: the reduction order is `InvariantSettings`' block_k and split_k."""

    block_m: int
    block_n: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class InvariantSettings:
    """Launch settings: the reduction order (block_k, split_k) from the weight's shape alone, never
    from the number of rows; the tile too, except that `many_rows`, where set, covers launches of at
    least MANY_ROWS rows (the GPU tests hold a row's bits the same under both)."""

    block_m: int = 64  # the smallest tile that takes Hopper's warp-group MMA, for every M
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8  # row tiles visited together, so a weight tile is read from L2 by all of them
    num_warps: int = 4
    num_stages: int = 3
    # K in this many fixed ranges, each its own chain of dots into a float32 partial; the partials
    # are then added in range order. The ranges depend on K alone, so a row's sum does not change
    # with M (a split-K chosen by size, as cuBLAS's, would).
    split_k: int = 1
    many_rows: Tile | None = None

    @classmethod
    def for_shape(cls, n: int, k: int) -> InvariantSettings:
        """From the H200 sweeps (`bench.invariant_linear`, 2026-12-02): K steps of 128; SmolLM2-sized
        layers in 32-row tiles of 64 columns (5 stages), larger ones in 64 × 128 tiles; narrow
        layers of long K split K in ranges of SPLIT_K_RANGE (at Qwen3-8B's shapes, the best of 72
        settings: QKV and O in 4, down in 8). From MANY_ROWS rows on (a batch's verify), the best
        tiles of the second sweep at QKV, O and gate-up: 128 × 128 for wide layers, and for split
        ones 64 × 128 on 8 warps, each program adding its own ranges."""
        if k < SPLIT_MIN_K:
            if n >= WIDE_N:
                return cls(block_n=128, block_k=64, num_warps=8)
            return cls(block_m=32, block_n=64, block_k=128, num_stages=5)
        if n >= WIDE_N:
            return cls(block_n=128, block_k=128, many_rows=Tile(block_m=128, block_n=128, num_warps=8))
        split = min(MAX_SPLIT_K, k // SPLIT_K_RANGE)
        return cls(block_n=128, block_k=128, split_k=split,
                   many_rows=Tile(block_m=64, block_n=128, num_warps=8, num_stages=4))


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
        split = settings.split_k
        # K steps per range, from K alone: every M splits a row's sum at the same k.
        k_per_split = triton.cdiv(triton.cdiv(k, settings.block_k), split) * settings.block_k
        tile = settings.many_rows if settings.many_rows is not None and m >= MANY_ROWS else settings
        # Many rows fill the GPU without spreading K's ranges over programs: each program then walks
        # them all and adds the partials in the same order, without a round trip through memory.
        in_program = tile is settings.many_rows
        partials = out if split == 1 or in_program else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(m, tile.block_m) * triton.cdiv(n, tile.block_n), 1 if in_program else split)
        _invariant_linear_kernel[grid](
            rows, weight, out if bias is None else bias, partials, m, n, k, k_per_split, rows.stride(0),
            weight.stride(0), HAS_BIAS=bias is not None and (split == 1 or in_program), SPLIT_K=split,
            RANGES_IN_PROGRAM=in_program, BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, BLOCK_K=settings.block_k,
            GROUP_M=tile.group_m,
            # float32 stays float32 (no TF32 rounding of the products), as in paged attention.
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=tile.num_warps, num_stages=tile.num_stages,
        )
        if split > 1 and not in_program:
            _add_partials_kernel[(triton.cdiv(m * n, ADD_BLOCK),)](
                partials, out if bias is None else bias, out, m * n, n, HAS_BIAS=bias is not None, SPLIT_K=split,
                BLOCK=ADD_BLOCK,
            )
    return out.view(*x.shape[:-1], n)


ADD_BLOCK = 1024

if triton is not None:

    # M changes with every batch: not specialized on, so a new row count reuses the compiled kernel.
    # The row stride is specialized (a multiple of 16 in every model here): x's loads can be vectorized.
    @triton.jit(do_not_specialize=["M"])
    def _invariant_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, K_PER_SPLIT, stride_xm, stride_wn,
                                 HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, RANGES_IN_PROGRAM: tl.constexpr,
                                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                                 GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """SPLIT_K 1: out = x @ w.T (+ bias) in the output dtype. Otherwise program (tile, s) writes
        the float32 sum over K range s to out_ptr[s] ([SPLIT_K, M, N]), for `_add_partials_kernel`;
        or, RANGES_IN_PROGRAM, program (tile, 0) sums every range as that kernel would and writes out."""
        # Program -> (row tile, column tile), GROUP_M row tiles per column tile in turn.
        pid = tl.program_id(0)
        split = tl.program_id(1)
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
        if RANGES_IN_PROGRAM:
            acc = _range_sum(x_ptr, w_ptr, row_offsets, col_offsets, rows, cols, ks, 0, K_PER_SPLIT, M, N, K,
                             BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
            for s in tl.static_range(1, SPLIT_K):  # ((range 0 + range 1) + ...), as `_add_partials_kernel`
                acc += _range_sum(x_ptr, w_ptr, row_offsets, col_offsets, rows, cols, ks, s * K_PER_SPLIT,
                                  K_PER_SPLIT, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        else:
            acc = _range_sum(x_ptr, w_ptr, row_offsets, col_offsets, rows, cols, ks, split * K_PER_SPLIT,
                             K_PER_SPLIT, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out_offsets = rows.to(tl.int64)[:, None] * N + cols[None, :]
        out_mask = (rows[:, None] < M) & (cols[None, :] < N)
        if SPLIT_K == 1 or RANGES_IN_PROGRAM:
            tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            tl.store(out_ptr + split.to(tl.int64) * M * N + out_offsets, acc, mask=out_mask)

    @triton.jit
    def _range_sum(x_ptr, w_ptr, row_offsets, col_offsets, rows, cols, ks, k_begin, K_PER_SPLIT, M, N, K,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """The float32 chain of dots over one range of K, BLOCK_K at a time from its first k."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, tl.minimum(k_begin + K_PER_SPLIT, K), BLOCK_K):
            kk = k0 + ks
            x = tl.load(x_ptr + row_offsets + kk[None, :], mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + col_offsets + kk[:, None], mask=(cols[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        return acc

    @triton.jit(do_not_specialize=["size"])
    def _add_partials_kernel(partials_ptr, bias_ptr, out_ptr, size, N, HAS_BIAS: tl.constexpr,
                             SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
        """out = ((partial 0 + partial 1) + ...) (+ bias), in float32, in range order."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < size
        total = tl.load(partials_ptr + offsets, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT_K):
            total += tl.load(partials_ptr + s * size + offsets, mask=mask, other=0.0)
        if HAS_BIAS:
            total += tl.load(bias_ptr + offsets % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=mask)
