"""Two groups in flight: the target verifies one group's round while the drafter drafts the other's.

Two groups (a drafter in another process that holds two groups' requests, chained rounds, a
stable batch of at least 2 × `Engine.min_group_size` sequences, and measured costs that say a
step of two half batches is faster than one of the whole batch): the batch is split in two, and
each group's rounds chain on their own, interleaved with the other's — the target verifies A_r,
B_r, A_r+1, …, and right after a group's round is queued its next drafts are asked for, so the
drafter drafts A_r+1 while the target verifies B_r. A step runs a turn of each group (`Group`).
A group's sequences stay the same while its rounds chain: a request that ends or is cancelled, one
waiting to be admitted, a drafter lost or KV blocks running out end both groups (their rounds are
read, drafts asked for and never verified are dropped), and the next step schedules as usual.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_serve.services.engine.request import Sequence, SequenceStatus
from dflash_serve.services.engine.round import Round

# Two groups are pipelined from 2 × this many decoding sequences (`Engine.min_group_size`), and
# only where the measured costs say they pay (`_two_groups_pay`); below it, the host's work per
# round would weigh on every step twice.
MIN_GROUP_SIZE = 8


@dataclass
class Group:
    """One of two groups of sequences in flight (see the module doc). A turn: launch the round
    whose drafts the last turn asked for, read the round before it, ask for the next drafts."""

    index: int  # 0 or 1: its draft requests (`Proposer.draft_groups`)
    seqs: list[Sequence]
    in_flight: Round | None = None  # launched, not read
    # Drafts the next round verifies: asked for when > 0 (0: an AR round); None: nothing was
    # asked, the group stops (so do both, at the next step).
    k: int | None = None


class TwoGroups:
    """The Engine's two groups. A part of `Engine` (engine.py), whose state it reads and writes."""

    def _two_groups_fit(self, seqs: list[Sequence]) -> bool:
        """Whether to split a decoding batch into two groups in flight (see the module doc)."""
        proposer = self.proposer
        return (self.chain_rounds and proposer is not None and proposer.draft_groups == 2
                and len(seqs) >= 2 * self.min_group_size and self._two_groups_pay(len(seqs))
                and self._batch_stays(seqs))

    def _two_groups_pay(self, n: int) -> bool:
        """Whether the round costs (`RoundCosts`, at the deepest k) predict a step of two groups
        faster than one: the target verifies both halves back to back and each half's draft hides
        behind the other's verify — 2 × max(verify(n/2), draft(n/2)) — against the whole batch's
        draft and then its verify. Two halves cost twice a forward's fixed part (reading the
        weights), so they pay only where a verify grows with the batch and drafts are not cheap.
        Measured for a drafter that can pipeline whatever the speculation (`measure_round_costs`)."""
        costs = self.speculation.costs
        if costs is None:
            return False
        k, half = max(costs.ks), (n + 1) // 2
        two = 2 * max(costs.verify_seconds(half, k), costs.draft_seconds(half))
        return two < costs.verify_seconds(n, k) + costs.draft_seconds(n)

    def _groups_go_on(self) -> bool:
        """Whether both groups asked for their next round (`_ask_for_group`) and the batch is still theirs."""
        return (bool(self._groups) and all(g.k is not None for g in self._groups)
                and self._batch_stays([s for g in self._groups for s in g.seqs]))

    def _turn_groups(self) -> None:
        """A's round, then B's: the drafter drafts each group while the target verifies the other."""
        for group in self._groups:
            self._guarded(self._group_turn, group, group.seqs)

    def _start_groups(self, seqs: list[Sequence]) -> None:
        """Split the batch in two and run each group's first turn; both ask for drafts first, so
        the drafter drafts B's first round while the target verifies A's."""
        half = (len(seqs) + 1) // 2
        self._groups = [Group(0, seqs[:half]), Group(1, seqs[half:])]
        for group in self._groups:
            k = self._choose_k(group.seqs)
            group.k = self._ask_for_drafts(group.seqs, None, [s.bonus for s in group.seqs],
                                           [s.num_cached for s in group.seqs], k, group.index)
        for group in self._groups:
            self._group_turn(group)

    def _group_turn(self, group: Group) -> None:
        """Launch the group's round with the drafts its last turn asked for, read the round
        before it, then ask for the next round's drafts."""
        previous = group.in_flight
        lookahead = self.block_size  # what the new round writes, even if it loses its drafter
        group.in_flight = self._launch_round(group.seqs, previous, group)
        group.k = None  # taken
        if previous is not None:
            self._finish_round(previous, lookahead)
        self._ask_for_group(group)

    def _ask_for_group(self, group: Group) -> None:
        """Ask for the drafts of the group's next round, chained on the round it has in flight,
        if the group goes on: its sequences all running, none waiting to be admitted, KV blocks
        for two rounds ahead and a drafter. Else it stops, and its round keeps a copy of its
        context rows for `_finish_round`: the other group's verify may replay the same graph
        buffers before that reads them."""
        rnd, seqs = group.in_flight, group.seqs
        goes_on = (self.proposer is not None and all(s.status is SequenceStatus.RUNNING for s in seqs)
                   and not self._admission_waits() and self.scheduler.grow_for_chained_round(seqs))
        if goes_on:
            k = self._choose_k(seqs)
            k = self._ask_for_drafts(seqs, rnd, rnd.next_bonus, rnd.next_starts, k, group.index)
            if self.proposer is not None:
                group.k = k
        if rnd.context is not None:
            rnd.context = tuple(t.clone() for t in rnd.context)

    def _end_groups(self) -> None:
        """Read both groups' rounds in flight. Drafts asked for and never verified are dropped:
        the proposer reads them before their rows are asked for again, and their KV writes, on
        the drafter's device, come before any of a later request."""
        groups, self._groups = self._groups, []
        for group in groups:
            if group.in_flight is not None:
                self._guarded(self._finish_round, group.in_flight, group.seqs)
