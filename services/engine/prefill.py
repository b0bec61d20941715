"""Prefill: a step's prompt chunks through the target, their feature rows to the drafter, first tokens sampled.

The scheduler (scheduler.py) chooses the chunks under the step's token budget; here they run — in a
CUDA graph captured for their size (prefill_graphs.py) where one fits, else eagerly — and a prompt
that completes samples its first token, on the device: the host reads it after launching the
step's round (`Engine.step`), so a prompt can join that round from its first token unread.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch

from dflash_serve.services.engine.kv_cache import AttentionBatch
from dflash_serve.services.engine.prefill_graphs import PrefillChunkView
from dflash_serve.services.engine.request import Sequence, SequenceStatus
from dflash_serve.services.engine.sampling import sample_tokens
from dflash_serve.services.engine.scheduler import PrefillChunk
from dflash_serve.services.engine.transfer import to_device


@dataclass
class FirstTokens:
    """The first tokens a prefill sampled for fresh sequences, on the device, not read yet."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [len(seqs)]


class Prefilling:
    """The Engine's prefill. A part of `Engine` (engine.py), whose state it reads and writes."""

    def _prefill(self, chunks: list[PrefillChunk]) -> FirstTokens | None:
        """Prefill the chunks; the first tokens of the prompts they complete, sampled and not read."""
        t0 = time.perf_counter()
        # Fresh sequences whose prompt completes now sample their first token from their last row.
        sampling = [i for i, c in enumerate(chunks) if c.completes_prefill and not c.seq.output_ids]
        graphs, proposer = self.prefill_graphs, self.proposer
        if graphs is not None and graphs.fits(len(chunks), sum(c.length for c in chunks), proposer):
            views = [PrefillChunkView(c.seq.tokens[c.start : c.start + c.length], c.start, c.seq.block_table)
                     for c in chunks]
            out = graphs.run(views, sampling)
            logits, features, pos_t, slots = out.logits, out.features, out.positions, out.slots
            injected = graphs.injects_for(proposer)
        else:
            logits, features, pos_t, slots = self._eager_prefill(chunks, sampling)
            injected = False
        if proposer is not None and not injected:  # with any deferred rows, in one injection
            self._deferred.append((features, pos_t, slots))
            self._flush_context()
        for c in chunks:
            c.seq.num_cached = c.start + c.length
            self.scheduler.offer_committed_blocks(c.seq)
        first = None
        if sampling:
            seqs = [chunks[i].seq for i in sampling]
            tokens = sample_tokens(
                logits[:, None], self._sampling_batch(seqs),
                to_device([[s.num_cached] for s in seqs], torch.long, self.device),
            )
            first = FirstTokens(seqs, tokens[:, 0])
        self.timings.prefill += time.perf_counter() - t0
        return first

    def _commit_first_tokens(self, first: FirstTokens | None) -> None:
        """Read the first tokens a prefill sampled and commit them (they may end their requests)."""
        if first is None:
            return
        now = time.monotonic()
        for seq, token in zip(first.seqs, first.tokens.tolist(), strict=True):
            if seq.status is SequenceStatus.RUNNING:  # not failed or cancelled since
                seq.first_token_time = now
                self._commit(seq, [token])

    def _eager_prefill(self, chunks: list[PrefillChunk], sampling: list[int]):
        """The target's forward over the packed chunks, launched op by op: (logits of each sampled
        chunk's last row, features, positions, KV slots)."""
        ids, positions = [], []
        for c in chunks:
            ids.extend(c.seq.tokens[c.start : c.start + c.length])
            positions.extend(range(c.start, c.start + c.length))
        batch = AttentionBatch.build(
            [c.seq.block_table for c in chunks], [c.start for c in chunks], [c.length for c in chunks],
            self.allocator.block_size, self.device,
        )
        ends = list(itertools.accumulate(c.length for c in chunks))
        last_rows = to_device([ends[i] - 1 for i in sampling], torch.long, self.device)
        ids_t = to_device(ids, torch.long, self.device)
        pos_t = to_device(positions, torch.long, self.device)
        logits, features = self.runner.forward(ids_t, pos_t, batch, last_rows)
        return logits, features, pos_t, batch.slot_mapping
