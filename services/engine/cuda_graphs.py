"""CUDA graphs for the fixed-shape forwards of a speculative round.

A round's draft forward (B slots per sequence) and verify forward (B tokens per sequence) have
the same shapes every step for a given batch size, so each is captured once per batch-size
bucket and replayed: at batch 1 an eager 8B-parameter transformers forward spends ~10× longer
launching kernels from Python than the GPU spends running them (dflash-spec addendum).

The host fills three static buffers per round — bonus tokens, start positions and block tables —
(and, for a drafter in another process, a fourth: its drafts, copied on the device) and everything else (positions, slots, sequence lengths, block ids) is computed inside the
graphs. Batches smaller than their bucket are padded with rows that point at reserved scratch
blocks, so their writes never touch a real sequence's KV.

A round verifies k of the B−1 drafts (dflash_serve.services.engine.speculation): the verify and the context
injection are captured per k bucket of each batch bucket (k = 0 verifies the bonus token alone),
the draft once per batch bucket (it always drafts the whole block).

The target's sampling and the round's acceptance are captured too, per k bucket, once for greedy
batches and once for batches that sample without top-k or top-p (the race reads temperatures and
seeds from static buffers): eager, their launches (3 of them Triton's) and allocations took the
H100's host 190–260 µs a round at batch 8, the replay ~20 (BENCHMARKS). Batches that truncate
have data-dependent shapes and sample eagerly.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from dflash_serve.kernels import accept_round
from dflash_serve.services.engine.draft_runner import DraftRunner, Proposer
from dflash_serve.services.engine.kv_cache import AttentionBatch
from dflash_serve.services.engine.round_costs import time_call
from dflash_serve.services.engine.sampling import SamplingBatch, sample_tokens
from dflash_serve.services.engine.target_runner import TargetRunner

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32)


@contextlib.contextmanager
def capture_graph(graph: torch.cuda.CUDAGraph, pool) -> Iterator[None]:
    """`torch.cuda.graph` with Python's garbage collector off. A collection that runs inside the
    capture (any allocation may trigger one) frees whatever unreachable objects hold — pinned
    host buffers, CUDA events of an engine gone — and such calls invalidate a capturing stream:
    the capture fails ("operation failed due to a previous error during capture"). `tests/gpu`
    failed so on the H100, in the same test of the whole suite twice, and passed with the
    collector off. `torch.cuda.graph` collects once before it starts capturing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class _Accept:
    """A bucket's sampling and acceptance after its verify of k drafts: [accepted, the k+1 tokens]
    per row, and the next bonus tokens and starts."""

    graph: torch.cuda.CUDAGraph
    results: torch.Tensor
    next_bonus: torch.Tensor
    next_starts: torch.Tensor


@dataclass
class _Verify:
    """A bucket's verify of k drafts per sequence (k+1 tokens), its context injection, and its
    acceptance (by whether the batch is all greedy)."""

    k: int
    logits: torch.Tensor | None = None
    features: torch.Tensor | None = None
    slots: torch.Tensor | None = None
    graph: torch.cuda.CUDAGraph | None = None
    inject_graph: torch.cuda.CUDAGraph | None = None
    accepts: dict[bool, _Accept] = field(default_factory=dict)


@dataclass
class GraphBucket:
    size: int
    bonus: torch.Tensor  # [n] long
    starts: torch.Tensor  # [n] long
    block_tables: torch.Tensor  # [n, max_blocks] int32
    drafts: torch.Tensor | None = None  # the draft graph's output, or a remote drafter's (copied in)
    draft_graph: torch.cuda.CUDAGraph | None = None
    verified: dict[int, _Verify] = field(default_factory=dict)  # by k
    host_ids: torch.Tensor | None = None  # pinned [2, n]: bonus, starts
    host_tables: torch.Tensor | None = None  # pinned [n, max_blocks]
    staged: torch.cuda.Event | None = None
    race: SamplingBatch | None = None  # the accept graphs' sampling parameters: static temperature and seed [n]
    loaded: SamplingBatch | None = None  # the batch whose parameters `race` holds


class RoundGraphs:
    def __init__(self, runner: TargetRunner | None, proposer: DraftRunner | None, *, block: int, kv_block_size: int,
                 max_blocks: int, scratch_blocks: list[int], buckets: tuple[int, ...] = DEFAULT_BUCKETS,
                 external_drafts: bool = False, k_buckets: tuple[int, ...] | None = None, capture_now: bool = True):
        """With `proposer` the draft forward is captured too; with `external_drafts` (block > 1, no
        proposer) the verify reads drafts the host loads (`load_drafts`); else the graphs decode AR.
        Without `runner` (a drafter serving another process's verifier) only the draft is captured.
        `k_buckets`: the numbers of drafts a verify may take (default: all B−1 only; AR: 0).
        `capture_now` False: a bucket is captured at each `capture_next` (a serving engine's, once
        it answers); a round meanwhile replays the smallest captured bucket that holds it, or runs
        eagerly."""
        self.runner = runner
        self.proposer = proposer
        self.external_drafts = external_drafts
        self.block = block
        self.k_buckets = tuple(sorted(k_buckets if k_buckets is not None else {block - 1}))
        if any(not 0 <= k < block for k in self.k_buckets):
            raise ValueError(f"k buckets {self.k_buckets} must lie in 0..{block - 1}")
        self.kv_block_size = kv_block_size
        self.max_blocks = max_blocks
        self.device = runner.target.device if runner is not None else proposer.drafter.device
        self.scratch_blocks = list(scratch_blocks)
        self.scratch_row = torch.tensor((scratch_blocks * max_blocks)[:max_blocks], dtype=torch.int32)
        self._scratch_row_np = self.scratch_row.numpy()
        self.buckets = sorted(buckets)
        self._pool = torch.cuda.graph_pool_handle()
        self._offsets = torch.arange(block, device=self.device)
        self._query_start = {}
        self._captured: dict[int, GraphBucket] = {}
        self._to_capture = self.buckets[::-1]  # largest first: smaller graphs reuse its memory pool
        while capture_now and self.capture_next():
            pass

    def capture_next(self) -> bool:
        """Capture the next bucket; whether any is left."""
        if self._to_capture:
            size = self._to_capture.pop(0)
            self._captured[size] = self._capture(size)
        return bool(self._to_capture)

    @property
    def complete(self) -> bool:
        return not self._to_capture

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def holds(self, n: int) -> bool:
        """Whether a captured bucket holds a round of n sequences (the largest is captured first)."""
        return n <= self.buckets[-1] and bool(self._captured)

    def _batch(self, bucket: GraphBucket, width: int) -> AttentionBatch:
        """The attention metadata of `width` new tokens per sequence, computed on the GPU from the
        static buffers."""
        return AttentionBatch.for_round(bucket.block_tables, bucket.starts, width, self.kv_block_size,
                                        self._query_start[bucket.size, width])

    def _draft(self, bucket: GraphBucket) -> None:
        bucket.drafts = self.proposer.propose((), bucket.bonus, bucket.starts, self._batch(bucket, self.block))

    def _verify(self, bucket: GraphBucket, out: _Verify) -> None:
        ids = bucket.bonus[:, None]
        if out.k:
            ids = torch.cat([ids, bucket.drafts[:, : out.k]], dim=1)
        width = out.k + 1
        positions = bucket.starts[:, None] + self._offsets[:width]
        rows = torch.arange(bucket.size * width, device=self.device)
        batch = self._batch(bucket, width)
        out.slots = batch.slot_mapping
        out.logits, out.features = self.runner.forward(ids.flatten(), positions.flatten(), batch, rows)

    def _accept(self, bucket: GraphBucket, out: _Verify, greedy: bool) -> tuple[torch.Tensor, ...]:
        """The target's token at every verified slot, and the drafts accepted (as the engine's eager
        round: `sample_tokens`, then `accept_round`); padding rows accept whatever, unread."""
        width = out.k + 1
        logits = out.logits.view(bucket.size, width, -1)
        positions = bucket.starts[:, None] + self._offsets[:width] + 1  # where each sampled token goes
        tokens = sample_tokens(logits, SamplingBatch.greedy() if greedy else bucket.race, positions)
        return accept_round(tokens, bucket.starts, bucket.drafts[:, :out.k] if out.k else None)

    def _inject(self, bucket: GraphBucket, out: _Verify) -> None:
        """Every verified slot's feature row into the drafter's context, accepted or not (Engine:
        the rows past the accepted ones are overwritten by the next draft before it reads them)."""
        positions = bucket.starts[:, None] + self._offsets[: out.k + 1]
        self.proposer.inject_context(out.features, positions.flatten(), out.slots)

    def _capture(self, size: int) -> GraphBucket:
        device = self.device
        for width in {self.block} | {k + 1 for k in self.k_buckets}:
            self._query_start[size, width] = torch.arange(0, (size + 1) * width, width, dtype=torch.int32,
                                                          device=device)
        bucket = GraphBucket(
            size=size,
            bonus=torch.zeros(size, dtype=torch.long, device=device),
            starts=torch.zeros(size, dtype=torch.long, device=device),
            block_tables=self.scratch_row.to(device).repeat(size, 1),
            drafts=torch.zeros(size, self.block - 1, dtype=torch.long, device=device) if self.external_drafts else None,
            host_ids=torch.zeros(2, size, dtype=torch.long).pin_memory(),
            host_tables=self.scratch_row.repeat(size, 1).pin_memory(),
            staged=torch.cuda.Event(),
        )
        if self.runner is not None:
            bucket.verified = {k: _Verify(k) for k in self.k_buckets}
            bucket.race = SamplingBatch.untruncated(torch.ones(size, dtype=torch.float32, device=device),
                                                    torch.zeros(size, dtype=torch.long, device=device))
        inject = self.runner is not None and self.proposer is not None
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up compiles the Triton kernels outside capture
            for _ in range(2):
                if self.proposer is not None:
                    self._draft(bucket)
                for out in bucket.verified.values():
                    self._verify(bucket, out)
                    if inject:
                        self._inject(bucket, out)
                    for greedy in (True, False):
                        self._accept(bucket, out, greedy)
        torch.cuda.current_stream(device).wait_stream(stream)
        if self.proposer is not None:
            bucket.draft_graph = torch.cuda.CUDAGraph()
            with capture_graph(bucket.draft_graph, self._pool):
                self._draft(bucket)
        for out in sorted(bucket.verified.values(), key=lambda o: -o.k):  # largest first, as the buckets
            out.graph = torch.cuda.CUDAGraph()
            with capture_graph(out.graph, self._pool):
                self._verify(bucket, out)
            if inject:
                # Its own graph, so that a verify replay times the target's forward alone; eager,
                # its ~10 launches (2 of them Triton's) cost ~0.3 ms of host time a round.
                out.inject_graph = torch.cuda.CUDAGraph()
                with capture_graph(out.inject_graph, self._pool):
                    self._inject(bucket, out)
            for greedy in (True, False):
                graph = torch.cuda.CUDAGraph()
                with capture_graph(graph, self._pool):
                    results, next_bonus, next_starts = self._accept(bucket, out, greedy)
                out.accepts[greedy] = _Accept(graph, results, next_bonus, next_starts)
        return bucket

    def fits(self, proposer, block: int) -> bool:
        """Whether these graphs run a round of `block` tokens with this proposer."""
        if block != self.block:
            return False
        if self.proposer is not None:
            return proposer is self.proposer
        if self.external_drafts:
            return proposer is not None and proposer.drafts_in_background
        return proposer is None

    def proposer_for(self, bucket: GraphBucket, n: int, k: int) -> CapturedProposer:
        """The captured drafter as the `Proposer` of a round of n sequences that verifies k drafts,
        loaded into `bucket`."""
        return CapturedProposer(self, bucket, n, k)

    def bucket_for(self, n: int) -> GraphBucket:
        """The smallest captured bucket that holds n sequences (`holds`)."""
        return self._captured[next(size for size in self.buckets if size >= n and size in self._captured)]

    def load(self, bonus: list[int] | torch.Tensor, starts: list[int] | torch.Tensor,
             tables: list[list[int]]) -> GraphBucket:
        """Copy one round's inputs into the smallest bucket that holds them; padding rows point
        at the scratch blocks. `bonus` and `starts` may be device tensors instead of lists: a
        chained round's, taken from the last round's results, which the host has not read."""
        if not isinstance(bonus, torch.Tensor):
            return self.stage(tables, bonus, starts)
        bucket = self.stage(tables)
        self.load_inputs(bucket, bonus, starts)
        return bucket

    def stage(self, tables: list[list[int]], bonus: list[int] | None = None,
              starts: list[int] | None = None) -> GraphBucket:
        """The host's half of `load`: block tables (and host bonus tokens and starts) into the
        bucket, by copies that wait for no other device work. One pinned staging buffer per
        bucket, one copy per buffer, filled through numpy views: ~20 small torch CPU ops cost
        0.1–0.3 ms a round, numpy a few µs, and in a split pair this sits on the critical path
        twice (drafter and verifier)."""
        n = len(tables)
        bucket = self.bucket_for(n)
        bucket.staged.synchronize()  # the last copy out of this bucket's staging buffers is done
        ids, host_tables = bucket.host_ids.numpy(), bucket.host_tables.numpy()
        if bonus is not None:
            ids[0, :n] = bonus
            ids[1, :n] = starts
        ids[:, n:] = 0
        host_tables[:] = self._scratch_row_np
        for row, table in zip(host_tables, tables):
            row[:len(table)] = table
        bucket.bonus.copy_(bucket.host_ids[0], non_blocking=True)
        bucket.starts.copy_(bucket.host_ids[1], non_blocking=True)
        bucket.block_tables.copy_(bucket.host_tables, non_blocking=True)
        bucket.staged.record()
        return bucket

    def load_inputs(self, bucket: GraphBucket, bonus: torch.Tensor, starts: torch.Tensor) -> None:
        """Bonus tokens and starts from device tensors into a bucket `stage` filled."""
        n = bonus.shape[0]
        bucket.bonus[:n].copy_(bonus)
        bucket.starts[:n].copy_(starts)

    def load_drafts(self, bucket: GraphBucket, drafts: torch.Tensor) -> torch.Tensor:
        """Copy a round's drafts ([n, block-1] on the device, from another process; after `load`
        of the same round) in; returns the live rows."""
        n = drafts.shape[0]
        bucket.drafts[:n].copy_(drafts)
        return bucket.drafts[:n]

    def draft(self, bucket: GraphBucket) -> None:
        bucket.draft_graph.replay()

    def verify(self, bucket: GraphBucket, k: int) -> _Verify:
        """Replay the verify of k drafts per sequence; its outputs are the returned buffers."""
        out = bucket.verified[k]
        out.graph.replay()
        return out

    def inject(self, bucket: GraphBucket, k: int) -> None:
        bucket.verified[k].inject_graph.replay()

    @staticmethod
    def accepts(sampling: SamplingBatch) -> bool:
        """Whether a batch's sampling runs in the accept graphs: no request truncates."""
        return not sampling.truncates

    def accept(self, bucket: GraphBucket, k: int, sampling: SamplingBatch,
               n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Replay the sampling and acceptance after the verify of k drafts (`accepts(sampling)`), for
        n sequences: results [n, k+2], next bonus [n] and starts [n], the graph's buffers — which
        its next replay rewrites: read them before (the host's copy of results is queued right after
        it; a round chained on this one loads the rest first)."""
        greedy = sampling.all_greedy
        if not greedy and bucket.loaded is not sampling:  # a round chained on the same batch keeps them
            bucket.race.temperature[:n].copy_(sampling.temperature)
            bucket.race.seed[:n].copy_(sampling.seed)
            bucket.loaded = sampling
        out = bucket.verified[k].accepts[greedy]
        out.graph.replay()
        return out.results[:n], out.next_bonus[:n], out.next_starts[:n]

    def time_round(self, context: int, reps: int = 5) -> dict:
        """Seconds of each bucket's replays with every sequence at position `context` (through the
        scratch blocks: nothing real is read or written): {"verify": {size: {k: s}}, "draft":
        {size: s}} (draft only where captured here). For the engine's cost model."""
        sync = torch.cuda.synchronize
        out = {"verify": {}, "draft": {}}
        for size, bucket in self._captured.items():
            bucket.starts.fill_(context)
            bucket.block_tables.copy_(self.scratch_row.to(self.device).expand_as(bucket.block_tables))
            # The buckets share one memory pool, so another bucket's replays may have overwritten
            # this one's drafts (a verify's intermediates can live where they are): a verify must
            # read drafts written since — the draft's own, or zeros when drafts come from outside.
            if bucket.draft_graph is not None:
                out["draft"][size] = time_call(bucket.draft_graph.replay, sync, reps=reps)
            elif bucket.drafts is not None:
                bucket.drafts.zero_()
            out["verify"][size] = {k: time_call(v.graph.replay, sync, reps=reps) for k, v in bucket.verified.items()}
            bucket.starts.zero_()
        return out


class CapturedProposer(Proposer):
    """A `RoundGraphs`' captured drafter for one round, whose inputs `load` put into `bucket`: a
    request replays the draft graph over them (the arguments are the same values, already there),
    and the drafts stay in the buffer the verify graph reads; the context rows it is given are the
    verify graph's outputs, which the injection graph of that k reads in place."""

    in_graphs = True

    def __init__(self, graphs: RoundGraphs, bucket: GraphBucket, n: int, k: int):
        self.graphs, self.bucket, self.n, self.k = graphs, bucket, n, k
        self.block_size = graphs.block

    def request_drafts(self, request_ids, bonus, starts, tables, batch, num_drafts=None) -> None:
        self.graphs.draft(self.bucket)  # the whole block, as captured

    def receive_drafts(self) -> torch.Tensor:
        return self.bucket.drafts[: self.n]

    def inject_context(self, features, positions, slots) -> None:
        self.graphs.inject(self.bucket, self.k)


class InjectionGraphs:
    """CUDA graphs for a drafter's context injection, for a drafter serving another process.

    In-process, the eager injection overlaps the host's next work; a drafter in its own process
    must inject and then draft before it can answer, so the injection's ~10 launches sit on every
    round's critical path. A round injects one to `block` rows per sequence, so graphs are
    captured for row-count buckets: the rows are copied into a static buffer, positions and slots
    arrive in one host-to-device copy, and padding rows write into a scratch slot.
    """

    def __init__(self, runner: DraftRunner, width: int, dtype: torch.dtype, *, scratch_slot: int,
                 buckets: tuple[int, ...]):
        self.runner = runner
        self.device = runner.drafter.device
        self.buckets = sorted(buckets)
        self.scratch_slot = scratch_slot
        top = self.buckets[-1]
        self.rows = torch.zeros(top, width, dtype=dtype, device=self.device)
        self.index = torch.zeros(2, top, dtype=torch.long, device=self.device)  # positions, slots
        self._staging = torch.zeros(2, top, dtype=torch.long).pin_memory()
        self._staged = torch.cuda.Event()  # the last copy out of the staging buffer
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.index[1] = scratch_slot
        for size in reversed(self.buckets):
            self._graphs[size] = self._capture(size)

    def _inject(self, size: int) -> None:
        self.runner.inject_context(self.rows[:size], self.index[0, :size], self.index[1, :size])

    def _capture(self, size: int) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up compiles the Triton kernel outside capture
            self._inject(size)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with capture_graph(graph, self._pool):
            self._inject(size)
        return graph

    def inject(self, rows: torch.Tensor, positions: list[int], slots: list[int]) -> None:
        """Inject `rows` [T, width] at `positions`/`slots`: a graph replay when T fits a bucket."""
        size = self.stage(positions, slots)
        if size is None:  # a prefill's rows: rare, and long enough to amortise launches
            index = torch.tensor([positions, slots], dtype=torch.long, device=self.device)
            self.runner.inject_context(rows, index[0], index[1])
        else:
            self.replay(rows, size)

    def stage(self, positions: list[int], slots: list[int]) -> int | None:
        """The host's half of `inject`: positions and slots to the device, by a copy that waits
        for no other device work; the bucket to `replay`, or None for more rows than the largest."""
        count = len(positions)
        if count > self.buckets[-1]:
            return None
        size = next(b for b in self.buckets if b >= count)
        self._staged.synchronize()  # the staging buffer is refilled only once its last copy is done
        staging = self._staging.numpy()  # numpy, not torch CPU ops: see RoundGraphs.stage
        staging[0, :count] = positions
        staging[1, :count] = slots
        staging[0, count:size] = 0
        staging[1, count:size] = self.scratch_slot
        self.index[:, :size].copy_(self._staging[:, :size], non_blocking=True)
        self._staged.record()
        return size

    def replay(self, rows: torch.Tensor, size: int) -> None:
        """Inject `rows` (as many as `stage` was given) through the graph of bucket `size`."""
        self.rows[:rows.shape[0]].copy_(rows)
        self._graphs[size].replay()
