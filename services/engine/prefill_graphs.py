"""CUDA graphs for prefill: a step's prompt chunks, packed and padded to a token-count bucket.

An eager prefill launches every kernel of the target's forward from Python, and the drafter's
context injection after it: ~10 launches a layer, most of them Triton's, whose Python launcher
costs tens of µs each. For a short prompt on a small model that is nearly all of the time to
first token (a step prefilling a 150-token prompt on SmolLM2-135M: 20.7 ms on the H100 eagerly,
1.4 ms replayed; BENCHMARKS.md), and every running sequence waits for it. So the forward (and, for a drafter in this process, its
context injection) is captured once per (tokens, chunks) bucket and replayed.

The host writes one step's inputs — token ids, positions, KV slots, the rows whose logits are
sampled, and the attention metadata (block tables, sequence lengths, query starts) — into two
pinned staging buffers, each copied to the device in one transfer that waits for no other work.
Padding tokens sit at position 0 and write their K/V (and context rows) into a reserved scratch
slot; padding chunks have no queries and no keys. A plan with more chunks or tokens than the
largest bucket prefills eagerly, as does one whose drafter is not the captured one (a new or lost
drafter). On a CPU (`capture=False`, the tests) the same padded forward runs eagerly over the same
buffers. A serving engine captures the buckets after it answers (`capture_now=False`,
`capture_next`): a plan whose bucket is not captured yet prefills eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dflash_serve.services.engine.cuda_graphs import capture_graph
from dflash_serve.services.engine.draft_runner import DraftRunner, Proposer
from dflash_serve.services.engine.kv_cache import AttentionBatch

# Packed prompt tokens per graph; a larger plan prefills eagerly, where its launches are a small
# share of the work.
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048)
# Chunks per graph: a step prefills a few new prompts at low load; a burst of arrivals prefills
# many in one eager forward, whose launches are shared by all of them.
CHUNK_BUCKETS = (1, 2, 4, 8)
# Each input buffer starts at this byte alignment. Triton compiles a kernel per pointer alignment
# (16 bytes or not): block tables packed after 17 int32s made the graphs' attention a variant that
# the eager prefill's own tensors never use, so a burst of prompts past the graphs could compile its
# own mid-serving (on the H100 one paged-attention variant compiled in the first step of a
# 32-prompt burst after the warm-up, TTFT p99 820 ms; aligned, a fresh Triton cache compiled
# nothing after the warm-up and the p99 was 80 ms).
ALIGN_BYTES = 16


@dataclass
class PrefillChunkView:
    """What a graph needs of one prompt chunk: its tokens at positions start..start+len-1 of a
    sequence with this block table."""

    tokens: list[int]
    start: int
    block_table: list[int]


@dataclass
class PrefillOutputs:
    """A prefill's results, views of the graph's static buffers (valid until the next replay)."""

    logits: torch.Tensor  # [len(sample_chunks), V]: each sampled chunk's last row
    features: torch.Tensor | None  # [T, F*H]
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T]


class PrefillGraphs:
    def __init__(self, runner, proposer: DraftRunner | None, *, kv_block_size: int, max_blocks: int,
                 scratch_slot: int, device: torch.device, token_buckets: tuple[int, ...] = TOKEN_BUCKETS,
                 chunk_buckets: tuple[int, ...] = CHUNK_BUCKETS, capture: bool = True, capture_now: bool = True):
        """`proposer`: a drafter in this process whose context injection is captured with the
        forward (None: the engine injects, or has no drafter). `capture_now` False: the graphs are
        captured one per `capture_next`."""
        self.runner = runner
        self.proposer = proposer
        self.kv_block_size = kv_block_size
        self.max_blocks = max_blocks
        self.scratch_slot = scratch_slot
        self.device = device
        self.token_buckets = sorted(token_buckets)
        self.chunk_buckets = sorted(chunk_buckets)
        self.capture = capture
        tokens, chunks = self.token_buckets[-1], self.chunk_buckets[-1]
        # int64: ids, positions, slots [tokens each], sampled rows [chunks];
        # int32: sequence lengths [chunks], query starts [chunks + 1], block tables [chunks, max_blocks].
        self._long_sizes = (tokens, tokens, tokens, chunks)
        self._int_sizes = (chunks, chunks + 1, chunks * max_blocks)
        self._long = torch.zeros(_aligned_length(self._long_sizes, torch.long), dtype=torch.long, device=device)
        self._int = torch.zeros(_aligned_length(self._int_sizes, torch.int32), dtype=torch.int32, device=device)
        self.ids, self.positions, self.slots, self.sample_rows = _aligned_split(self._long, self._long_sizes)
        seq_lens, query_start, tables = _aligned_split(self._int, self._int_sizes)
        self.seq_lens, self.query_start, self.block_tables = seq_lens, query_start, tables.view(chunks, max_blocks)
        self.slots.fill_(scratch_slot)
        if device.type == "cuda":
            self._host_long = torch.zeros_like(self._long, device="cpu").pin_memory()
            self._host_int = torch.zeros_like(self._int, device="cpu").pin_memory()
            self._staged = torch.cuda.Event()
        else:  # no copy to make: the host writes the buffers the forward reads
            self._host_long, self._host_int, self._staged = self._long, self._int, None
        self._outputs: dict[tuple[int, int], PrefillOutputs] = {}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        # Largest first, so that smaller graphs reuse its memory in the shared pool.
        self._to_capture = [(tokens, chunks) for tokens in reversed(self.token_buckets)
                            for chunks in reversed(self.chunk_buckets)] if capture else []
        if capture:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(device)
        while capture_now and self.capture_next():
            pass

    @property
    def max_tokens(self) -> int:
        return self.token_buckets[-1]

    def fits(self, num_chunks: int, num_tokens: int, proposer: Proposer | None) -> bool:
        """Whether a plan of this size, for the engine's current drafter, runs in a graph."""
        if self.proposer is not None and proposer is not self.proposer:
            return False  # the graphs inject into a drafter the engine no longer has
        if num_chunks > self.chunk_buckets[-1] or num_tokens > self.max_tokens:
            return False
        return not self._to_capture or self._bucket(num_tokens, num_chunks) in self._graphs

    def _bucket(self, num_tokens: int, num_chunks: int) -> tuple[int, int]:
        return (next(b for b in self.token_buckets if b >= num_tokens),
                next(b for b in self.chunk_buckets if b >= num_chunks))

    def injects_for(self, proposer: Proposer | None) -> bool:
        """Whether `run` already gave this drafter the prefill's context rows."""
        return proposer is not None and proposer is self.proposer

    def _forward(self, tokens: int, chunks: int) -> PrefillOutputs:
        """The padded forward of bucket (tokens, chunks) over the static buffers."""
        batch = AttentionBatch(block_tables=self.block_tables[:chunks], seq_lens=self.seq_lens[:chunks],
                               query_start=self.query_start[:chunks + 1], slot_mapping=self.slots[:tokens],
                               max_query_len=tokens)
        positions = self.positions[:tokens]
        logits, features = self.runner.forward(self.ids[:tokens], positions, batch, self.sample_rows[:chunks])
        if self.proposer is not None:
            self.proposer.inject_context(features, positions, self.slots[:tokens])
        return PrefillOutputs(logits, features, positions, self.slots[:tokens])

    def capture_next(self) -> bool:
        """Capture the next bucket; whether any is left. The warm-up forward runs over the static
        buffers, which after a served prefill name real sequences' KV slots (maybe given to another
        sequence since): they are reset to padding first, so that it writes the scratch slot alone."""
        if self._to_capture:
            tokens, chunks = self._to_capture.pop(0)
            self._long.zero_()
            self._int.zero_()
            self.slots.fill_(self.scratch_slot)
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # compiles the Triton kernels outside capture
                self._forward(tokens, chunks)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with capture_graph(graph, self._pool):
                self._outputs[tokens, chunks] = self._forward(tokens, chunks)
            self._graphs[tokens, chunks] = graph
        return bool(self._to_capture)

    @property
    def complete(self) -> bool:
        return not self._to_capture

    def run(self, chunks: list[PrefillChunkView], sample_chunks: list[int]) -> PrefillOutputs:
        """Prefill `chunks` (at most the largest buckets); logits of the last row of each chunk
        listed in `sample_chunks`; features, positions and slots of the real tokens only."""
        count = sum(len(c.tokens) for c in chunks)
        tokens, num = self._bucket(count, len(chunks))
        self._stage(chunks, sample_chunks, tokens, num)
        if self.capture:
            self._graphs[tokens, num].replay()
            out = self._outputs[tokens, num]
        else:
            out = self._forward(tokens, num)
        features = None if out.features is None else out.features[:count]
        return PrefillOutputs(out.logits[:len(sample_chunks)], features, out.positions[:count], out.slots[:count])

    def _stage(self, chunks: list[PrefillChunkView], sample_chunks: list[int], tokens: int, num: int) -> None:
        """The step's inputs into the buffers of bucket (tokens, num), padding included."""
        if self._staged is not None:
            self._staged.synchronize()  # the last copy out of the staging buffers is done
        longs = [t.numpy() for t in _aligned_split(self._host_long, self._long_sizes)]
        ints = [t.numpy() for t in _aligned_split(self._host_int, self._int_sizes)]
        ids, positions, slots, sample_rows = longs
        seq_lens, query_start, tables = ints[0], ints[1], ints[2].reshape(len(ints[0]), self.max_blocks)
        page, row = self.kv_block_size, 0
        query_start[0] = 0
        for i, chunk in enumerate(chunks):
            length = len(chunk.tokens)
            pos = np.arange(chunk.start, chunk.start + length)
            table = np.asarray(chunk.block_table, dtype=np.int64)
            ids[row:row + length] = chunk.tokens
            positions[row:row + length] = pos
            slots[row:row + length] = table[pos // page] * page + pos % page
            tables[i, :len(chunk.block_table)] = chunk.block_table
            tables[i, len(chunk.block_table):] = 0
            seq_lens[i] = chunk.start + length
            row += length
            query_start[i + 1] = row
        ids[row:tokens] = 0
        positions[row:tokens] = 0
        slots[row:tokens] = self.scratch_slot
        seq_lens[len(chunks):num] = 0  # padding chunks: no keys, no queries
        query_start[len(chunks) + 1:num + 1] = row
        sample_rows[:num] = 0
        sample_rows[:len(sample_chunks)] = [query_start[i + 1] - 1 for i in sample_chunks]
        if self._staged is not None:
            self._long.copy_(self._host_long, non_blocking=True)
            self._int.copy_(self._host_int, non_blocking=True)
            self._staged.record()


def _padded(sizes: tuple[int, ...], dtype: torch.dtype) -> list[int]:
    """`sizes` rounded up to whole ALIGN_BYTES."""
    per = ALIGN_BYTES // dtype.itemsize
    return [-(-size // per) * per for size in sizes]


def _aligned_length(sizes: tuple[int, ...], dtype: torch.dtype) -> int:
    """The length of a buffer whose parts of `sizes` each start at ALIGN_BYTES (`_aligned_split`)."""
    return sum(_padded(sizes, dtype))


def _aligned_split(buffer: torch.Tensor, sizes: tuple[int, ...]) -> list[torch.Tensor]:
    """Views of `buffer` of `sizes`, each at ALIGN_BYTES from the buffer's start."""
    return [part[:size] for part, size in zip(buffer.split(_padded(sizes, buffer.dtype)), sizes, strict=True)]
