"""A speculative round: draft → verify → accept → commit (spec §3), launched and read by the Engine.

- k: how many drafts the round verifies, 0..B−1 (`SpeculationPolicy`: adaptive to the batch
  size, the measured acceptance and the measured costs, or fixed, or a static table);
- draft: the proposer drafts B−1 tokens after each bonus token (positions s+1..s+B−1); the
  first k are verified (k = 0: no draft forward, a plain AR step), and an eager drafter in this
  process takes the LM head of those k rows only;
- verify: one target forward over [bonus, k drafts] at positions s..s+k (paged KV, causal);
- accept: the target samples every slot (greedy or seeded sampling); drafts are accepted while
  they equal those samples, so every emitted token is the target's own;
- commit: the a+1 emitted tokens go through the stop checker (which may end the request inside
  the block); the target cache keeps s..s+a, and feature rows of slots 0..a — only those —
  become the drafter's next context (also after k = 0, so later rounds can draft; on a CPU the
  rows of AR steps wait and go in one injection before the next round that drafts);
- trim: blocks past the cached positions go back to the pool.

`Rounds._launch_round` queues draft, verify and accept on the device — replaying the CUDA graphs
of `cuda_graphs.RoundGraphs` where they fit the round, else eager forwards — and returns the round
unread; `Rounds._finish_round` reads its results and commits them. Between the two the host may
launch the next round (chained rounds: engine.py says when).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from dflash_serve.kernels import accept_round
from dflash_serve.services.engine.cuda_graphs import GraphBucket
from dflash_serve.services.engine.draft_runner import Proposer, ProposerLost
from dflash_serve.services.engine.kv_cache import AttentionBatch
from dflash_serve.services.engine.prefill import FirstTokens
from dflash_serve.services.engine.request import Sequence, SequenceStatus
from dflash_serve.services.engine.round_record import RoundRecord
from dflash_serve.services.engine.sampling import SamplingBatch, sample_tokens
from dflash_serve.services.engine.transfer import to_device

if TYPE_CHECKING:
    from dflash_serve.services.engine.two_groups import Group

# On a CPU the context rows of at most this many AR steps in a row wait to be injected together
# (`Engine.defer_context`): one injection then reads the drafter's projections for all of them.
MAX_DEFERRED_STEPS = 32


@dataclass
class StepTimings:
    """Seconds per phase, summed over rounds (for benchmarks). draft, verify and accept (the
    drafter's context injection, sampling and acceptance) are device times on a GPU; host is the Python time spent launching and
    finishing rounds, which overlaps the device's work when rounds are chained."""

    prefill: float = 0.0
    draft: float = 0.0
    verify: float = 0.0
    accept: float = 0.0
    host: float = 0.0
    rounds: int = 0
    rounds_by_k: dict[int, int] = dataclasses.field(default_factory=dict)  # k verified (0: AR steps) -> rounds
    # By k, the rounds read in the step loop and their periods, summed (`Engine._observe_round_time`: what each added to
    # the loop, batch changes and prefills included): what the adaptive policy weighs.
    period_rounds_by_k: dict[int, int] = dataclasses.field(default_factory=dict)
    period_by_k: dict[int, float] = dataclasses.field(default_factory=dict)
    period_context: float = 0.0  # those rounds' mean positions, summed: the context the policy priced them at

    def copy(self) -> StepTimings:
        return dataclasses.replace(self, **{f.name: dict(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), dict)})

    def add_period(self, k: int, seconds: float, context: float) -> None:
        self.period_rounds_by_k[k] = self.period_rounds_by_k.get(k, 0) + 1
        self.period_by_k[k] = self.period_by_k.get(k, 0.0) + seconds
        self.period_context += context

    def __sub__(self, before: StepTimings) -> StepTimings:
        def minus(now, then):
            if isinstance(now, dict):
                return {k: n - then.get(k, 0) for k, n in sorted(now.items()) if n != then.get(k, 0)}
            return now - then
        return StepTimings(*(minus(getattr(self, f.name), getattr(before, f.name)) for f in dataclasses.fields(self)))


class _PhaseClock:
    """Phase boundaries of a round: CUDA events on a GPU, read once the round is done so the host
    never waits between phases; wall-clock time on a CPU. The events go on `stream`, the round's,
    looked up once: `Event.record()` looks up the current stream itself, which took longer than
    the record (on the H100's host, under a profiler, ~30 µs a call, 4–6 calls a round)."""

    def __init__(self, device: torch.device, stream: torch.cuda.Stream | None = None):
        self.cuda = device.type == "cuda"
        self.stream = stream
        self.marks: list = []
        self.mark()

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def seconds(self) -> list[float]:
        """The time between consecutive marks (the round must be done)."""
        pairs = zip(self.marks, self.marks[1:])
        if self.cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in pairs]
        return [b - a for a, b in pairs]


@dataclass
class Round:
    """A round queued on the device whose results the host has not read yet."""

    seqs: list[Sequence]
    proposer: Proposer | None  # the drafter it was launched with (None: none, or lost before its verify)
    k: int  # drafts verified per sequence (0: an AR step)
    verified: list[int]  # per sequence: min(k, its own limit), the drafts it may accept
    # Drafted by a drafter in another process, which the round waited for (its draft time is learnt
    # from rounds; not a group's round, whose draft hid behind the other group's verify).
    times_draft: bool
    results: torch.Tensor  # [n, 1+k+1] on the host: accepted drafts, then the target's token per slot
    ready: torch.cuda.Event | None  # recorded after the copy of `results` (None: nothing to wait for)
    next_bonus: torch.Tensor  # [n] on the device: where a round chained after this one starts
    next_starts: torch.Tensor
    clock: _PhaseClock
    chainable: bool  # the next round may start from this one's device results
    context: tuple | None  # (features, positions, slots) of every slot, for a drafter that takes them after acceptance
    sampling: SamplingBatch  # its sequences' sampling parameters on the device; a round chained on it reuses them
    launched_at: float  # perf_counter() when the host began to launch it
    host_seconds: float = 0.0  # the host's own time launching and finishing it
    chained: bool = False  # launched while the round before it was still on the device
    finished: bool = False  # read and committed
    # A request it held still ran when it was read: else the loop may have waited for new work since, and its
    # time is not a round's (`_observe_round_time`).
    timed: bool = True
    mean_position: float = 0.0  # of the sequences that still ran, after its commit (`_observe_round_time`)


def mean_position(seqs: list[Sequence]) -> float:
    """The mean position of the next token of `seqs` (non-empty): their mean context."""
    return sum(s.num_cached for s in seqs) / len(seqs)


def _rows_held(seqs: list[Sequence], source: Round | FirstTokens | None) -> list[list[int]]:
    """[indices into `seqs`, their rows in `source`] of the sequences `source` holds."""
    rows = {} if source is None else {id(s): i for i, s in enumerate(source.seqs)}
    at = [i for i, s in enumerate(seqs) if id(s) in rows]
    return [at, [rows[id(seqs[i])] for i in at]]


@dataclass
class _RoundInputs:
    """A round's inputs on the device: in a CUDA graph bucket, or with eager forwards' metadata."""

    bonus: torch.Tensor  # [n]
    starts: torch.Tensor  # [n]
    positions: torch.Tensor  # [n, k+1]: the verified tokens'
    bucket: GraphBucket | None = None
    batch: AttentionBatch | None = None  # eager: the verify's
    draft_batch: AttentionBatch | None = None  # eager: the whole block's, for the draft


class Rounds:
    """The Engine's rounds: choosing k, launching a round, reading and committing it, and the
    drafter's context rows. A part of `Engine` (engine.py), whose state it reads and writes."""

    def _choose_k(self, seqs: list[Sequence]) -> int:
        """The policy's k for a round over `seqs`, at their mean position (a round's cost grows
        with the context its attention reads; only an adaptive policy reads it)."""
        policy = self.speculation
        context = mean_position(seqs) if policy.adapts else None
        return policy.choose([s.params.num_speculative_tokens for s in seqs], context)

    def _observe_round_time(self, rnd: Round) -> None:
        """Give the speculation policy the wall time of a round just read: from the later of its
        launch and the last round's read, which is what it added to the serving loop — the step
        period of chained rounds, launch to read for one that ran alone. Every round, the batch's
        changes and the prefills read with it included: at c = 32 two thirds of the rounds are at
        batch changes, where requests end and others join, and on the H200 (T 1, alpaca) they held
        80 % of the time, a round of k = 3 at 1.10 × an AR step there against 1.3 chained. Priced by
        the chained rounds alone, the policy read AR steps as the faster where rounds of k = 3 ran as
        fast (BENCHMARKS, thirty-second session). A prefill's time, the same whatever k, comes per
        token alike to either kind of round. Not a round none of whose requests still ran (`timed`):
        the loop may have waited for work. Its context is its running sequences' mean position after
        its commit, which `_finish_round` sums as it commits: a round past where it ran, a few
        positions of hundreds. For a round launched while the one before it ran, the host's own time
        for it goes too: the device runs one round while the host finishes the last and launches the
        next, so such a round takes at least that (`RoundCosts`). The periods go into the timings too
        (`StepTimings.add_period`)."""
        now = time.perf_counter()
        start = rnd.launched_at if self._last_read_at is None else max(rnd.launched_at, self._last_read_at)
        self._last_read_at = now
        if not rnd.timed:
            return
        self.timings.add_period(rnd.k, now - start, rnd.mean_position)
        if rnd.proposer is not None and self.speculation.adapts:
            host = rnd.host_seconds if rnd.chained else 0.0
            self.speculation.observe_round_time(len(rnd.seqs), rnd.k, now - start, rnd.mean_position, host)

    def _ask_for_drafts(self, seqs: list[Sequence], previous: Round | None, bonus: list[int] | torch.Tensor,
                        starts: list[int] | torch.Tensor, k: int, group: int = 0) -> int:
        """Before a round of `seqs` starting at `bonus`/`starts`: give a drafter that takes context
        after acceptance the rows of `previous` (every slot: which are accepted is not known yet),
        and ask a drafter in the background for the round's drafts, which it drafts while this
        process works. Returns k, or 0 when there is no drafter or it was lost."""
        proposer = self.proposer
        if proposer is None:
            return 0
        if k:  # its draft attends over the rows AR steps deferred
            self._flush_context()
            if self.proposer is None:
                return 0
        try:
            if previous is not None and proposer.context_after_accept:
                self._send_every_slot(previous)
            if k and proposer.drafts_in_background:
                proposer.request_drafts([s.request_id for s in seqs], bonus, starts, [s.block_table for s in seqs],
                                        None, group=group)
        except ProposerLost as err:
            self._lose_proposer(err)
            return 0
        return k

    def _launch_round(self, seqs: list[Sequence], previous: Round | None = None,
                      group: Group | None = None, first: FirstTokens | None = None) -> Round:
        """Queue one round for `seqs` on the device — draft, verify, sample, accept — and return
        it unread; `_finish_round` commits it. With `previous` (the last round, which the host has
        not read yet) the bonus tokens and starts come from its results on the device. A group's
        round verifies the drafts its last turn asked for (`group.k` of them). A drafter lost on
        the way is dropped, and the same round goes on target-only (k = 0)."""
        t0 = time.perf_counter()
        n = len(seqs)
        ids, tables = [s.request_id for s in seqs], [s.block_table for s in seqs]
        bonus_ids, starts = self._bonus_tokens(seqs, first, previous)
        proposer = self.proposer
        if group is not None:
            k = group.k if proposer is not None else 0
        else:  # a drafter in the background is asked first: it drafts while this process prepares the verify
            k = self._choose_k(seqs) if proposer is not None else 0
            k = self._ask_for_drafts(seqs, previous, bonus_ids, starts, k)
            proposer = self.proposer  # None if lost
        inputs = self._round_inputs(n, k, bonus_ids, starts, tables)
        if group is None and previous is not None and proposer is not None and proposer.drafts_in_background:
            self._finish_round(previous, self.block_size)  # the host commits the last round while the drafter drafts
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        clock = _PhaseClock(self.device, stream)

        # draft: the whole block; the first k are verified
        drafter = proposer
        if inputs.bucket is not None and self.graphs.proposer is not None:  # captured with the verify
            drafter = self.graphs.proposer_for(inputs.bucket, n, k)
        drafts = None
        if k:
            try:
                drafts = self._draft(drafter, ids, tables, inputs, k, 0 if group is None else group.index)
            except ProposerLost as err:
                self._lose_proposer(err)
                proposer, drafter, k = None, None, 0
                inputs = self._round_inputs(n, k, bonus_ids, starts, tables)  # to verify the bonus tokens alone
                clock = _PhaseClock(self.device, stream)  # the phases of the round that runs
        clock.mark()

        # verify: [bonus, k drafts] per sequence
        logits, features, slots = self._verify(inputs, drafts, n, k)
        clock.mark()

        # context: the feature rows of every slot, which the drafter's next draft attends over;
        # `Proposer.context_after_accept` says whether they go now or once acceptance is known
        context = None
        if drafter is not None and drafter.context_after_accept:
            context = (features, inputs.positions.flatten(), slots)  # `_finish_round` sends the accepted ones
        elif drafter is not None and not k and self.defer_context:
            self._deferred.append((features, inputs.positions.flatten(), slots))
            if len(self._deferred) >= MAX_DEFERRED_STEPS:
                self._flush_context()
        elif drafter is not None:
            try:
                drafter.inject_context(features, inputs.positions.flatten(), slots)
            except ProposerLost as err:
                self._lose_proposer(err)

        # accept: the target samples every slot (the token sampled at slot j is the one at
        # position s+j+1); drafts count while they equal those samples, up to each request's limit
        # The same sequences as the round it chains on: the same parameters and seeds, already on the device (building
        # them, a few host-to-device copies, took the H100's host ~180 µs a round at batch 32, T 1; BENCHMARKS).
        sampling = previous.sampling if previous is not None and seqs is previous.seqs else self._sampling_batch(seqs)
        verified = [k if s.params.num_speculative_tokens is None else min(k, s.params.num_speculative_tokens)
                    for s in seqs]
        # [accepted, the k+1 tokens] for the host; next bonus and start for a round chained on this one
        results, next_bonus, next_starts = self._accept(inputs, logits, drafts, sampling, verified, k,
                                                        group is not None)
        clock.mark()
        ready = None
        if results.is_cuda:  # to the host without waiting for it: `_finish_round` waits
            results = results.to("cpu", non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        launch_seconds = time.perf_counter() - t0
        self.timings.host += launch_seconds
        return Round(
            seqs=seqs, proposer=proposer, k=k, verified=verified,
            times_draft=k > 0 and proposer.drafts_in_background and group is None,
            results=results, ready=ready, next_bonus=next_bonus, next_starts=next_starts, clock=clock,
            chainable=self.chain_rounds, context=context, sampling=sampling,
            launched_at=t0, host_seconds=launch_seconds, chained=previous is not None,
        )

    def _bonus_tokens(self, seqs: list[Sequence], first: FirstTokens | None, previous: Round | None
                      ) -> tuple[list[int] | torch.Tensor, list[int] | torch.Tensor]:
        """A round's bonus tokens and starts: the host's, or on the device for sequences of
        `previous` (the round in flight, not read yet) and those whose first token this step's
        prefill sampled (not read yet)."""
        if previous is not None and seqs is previous.seqs:
            return previous.next_bonus, previous.next_starts
        bonus, starts = [s.bonus for s in seqs], [s.num_cached for s in seqs]
        (into_p, take_p), (into_f, take_f) = _rows_held(seqs, previous), _rows_held(seqs, first)
        if not into_p and not into_f:
            return bonus, starts
        n, p, f = len(seqs), len(into_p), len(into_f)
        host = bonus + starts + into_p + take_p + into_f + take_f  # one host-to-device copy
        bonus_t, starts_t, into_p, take_p, into_f, take_f = to_device(host, torch.long, self.device).split(
            [n, n, p, p, f, f])
        if p:
            bonus_t[into_p] = previous.next_bonus[take_p]
            starts_t[into_p] = previous.next_starts[take_p]
        if f:
            bonus_t[into_f] = first.tokens[take_f]
        return bonus_t, starts_t

    def _round_inputs(self, n: int, k: int, bonus_ids: list[int] | torch.Tensor, starts: list[int] | torch.Tensor,
                      tables: list[list[int]]) -> _RoundInputs:
        """A round's inputs on the device: in a CUDA graph bucket where the graphs fit the round,
        else with the attention metadata of eager forwards."""
        block, width, graphs = self.block_size, k + 1, self.graphs
        bucket = batch = draft_batch = None
        if (graphs is not None and graphs.holds(n) and graphs.fits(self.proposer, block)
                and k in graphs.k_buckets):
            bucket = graphs.load(bonus_ids, starts, tables)
            bonus, starts_t = bucket.bonus[:n], bucket.starts[:n]
        else:
            if isinstance(bonus_ids, torch.Tensor):  # a chained round's, on the device already
                bonus, starts_t = bonus_ids, starts
            else:
                bonus = to_device(bonus_ids, torch.long, self.device)
                starts_t = to_device(starts, torch.long, self.device)
            table_width = max(map(len, tables))
            table_t = to_device([t + [0] * (table_width - len(t)) for t in tables], torch.int32, self.device)
            page = self.allocator.block_size
            batch = AttentionBatch.for_round(table_t, starts_t, width, page)  # the verify's
            draft_batch = batch if width == block or not k else AttentionBatch.for_round(table_t, starts_t, block, page)
        positions = starts_t[:, None] + torch.arange(width, device=self.device)
        return _RoundInputs(bonus, starts_t, positions, bucket, batch, draft_batch)

    def _draft(self, drafter: Proposer, ids: list[str], tables: list[list[int]], inputs: _RoundInputs,
               k: int, group: int) -> torch.Tensor:
        """The first k drafts of the block [n, k], where the verify reads them."""
        if drafter.drafts_in_background:  # asked before the verify was prepared
            drafts = drafter.receive_drafts(group)
        else:
            drafter.request_drafts(ids, inputs.bonus, inputs.starts, tables, inputs.draft_batch, num_drafts=k)
            drafts = drafter.receive_drafts()
        if inputs.bucket is not None and not drafter.in_graphs:
            return self.graphs.load_drafts(inputs.bucket, drafts)[:, :k]
        if drafter.drafts_in_background:  # cloned: the buffer they arrive in is rewritten next round
            return drafts[:, :k].clone()
        return drafts[:, :k]

    def _verify(self, inputs: _RoundInputs, drafts: torch.Tensor | None, n: int,
                k: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The target's forward over [bonus, k drafts] per sequence: logits, feature rows and KV
        slots of its n*(k+1) tokens."""
        rows = n * (k + 1)
        if inputs.bucket is not None:
            out = self.graphs.verify(inputs.bucket, k)
            features = None if out.features is None else out.features[:rows]
            return out.logits[:rows], features, out.slots[:rows]
        bonus = inputs.bonus[:, None]
        block_ids = bonus if drafts is None else torch.cat([bonus, drafts.to(bonus)], dim=1)
        logits, features = self.runner.forward(block_ids.flatten(), inputs.positions.flatten(), inputs.batch,
                                               torch.arange(rows, device=self.device))
        return logits, features, inputs.batch.slot_mapping

    def _accept(self, inputs: _RoundInputs, logits: torch.Tensor, drafts: torch.Tensor | None,
                sampling: SamplingBatch, verified: list[int], k: int,
                grouped: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The target's token at every slot, and per sequence the drafts accepted, up to its `verified`
        limit: [accepted, the k+1 tokens] for the host, the next bonus and start on the device. In
        the bucket's accept graph where no sequence's limit is below k and no request truncates —
        not for a group's round (`grouped`): the other group's round of the same bucket and k
        would rewrite the graph's buffers before this group's next round reads them."""
        n = len(verified)
        synthetic = self.synthetic if k else None  # benchmarks only; an AR round accepts nothing, and owes nothing
        if (not grouped and inputs.bucket is not None and synthetic is None and min(verified) == k
                and self.graphs.accepts(sampling)):
            return self.graphs.accept(inputs.bucket, k, sampling, n)
        target_tokens = sample_tokens(logits.view(n, k + 1, -1), sampling, inputs.positions + 1)
        limits = verified
        if synthetic is not None:
            drafts, limits = synthetic.drafts_and_limits(target_tokens, verified, k, self.block_size)
        limits_t = to_device(limits, torch.long, self.device) if min(limits) < k else None
        return accept_round(target_tokens, inputs.starts, drafts, limits_t)

    def _send_every_slot(self, rnd: Round) -> None:
        """Give a drafter that takes context after acceptance the feature rows of every slot of
        `rnd` before the host has read which were accepted (engine.py's module doc). Their positions
        and KV slots come from the host's cached counts, which `rnd` has not advanced yet: no wait
        for the device."""
        features = rnd.context[0]
        rnd.context = None  # `_finish_round` must not send the accepted ones again
        kv, width = self.allocator.block_size, rnd.k + 1
        positions = [p for seq in rnd.seqs for p in range(seq.num_cached, seq.num_cached + width)]
        tables = [seq.block_table for seq in rnd.seqs for _ in range(width)]
        slots = [table[p // kv] * kv + p % kv for table, p in zip(tables, positions)]
        self.proposer.inject_context(features, positions, slots)

    def _finish_round(self, rnd: Round, lookahead: int = 0) -> None:
        """Read a round's results and commit them. `lookahead`: KV positions past the new cached
        ones to keep, for a round already launched after this one."""
        if rnd.finished:  # a chained round with a drafter in the background reads its predecessor itself
            return
        rnd.finished = True
        rnd.timed = False  # until its results are committed (a failed read is not a round's time)
        if rnd.ready is not None:
            rnd.ready.synchronize()
        t0 = time.perf_counter()  # the host's own time, not its wait for the device
        width = rnd.k + 1
        keep_rows, verified, accepted, counted = [], [], [], []
        positions = 0
        for i, (seq, row) in enumerate(zip(rnd.seqs, rnd.results.tolist(), strict=True)):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # cancelled since, or ended by the round before this one
            a = row[0]
            verified.append(rnd.verified[i])
            accepted.append(a)
            seq.num_cached += a + 1
            positions += seq.num_cached
            # τ counts the tokens the round commits (vLLM, the z-lab reference): drafts accepted past
            # a stop token or max_tokens are not output, so they are not counted.
            counted.append(self._commit(seq, row[1 : a + 2]) - 1)
            if rnd.verified[i]:
                seq.stats.record(rnd.verified[i], counted[-1])
            # Also a sequence that just finished: its blocks may stay in the prefix cache.
            keep_rows.extend(range(i * width, i * width + a + 1))
            if seq.status is SequenceStatus.RUNNING:  # a finished one's blocks are already free
                self.scheduler.offer_committed_blocks(seq)
                self.scheduler.trim(seq, lookahead)
        rnd.timed = bool(verified)  # some request still ran: the loop did not wait for work
        if verified:
            rnd.mean_position = positions / len(verified)
        if rnd.context is not None and keep_rows and self.proposer is rnd.proposer:
            rows_t = to_device(keep_rows, torch.long, self.device)
            try:
                self.proposer.inject_context(*(t[rows_t] for t in rnd.context))
            except ProposerLost as err:
                self._lose_proposer(err)
        draft_s, verify_s, accept_s = rnd.clock.seconds()
        if rnd.proposer is not None and rnd.proposer is self.proposer:
            self.speculation.observe_round(rnd.k, verified, accepted)
            costs = self.speculation.costs
            if rnd.times_draft and costs is not None and not costs.measured_draft:
                costs.observe_draft(len(rnd.seqs), draft_s)
        self.round_log.append(RoundRecord(rnd.k, verified, counted, draft_s, verify_s))
        tm = self.timings
        tm.draft += draft_s
        tm.verify += verify_s
        tm.accept += accept_s
        finish_seconds = time.perf_counter() - t0
        rnd.host_seconds += finish_seconds
        tm.host += finish_seconds
        tm.rounds += 1
        tm.rounds_by_k[rnd.k] = tm.rounds_by_k.get(rnd.k, 0) + 1

    def _flush_context(self) -> None:
        """Inject the context rows that wait (`defer_context`), in the order they came, in one call."""
        if not self._deferred:
            return
        rows, self._deferred = self._deferred, []
        # One set of rows (a prefill's, on a GPU always) goes as it is: a long prompt's features are large.
        features, positions, slots = rows[0] if len(rows) == 1 else (torch.cat(p) for p in zip(*rows, strict=True))
        try:
            self.proposer.inject_context(features, positions, slots)
        except ProposerLost as err:
            self._lose_proposer(err)

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        return SamplingBatch.build([s.params for s in seqs], [s.seed for s in seqs], self.device,
                                   batch_invariant=self.config.deterministic)
