"""CUDA graphs for the fixed-shape forwards of a speculative round.

A round's draft forward (B slots per sequence) and verify forward (B tokens per sequence) have
the same shapes every step for a given batch size, so each is captured once per batch-size
bucket and replayed: at batch 1 an eager 8B-parameter transformers forward spends ~10× longer
launching kernels from Python than the GPU spends running them (dflash-spec addendum).

The host fills three static buffers per round — bonus tokens, start positions and block tables —
(and, for a drafter in another process, a fourth: its drafts) and everything else (positions, slots, sequence lengths, block ids) is computed inside the
graphs. Batches smaller than their bucket are padded with rows that point at reserved scratch
blocks, so their writes never touch a real sequence's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.draft_runner import DraftRunner
from services.engine.kv_cache import AttentionBatch
from services.engine.target_runner import TargetRunner

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


@dataclass
class _Bucket:
    size: int
    bonus: torch.Tensor  # [n] long
    starts: torch.Tensor  # [n] long
    block_tables: torch.Tensor  # [n, max_blocks] int32
    drafts: torch.Tensor | None = None  # the draft graph's output, or the host's (external drafts)
    logits: torch.Tensor | None = None
    features: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    draft_graph: torch.cuda.CUDAGraph | None = None
    verify_graph: torch.cuda.CUDAGraph | None = None


class RoundGraphs:
    def __init__(self, runner: TargetRunner | None, proposer: DraftRunner | None, *, block: int, kv_block_size: int,
                 max_blocks: int, scratch_blocks: list[int], buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 external_drafts: bool = False):
        """With `proposer` the draft forward is captured too; with `external_drafts` (block > 1, no
        proposer) the verify reads drafts the host loads (`load_drafts`); else the graphs decode AR.
        Without `runner` (a drafter serving another process's verifier) only the draft is captured."""
        self.runner = runner
        self.proposer = proposer
        self.external_drafts = external_drafts
        self.block = block
        self.kv_block_size = kv_block_size
        self.max_blocks = max_blocks
        self.device = runner.target.device if runner is not None else proposer.drafter.device
        self.scratch_blocks = list(scratch_blocks)
        self.scratch_row = torch.tensor((scratch_blocks * max_blocks)[:max_blocks], dtype=torch.int32)
        self.buckets = sorted(buckets)
        self._pool = torch.cuda.graph_pool_handle()
        self._offsets = torch.arange(block, device=self.device)
        self._query_start = {}
        self._captured: dict[int, _Bucket] = {}
        for size in reversed(self.buckets):  # largest first: smaller graphs reuse its memory pool
            self._captured[size] = self._capture(size)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _batch(self, bucket: _Bucket) -> AttentionBatch:
        """The round's attention metadata, computed on the GPU from the static buffers."""
        n, block, page = bucket.size, self.block, self.kv_block_size
        positions = bucket.starts[:, None] + self._offsets
        rows = torch.arange(n, device=self.device)[:, None].expand(n, block)
        slots = bucket.block_tables[rows, positions // page].long() * page + positions % page
        return AttentionBatch(
            block_tables=bucket.block_tables,
            seq_lens=(bucket.starts + block).to(torch.int32),
            query_start=self._query_start[n],
            slot_mapping=slots.flatten(),
            max_query_len=block,
        )

    def _draft(self, bucket: _Bucket) -> None:
        bucket.drafts = self.proposer.propose((), bucket.bonus, bucket.starts, self._batch(bucket))

    def _verify(self, bucket: _Bucket) -> None:
        ids = bucket.bonus[:, None]
        if bucket.drafts is not None:
            ids = torch.cat([ids, bucket.drafts], dim=1)
        positions = bucket.starts[:, None] + self._offsets
        rows = torch.arange(bucket.size * self.block, device=self.device)
        batch = self._batch(bucket)
        bucket.slots = batch.slot_mapping
        bucket.logits, bucket.features = self.runner.forward(ids.flatten(), positions.flatten(), batch, rows)

    def _capture(self, size: int) -> _Bucket:
        device = self.device
        self._query_start[size] = torch.arange(0, (size + 1) * self.block, self.block, dtype=torch.int32, device=device)
        bucket = _Bucket(
            size=size,
            bonus=torch.zeros(size, dtype=torch.long, device=device),
            starts=torch.zeros(size, dtype=torch.long, device=device),
            block_tables=self.scratch_row.to(device).repeat(size, 1),
            drafts=torch.zeros(size, self.block - 1, dtype=torch.long, device=device) if self.external_drafts else None,
        )
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up compiles the Triton kernels outside capture
            for _ in range(2):
                if self.proposer is not None:
                    self._draft(bucket)
                if self.runner is not None:
                    self._verify(bucket)
        torch.cuda.current_stream(device).wait_stream(stream)
        if self.proposer is not None:
            bucket.draft_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.draft_graph, pool=self._pool):
                self._draft(bucket)
        if self.runner is not None:
            bucket.verify_graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(bucket.verify_graph, pool=self._pool):
                self._verify(bucket)
        return bucket

    def fits(self, proposer, block: int) -> bool:
        """Whether these graphs run a round of `block` tokens with this proposer."""
        if block != self.block:
            return False
        if self.proposer is not None:
            return proposer is self.proposer
        if self.external_drafts:
            return hasattr(proposer, "propose_host")
        return proposer is None

    def bucket_for(self, n: int) -> _Bucket:
        return self._captured[next(b for b in self.buckets if b >= n)]

    def load(self, bonus: list[int], starts: list[int], tables: list[list[int]]) -> _Bucket:
        """Copy one round's inputs into the smallest bucket that holds them; padding rows point
        at the scratch blocks."""
        bucket = self.bucket_for(len(bonus))
        pad = bucket.size - len(bonus)
        host_tables = self.scratch_row.repeat(bucket.size, 1)
        for i, table in enumerate(tables):
            host_tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        bucket.bonus.copy_(torch.tensor(bonus + [0] * pad), non_blocking=True)
        bucket.starts.copy_(torch.tensor(starts + [0] * pad), non_blocking=True)
        bucket.block_tables.copy_(host_tables, non_blocking=True)
        return bucket

    def load_drafts(self, bucket: _Bucket, drafts: torch.Tensor) -> torch.Tensor:
        """Copy a round's drafts [n, block-1] (from another process) in; returns the live rows."""
        n = drafts.shape[0]
        bucket.drafts[:n].copy_(drafts, non_blocking=True)
        return bucket.drafts[:n]

    def draft(self, bucket: _Bucket) -> None:
        bucket.draft_graph.replay()

    def verify(self, bucket: _Bucket) -> None:
        bucket.verify_graph.replay()
