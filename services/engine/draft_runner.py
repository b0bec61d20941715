"""The drafter on the paged KV cache: fused context KV injection and the block forward.

The model code is `services.models.draft` itself; this file only supplies where its keys and
values live (a `KVPool` addressed by the same block tables as the target's) and the fused
injection path (one stacked GEMM for all layers' k/v projections, then one kernel for
k_norm + RoPE + paged write).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from kernels import inject_context_kv, paged_attention
from services.engine.kv_cache import AttentionBatch, KVPool
from services.models.draft import DFlashDraftModel
from services.models.draft_config import DFlashDraftConfig
from services.models.target import TargetModel


class ProposerLost(RuntimeError):
    """The drafter is gone (a remote drafter died or hung); the engine continues target-only."""


class Proposer(Protocol):
    """What the engine needs from a drafter: keep its context up to date and propose blocks.

    The in-process `DraftRunner` implements it; so do the remote drafter client and the test
    oracles. Context rows are committed target features; they arrive in position order.
    Raising `ProposerLost` from either method makes the engine drop the proposer and decode
    target-only (still lossless) until `Engine.attach_proposer` gives it a new one.

    A drafter in another process implements `request_drafts` (host lists: bonus tokens, starts,
    block tables) and `receive_drafts` (the drafts, [n, block-1] row-major) instead of `propose`:
    the engine sends the request first and prepares its verify while the drafter works, and
    needs no per-round GPU metadata for it (the verify replays a CUDA graph that reads the
    drafts from a static buffer).
    """

    block_size: int

    def inject_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None: ...

    def propose(self, request_ids: Sequence[str], bonus_ids: torch.Tensor, starts: torch.Tensor,
                batch: AttentionBatch) -> torch.Tensor: ...


class PagedDraftContext:
    """`DraftAttentionContext` over the drafter's KV pool: block K/V go to the lookahead slots
    (positions s..s+B-1, overwritten by the next round's context rows), then one paged attention."""

    def __init__(self, pool: KVPool, batch: AttentionBatch):
        self.pool = pool
        self.batch = batch

    def attend(self, layer, q, k, v, positions, *, causal, window):
        n, heads, block, head_dim = q.shape
        pack = lambda x: x.transpose(1, 2).reshape(n * block, x.shape[1], head_dim)  # noqa: E731
        self.pool.write(layer, self.batch.slot_mapping, pack(k), pack(v))
        out = paged_attention(
            pack(q),
            self.pool.k[layer],
            self.pool.v[layer],
            self.batch.block_tables,
            self.batch.seq_lens,
            self.batch.query_start,
            scale=head_dim**-0.5,
            causal=causal,
            window=window,
            max_query_len=block,
        )
        return out.view(n, block, heads, head_dim).transpose(1, 2)


class DraftRunner:
    def __init__(self, drafter: DFlashDraftModel, target: TargetModel, pool: KVPool):
        self.drafter = drafter
        self.target = target
        self.pool = pool
        self.block_size = drafter.config.block_size
        attns = [layer.self_attn for layer in drafter.layers]
        # [L*2*nkv*hd, H]: k then v of layer 0, then layer 1, … (matches the [T, L, 2, nkv, hd] view)
        self.kv_weight = torch.cat([w for a in attns for w in (a.k_proj.weight, a.v_proj.weight)])
        self.kv_bias = (
            torch.cat([b for a in attns for b in (a.k_proj.bias, a.v_proj.bias)]) if drafter.config.attention_bias else None
        )
        self.k_norm_weight = torch.stack([a.k_norm.weight for a in attns])

    @staticmethod
    def kv_shape(cfg: DFlashDraftConfig) -> tuple[int, int, int]:
        return cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim

    @torch.inference_mode()
    def inject_context(self, features: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Committed target features [T, F*H] at positions [T] -> every draft layer's context K/V."""
        if features.shape[0] == 0:
            return
        cfg = self.drafter.config
        ctx = self.drafter.fuse_context(features)
        kv = torch.nn.functional.linear(ctx, self.kv_weight, self.kv_bias)
        kv = kv.view(-1, cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim)
        cos, sin = self.drafter.rotary.cos_sin(positions, self.drafter.dtype)
        inject_context_kv(kv, self.k_norm_weight, cos, sin, slots, self.pool.k, self.pool.v, eps=cfg.rms_norm_eps)

    @torch.inference_mode()
    def propose(self, request_ids, bonus_ids, starts, batch) -> torch.Tensor:
        """Greedy drafts [N, B-1] for the tokens after each bonus token (spec §3.2: argmax drafts,
        verified by exact match against the target's own samples, are lossless at any temperature)."""
        logits = self.drafter.draft_logits(self.target, bonus_ids, starts, PagedDraftContext(self.pool, batch))
        return logits.argmax(dim=-1)
