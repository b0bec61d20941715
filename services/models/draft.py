"""The DFlash draft model (dflash-spec §1), readable top to bottom.

One forward drafts a whole block: the block `[bonus, MASK × (B−1)]` at positions s..s+B−1 runs
through L Qwen3-style layers whose attention keys/values are the context features (projected by
each layer's own k/v weights — "KV injection") followed by the block's own keys/values. Slot j's
output predicts the token at position s+j; slot 0 is discarded. Embedding and LM head are the
target's (passed in as a `TargetModel`), so the checkpoint holds neither.

The context side is split out (`fuse_context`, `context_kv`) because the engine computes it once
per committed token and keeps it in a KV cache; `forward` then only runs the B block slots.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dflash_serve.kernels import rms_norm
from dflash_serve.services.models.draft_config import DFlashDraftConfig
from dflash_serve.services.models.rope import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from dflash_serve.services.models.target import TargetModel


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: normalise in (at least) float32, cast back, then scale by the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DraftAttentionContext(Protocol):
    """Where the context keys/values live and how a block attends over them.

    `attend` gets one layer's block queries [N, nh, B, hd], block keys/values [N, nkv, B, hd]
    (normed and rotated) and the block positions [N, B]; it returns the attention output
    [N, nh, B, hd] over context + block.
    `DraftContext` below keeps the context dense in memory; the engine's implementation keeps it
    in a paged KV pool. The model code is the same for both.
    """

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, *,
               causal: bool, window: int | None) -> torch.Tensor: ...


@dataclass
class DraftContext:
    """Dense context keys/values of every draft layer for a batch of N sequences, padded to T rows.

    kv[i] = (k, v), each [N, num_kv_heads, T, head_dim], k already normed and rotated.
    positions [N, T] are absolute positions; valid [N, T] marks the real (non-padding) rows.
    """

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    positions: torch.Tensor
    valid: torch.Tensor

    def attend(self, layer, q, k, v, positions, *, causal, window):
        key_positions = torch.cat([self.positions, positions], dim=1)
        key_valid = torch.cat([self.valid, torch.ones_like(positions, dtype=torch.bool)], dim=1)
        visible = visible_keys(positions, key_positions, key_valid, causal=causal, window=window)
        k = torch.cat([self.kv[layer][0], k], dim=2)  # context first, then the block
        v = torch.cat([self.kv[layer][1], v], dim=2)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=visible, scale=q.shape[-1] ** -0.5, enable_gqa=q.shape[1] != k.shape[1]
        )


def visible_keys(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor,
    *,
    causal: bool,
    window: int | None,
) -> torch.Tensor:
    """Which keys each block query may attend to (spec §1.5) -> bool [N, 1, B, K].

    Non-causal: every valid key. Causal: keys at positions <= the query's. Sliding window W:
    keys with q - k < W (and k - q < W when non-causal).
    """
    q = query_positions[:, :, None]
    k = key_positions[:, None, :]
    visible = key_valid[:, None, :].expand(-1, q.shape[1], -1)
    if causal:
        visible = visible & (k <= q)
    if window is not None:
        visible = visible & (q - k < window)
        if not causal:
            visible = visible & (k - q < window)
    return visible[:, None]


class DraftAttention(nn.Module):
    def __init__(self, config: DFlashDraftConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[N, T, heads*hd] -> [N, heads, T, hd]"""
        return x.view(*x.shape[:2], heads, self.head_dim).transpose(1, 2)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_proj → k_norm → RoPE) and values of rows x [N, T, H] -> 2 × [N, nkv, T, hd]."""
        k = apply_rotary(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        return k, self._heads(self.v_proj(x), self.num_kv_heads)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                context: DraftAttentionContext, layer: int, causal: bool, window: int | None) -> torch.Tensor:
        q = apply_rotary(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        k, v = self.project_kv(x, cos, sin)
        out = context.attend(layer, q, k, v, positions, causal=causal, window=window)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:2], -1))


class DraftMLP(nn.Module):
    def __init__(self, config: DFlashDraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, config: DFlashDraftConfig, index: int):
        super().__init__()
        self.index = index
        self.causal = config.layer_is_causal(index)
        self.window = config.layer_window(index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def forward(self, x, cos, sin, positions, context: DraftAttentionContext) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + self.self_attn(h, cos, sin, positions, context, self.index, self.causal, self.window)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraftModel(nn.Module):
    def __init__(self, config: DFlashDraftConfig):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rope, config.head_dim)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    # -- context side: once per committed token -------------------------------------------------

    def fuse_context(self, features: torch.Tensor) -> torch.Tensor:
        """Concatenated target features [..., F*H] -> fused context rows [..., H] (spec §1.3)."""
        return self.hidden_norm(self.fc(features.to(self.dtype)))

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Target features [N, T, F*H] at absolute positions [N, T] -> every layer's context (k, v)."""
        ctx = self.fuse_context(features)
        cos, sin = self.rotary.cos_sin(positions, self.dtype)
        return [layer.self_attn.project_kv(ctx, cos, sin) for layer in self.layers]

    # -- block side: one forward per round ------------------------------------------------------

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                context: DraftAttentionContext) -> torch.Tensor:
        """Block embeddings [N, B, H] at positions [N, B] -> final-normed hidden states [N, B, H]."""
        x = block_embeds.to(self.dtype)
        cos, sin = self.rotary.cos_sin(block_positions, self.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, block_positions, context)
        return self.norm(x)

    # -- the target's embedding and LM head -----------------------------------------------------

    def check_target(self, target: TargetModel) -> None:
        """Refuse a target this drafter cannot run against, saying what does not fit."""
        cfg = self.config
        if target.hidden_size != cfg.hidden_size:
            raise ValueError(f"drafter hidden_size={cfg.hidden_size} but the target's is {target.hidden_size}")
        if not 0 <= cfg.mask_token_id < target.embedding_rows:
            raise ValueError(
                f"drafter mask_token_id={cfg.mask_token_id} is not a row of the target embedding "
                f"({target.embedding_rows} rows): this drafter was trained for another target"
            )
        if max(cfg.target_layer_ids) >= target.num_layers:
            raise ValueError(
                f"drafter target_layer_ids={list(cfg.target_layer_ids)} need a target with more than "
                f"{max(cfg.target_layer_ids)} layers; this one has {target.num_layers}"
            )
        if tuple(target.layer_ids) != cfg.target_layer_ids:
            raise ValueError(f"target captures layers {list(target.layer_ids)}, drafter needs {list(cfg.target_layer_ids)}")

    def embed_block(self, target: TargetModel, block_ids: torch.Tensor) -> torch.Tensor:
        """Block ids -> embeddings, exactly as the drafter was trained to see them (spec §1.7).

        A checkpoint that states `input_embedding_scale` scales the raw table lookup by it (the
        newest reference); otherwise the target's own input embedding is used, including any
        scaling it applies (Gemma's × sqrt(H), rounded in the target's dtype).
        """
        if self.config.input_embedding_scale is not None:
            raw = F.embedding(block_ids, target.input_embeddings.weight)
            return raw * torch.tensor(self.config.input_embedding_scale, dtype=raw.dtype)
        return target.embed(block_ids)

    def logits(self, target: TargetModel, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits through the target's LM head; the drafter's own multiplier and softcap
        apply when its config states them, else the target's softcap (Gemma)."""
        # hidden is a strided slice (the block minus its bonus row): cuBLAS takes a path ~10x slower
        # for it than for the contiguous copy (9.2 vs 0.8 ms at 32x15 rows into a 152k vocabulary, H200).
        logits = target.lm_head(hidden.to(target.dtype).contiguous())
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping or target.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def draft_logits(
        self, target: TargetModel, bonus_ids: torch.Tensor, start: torch.Tensor, context: DraftAttentionContext
    ) -> torch.Tensor:
        """One round's proposal: bonus token ids [N] at positions start [N] -> logits [N, B-1, V]
        for the tokens at positions start+1 .. start+B-1."""
        block = self.config.block_size
        offsets = torch.arange(block, device=bonus_ids.device)
        block_ids = torch.full((bonus_ids.shape[0], block), self.config.mask_token_id, device=bonus_ids.device)
        block_ids[:, 0] = bonus_ids
        hidden = self.forward(self.embed_block(target, block_ids), start[:, None] + offsets, context)
        return self.logits(target, hidden[:, 1:])
