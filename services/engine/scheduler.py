"""Continuous batching: which sequences prefill and which run a speculative round this step.

Requests join and leave between steps. Every running sequence that has finished its prefill runs
one round per step; prompts are prefilled in chunks under a per-step token budget so a long prompt
does not stall the others. KV blocks are taken before each step (the round's lookahead included)
and, when they run out, the most recently admitted sequence is preempted: its blocks are freed
and it is prefilled again later from its prompt and the tokens it already produced (recompute).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.config import EngineConfig
from services.engine.kv_cache import BlockAllocator
from services.engine.request import Sequence, SequenceStatus


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
    decodes: list[Sequence] = field(default_factory=list)
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

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a finished, failed or cancelled sequence and give back its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.allocator.release(seq.block_table)

    def trim(self, seq: Sequence, lookahead: int = 0) -> None:
        """After a round: keep blocks for the cached positions (and `lookahead` more, which a
        round already launched writes); the rejected slots' blocks go back."""
        self.allocator.trim(seq.block_table, seq.num_cached + lookahead)

    def grow_for_chained_round(self, seqs: list[Sequence]) -> bool:
        """Blocks for a round launched before the last one is read: that one may have accepted
        its whole block, so the new one may write up to num_cached + 2 * lookahead. All or
        nothing: False (not enough free blocks) changes no table."""
        ends = [s.num_cached + 2 * self.lookahead for s in seqs]
        missing = sum(max(0, self.allocator.blocks_for(end) - len(s.block_table)) for s, end in zip(seqs, ends))
        if missing > self.allocator.num_free:
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
        victim.num_cached = 0
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
            before = len(plan.prefills)
            budget = self._plan_chunk(seq, budget, plan)
            if len(plan.prefills) == before:
                break  # not enough free blocks for its first chunk: admit later (FCFS)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
        return plan

    def _plan_chunk(self, seq: Sequence, budget: int, plan: StepPlan) -> int:
        length = min(seq.prefill_target - seq.num_cached, budget)
        if length <= 0:
            return budget
        end = seq.num_cached + length
        if not self.allocator.can_hold(seq.block_table, end):
            # Take what fits in whole free blocks rather than nothing.
            end = min(end, (len(seq.block_table) + self.allocator.num_free) * self.allocator.block_size)
            length = end - seq.num_cached
            if length <= 0:
                return budget
        self.allocator.grow(seq.block_table, end)
        plan.prefills.append(PrefillChunk(seq, seq.num_cached, length))
        return budget - length
