"""The fused MoE blocks against transformers' own modules, one block at a time: routing, the
grouped expert computation, and that only the routed experts' weights are read. (Whole targets
against transformers: tests/unit/test_fused_target.py.)"""

from __future__ import annotations

import pytest
import torch

from dflash_serve.kernels import gelu_tanh_mul, silu_mul
from dflash_serve.kernels.moe import grouped_expert_ffn, grouped_expert_ffn_grouped_mm
from dflash_serve.services.engine.fused_moe import Gemma4MoeBlock, Qwen3MoeBlock, StackedExperts
from dflash_serve.services.engine.fused_target import _gemma_norm_weight
from tests.targets import gemma4_26b_a4b_twin, qwen3_moe_twin


def _rows(n: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed), dtype=dtype)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_block_equals_transformers_in_float64(norm_topk_prob):
    """Without a norm in the block, float64 agrees to float64 rounding (the softmax is float32 in both)."""
    block = qwen3_moe_twin(seed=1, norm_topk_prob=norm_topk_prob).double().model.layers[1].mlp
    x = _rows(13, 32, torch.float64, seed=2)
    with torch.no_grad():
        want = block(x[None])[0]
    got = Qwen3MoeBlock.from_module(block, silu_mul)(x, x, None)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_gemma4_router_picks_transformers_experts_and_weights():
    layer = gemma4_26b_a4b_twin(seed=3).model.layers[2]
    moe = Gemma4MoeBlock.from_layer(layer, gelu_tanh_mul, _gemma_norm_weight)
    residual = _rows(17, 32, torch.float32, seed=4)
    with torch.no_grad():
        _, want_weights, want_ids = layer.router(residual)
    weights, ids = moe.route(residual)
    assert torch.equal(ids, want_ids)
    assert weights.dtype == want_weights.dtype == torch.float32
    torch.testing.assert_close(weights, want_weights, rtol=1e-6, atol=1e-7)


def test_stacked_experts_equal_transformers_expert_loop_in_float64():
    """Tokens routed to overlapping sets of experts, some experts to none, k = 3."""
    experts = qwen3_moe_twin(seed=5).double().model.layers[1].mlp.experts
    g = torch.Generator().manual_seed(6)
    x = _rows(11, 32, torch.float64, seed=7)
    ids = torch.stack([torch.randperm(5, generator=g)[:3] for _ in range(11)])  # experts 5..7 get no token
    weights = torch.rand(11, 3, generator=g, dtype=torch.float64)
    with torch.no_grad():
        want = experts(x, ids, weights)
    got = StackedExperts.from_module(experts, silu_mul)(x, ids, weights)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_only_experts_with_rows_have_their_weights_read():
    """An expert routed no row is never touched: NaN weights there leave the output finite."""
    gate_up = torch.randn(4, 2 * 8, 16, dtype=torch.float64)
    down = torch.randn(4, 16, 8, dtype=torch.float64)
    gate_up[1], down[1], gate_up[3], down[3] = float("nan"), float("nan"), float("nan"), float("nan")
    rows = _rows(5, 16, torch.float64, seed=8)
    ends = torch.tensor([2, 2, 5, 5], dtype=torch.int32)  # experts 1 and 3 have no rows
    out = grouped_expert_ffn(rows, ends, gate_up, down, silu_mul)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[2:], silu_mul(rows[2:] @ gate_up[2].T) @ down[2].T)
    torch.testing.assert_close(out[:2], silu_mul(rows[:2] @ gate_up[0].T) @ down[0].T)


def test_the_grouped_gemm_computes_what_the_per_expert_loop_does():
    """torch's grouped_mm (the GPU's path; it has a CPU kernel too) over the same sorted rows and
    run ends, experts without rows among them, equals the reference loop."""
    g = torch.Generator().manual_seed(9)
    gate_up = torch.randn(6, 2 * 16, 32, generator=g) / 32**0.5
    down = torch.randn(6, 32, 16, generator=g) / 16**0.5
    rows = _rows(14, 32, torch.float32, seed=10)
    ends = torch.tensor([3, 3, 8, 9, 9, 14], dtype=torch.int32)
    want = grouped_expert_ffn(rows, ends, gate_up, down, gelu_tanh_mul)
    torch.testing.assert_close(grouped_expert_ffn_grouped_mm(rows, ends, gate_up, down, gelu_tanh_mul), want,
                               rtol=1e-6, atol=1e-6)
