"""The drafter on the paged KV cache: fused context KV injection and the block forward.

The model code is `dflash_serve.services.models.draft`; this file runs it on a `KVPool` addressed by the same
block tables as the target's, in the fused layout: the injection is one stacked GEMM for all
layers' k/v projections and one kernel for k_norm + RoPE + paged write, and the block forward
is the target's fused decoder stack (`FusedStack`: merged QKV and gate-up GEMMs, fused norms,
RoPE + KV write and SiLU·mul) over the drafter's layers — tested equal to the model code.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from dflash_serve.kernels import inject_context_kv, row_argmax
from dflash_serve.services.engine.fused_target import FusedLayer, FusedStack
from dflash_serve.services.engine.kv_cache import AttentionBatch, KVPool
from dflash_serve.services.models.draft import DFlashDraftModel
from dflash_serve.services.models.draft_config import DFlashDraftConfig
from dflash_serve.services.models.target import TargetModel


class ProposerLost(RuntimeError):
    """The drafter is gone (a remote drafter died or hung); the engine continues target-only."""


class Proposer(abc.ABC):
    """What the engine needs from a drafter, of whichever kind: the in-process `DraftRunner`, the
    client of a drafter in another process (`RemoteProposer`), the drafter captured in a round's
    CUDA graphs (`RoundGraphs.proposer_for`) and the tests' fakes.

    A round asks for a block of drafts (`request_drafts`), then takes them (`receive_drafts`);
    context rows — committed target features — reach the drafter by `inject_context`, in position
    order. `ProposerLost` from any of these makes the engine drop the proposer (`release`) and
    decode target-only, still lossless and from the interrupted round on, until
    `Engine.attach_proposer` gives it a new one.

    How the kinds differ in what the round must do is declared by the attributes below, whose
    defaults describe a drafter in this process.
    """

    block_size: int  # B: a request drafts the B-1 tokens after each bonus token

    drafts_in_background: bool = False
    """True: it drafts in another process while this one works. The engine asks it first (bonus
    tokens and starts as host lists, or as device tensors for a chained round; no attention batch),
    then prepares its verify and commits the last round while it drafts; it copies the drafts out
    of the buffer they arrive in (rewritten next round), and learns the draft time from rounds, not
    by timing a call. False: it is asked once the round's inputs are on the device, with the
    block's attention batch."""

    context_after_accept: bool = False
    """True: context rows go once acceptance is known: the accepted ones when the host reads a
    round, or every slot of a round chained before that, ahead of the next request (positions and
    slots then as host lists). False: every verified slot's rows right after the verify, on the
    device: the rows past the accepted ones are never read (the next draft writes its own block
    over them before it attends)."""

    in_graphs: bool = False
    """True: it runs inside the round's CUDA graphs, so its drafts already lie where the verify
    graph reads them; others' are copied there."""

    draft_groups: int = 1
    """2: it drafts in the background and holds a draft request of each of two groups of
    sequences at once (`group` 0 and 1 of `request_drafts` and `receive_drafts`), so the engine
    may pipeline two groups: it drafts one while the target verifies the other. 1: the engine
    asks with group 0 only (where `drafts_in_background`) or without a group."""

    @abc.abstractmethod
    def request_drafts(self, request_ids: Sequence[str], bonus: list[int] | torch.Tensor,
                       starts: list[int] | torch.Tensor, tables: list[list[int]], batch: AttentionBatch | None,
                       group: int = 0, num_drafts: int | None = None) -> None:
        """Draft the B-1 tokens after each sequence's bonus token, which sits at position starts[i];
        `tables`: the sequences' block tables; `batch`: the block's attention metadata on the
        device (None where `drafts_in_background`); `group`: see `draft_groups`. `num_drafts`: the
        round verifies only the first that many (asked so of a drafter in this process): the block
        forward still covers the whole block, but drafts past them may be left out."""

    @abc.abstractmethod
    def receive_drafts(self, group: int = 0) -> torch.Tensor:
        """The drafts asked for last (for `group`), [n, B-1] on the engine's device."""

    @abc.abstractmethod
    def inject_context(self, features: torch.Tensor, positions: torch.Tensor | list[int],
                       slots: torch.Tensor | list[int]) -> None:
        """Committed target features [T, F*H] at positions [T] into the drafter's KV slots [T]."""

    def forget(self, request_ids: Sequence[str]) -> None:
        """These sequences ended: drop what is kept for them (by default nothing is). Never
        raises: a lost drafter is noticed at its next request or injection."""

    def release(self) -> None:
        """The engine drops or replaces this proposer: free what it holds that the engine does not
        own (by default nothing: a local drafter's KV pool and graphs are the engine's). Never
        raises."""


class DraftRunner(Proposer):
    def __init__(self, drafter: DFlashDraftModel, target: TargetModel, pool: KVPool, *, max_positions: int):
        """`max_positions`: one past the largest position a round may write (the target's table's)."""
        self.drafter = drafter
        self.target = target
        self.pool = pool
        cfg = drafter.config
        self.block_size = cfg.block_size
        attns = [layer.self_attn for layer in drafter.layers]
        # [L*2*nkv*hd, H]: k then v of layer 0, then layer 1, … (matches the [T, L, 2, nkv, hd] view)
        self.kv_weight = torch.cat([w for a in attns for w in (a.k_proj.weight, a.v_proj.weight)])
        self.kv_bias = torch.cat([b for a in attns for b in (a.k_proj.bias, a.v_proj.bias)]) if cfg.attention_bias else None
        self.k_norm_weight = torch.stack([a.k_norm.weight for a in attns])
        # cos/sin of every position [max_positions, 2, head_dim], as the model computes them per call:
        # the injection gathers its rows in one launch and the draft's RoPE kernel reads the table
        # by position, where computing them took ~10 launches each (on the H100 at batch 32 an
        # injection replay took 27 µs with them, 15 without).
        with torch.no_grad():
            cos, sin = drafter.rotary.cos_sin(torch.arange(max_positions, device=drafter.device), drafter.dtype)
        self.rope = torch.stack([cos, sin], dim=1)
        # The block forward in the target's fused layout (the drafter's layers are Qwen3 layers
        # whose attention may be non-causal): the model code in dflash_serve.services.models.draft stays the
        # reference, and its parameters become views of the merged weights.
        with torch.no_grad():
            layers = [FusedLayer.from_layer(layer, scaling=cfg.head_dim**-0.5, window=layer.window, causal=layer.causal)
                      for layer in drafter.layers]
        self.stack = FusedStack(layers, drafter.norm.weight.detach(), pool, cfg.num_attention_heads,
                                cfg.num_key_value_heads, cfg.rms_norm_eps)
        self._drafts: torch.Tensor | None = None  # requested, not received yet

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
        rope = self.rope[positions]
        inject_context_kv(kv, self.k_norm_weight, rope[:, 0], rope[:, 1], slots, self.pool.k, self.pool.v,
                          eps=cfg.rms_norm_eps)

    def request_drafts(self, request_ids, bonus, starts, tables, batch, num_drafts=None) -> None:
        self._drafts = self.propose(request_ids, bonus, starts, batch, num_drafts)  # queued on the device

    def receive_drafts(self) -> torch.Tensor:
        drafts, self._drafts = self._drafts, None
        return drafts

    @torch.inference_mode()
    def propose(self, request_ids, bonus_ids, starts, batch, num_drafts: int | None = None) -> torch.Tensor:
        """Greedy drafts [N, num_drafts or B-1] for the tokens after each bonus token (spec §3.2:
        argmax drafts, verified by exact match against the target's own samples, are lossless at
        any temperature)."""
        return row_argmax(self.draft_logits(bonus_ids, starts, batch, num_drafts))

    def draft_logits(self, bonus_ids: torch.Tensor, starts: torch.Tensor, batch: AttentionBatch,
                     num_drafts: int | None = None) -> torch.Tensor:
        """`DFlashDraftModel.draft_logits` [N, num_drafts or B-1, V] over the paged pool: the block's
        keys and values go to its lookahead slots (positions s..s+B-1, overwritten by the next
        round's context rows) and attend over context + block. Only the first `num_drafts` rows
        go through the LM head: on a CPU the head over B-1 rows of a 49k vocabulary is two thirds
        of a draft."""
        drafter, block = self.drafter, self.block_size
        n = bonus_ids.shape[0]
        block_ids = torch.full((n, block), drafter.config.mask_token_id, device=bonus_ids.device)
        block_ids[:, 0] = bonus_ids
        embeds = drafter.embed_block(self.target, block_ids).to(drafter.dtype).view(n * block, -1)
        positions = (starts[:, None] + torch.arange(block, device=starts.device)).flatten()
        half = self.drafter.config.head_dim // 2  # rotate-half: the table's rows repeat their first half
        hidden = self.stack.forward(embeds, positions, self.rope[:, 0, :half], self.rope[:, 1, :half], batch)
        drafts = block - 1 if num_drafts is None else num_drafts
        return drafter.logits(self.target, hidden.view(n, block, -1)[:, 1 : 1 + drafts])
