"""The training forward (dflash-spec §4): every anchored block of a sequence in one pass.

For a sequence x_0..x_{S-1} with target features f_0..f_{S-1} and anchors p_1..p_A, block a is
[x_p, MASK × (B−1)] at positions p..p+B−1 — exactly what the drafter sees at inference when x_p
is the bonus token of a round. All A·B block slots run as one "block" through the unchanged
`DFlashDraftModel.forward`; only the attention context differs from inference: keys are
[context features of all S positions ; all A·B block slots], and which of them a query sees is
the §4 mask:
- context position j is visible to block a iff j < p_a (strictly: at inference the bonus token's
  own features do not exist yet);
- block slots see every slot of their own block (bidirectional) and no slot of another block.
The layer's own rules (causal / sliding window, spec §1.5) apply on top, by position, as at
inference. So the trained weights are used at inference exactly as they were trained.

Slot k (1..B−1) of block a is trained to produce x_{p_a+k}, weighted by exp(−(k−1)/γ).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dflash_serve.services.models import DFlashDraftModel, TargetModel
from dflash_serve.services.models.draft import visible_keys
from dflash_serve.services.training.dataset import AnchorBatch

# γ of the position weights per block size (spec §4: 7 for B=16; community ports 5 for B=10, 4 for B=8).
GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    return GAMMA_BY_BLOCK.get(block_size, block_size * 7 / 16)


def block_positions(anchors: torch.Tensor, block: int) -> torch.Tensor:
    """anchors [N, A] -> absolute positions of every block slot [N, A*B]."""
    return (anchors[:, :, None] + torch.arange(block, device=anchors.device)).flatten(1)


def block_attention_mask(anchors: torch.Tensor, seq_len: int, block: int) -> torch.Tensor:
    """The §4 mask: bool [N, A*B, S + A*B], True where a block query may attend to a key
    (context keys first, then the block slots)."""
    n, num_anchors = anchors.shape
    query_block = torch.arange(num_anchors, device=anchors.device).repeat_interleave(block)  # [A*B]
    context = torch.arange(seq_len, device=anchors.device)
    sees_context = context[None, None, :] < anchors.repeat_interleave(block, dim=1)[:, :, None]
    sees_block = (query_block[:, None] == query_block[None, :]).expand(n, -1, -1)
    return torch.cat([sees_context, sees_block], dim=2)


@dataclass
class AnchoredContext:
    """`DraftAttentionContext` of a training batch: per-layer context K/V of whole sequences
    [N, nkv, S, hd] at positions [N, S], and the §4 mask over [context ; blocks]."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    positions: torch.Tensor
    mask: torch.Tensor

    def attend(self, layer, q, k, v, positions, *, causal, window):
        key_positions = torch.cat([self.positions, positions], dim=1)
        every_key = torch.ones_like(key_positions, dtype=torch.bool)
        visible = self.mask[:, None] & visible_keys(positions, key_positions, every_key, causal=causal, window=window)
        k = torch.cat([self.kv[layer][0], k], dim=2)
        v = torch.cat([self.kv[layer][1], v], dim=2)
        # Repeat the KV heads rather than enable_gqa: the fused masked (memory-efficient) kernel
        # takes equal head counts, so the backward never falls back to the quadratic-memory path.
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=q.shape[-1] ** -0.5)


def draft_blocks(drafter: DFlashDraftModel, target: TargetModel, batch: AnchorBatch,
                 features: torch.Tensor) -> torch.Tensor:
    """Final-normed drafter hidden states of every block slot -> [N, A, B, H].

    features [N, S, F*H]: the target's features of the whole (padded) sequences."""
    block, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    n, seq_len = batch.input_ids.shape
    num_anchors = batch.anchors.shape[1]
    block_ids = torch.full((n, num_anchors, block), mask_id, dtype=torch.long, device=batch.input_ids.device)
    block_ids[:, :, 0] = batch.input_ids.gather(1, batch.anchors)
    context_positions = torch.arange(seq_len, device=features.device).expand(n, -1)
    context = AnchoredContext(drafter.context_kv(features, context_positions), context_positions,
                              block_attention_mask(batch.anchors, seq_len, block))
    hidden = drafter(drafter.embed_block(target, block_ids.flatten(1)), block_positions(batch.anchors, block), context)
    return hidden.view(n, num_anchors, block, -1)


def block_labels(batch: AnchorBatch, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels of slots 1..B-1 (the token at p+k) [N, A, B-1], and which are real: the anchor is,
    and p+k is inside the sequence (anchors lie in the response, so every label is a response
    token; padding and positions past the end are masked)."""
    seq_len = batch.input_ids.shape[1]
    positions = batch.anchors[:, :, None] + torch.arange(1, block, device=batch.anchors.device)
    valid = batch.anchor_valid[:, :, None] & (positions < batch.lengths[:, None, None])
    labels = batch.input_ids.gather(1, positions.clamp(max=seq_len - 1).flatten(1)).view(positions.shape)
    return labels, valid


def slot_weights(block: int, gamma: float, device=None) -> torch.Tensor:
    """w_k = exp(-(k-1)/γ) for slots k = 1..B-1: an early miss makes every later slot worthless."""
    return torch.exp(-torch.arange(block - 1, dtype=torch.float32, device=device) / gamma)


def block_loss(drafter: DFlashDraftModel, target: TargetModel, hidden: torch.Tensor, batch: AnchorBatch,
               gamma: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Position-weighted cross-entropy Σ w·CE / Σ w over the real labels, and two readings of
    how well the blocks are drafted: slot-1 accuracy and the teacher-forced accepted length
    (1 + leading correct slots per block, which is what τ counts)."""
    block = hidden.shape[2]
    labels, valid = block_labels(batch, block)
    rows = hidden[:, :, 1:][valid]  # only slots with a label reach the (vocabulary-wide) LM head
    logits = drafter.logits(target, rows).float()
    ce = F.cross_entropy(logits, labels[valid], reduction="none")
    weights = slot_weights(block, gamma, hidden.device).expand_as(valid)[valid]
    loss = (weights * ce).sum() / weights.sum()
    with torch.no_grad():
        correct = torch.zeros_like(valid)
        correct[valid] = logits.argmax(-1) == labels[valid]
        anchors = batch.anchor_valid
        streak = correct.long().cumprod(dim=2).sum(dim=2)
        metrics = {
            "loss": loss.item(),
            "acc1": (correct[:, :, 0][valid[:, :, 0]].float().mean().item()),
            "block_tau": (streak[anchors].float().mean().item() + 1) if anchors.any() else math.nan,
        }
    return loss, metrics
