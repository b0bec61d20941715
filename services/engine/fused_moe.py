"""Mixture-of-experts feed-forward blocks of the fused target forward: Qwen3-MoE's and Gemma-4's.

Routing is computed as transformers computes it: the router's logits in the model dtype, their
softmax in float32, the top k, renormalized to sum to 1 (Qwen3-MoE where `norm_topk_prob`,
Gemma-4 always, which then scales each weight by its expert's `per_expert_scale`).

The experts' weights are stacked: gate-up [E, 2I, H] (each expert's gate rows, then its up rows)
and down [E, H, I] — views of transformers' own expert parameters, which its checkpoint loading
already stacks in this layout, so no weight is held twice.

The experts run grouped: the T·k (token, expert) pairs are sorted by expert, so each expert's
rows are one contiguous run; `grouped_expert_ffn` sends each run through its expert's two GEMMs;
the outputs go back to (token, pair) order and each token sums its k outputs, weighted. Its
reference (the CPU path and the tests' oracle) loops over the experts that have rows, reading only
their weights (at decode and verify sizes, the routed ones), and reads the run ends on the host:
no CUDA graph can capture it. On a GPU that has it (bfloat16, SM80+) the two GEMMs are each one
`torch.nn.functional.grouped_mm` over the same run ends, kept on the device, so CUDA graphs capture
the whole block (tests/gpu checks it against transformers in bf16; BENCHMARKS measures it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from dflash_serve.kernels import rms_norm


Activation = Callable[[torch.Tensor], torch.Tensor]


def grouped_expert_ffn(rows: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                       activation: Activation) -> torch.Tensor:
    """rows [N, H] sorted by expert, expert e's from ends[e-1] (0 for the first) to ends[e]
    (int32 [E]) -> each row through its expert: down[e] · activation(gate_up[e] · row), [N, H]."""
    if rows.is_cuda and rows.dtype == torch.bfloat16 and torch.cuda.get_device_capability(rows.device) >= (8, 0):
        return grouped_expert_ffn_grouped_mm(rows, ends, gate_up, down, activation)
    return grouped_expert_ffn_reference(rows, ends, gate_up, down, activation)


def grouped_expert_ffn_reference(rows: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                                 activation: Activation) -> torch.Tensor:
    out = torch.empty_like(rows)
    start = 0
    for expert, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = F.linear(activation(F.linear(rows[start:end], gate_up[expert])), down[expert])
            start = end
    return out


def grouped_expert_ffn_grouped_mm(rows: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                                  activation: Activation) -> torch.Tensor:
    # grouped_mm multiplies by [E, K, N]: the transposed views of the [E, N, K] linear weights.
    hidden = activation(F.grouped_mm(rows, gate_up.transpose(1, 2), offs=ends))
    return F.grouped_mm(hidden, down.transpose(1, 2), offs=ends)


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
        tokens, k = expert_ids.shape
        # Stable: an expert's rows keep token order. All on the device, without a host sync.
        sorted_ids, by_expert = torch.sort(expert_ids.reshape(-1), stable=True)
        expert_after = torch.arange(1, self.num_experts + 1, device=sorted_ids.device, dtype=sorted_ids.dtype)
        ends = torch.searchsorted(sorted_ids, expert_after).to(torch.int32)
        sorted_out = grouped_expert_ffn(x[by_expert // k], ends, self.gate_up, self.down, self.activation)
        out = torch.empty_like(sorted_out)
        out[by_expert] = sorted_out
        # Weighted in the weights' dtype (Gemma-4's are float32), cast to the model's before the
        # sum, as transformers' experts do.
        weighted = (out * weights.reshape(-1, 1)).to(x.dtype)
        return weighted.view(tokens, k, -1).sum(dim=1)


def _top_k(logits: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 weights [T, k], expert ids [T, k]): the top k of the float32 softmax."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


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
        weights, ids = _top_k(logits, self.top_k, self.renormalize)
        return self.experts(x, ids, weights.to(logits.dtype))


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
        weights, ids = _top_k(logits, self.top_k, renormalize=True)
        return weights * self.per_expert_scale[ids], ids

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, dense: torch.Tensor | None) -> torch.Tensor:
        """dense: the dense MLP's output on x; residual: the stream x was normed from [T, H]."""
        weights, ids = self.route(residual)
        expert_in = rms_norm(residual, self.pre_experts_norm, self.eps, scale_in_float32=True)
        experts_out = self.experts(expert_in, ids, weights)
        return (rms_norm(dense, self.post_dense_norm, self.eps, scale_in_float32=True)
                + rms_norm(experts_out, self.post_experts_norm, self.eps, scale_in_float32=True))
