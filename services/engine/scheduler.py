"""Continuous batching: which sequences prefill and which run a speculative round this step.

Requests join and leave between steps. Every running sequence that has finished its prefill runs
one round per step, and one whose prefill completes in a step where others decode runs that
step's round too (from the first token its prefill samples); prompts are prefilled in chunks
under a per-step token budget so a long prompt does not stall the others. KV blocks are taken
before each step (the round's lookahead included) and, when they run out, the most recently admitted sequence is preempted: its blocks are freed
and it is prefilled again later from its prompt and the tokens it already produced (recompute).

Prefix caching (`EngineConfig.enable_prefix_caching`): once a block is full of committed tokens
it is offered to the allocator's prefix cache, and an admitted sequence starts from the longest
run of cached blocks its tokens match — never the block of the last position to prefill, which
is computed for its logits (and its feature row). Every write of a sequence (prefill, the
round's verify block, the drafter's block, a chained round's two blocks ahead) lands at or after
its committed positions, so never in a block it shares.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.kv_cache import BlockAllocator, hash_block_tokens
from dflash_serve.services.engine.request import Sequence, SequenceStatus


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int  # first position of the chunk
    length: int

    @property
    def completes_prefill(self) -> bool:
        return self.start + self.length == self.seq.prefill_target


@dataclass
class StepPlan:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)  # the step's round, in the running order
    preempted: list[Sequence] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefills or self.decodes)


class Scheduler:
    def __init__(self, allocator: BlockAllocator, config: EngineConfig, lookahead: int):
        self.allocator = allocator
        self.config = config
        # Positions a round writes past the cached ones: the B verify/draft slots (1 in AR mode).
        self.lookahead = lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # since start, for the server's counter
        self.prefix_caching = config.enable_prefix_caching
        # Since start, in tokens (vLLM's prefix_cache_queries / _hits): what admitted sequences
        # had to prefill, and how much of it the cache held.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished, failed or cancelled sequence and give back its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq.block_table)

    def offer_committed_blocks(self, seq: Sequence) -> None:
        """Offer the blocks now full of committed tokens to the prefix cache: positions below
        num_cached have their K/V and context rows, and below num_tokens their tokens (a stop
        inside a round's block drops the tokens after it). Blocks no query of the sequence can
        see any more give back their sliding-window layers' slots."""
        self.allocator.leave_window(seq.block_table, seq.num_cached)
        if not self.prefix_caching:
            return
        full = min(seq.num_cached, seq.num_tokens) // self.allocator.block_size
        if full <= seq.num_offered_blocks:
            return
        keys = self._block_keys(seq, full)
        for i in range(seq.num_offered_blocks, full):
            self.allocator.register(seq.block_table[i], keys[i])
        seq.num_offered_blocks = full

    def _block_keys(self, seq: Sequence, count: int) -> list[bytes]:
        """The content keys of the sequence's first `count` blocks (computed once each)."""
        keys, size = seq.block_keys, self.allocator.block_size
        if len(keys) < count:
            tokens = seq.tokens
            for i in range(len(keys), count):
                keys.append(hash_block_tokens(keys[i - 1] if i else b"", tokens[i * size : (i + 1) * size]))
        return keys[:count]

    def _take_cached_prefix(self, seq: Sequence) -> None:
        """Start a sequence being admitted (holding no blocks) from its longest cached prefix."""
        if not self.prefix_caching:
            return
        usable = (seq.prefill_target - 1) // self.allocator.block_size  # the last position is computed
        blocks = self.allocator.cached_prefix(self._block_keys(seq, usable))
        seq.block_table.extend(blocks)
        seq.num_offered_blocks = len(blocks)
        seq.num_cached = len(blocks) * self.allocator.block_size

    def trim(self, seq: Sequence, lookahead: int = 0) -> None:
        """After a round: keep blocks for the cached positions; the rejected slots' blocks go
        back. With a round already launched after this one, which writes up to `lookahead`
        positions past them, also those the chained round after it takes: two rounds ahead
        (`grow_for_chained_round`) — given back here, every sequence took a block again the next
        step, a block per sequence and round through the allocator."""
        self.allocator.trim(seq.block_table, seq.num_cached + 2 * lookahead)

    def grow_for_chained_round(self, seqs: list[Sequence]) -> bool:
        """Blocks for a round launched before the last one is read: that one may have accepted
        its whole block, so the new one may write up to num_cached + 2 * lookahead. All or
        nothing: False (not enough free blocks) changes no table."""
        ends = [s.num_cached + 2 * self.lookahead for s in seqs]
        missing = sum(max(0, self.allocator.blocks_for(end) - len(s.block_table)) for s, end in zip(seqs, ends))
        if missing > self.allocator.num_takeable:
            return False
        for seq, end in zip(seqs, ends, strict=True):
            self.allocator.grow(seq.block_table, end)
        return True

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def _preempt_last(self, plan: StepPlan) -> Sequence:
        victim = self.running.pop()
        self.allocator.release(victim.block_table)
        victim.num_cached = victim.num_offered_blocks = 0
        victim.status = SequenceStatus.WAITING
        self.waiting.appendleft(victim)
        plan.preempted.append(victim)
        self.num_preemptions += 1
        return victim

    def preempt_all(self) -> None:
        """Send every running sequence back to the queue (newest first, so the order is kept)."""
        plan = StepPlan()
        while self.running:
            self._preempt_last(plan)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        # 1. Rounds for decoding sequences, oldest first; preempt the newest when blocks run out.
        decoding = [s for s in self.running if not s.is_prefilling]
        for seq in decoding:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted below, in this same pass
            need = seq.num_cached + self.lookahead
            while not self.allocator.can_hold(seq.block_table, need) and self.running[-1] is not seq:
                self._preempt_last(plan)
            if not self.allocator.can_hold(seq.block_table, need):
                self._preempt_last(plan)  # it is the newest itself: wait for others to finish
                continue
            self.allocator.grow(seq.block_table, need)
            plan.decodes.append(seq)

        # 2. Prefill chunks under the token budget: running prefills first, then admissions.
        budget = self.config.max_prefill_tokens
        for seq in [s for s in self.running if s.is_prefilling]:
            budget = self._plan_chunk(seq, budget, plan)
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            self._take_cached_prefix(seq)
            before = len(plan.prefills)
            budget = self._plan_chunk(seq, budget, plan)
            if len(plan.prefills) == before:
                # Not enough free blocks for its first chunk: admit later (FCFS), holding nothing.
                self.allocator.release(seq.block_table)
                seq.num_cached = seq.num_offered_blocks = 0
                break
            if self.prefix_caching:
                self.prefix_cache_queries += seq.prefill_target
                self.prefix_cache_hits += seq.num_cached
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

        # 3. Prompts whose prefill completes now decode in this step's round too, if others do (a step
        #    of their own would break the chain of rounds; with nothing decoding, the step returns their
        #    first tokens at once, not after a round's launch).
        joining = [c.seq for c in plan.prefills if self._joins_round(c)] if plan.decodes else []
        if joining:
            members = {id(s) for s in plan.decodes + joining}
            plan.decodes = [s for s in self.running if id(s) in members]  # so that later rounds chain on it
        return plan

    def _joins_round(self, chunk: PrefillChunk) -> bool:
        """Whether the sequence of a planned chunk decodes in this step's round: its prefill
        completes, it may generate more than the first token (which a fresh one samples from its
        prefill), and blocks hold the round's lookahead (taken here)."""
        seq = chunk.seq
        if not chunk.completes_prefill or (not seq.output_ids and seq.params.max_tokens <= 1):
            return False
        need = seq.prefill_target + self.lookahead
        if not self.allocator.can_hold(seq.block_table, need):
            return False
        self.allocator.grow(seq.block_table, need)
        return True

    def _plan_chunk(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        length = min(seq.prefill_target - seq.num_cached, budget)
        if length <= 0:
            return budget
        end = seq.num_cached + length
        if not self.allocator.can_hold(seq.block_table, end):
            # Take what fits in whole free blocks rather than nothing.
            end = min(end, (len(seq.block_table) + self.allocator.num_takeable) * self.allocator.block_size)
            length = end - seq.num_cached
            if length <= 0:
                return budget
        self.allocator.grow(seq.block_table, end)
        plan.prefills.append(PrefillChunk(seq, seq.num_cached, length))
        return budget - length
