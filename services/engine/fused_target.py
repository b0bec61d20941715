"""The target's forward for Llama, Qwen2 and Qwen3 dense models, written out with fused kernels.

Same contract as `TargetRunner.forward` (packed tokens on the paged KV cache -> logits of chosen
rows and the drafter's features), from the same HF checkpoint, but each decoder layer is nine
launches instead of ~35:

    add+RMSNorm → QKV GEMM → q/k-norm+RoPE+KV write → paged attention → O GEMM
    → add+RMSNorm → gate-up GEMM → SiLU·mul → down GEMM

q/k/v and gate/up are each one GEMM over weights concatenated at load; the HF modules' parameters
are re-pointed at slices of those (contiguous row blocks), so no weight is held twice and the HF
model stays usable for plain forwards and training. Feature k (the residual stream after layer k,
HF's `hidden_states[k + 1]`) is the sum the next fused add produces, so no hook is needed.

Other architectures, RoPE types whose frequencies change with the sequence (dynamic NTK,
LongRoPE), partial rotary and non-SiLU MLPs stay on `TargetRunner` (`fused_unsupported_reason`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import add_rms_norm, paged_attention, rms_norm, rope_kv_write, silu_mul
from services.engine.kv_cache import AttentionBatch, KVPool
from services.models.target import TargetModel

FUSED_FAMILIES = ("llama", "qwen2", "qwen3")
# RoPE types whose inverse frequencies are fixed at load (a cos/sin table per position is exact).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def fused_unsupported_reason(target: TargetModel) -> str | None:
    """None when the fused forward computes exactly what transformers does for this target."""
    cfg = target.config
    if cfg.model_type not in FUSED_FAMILIES:
        return f"model_type {cfg.model_type!r} is not one of {', '.join(FUSED_FAMILIES)}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (the fused MLP is SiLU·mul)"
    rotary = _rotary(target)
    if rotary is None or rotary.rope_type not in STATIC_ROPE_TYPES:
        return f"RoPE type {getattr(rotary, 'rope_type', None)!r} is not one of {', '.join(STATIC_ROPE_TYPES)}"
    head_dim = target.layers[0].self_attn.head_dim
    if 2 * rotary.inv_freq.numel() != head_dim:
        return "partial rotary embedding"
    return None


def _rotary(target: TargetModel) -> nn.Module | None:
    return getattr(target.model.get_decoder(), "rotary_emb", None)


def _merged(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several projections of the same input; each module's parameters
    become views of their rows, so the memory is not doubled."""
    weight = torch.cat([m.weight.detach() for m in linears])
    has_bias = [m.bias is not None for m in linears]
    bias = torch.cat([m.bias.detach() for m in linears]) if all(has_bias) else None
    if any(has_bias) and bias is None:
        raise ValueError("projections of one input disagree on having a bias")
    row = 0
    for m in linears:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(weight[row:row + rows], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[row:row + rows], requires_grad=False)
        row += rows
    return weight, bias


def _param(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


@dataclass
class FusedLayer:
    """One decoder layer's weights in the fused layout."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3's per-head norms
    k_norm: torch.Tensor | None
    scaling: float
    window: int | None
    causal: bool

    @classmethod
    def from_layer(cls, layer: nn.Module, *, scaling: float, window: int | None, causal: bool = True) -> FusedLayer:
        """From a Llama/Qwen-style layer (HF's, or the drafter's: the same module names)."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _merged([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up, gate_up_bias = _merged([mlp.gate_proj, mlp.up_proj])
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return cls(
            input_norm=layer.input_layernorm.weight.detach(),
            post_attention_norm=layer.post_attention_layernorm.weight.detach(),
            qkv=qkv, qkv_bias=qkv_bias,
            o=attn.o_proj.weight.detach(), o_bias=_param(attn.o_proj.bias),
            gate_up=gate_up, gate_up_bias=gate_up_bias,
            down=mlp.down_proj.weight.detach(), down_bias=_param(mlp.down_proj.bias),
            q_norm=None if q_norm is None else q_norm.weight.detach(),
            k_norm=None if k_norm is None else k_norm.weight.detach(),
            scaling=scaling, window=window, causal=causal,
        )


@dataclass
class FusedStack:
    """Decoder layers in the fused layout over one paged KV pool: the target's, or the drafter's
    block forward (the same layer, non-causal where the drafter says so)."""

    layers: list[FusedLayer]
    final_norm: torch.Tensor
    pool: KVPool
    num_heads: int
    num_kv_heads: int
    eps: float

    def forward(self, hidden: torch.Tensor, rope_index: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: AttentionBatch, on_residual=None) -> torch.Tensor:
        """Packed rows [T, H] -> final-normed hidden states [T, H]. Row t is rotated by
        cos/sin[rope_index[t]]; `on_residual(k, residual)` sees the residual stream after layer k
        (it is the sum the next fused add produces)."""
        residual = None
        for index, layer in enumerate(self.layers):
            if residual is None:
                x, residual = rms_norm(hidden, layer.input_norm, self.eps), hidden
            else:
                x, residual = add_rms_norm(hidden, residual, layer.input_norm, self.eps)
                if on_residual is not None:
                    on_residual(index - 1, residual)
            hidden, residual = self._layer(index, layer, x, residual, rope_index, cos, sin, batch)
        x, residual = add_rms_norm(hidden, residual, self.final_norm, self.eps)
        if on_residual is not None:
            on_residual(len(self.layers) - 1, residual)
        return x

    def _layer(self, index: int, layer: FusedLayer, x: torch.Tensor, residual: torch.Tensor,
               rope_index: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer after its input norm -> (its MLP output, the residual it is added to)."""
        k_cache, v_cache = self.pool.k[index], self.pool.v[index]
        qkv = F.linear(x, layer.qkv, layer.qkv_bias)
        q = rope_kv_write(qkv, rope_index, cos, sin, batch.slot_mapping, k_cache, v_cache,
                          num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                          q_norm_weight=layer.q_norm, k_norm_weight=layer.k_norm, eps=self.eps)
        attn = paged_attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start,
                               scale=layer.scaling, causal=layer.causal, window=layer.window,
                               max_query_len=batch.max_query_len)
        hidden = F.linear(attn.view(attn.shape[0], -1), layer.o, layer.o_bias)
        x, residual = add_rms_norm(hidden, residual, layer.post_attention_norm, self.eps)
        mlp = silu_mul(F.linear(x, layer.gate_up, layer.gate_up_bias))
        return F.linear(mlp, layer.down, layer.down_bias), residual


class FusedTargetRunner:
    """Runs a `TargetModel` of a fused family over packed tokens with its KV in a `KVPool`."""

    def __init__(self, target: TargetModel, pool: KVPool, *, max_positions: int):
        reason = fused_unsupported_reason(target)
        if reason is not None:
            raise ValueError(f"{type(target.model).__name__}: no fused forward ({reason}); use target_impl=transformers")
        self.target = target
        self.pool = pool
        cfg = target.config
        num_heads = cfg.num_attention_heads
        with torch.no_grad():
            layers = [FusedLayer.from_layer(layer, scaling=float(layer.self_attn.scaling),
                                            window=getattr(layer.self_attn, "sliding_window", None))
                      for layer in target.layers]
        self.stack = FusedStack(layers, target.model.get_decoder().norm.weight.detach(), pool, num_heads,
                                getattr(cfg, "num_key_value_heads", None) or num_heads, float(cfg.rms_norm_eps))
        self.cos, self.sin = self._rope_table(_rotary(target), max_positions, target.dtype, target.device)
        self.capture: dict[int, list[int]] = {}  # layer -> its feature slots (a layer may be listed twice)
        for slot, k in enumerate(target.layer_ids):
            self.capture.setdefault(k, []).append(slot)

    @staticmethod
    def _rope_table(rotary: nn.Module, max_positions: int, dtype: torch.dtype, device: torch.device):
        """cos/sin [max_positions, D/2] exactly as transformers computes them (float32 product of
        position and inverse frequency, times the attention scaling, cast to the model dtype)."""
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * rotary.inv_freq.to(device=device, dtype=torch.float32)[None, :]
        scale = rotary.attention_scaling
        return (freqs.cos() * scale).to(dtype).contiguous(), (freqs.sin() * scale).to(dtype).contiguous()

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, logits_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed tokens [T] at positions [T] -> (logits [K, V] of rows `logits_rows`, features [T, F*H])."""
        features: list[torch.Tensor | None] = [None] * len(self.target.layer_ids)

        def keep(layer: int, residual: torch.Tensor) -> None:
            for slot in self.capture.get(layer, ()):
                features[slot] = residual

        x = self.stack.forward(self.target.embed(input_ids), positions, self.cos, self.sin, batch, keep)
        logits = self.target.logits(x[logits_rows])
        return logits, torch.cat(features, dim=-1) if features else None
