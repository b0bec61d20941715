"""Mixture-of-experts feed-forward blocks of the fused target forward: Qwen3-MoE's and Gemma-4's.

Routing is computed as transformers computes it: the router's logits in the model dtype, their
softmax in float32, the top k, renormalized to sum to 1 (Qwen3-MoE where `norm_topk_prob`,
Gemma-4 always, which then scales each weight by its expert's `per_expert_scale`).

The experts' weights are stacked: gate-up [E, 2I, H] (each expert's gate rows, then its up rows)
and down [E, H, I] — views of transformers' own expert parameters, which its checkpoint loading
already stacks in this layout, so no weight is held twice.

Routing and experts are `dflash_serve.kernels.moe`'s (`moe_route`, `moe_experts`): on a GPU, Triton routing
for every token and Triton experts at decode and verify sizes (a few launches, each routed expert's
weights read once); otherwise, and for larger batches, the torch path: the T·k (token, expert)
pairs sorted by expert, so each expert's rows are one contiguous run, which `grouped_expert_ffn`
sends through its expert's two GEMMs (on the CPU a loop over the experts that have rows, reading
only their weights; on a GPU in bfloat16 one `torch.nn.functional.grouped_mm` per projection over
run ends kept on the device); the outputs go back to (token, pair) order and each token sums its k
outputs, weighted. The CPU path is the tests' oracle for the kernels.
On a GPU neither path is yet checked against transformers in bf16 (tests/gpu and
tests/unit/test_moe_kernels.py's CUDA cases are written); BENCHMARKS measures the grouped one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dflash_serve.kernels import rms_norm
from dflash_serve.kernels.moe import Activation, moe_experts, moe_route


@dataclass
class StackedExperts:
    """E experts' SwiGLU/GeGLU MLPs as stacked weights."""

    gate_up: torch.Tensor  # [E, 2I, H]
    down: torch.Tensor  # [E, H, I]
    activation: Activation  # gate-up output [.., 2I] -> [.., I]

    @classmethod
    def from_module(cls, experts: nn.Module, activation: Activation) -> StackedExperts:
        """From transformers' stacked experts (Qwen3MoeExperts, Gemma4TextExperts)."""
        return cls(experts.gate_up_proj.detach(), experts.down_proj.detach(), activation)

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]

    def __call__(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], each token's k experts [T, k] and their weights [T, k] -> [T, H]."""
        return moe_experts(x, expert_ids, weights, self.gate_up, self.down, self.activation)


@dataclass
class Qwen3MoeBlock:
    """Qwen3-MoE's sparse block, in place of the layer's MLP on its normed input."""

    router: torch.Tensor  # [E, H]
    top_k: int
    renormalize: bool  # norm_topk_prob
    experts: StackedExperts

    @classmethod
    def from_module(cls, block: nn.Module, activation: Activation) -> Qwen3MoeBlock:
        gate = block.gate
        return cls(gate.weight.detach(), gate.top_k, bool(gate.norm_topk_prob),
                   StackedExperts.from_module(block.experts, activation))

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, dense: torch.Tensor | None) -> torch.Tensor:
        """x: the MLP's normed input [T, H] (the residual stream and a dense output it has none of)."""
        logits = F.linear(x, self.router)
        weights, ids = moe_route(logits, self.top_k, self.renormalize, weights_dtype=logits.dtype)
        return self.experts(x, ids, weights)


@dataclass
class Gemma4MoeBlock:
    """Gemma-4's experts beside the layer's dense MLP (26B-A4B): the router and the experts read
    the residual stream, each through its own norm; the dense and the experts' outputs are each
    normed, then summed (the layer's post-feedforward norm and residual add follow)."""

    router_proj: torch.Tensor  # [E, H]
    router_scale: torch.Tensor  # [H]: the router's input scale (times H^-0.5)
    per_expert_scale: torch.Tensor  # [E]
    top_k: int
    experts: StackedExperts
    post_dense_norm: torch.Tensor  # float32 norm weights (post_feedforward_layernorm_1)
    pre_experts_norm: torch.Tensor  # pre_feedforward_layernorm_2
    post_experts_norm: torch.Tensor  # post_feedforward_layernorm_2
    eps: float

    def __post_init__(self):
        # The router's norm has no weight; times a float32 one it is exactly transformers' (x · 1 is x).
        self.unit_norm = torch.ones(self.router_proj.shape[1], dtype=torch.float32, device=self.router_proj.device)
        self.root_size = self.router_proj.shape[1] ** -0.5

    @classmethod
    def from_layer(cls, layer: nn.Module, activation: Activation,
                   norm_weight: Callable[[nn.Module], torch.Tensor]) -> Gemma4MoeBlock:
        """`norm_weight`: a Gemma norm's float32 weight, as the fused layer takes its other norms."""
        router = layer.router
        return cls(router.proj.weight.detach(), router.scale.detach(), router.per_expert_scale.detach(),
                   int(router.config.top_k_experts), StackedExperts.from_module(layer.experts, activation),
                   norm_weight(layer.post_feedforward_layernorm_1), norm_weight(layer.pre_feedforward_layernorm_2),
                   norm_weight(layer.post_feedforward_layernorm_2), float(router.eps))

    def route(self, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 weights [T, k], expert ids [T, k]), each weight times its expert's scale."""
        normed = rms_norm(residual, self.unit_norm, self.eps, scale_in_float32=True)
        logits = F.linear(normed * self.router_scale * self.root_size, self.router_proj)
        return moe_route(logits, self.top_k, renormalize=True, scale=self.per_expert_scale)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, dense: torch.Tensor | None) -> torch.Tensor:
        """dense: the dense MLP's output on x; residual: the stream x was normed from [T, H]."""
        weights, ids = self.route(residual)
        expert_in = rms_norm(residual, self.pre_experts_norm, self.eps, scale_in_float32=True)
        experts_out = self.experts(expert_in, ids, weights)
        return (rms_norm(dense, self.post_dense_norm, self.eps, scale_in_float32=True)
                + rms_norm(experts_out, self.post_experts_norm, self.eps, scale_in_float32=True))
