"""y = x @ weight.T (+ bias) for a few rows of x in ONE launch: the decode, verify and draft GEMMs.

At 1–16 rows a linear layer only streams its weight. cuBLAS covers such shapes at ~2.3–2.8 TB/s on
an H100, several of them (Qwen3-8B's O and down projections, its LM head) with a split-K kernel and
a separate reduce or memset launch. This kernel gives each program a tile of BLOCK_N weight rows and
walks K with NUM_STAGES blocks in flight; all rows of x (padded to one 16-row tensor-core tile) ride
along. Measured as fast as cuBLAS or faster at every Qwen3-8B and SmolLM2-135M shape (BENCHMARKS.md).

`skinny_linear_reference` is F.linear (the CPU path and test oracle); `SkinnyLinear` holds a weight,
its bias and its launch settings, and picks the kernel or F.linear per call.
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

MAX_ROWS = 16  # one tensor-core tile of rows: more rows take cuBLAS


def skinny_linear_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


# Launch settings by weight shape, from `python -m dflash_serve.services.bench.skinny_linear` on an H100: K in
# steps of 256 (128 for a layer narrower than 1024), tiles of 64 weight rows (32 up to 4096 rows, or
# for a narrow layer); five K blocks in flight.
NARROW_K = 1024
SHORT_N = 4096


@dataclass(frozen=True)
class LaunchSettings:
    block_n: int = 32
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 5

    @classmethod
    def for_shape(cls, n: int, k: int) -> LaunchSettings:
        if k < NARROW_K:
            return cls(32, 128)
        return cls(32 if n <= SHORT_N else 64, 256)


class SkinnyLinear:
    """A linear layer (weight [N, K], optional bias) that takes `skinny_linear_triton` for up to
    MAX_ROWS half-precision rows on CUDA and F.linear otherwise. `weight` and `bias` are kept as
    given (a Parameter stays the module's own, also across `.to()`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 settings: LaunchSettings | None = None):
        self.weight, self.bias = weight, bias
        self.settings = settings or LaunchSettings.for_shape(*weight.shape)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= MAX_ROWS and rows.stride(-1) == 1 and _runs_triton(x):
            out = skinny_linear_triton(rows, self.weight, self.bias, self.settings)
            return out.view(*x.shape[:-1], out.shape[-1])
        return skinny_linear_reference(x, self.weight, self.bias)


def _runs_triton(x: torch.Tensor) -> bool:
    """Half precision on CUDA (float32 would take TF32 tensor-core products); any dtype under the
    interpreter (TRITON_INTERPRET=1, the CPU tests)."""
    if triton is None:
        return False
    return os.environ.get("TRITON_INTERPRET") == "1" or (x.is_cuda and x.dtype in (torch.float16, torch.bfloat16))


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         settings: LaunchSettings) -> torch.Tensor:
    rows, k = x.shape
    n = weight.shape[0]
    assert rows <= MAX_ROWS and weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _skinny_linear_kernel[(triton.cdiv(n, settings.block_n),)](
        x, weight, out if bias is None else bias, out, rows, n, k, x.stride(0), weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=settings.block_n, BLOCK_K=settings.block_k,
        num_warps=settings.num_warps, num_stages=settings.num_stages,
    )
    return out


if triton is not None:

    @triton.jit
    def _skinny_linear_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        rows = tl.arange(0, BLOCK_M)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + ks
            x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                        mask=(rows[:, None] < M) & (kk[None, :] < K), other=0.0)
            w = tl.load(w_ptr + cols[None, :] * stride_wn + kk[:, None],
                        mask=(cols[None, :] < N) & (kk[:, None] < K), other=0.0)
            acc += tl.dot(x, w)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))
