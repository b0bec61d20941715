"""The target's forward for Llama, Qwen2, Qwen3(-MoE) and Gemma-3/4 models, written out with fused kernels.

Same contract as `TargetRunner.forward` (packed tokens on the paged KV cache -> logits of chosen
rows and the drafter's features), from the same HF checkpoint, but each decoder layer is nine
launches instead of ~35:

    add+RMSNorm → QKV GEMM → q/k-norm+RoPE+KV write → paged attention → O GEMM
    → add+RMSNorm → gate-up GEMM → SiLU·mul → down GEMM

Gemma's layers norm each sublayer's output before its residual add ("sandwich" norms):

    residual += post_attention_norm(attn(input_norm(residual)))
    residual += post_feedforward_norm(mlp(pre_feedforward_norm(residual)))

so the fused add there is norm → add → norm in one launch (`add_rms_norm(x_norm_weight=…)`), the
norms scale in float32 and cast last (Gemma-3's `1 + w` folded into a float32 weight at load), the
MLP is GELU-tanh·mul, and sliding-window and global layers each rotate with their own RoPE table.
The layer count of launches is the same nine. Gemma-4's layers add: a value norm (in the same
launch as q/k norms and RoPE); global layers of their own head size and KV heads (their K/V in
their own group of the pool), rotating part of the head (proportional RoPE: zero frequencies for
the rest), and with `attention_k_eq_v` no value projection (the values are the key projection's
raw heads, normed, and the cache holds them alone: the attention derives each key from its
value); KV-shared layers that project queries only and attend over an earlier layer's K/V; and,
where a checkpoint has them, a per-layer input (E2B/E4B) and an output scale (`layer_scalar`),
which add to and scale the residual before the next norm (a few launches more per layer).

Mixture-of-experts blocks (`fused_moe`): Qwen3-MoE's sparse layers route the MLP's normed input
to their experts in place of the MLP; Gemma-4's (26B-A4B) add experts beside the dense MLP, which
read the residual stream through their own router and norms.

q/k/v and gate/up are each one GEMM over weights concatenated at load; a GEMM of at most 16 rows
(decode, a batch-1 verify, the draft) is one launch of `dflash_serve.kernels.SkinnyLinear`'s kernel, where
cuBLAS would add a split-K reduce (and is slower at these shapes: BENCHMARKS.md); the HF modules' parameters
are re-pointed at slices of those (contiguous row blocks), so no weight is held twice and the HF
model stays usable for plain forwards and training. Feature k (the residual stream after layer k,
HF's `hidden_states[k + 1]`) is the sum the next fused add produces, so no hook is needed.

Other architectures, RoPE types whose frequencies change with the sequence (dynamic NTK,
LongRoPE), and partial rotary other than Gemma-4's stay on `TargetRunner` (`fused_unsupported_reason`
names why).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from dflash_serve.kernels import (
    InvariantLinear,
    SkinnyLinear,
    add_rms_norm,
    gelu_tanh_mul,
    paged_attention,
    paged_attention_invariant,
    rms_norm,
    rope_kv_write,
    silu_mul,
)
from dflash_serve.services.engine.fused_moe import Gemma4MoeBlock, Qwen3MoeBlock
from dflash_serve.services.engine.kv_cache import AttentionBatch, KVPool
from dflash_serve.services.models.target import TargetModel

if TYPE_CHECKING:
    from dflash_serve.services.engine.tensor_parallel import TensorParallel

LLAMA_FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe")
GEMMA_FAMILIES = ("gemma3_text", "gemma4_text")
FUSED_FAMILIES = LLAMA_FAMILIES + GEMMA_FAMILIES
# RoPE types whose inverse frequencies are fixed at load (a cos/sin table per position is exact).
# Gemma-4's "proportional" rotates part of each head with zero frequencies for the rest (cos 1, sin 0).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
# transformers' RMSNorm classes with Gemma's float32 scaling, and whether the weight is `1 + w`.
GEMMA_NORMS = {"Gemma3RMSNorm": True, "Gemma4RMSNorm": False}
GEMMA_ACTIVATION = "gelu_pytorch_tanh"
# A layer's GEMMs: SkinnyLinear (fastest), or InvariantLinear (each row's bits independent of the batch).
Linear = type[SkinnyLinear] | type[InvariantLinear]


def fused_unsupported_reason(target: TargetModel) -> str | None:
    """None when the fused forward computes exactly what transformers does for this target."""
    cfg = target.config
    if cfg.model_type not in FUSED_FAMILIES:
        return f"model_type {cfg.model_type!r} is not one of {', '.join(FUSED_FAMILIES)}"
    gemma = cfg.model_type in GEMMA_FAMILIES
    if gemma:
        reason = _gemma_unsupported_reason(target)
        if reason is not None:
            return reason
    elif getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} (the fused MLP is SiLU·mul)"
    rotary = _text_model(target).rotary_emb
    for layer, layer_type in zip(target.layers, layer_rope_kinds(target), strict=True):
        inv_freq, _, rope_type = _rope_parameters(rotary, layer_type if gemma else None)
        if rope_type not in STATIC_ROPE_TYPES:
            return f"RoPE type {rope_type!r} is not one of {', '.join(STATIC_ROPE_TYPES)}"
        if 2 * inv_freq.numel() != layer.self_attn.head_dim:
            return "partial rotary embedding (of fewer frequencies than the head has pairs)"
    return None


def has_moe_blocks(target: TargetModel) -> bool:
    """Gemma-4's experts beside its dense MLP, or Qwen3-MoE's sparse layers."""
    return any(getattr(layer, "enable_moe_block", False) or hasattr(layer.mlp, "experts") for layer in target.layers)


def deterministic_unsupported_reason(target: TargetModel) -> str | None:
    """What of a fused target `engine.deterministic` cannot make batch-invariant, or None. Gemma-4's
    k_eq_v layers, KV groups of several geometries, KV-shared layers and window slots it covers."""
    if getattr(target.config, "hidden_size_per_layer_input", 0):
        # The per-layer inputs are computed by the model's own projection (a torch GEMM over all the
        # forward's rows) and norm, whose rounding may change with the number of rows.
        return "Gemma-4's per-layer inputs (hidden_size_per_layer_input > 0: E2B, E4B)"
    if has_moe_blocks(target):
        # An expert's GEMM takes the rows routed to it, whose number depends on the whole batch.
        return "mixture-of-experts blocks (an expert's rows depend on the batch)"
    return None


def rope_tables(target: TargetModel, max_positions: int) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
    """The target's cos/sin tables [max_positions, D/2] by layer type (Gemma: sliding and global
    layers rotate with their own; None: one table for all layers), exactly as transformers computes
    them: the float32 product of position and inverse frequency, times the attention scaling,
    cast to the model dtype."""
    rotary = _text_model(target).rotary_emb
    positions = torch.arange(max_positions, device=target.device, dtype=torch.float32)
    tables = {}
    for kind in dict.fromkeys(layer_rope_kinds(target)):
        inv_freq, scale, _ = _rope_parameters(rotary, kind)
        freqs = positions[:, None] * inv_freq.to(device=target.device, dtype=torch.float32)[None, :]
        tables[kind] = ((freqs.cos() * scale).to(target.dtype).contiguous(),
                        (freqs.sin() * scale).to(target.dtype).contiguous())
    return tables


def _gemma_unsupported_reason(target: TargetModel) -> str | None:
    """Gemma-3/4 configurations the fused layers do not compute (exactly), each named."""
    cfg = target.config
    if getattr(cfg, "hidden_activation", None) != GEMMA_ACTIVATION:
        return f"hidden_activation {getattr(cfg, 'hidden_activation', None)!r} (the fused MLP is {GEMMA_ACTIVATION}·mul)"
    if getattr(cfg, "attn_logit_softcapping", None):
        return "attention logit softcapping (the paged attention kernel has none)"
    if getattr(cfg, "use_bidirectional_attention", None) in (True, "all"):
        return "bidirectional attention over text tokens"
    for index, layer in enumerate(target.layers):
        attn = layer.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                 layer.post_feedforward_layernorm, attn.q_norm]
        norms += [attn.k_norm] if hasattr(attn, "k_proj") else []  # a KV-shared layer has neither
        norms += [layer.post_per_layer_input_norm] if getattr(layer, "hidden_size_per_layer_input", 0) else []
        norms += [layer.post_feedforward_layernorm_1, layer.pre_feedforward_layernorm_2,
                  layer.post_feedforward_layernorm_2] if getattr(layer, "enable_moe_block", False) else []
        for norm in norms:
            if type(norm).__name__ not in GEMMA_NORMS or not getattr(norm, "with_scale", True):
                return f"layer {index}: norm {type(norm).__name__} has no fused equivalent"
    return None


def _text_model(target: TargetModel) -> nn.Module:
    """The module that owns the decoder layers, final norm and rotary embedding (also inside a
    multimodal wrapper)."""
    for module in target.model.modules():
        if getattr(module, "layers", None) is target.layers:
            return module
    raise ValueError(f"{type(target.model).__name__}: cannot find the module holding its decoder layers")


def layer_rope_kinds(target: TargetModel) -> list[str | None]:
    """Each layer's RoPE table key: Gemma's layer type (sliding or global), else one table for all."""
    if target.config.model_type in GEMMA_FAMILIES:
        return [layer.self_attn.layer_type for layer in target.layers]
    return [None] * target.num_layers


def _rope_parameters(rotary: nn.Module, layer_type: str | None) -> tuple[torch.Tensor, float, str | None]:
    """(inverse frequencies, attention scaling, RoPE type) of one table of a transformers rotary module."""
    if layer_type is None:
        return rotary.inv_freq, rotary.attention_scaling, getattr(rotary, "rope_type", None)
    return (getattr(rotary, f"{layer_type}_inv_freq"), getattr(rotary, f"{layer_type}_attention_scaling"),
            rotary.rope_type.get(layer_type))


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


def _gemma_norm_weight(norm: nn.Module) -> torch.Tensor:
    """The float32 weight transformers multiplies a Gemma norm's output by: `1 + w` (Gemma-3) or
    `w` (Gemma-4), computed once here as it is on every call there (a copy: norms are small)."""
    weight = norm.weight.detach().float()
    return 1.0 + weight if GEMMA_NORMS[type(norm).__name__] else weight.clone()


@dataclass
class FusedLayer:
    """One decoder layer's weights in the fused layout."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor  # HF's post_attention_layernorm: Llama's MLP input norm, Gemma's attention output norm
    qkv: SkinnyLinear | InvariantLinear
    o: SkinnyLinear | InvariantLinear
    gate_up: SkinnyLinear | InvariantLinear | None  # None: a Qwen3-MoE sparse layer (its experts are its MLP)
    down: SkinnyLinear | InvariantLinear | None
    q_norm: torch.Tensor | None  # Qwen3's and Gemma's per-head norms
    k_norm: torch.Tensor | None
    scaling: float
    window: int | None
    causal: bool
    # The layer's own cos/sin table by position (a target's layers; Gemma's sliding and global layers
    # differ); None: the table passed to `FusedStack.forward` (the drafter's, by row).
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    pre_feedforward_norm: torch.Tensor | None = None  # Gemma's sandwich norms
    post_feedforward_norm: torch.Tensor | None = None
    v_norm: bool = False  # Gemma-4 RMS-normalizes values (no weight)
    num_kv_heads: int | None = None  # the layer's own (Gemma-4 global layers); None: the stack's
    values_from_keys: bool = False  # Gemma-4 `attention_k_eq_v`: no value projection, V is K's raw projection
    # (key norm weight, cos, sin) where the cache keeps values only and the keys are derived from them
    keys_from_values: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    layer_scalar: torch.Tensor | None = None  # Gemma-4: the layer's output residual is scaled by it
    per_layer_input: PerLayerInput | None = None  # Gemma-4 E2B/E4B
    moe: Qwen3MoeBlock | Gemma4MoeBlock | None = None

    @classmethod
    def from_layer(cls, layer: nn.Module, *, scaling: float, window: int | None, causal: bool = True,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None, linear: Linear = SkinnyLinear) -> FusedLayer:
        """From a Llama/Qwen-style layer (HF's, or the drafter's: the same module names); its GEMMs
        are `linear`s."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _merged([attn.q_proj, attn.k_proj, attn.v_proj])
        moe = Qwen3MoeBlock.from_module(mlp, silu_mul) if hasattr(mlp, "experts") else None
        dense = None if moe is not None else _merged([mlp.gate_proj, mlp.up_proj])
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return cls(
            input_norm=layer.input_layernorm.weight.detach(),
            post_attention_norm=layer.post_attention_layernorm.weight.detach(),
            qkv=linear(qkv, qkv_bias),
            o=linear(attn.o_proj.weight.detach(), _param(attn.o_proj.bias)),
            gate_up=None if dense is None else linear(*dense),
            down=None if dense is None else linear(mlp.down_proj.weight.detach(), _param(mlp.down_proj.bias)),
            q_norm=None if q_norm is None else q_norm.weight.detach(),
            k_norm=None if k_norm is None else k_norm.weight.detach(),
            scaling=scaling, window=window, causal=causal, rope=rope, moe=moe,
        )

    @classmethod
    def from_gemma_layer(cls, layer: nn.Module, *, rope: tuple[torch.Tensor, torch.Tensor],
                         num_kv_heads: int, linear: Linear = SkinnyLinear) -> FusedLayer:
        """From a Gemma-3/4 decoder layer: four norms, q/k norms (and Gemma-4's value norm); a
        Gemma-4 layer may have no value projection (k_eq_v), no K/V of its own (it reads an
        earlier layer's), a per-layer input and an output scale. Its GEMMs are `linear`s."""
        attn, mlp = layer.self_attn, layer.mlp
        projections = [attn.q_proj] + [p for p in (getattr(attn, "k_proj", None), getattr(attn, "v_proj", None))
                                       if p is not None]
        qkv, qkv_bias = _merged(projections)
        gate_up, gate_up_bias = _merged([mlp.gate_proj, mlp.up_proj])
        scalar = getattr(layer, "layer_scalar", None)
        return cls(
            input_norm=_gemma_norm_weight(layer.input_layernorm),
            post_attention_norm=_gemma_norm_weight(layer.post_attention_layernorm),
            qkv=linear(qkv, qkv_bias),
            o=linear(attn.o_proj.weight.detach(), _param(attn.o_proj.bias)),
            gate_up=linear(gate_up, gate_up_bias),
            down=linear(mlp.down_proj.weight.detach(), _param(mlp.down_proj.bias)),
            q_norm=_gemma_norm_weight(attn.q_norm),
            k_norm=_gemma_norm_weight(attn.k_norm) if hasattr(attn, "k_norm") else None,
            scaling=float(attn.scaling), window=attn.sliding_window, causal=True, rope=rope,
            pre_feedforward_norm=_gemma_norm_weight(layer.pre_feedforward_layernorm),
            post_feedforward_norm=_gemma_norm_weight(layer.post_feedforward_layernorm),
            v_norm=hasattr(attn, "v_norm"),
            num_kv_heads=num_kv_heads,
            values_from_keys=hasattr(attn, "k_proj") and getattr(attn, "v_proj", None) is None,
            # Gemma-3 and unscaled Gemma-4 layers skip the multiply (and keep their fused add + norm).
            layer_scalar=None if scalar is None or bool(torch.all(scalar == 1)) else scalar.detach(),
            per_layer_input=PerLayerInput.from_layer(layer) if getattr(layer, "hidden_size_per_layer_input", 0)
            else None,
            moe=Gemma4MoeBlock.from_layer(layer, gelu_tanh_mul, _gemma_norm_weight)
            if getattr(layer, "enable_moe_block", False) else None,
        )


@dataclass
class PerLayerInput:
    """Gemma-4's per-layer input (E2B/E4B): after the MLP's residual add, residual +=
    norm(projection(gelu_tanh(gate(residual)) · the layer's slice of the per-layer embeddings))."""

    gate: SkinnyLinear
    projection: SkinnyLinear
    norm: torch.Tensor

    @classmethod
    def from_layer(cls, layer: nn.Module) -> PerLayerInput:
        return cls(SkinnyLinear(layer.per_layer_input_gate.weight.detach(), None),
                   SkinnyLinear(layer.per_layer_projection.weight.detach(), None),
                   _gemma_norm_weight(layer.post_per_layer_input_norm))


@dataclass
class FusedStack:
    """Decoder layers in the fused layout over one paged KV pool: the target's, or the drafter's
    block forward (the same layer, non-causal where the drafter says so).

    `gemma`: the layers are Gemma's (sandwich norms scaled in float32, GELU-tanh MLP).
    `batch_invariant`: attention by `paged_attention_invariant` (a row's bits independent of the
    batch; the layers' GEMMs must then be InvariantLinear too).
    `all_reduce`: the layers are a tensor-parallel shard (`tensor_parallel`): the O and down
    projections' partial sums go through it; None: the whole layers."""

    layers: list[FusedLayer]
    final_norm: torch.Tensor
    pool: KVPool
    num_heads: int
    num_kv_heads: int
    eps: float
    gemma: bool = False
    batch_invariant: bool = False
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __post_init__(self):
        self.activation: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh_mul if self.gemma else silu_mul

    def forward(self, hidden: torch.Tensor, rope_index: torch.Tensor, cos: torch.Tensor | None,
                sin: torch.Tensor | None, batch: AttentionBatch, on_residual=None,
                per_layer_inputs: torch.Tensor | None = None) -> torch.Tensor:
        """Packed rows [T, H] -> final-normed hidden states [T, H]. Row t is rotated by
        cos/sin[rope_index[t]] (a layer's own table, else the one given here); `on_residual(k,
        residual)` sees the residual stream after layer k (it is the sum the next fused add produces).
        `per_layer_inputs` [T, layers, P]: Gemma-4's per-layer inputs, for layers that take one."""
        # Sliding-window layers whose K/V live in window slots attend through the slots' view.
        batches = (batch, None if self.pool.window_map is None else self.pool.window_batch(batch))
        if self.gemma:
            return self._forward_gemma(hidden, rope_index, cos, sin, batches, on_residual, per_layer_inputs)
        residual = None
        for index, layer in enumerate(self.layers):
            if residual is None:
                x, residual = rms_norm(hidden, layer.input_norm, self.eps), hidden
            else:
                x, residual = add_rms_norm(hidden, residual, layer.input_norm, self.eps)
                if on_residual is not None:
                    on_residual(index - 1, residual)
            hidden = self._attention(index, layer, x, rope_index, cos, sin, batches)
            x, residual = add_rms_norm(hidden, residual, layer.post_attention_norm, self.eps)
            hidden = self._mlp(layer, x, residual)
        x, residual = add_rms_norm(hidden, residual, self.final_norm, self.eps)
        if on_residual is not None:
            on_residual(len(self.layers) - 1, residual)
        return x

    def _forward_gemma(self, hidden: torch.Tensor, rope_index: torch.Tensor, cos: torch.Tensor | None,
                       sin: torch.Tensor | None, batches: tuple[AttentionBatch, AttentionBatch | None], on_residual,
                       per_layer_inputs: torch.Tensor | None) -> torch.Tensor:
        """residual += post_norm(sublayer(pre_norm(residual))) for attention, then MLP: each
        sublayer's post-norm, residual add and the next pre-norm are one launch. A Gemma-4 layer
        with a per-layer input or an output scale adds and scales its residual first, then norms."""
        x, residual = rms_norm(hidden, self.layers[0].input_norm, self.eps, scale_in_float32=True), hidden
        for index, layer in enumerate(self.layers):
            hidden = self._attention(index, layer, x, rope_index, cos, sin, batches)
            x, residual = add_rms_norm(hidden, residual, layer.pre_feedforward_norm, self.eps,
                                       x_norm_weight=layer.post_attention_norm, scale_in_float32=True)
            hidden = self._mlp(layer, x, residual)
            next_norm = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm
            if layer.per_layer_input is None and layer.layer_scalar is None:
                x, residual = add_rms_norm(hidden, residual, next_norm, self.eps,
                                           x_norm_weight=layer.post_feedforward_norm, scale_in_float32=True)
            else:
                residual = residual + rms_norm(hidden, layer.post_feedforward_norm, self.eps, scale_in_float32=True)
                if layer.per_layer_input is not None:
                    residual = residual + self._per_layer_input(layer.per_layer_input, residual,
                                                                per_layer_inputs[:, index])
                if layer.layer_scalar is not None:
                    residual = residual * layer.layer_scalar
                x = rms_norm(residual, next_norm, self.eps, scale_in_float32=True)
            if on_residual is not None:
                on_residual(index, residual)
        return x

    def _per_layer_input(self, ple: PerLayerInput, residual: torch.Tensor, layer_input: torch.Tensor) -> torch.Tensor:
        gated = torch.nn.functional.gelu(ple.gate(residual), approximate="tanh") * layer_input
        return rms_norm(ple.projection(gated), ple.norm, self.eps, scale_in_float32=True)

    def _attention(self, index: int, layer: FusedLayer, x: torch.Tensor, rope_index: torch.Tensor,
                   cos: torch.Tensor | None, sin: torch.Tensor | None,
                   batches: tuple[AttentionBatch, AttentionBatch | None]) -> torch.Tensor:
        """One layer's attention on its normed input -> the O projection's output."""
        k_cache, v_cache = self.pool.layer(index)
        batch = batches[1] if self.pool.windowed(index) else batches[0]
        if layer.rope is not None:
            cos, sin = layer.rope
        qkv = layer.qkv(x)
        # A layer reading an earlier layer's K/V (Gemma-4 KV sharing) projects queries only.
        writes = self.pool.stores(index)
        q = rope_kv_write(qkv, rope_index, cos, sin, batch.slot_mapping, k_cache if writes else None,
                          v_cache if writes else None, num_heads=self.num_heads,
                          num_kv_heads=layer.num_kv_heads or self.num_kv_heads,
                          q_norm_weight=layer.q_norm, k_norm_weight=layer.k_norm, eps=self.eps,
                          scale_in_float32=self.gemma, v_norm=layer.v_norm, values_from_keys=layer.values_from_keys,
                          batch_invariant=self.batch_invariant)
        attention = paged_attention_invariant if self.batch_invariant else paged_attention
        attn = attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start,
                         scale=layer.scaling, causal=layer.causal, window=layer.window,
                         max_query_len=batch.max_query_len, keys_from_values=layer.keys_from_values)
        out = layer.o(attn.view(attn.shape[0], -1))
        return out if self.all_reduce is None else self.all_reduce(out)

    def _mlp(self, layer: FusedLayer, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The feed-forward output on its normed input x; `residual`: the stream x was normed from
        (Gemma-4's experts read it)."""
        dense = None if layer.gate_up is None else layer.down(self.activation(layer.gate_up(x)))
        if self.all_reduce is not None:  # a shard has no MoE blocks (tensor_parallel refuses them)
            return self.all_reduce(dense)
        return dense if layer.moe is None else layer.moe(x, residual, dense)


class FusedTargetRunner:
    """Runs a `TargetModel` of a fused family over packed tokens with its KV in a `KVPool`.

    `deterministic` (`EngineConfig.deterministic`): every GEMM (the LM head's too) is an
    InvariantLinear and attention is batch-invariant, so a token's logits have the same bits in a
    decode, a verify or a prefill, whatever else is in the batch (the norms, RoPE, activations and
    the embedding are per-row kernels already).

    `tp`: `target` is this rank's shard (`tensor_parallel.shard_target`) and `pool` holds its KV
    heads: the layers all-reduce, the embedding and LM head are its vocabulary slice's, and
    `forward` (rank 0) sends each forward's inputs to the other ranks first."""

    def __init__(self, target: TargetModel, pool: KVPool, *, max_positions: int, deterministic: bool = False,
                 tp: TensorParallel | None = None):
        reason = fused_unsupported_reason(target)
        if reason is not None:
            raise ValueError(f"{type(target.model).__name__}: no fused forward ({reason}); use target_impl=transformers")
        reason = deterministic_unsupported_reason(target) if deterministic else None
        if reason is not None:
            raise ValueError(f"engine.deterministic does not cover {reason} yet ({type(target.model).__name__}); "
                             "turn it off to serve this target")
        self.target = target
        self.pool = pool
        self.tp = tp
        cfg = target.config
        text_model = _text_model(target)
        gemma = cfg.model_type in GEMMA_FAMILIES
        linear = InvariantLinear if deterministic else SkinnyLinear
        # One cos/sin table per layer type (Gemma: sliding layers rotate with a local base), shared.
        tables = rope_tables(target, max_positions)
        kv_heads = [spec.num_kv_heads for spec in pool.layout]
        with torch.no_grad():
            if gemma:
                layers = [FusedLayer.from_gemma_layer(layer, rope=tables[kind], num_kv_heads=heads, linear=linear)
                          for layer, kind, heads in zip(target.layers, layer_rope_kinds(target), kv_heads, strict=True)]
                final_norm = _gemma_norm_weight(text_model.norm)
            else:
                layers = [FusedLayer.from_layer(layer, scaling=float(layer.self_attn.scaling), rope=tables[None],
                                                window=getattr(layer.self_attn, "sliding_window", None), linear=linear)
                          for layer in target.layers]
                final_norm = text_model.norm.weight.detach()
        # A layer whose keys the cache derives from its values (k_eq_v; or one reading such a
        # layer's K/V) attends with the storing layer's key norm and its own RoPE table.
        for index, (layer, spec) in enumerate(zip(layers, pool.layout, strict=True)):
            if spec.keys_from_values:
                owner = index if spec.reads_layer is None else spec.reads_layer
                layer.keys_from_values = (layers[owner].k_norm, *layer.rope)
        world = 1 if tp is None else tp.world
        self.stack = FusedStack(layers, final_norm, pool, cfg.num_attention_heads // world, kv_heads[0],
                                float(cfg.rms_norm_eps), gemma=gemma, batch_invariant=deterministic,
                                all_reduce=None if tp is None else tp.all_reduce)
        # None: the target's own LM head (a SkinnyLinear, which hands more than 16 rows to cuBLAS).
        self.lm_head = InvariantLinear(target.lm_head.weight, target.lm_head.bias) if deterministic else None
        # Gemma-4 E2B/E4B: the per-layer inputs are computed once per forward by the model's own
        # embedding, projection and norm (a few small ops), then each layer takes its slice.
        self._text_model = text_model if getattr(cfg, "hidden_size_per_layer_input", 0) else None
        self.capture: dict[int, list[int]] = {}  # layer -> its feature slots (a layer may be listed twice)
        for slot, k in enumerate(target.layer_ids):
            self.capture.setdefault(k, []).append(slot)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, logits_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Packed tokens [T] at positions [T] -> (logits [K, V] of rows `logits_rows`, features [T, F*H])."""
        if self.tp is None:
            return self.forward_shard(input_ids, positions, batch, logits_rows)
        return self.tp.lead(self.forward_shard, input_ids, positions, batch, logits_rows, self.pool.window_map)

    def forward_shard(
        self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, logits_rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward` on this rank alone (every rank of a tensor-parallel group runs it on the same inputs)."""
        features: list[torch.Tensor | None] = [None] * len(self.target.layer_ids)

        def keep(layer: int, residual: torch.Tensor) -> None:
            for slot in self.capture.get(layer, ()):
                features[slot] = residual

        embeds = self.target.embed(input_ids) if self.tp is None else self.tp.embed(input_ids)
        per_layer_inputs = None
        if self._text_model is not None:
            per_layer_inputs = self._text_model.project_per_layer_inputs(
                embeds[None], self._text_model.get_per_layer_inputs(input_ids[None], None))[0]
        # Every target layer carries its RoPE table: none is passed to the stack.
        x = self.stack.forward(embeds, positions, None, None, batch, keep, per_layer_inputs)
        if self.tp is None:
            logits = self.target.logits(x[logits_rows], self.lm_head)
        else:
            logits = self.tp.logits(self.target, x[logits_rows])
        return logits, torch.cat(features, dim=-1) if features else None
