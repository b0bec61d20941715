"""The target's forward for Llama, Qwen2, Qwen3 and Gemma-3/4 dense models, written out with fused kernels.

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
The layer count of launches is the same nine.

q/k/v and gate/up are each one GEMM over weights concatenated at load; a GEMM of at most 16 rows
(decode, a batch-1 verify, the draft) is one launch of `dflash_serve.kernels.SkinnyLinear`'s kernel, where
cuBLAS would add a split-K reduce (and is slower at these shapes: BENCHMARKS.md); the HF modules' parameters
are re-pointed at slices of those (contiguous row blocks), so no weight is held twice and the HF
model stays usable for plain forwards and training. Feature k (the residual stream after layer k,
HF's `hidden_states[k + 1]`) is the sum the next fused add produces, so no hook is needed.

Other architectures, RoPE types whose frequencies change with the sequence (dynamic NTK,
LongRoPE), partial rotary, attention logit softcapping, and the Gemma-4 features listed in
`fused_unsupported_reason` stay on `TargetRunner`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
from dflash_serve.services.engine.kv_cache import AttentionBatch, KVPool
from dflash_serve.services.models.target import TargetModel

LLAMA_FAMILIES = ("llama", "qwen2", "qwen3")
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
    head_dim = _kv_head_dim(target)
    for layer_type in _layer_types(target):
        inv_freq, _, rope_type = _rope_parameters(rotary, layer_type if gemma else None)
        if rope_type not in STATIC_ROPE_TYPES:
            return f"RoPE type {rope_type!r} is not one of {', '.join(STATIC_ROPE_TYPES)}"
        if 2 * inv_freq.numel() != head_dim:
            return "partial rotary embedding"
    return None


def _gemma_unsupported_reason(target: TargetModel) -> str | None:
    """Gemma-3/4 configurations the fused layers do not compute (exactly), each named."""
    cfg = target.config
    if getattr(cfg, "hidden_activation", None) != GEMMA_ACTIVATION:
        return f"hidden_activation {getattr(cfg, 'hidden_activation', None)!r} (the fused MLP is {GEMMA_ACTIVATION}·mul)"
    if getattr(cfg, "attn_logit_softcapping", None):
        return "attention logit softcapping (the paged attention kernel has none)"
    if getattr(cfg, "use_bidirectional_attention", None) in (True, "all"):
        return "bidirectional attention over text tokens"
    if getattr(cfg, "enable_moe_block", False):
        return "Gemma-4 mixture-of-experts blocks"
    if getattr(cfg, "hidden_size_per_layer_input", 0):
        return "Gemma-4 per-layer input embeddings (hidden_size_per_layer_input > 0)"
    if getattr(cfg, "num_kv_shared_layers", 0):
        return "Gemma-4 KV sharing between layers (num_kv_shared_layers > 0)"
    if getattr(cfg, "attention_k_eq_v", False):
        return "Gemma-4 global layers whose values are their keys (attention_k_eq_v)"
    head_dim, kv_heads = _kv_head_dim(target), _kv_heads(target)
    for index, layer in enumerate(target.layers):
        attn = layer.self_attn
        if attn.head_dim != head_dim or attn.k_proj.out_features != kv_heads * head_dim:
            return (f"layer {index} has {attn.k_proj.out_features // attn.head_dim} KV heads of {attn.head_dim} "
                    f"where layer 0 has {kv_heads} of {head_dim} (Gemma-4 global layers of another head size; "
                    "the KV pool has one head shape)")
        scalar = getattr(layer, "layer_scalar", None)
        if scalar is not None and not bool(torch.all(scalar == 1)):
            return f"layer {index} scales its output (Gemma-4 layer_scalar != 1)"
        norms = (layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                 layer.post_feedforward_layernorm, attn.q_norm, attn.k_norm)
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


def _layer_types(target: TargetModel) -> list[str | None]:
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


def _kv_head_dim(target: TargetModel) -> int:
    return target.layers[0].self_attn.head_dim


def _kv_heads(target: TargetModel) -> int:
    cfg = target.config
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


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
    gate_up: SkinnyLinear | InvariantLinear
    down: SkinnyLinear | InvariantLinear
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

    @classmethod
    def from_layer(cls, layer: nn.Module, *, scaling: float, window: int | None, causal: bool = True,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None, linear: Linear = SkinnyLinear) -> FusedLayer:
        """From a Llama/Qwen-style layer (HF's, or the drafter's: the same module names); its GEMMs
        are `linear`s."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv, qkv_bias = _merged([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up, gate_up_bias = _merged([mlp.gate_proj, mlp.up_proj])
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        return cls(
            input_norm=layer.input_layernorm.weight.detach(),
            post_attention_norm=layer.post_attention_layernorm.weight.detach(),
            qkv=linear(qkv, qkv_bias),
            o=linear(attn.o_proj.weight.detach(), _param(attn.o_proj.bias)),
            gate_up=linear(gate_up, gate_up_bias),
            down=linear(mlp.down_proj.weight.detach(), _param(mlp.down_proj.bias)),
            q_norm=None if q_norm is None else q_norm.weight.detach(),
            k_norm=None if k_norm is None else k_norm.weight.detach(),
            scaling=scaling, window=window, causal=causal, rope=rope,
        )

    @classmethod
    def from_gemma_layer(cls, layer: nn.Module, *, rope: tuple[torch.Tensor, torch.Tensor],
                         linear: Linear = SkinnyLinear) -> FusedLayer:
        """From a Gemma-3/4 decoder layer: four norms, q/k norms (and Gemma-4's value norm)."""
        attn = layer.self_attn
        fused = cls.from_layer(layer, scaling=float(attn.scaling), window=attn.sliding_window, rope=rope,
                               linear=linear)
        fused.input_norm = _gemma_norm_weight(layer.input_layernorm)
        fused.post_attention_norm = _gemma_norm_weight(layer.post_attention_layernorm)
        fused.pre_feedforward_norm = _gemma_norm_weight(layer.pre_feedforward_layernorm)
        fused.post_feedforward_norm = _gemma_norm_weight(layer.post_feedforward_layernorm)
        fused.q_norm, fused.k_norm = _gemma_norm_weight(attn.q_norm), _gemma_norm_weight(attn.k_norm)
        fused.v_norm = hasattr(attn, "v_norm")
        return fused


@dataclass
class FusedStack:
    """Decoder layers in the fused layout over one paged KV pool: the target's, or the drafter's
    block forward (the same layer, non-causal where the drafter says so).

    `gemma`: the layers are Gemma's (sandwich norms scaled in float32, GELU-tanh MLP).
    `batch_invariant`: attention by `paged_attention_invariant` (a row's bits independent of the
    batch; the layers' GEMMs must then be InvariantLinear too)."""

    layers: list[FusedLayer]
    final_norm: torch.Tensor
    pool: KVPool
    num_heads: int
    num_kv_heads: int
    eps: float
    gemma: bool = False
    batch_invariant: bool = False

    def __post_init__(self):
        self.activation: Callable[[torch.Tensor], torch.Tensor] = gelu_tanh_mul if self.gemma else silu_mul

    def forward(self, hidden: torch.Tensor, rope_index: torch.Tensor, cos: torch.Tensor | None,
                sin: torch.Tensor | None, batch: AttentionBatch, on_residual=None) -> torch.Tensor:
        """Packed rows [T, H] -> final-normed hidden states [T, H]. Row t is rotated by
        cos/sin[rope_index[t]] (a layer's own table, else the one given here); `on_residual(k,
        residual)` sees the residual stream after layer k (it is the sum the next fused add produces)."""
        if self.gemma:
            return self._forward_gemma(hidden, rope_index, cos, sin, batch, on_residual)
        residual = None
        for index, layer in enumerate(self.layers):
            if residual is None:
                x, residual = rms_norm(hidden, layer.input_norm, self.eps), hidden
            else:
                x, residual = add_rms_norm(hidden, residual, layer.input_norm, self.eps)
                if on_residual is not None:
                    on_residual(index - 1, residual)
            hidden = self._attention(index, layer, x, rope_index, cos, sin, batch)
            x, residual = add_rms_norm(hidden, residual, layer.post_attention_norm, self.eps)
            hidden = self._mlp(layer, x)
        x, residual = add_rms_norm(hidden, residual, self.final_norm, self.eps)
        if on_residual is not None:
            on_residual(len(self.layers) - 1, residual)
        return x

    def _forward_gemma(self, hidden: torch.Tensor, rope_index: torch.Tensor, cos: torch.Tensor | None,
                       sin: torch.Tensor | None, batch: AttentionBatch, on_residual) -> torch.Tensor:
        """residual += post_norm(sublayer(pre_norm(residual))) for attention, then MLP: each
        sublayer's post-norm, residual add and the next pre-norm are one launch."""
        x, residual = rms_norm(hidden, self.layers[0].input_norm, self.eps, scale_in_float32=True), hidden
        for index, layer in enumerate(self.layers):
            hidden = self._attention(index, layer, x, rope_index, cos, sin, batch)
            x, residual = add_rms_norm(hidden, residual, layer.pre_feedforward_norm, self.eps,
                                       x_norm_weight=layer.post_attention_norm, scale_in_float32=True)
            hidden = self._mlp(layer, x)
            next_norm = self.layers[index + 1].input_norm if index + 1 < len(self.layers) else self.final_norm
            x, residual = add_rms_norm(hidden, residual, next_norm, self.eps,
                                       x_norm_weight=layer.post_feedforward_norm, scale_in_float32=True)
            if on_residual is not None:
                on_residual(index, residual)
        return x

    def _attention(self, index: int, layer: FusedLayer, x: torch.Tensor, rope_index: torch.Tensor,
                   cos: torch.Tensor | None, sin: torch.Tensor | None, batch: AttentionBatch) -> torch.Tensor:
        """One layer's attention on its normed input -> the O projection's output."""
        k_cache, v_cache = self.pool.k[index], self.pool.v[index]
        if layer.rope is not None:
            cos, sin = layer.rope
        qkv = layer.qkv(x)
        q = rope_kv_write(qkv, rope_index, cos, sin, batch.slot_mapping, k_cache, v_cache,
                          num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                          q_norm_weight=layer.q_norm, k_norm_weight=layer.k_norm, eps=self.eps,
                          scale_in_float32=self.gemma, v_norm=layer.v_norm)
        attention = paged_attention_invariant if self.batch_invariant else paged_attention
        attn = attention(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start,
                               scale=layer.scaling, causal=layer.causal, window=layer.window,
                               max_query_len=batch.max_query_len)
        return layer.o(attn.view(attn.shape[0], -1))

    def _mlp(self, layer: FusedLayer, x: torch.Tensor) -> torch.Tensor:
        return layer.down(self.activation(layer.gate_up(x)))


class FusedTargetRunner:
    """Runs a `TargetModel` of a fused family over packed tokens with its KV in a `KVPool`.

    `deterministic` (`EngineConfig.deterministic`): every GEMM (the LM head's too) is an
    InvariantLinear and attention is batch-invariant, so a token's logits have the same bits in a
    decode, a verify or a prefill, whatever else is in the batch (the norms, RoPE, activations and
    the embedding are per-row kernels already)."""

    def __init__(self, target: TargetModel, pool: KVPool, *, max_positions: int, deterministic: bool = False):
        reason = fused_unsupported_reason(target)
        if reason is not None:
            raise ValueError(f"{type(target.model).__name__}: no fused forward ({reason}); use target_impl=transformers")
        self.target = target
        self.pool = pool
        cfg = target.config
        text_model = _text_model(target)
        gemma = cfg.model_type in GEMMA_FAMILIES
        linear = InvariantLinear if deterministic else SkinnyLinear
        # One cos/sin table per layer type (Gemma: sliding layers rotate with a local base), shared.
        tables = {kind: self._rope_table(text_model.rotary_emb, kind, max_positions, target.dtype, target.device)
                  for kind in dict.fromkeys(_layer_types(target))}
        with torch.no_grad():
            if gemma:
                layers = [FusedLayer.from_gemma_layer(layer, rope=tables[kind], linear=linear)
                          for layer, kind in zip(target.layers, _layer_types(target), strict=True)]
                final_norm = _gemma_norm_weight(text_model.norm)
            else:
                layers = [FusedLayer.from_layer(layer, scaling=float(layer.self_attn.scaling), rope=tables[None],
                                                window=getattr(layer.self_attn, "sliding_window", None), linear=linear)
                          for layer in target.layers]
                final_norm = text_model.norm.weight.detach()
        self.stack = FusedStack(layers, final_norm, pool, cfg.num_attention_heads, _kv_heads(target),
                                float(cfg.rms_norm_eps), gemma=gemma, batch_invariant=deterministic)
        # None: the target's own LM head (a SkinnyLinear, which hands more than 16 rows to cuBLAS).
        self.lm_head = InvariantLinear(target.lm_head.weight, target.lm_head.bias) if deterministic else None
        self.capture: dict[int, list[int]] = {}  # layer -> its feature slots (a layer may be listed twice)
        for slot, k in enumerate(target.layer_ids):
            self.capture.setdefault(k, []).append(slot)

    @staticmethod
    def _rope_table(rotary: nn.Module, layer_type: str | None, max_positions: int, dtype: torch.dtype,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [max_positions, D/2] exactly as transformers computes them (float32 product of
        position and inverse frequency, times the attention scaling, cast to the model dtype)."""
        inv_freq, scale, _ = _rope_parameters(rotary, layer_type)
        positions = torch.arange(max_positions, device=device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.to(device=device, dtype=torch.float32)[None, :]
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

        # Every target layer carries its RoPE table: none is passed to the stack.
        x = self.stack.forward(self.target.embed(input_ids), positions, None, None, batch, keep)
        logits = self.target.logits(x[logits_rows], self.lm_head)
        return logits, torch.cat(features, dim=-1) if features else None
