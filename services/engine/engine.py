"""The embedded engine: add requests, step, stream, cancel.

One step = prefill chunks for new sequences, then one speculative round for every decoding
sequence (spec §3):  draft → verify → accept → commit → trim.

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

Chained rounds (`EngineConfig.async_scheduling`, on a GPU): accept runs on the device, and its
results reach the host by an asynchronous copy. While the batch stays the same, the next round is
launched from the device's bonus tokens and starts before the host has read them, so committing,
stop checks and streaming of round r overlap the device's round r+1 (vLLM's async scheduling,
SGLang's overlap scheduler). Its KV blocks are taken for two rounds ahead (num_cached + 2B), every
slot's feature row is injected (rows past the accepted ones are never read: the next draft
overwrites them first), and a round for a request that ended meanwhile is dropped unread. When
the batch changes — a request ended, one is admitted — the step schedules before reading the round
in flight: the sequences that stay start from its results on the device, and prompts whose prefill
completes in a step where others decode join the round from the first tokens their prefill
sampled on the device; the host reads both once the round is launched, so the device runs the
last round, the prefill and the next round back to back. A preemption, a sequence decoding that
the round in flight does not hold, a new drafter or one in another process make the host read the
round first, then schedule.
A drafter in another process chains too: its draft request goes out first, naming bonus tokens
that only the device knows yet, and the host commits the last round while the drafter drafts.

Two groups (a drafter in another process that holds two groups' requests, chained rounds, a
stable batch of at least 2 × `Engine.min_group_size` sequences, and measured costs that say a
step of two half batches is faster than one of the whole batch): the batch is split in two, and
each group's rounds chain on their own, interleaved with the other's — the target verifies A_r,
B_r, A_r+1, …, and right after a group's round is queued its next drafts are asked for, so the
drafter drafts A_r+1 while the target verifies B_r. A step runs a turn of each group (`_Group`).
A group's sequences stay the same while its rounds chain: a request that ends or is cancelled, one
waiting to be admitted, a drafter lost or KV blocks running out end both groups (their rounds are
read, drafts asked for and never verified are dropped), and the next step schedules as usual.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from dflash_serve.kernels import accept_round
from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.cuda_graphs import GraphBucket, RoundGraphs
from dflash_serve.services.engine.draft_runner import Proposer, ProposerLost
from dflash_serve.services.engine.kv_cache import AttentionBatch, BlockAllocator
from dflash_serve.services.engine.prefill_graphs import PrefillChunkView, PrefillGraphs
from dflash_serve.services.engine.request import RequestOutput, Sequence, SequenceStatus
from dflash_serve.services.engine.round_cost_cache import RoundCostCache
from dflash_serve.services.engine.round_costs import COST_CONTEXT, load_or_measure
from dflash_serve.services.engine.sampling import SamplingBatch, SamplingParams, resolve_seed, sample_tokens
from dflash_serve.services.engine.scheduler import PrefillChunk, Scheduler
from dflash_serve.services.engine.speculation import SpeculationPolicy
from dflash_serve.services.engine.stopping import FinishReason, IncrementalDetokenizer, StopChecker
from dflash_serve.services.engine.target_runner import TargetRunner
from dflash_serve.services.engine.transfer import to_device

log = logging.getLogger(__name__)
# Two groups are pipelined from 2 × this many decoding sequences (`Engine.min_group_size`), and
# only where the measured costs say they pay (`_two_groups_pay`); below it, the host's work per
# round would weigh on every step twice.
MIN_GROUP_SIZE = 8
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
class _Round:
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


@dataclass
class _Group:
    """One of two groups of sequences in flight (see the module doc). A turn: launch the round
    whose drafts the last turn asked for, read the round before it, ask for the next drafts."""

    index: int  # 0 or 1: its draft requests (`Proposer.draft_groups`)
    seqs: list[Sequence]
    in_flight: _Round | None = None  # launched, not read
    # Drafts the next round verifies: asked for when > 0 (0: an AR round); None: nothing was
    # asked, the group stops (so do both, at the next step).
    k: int | None = None


@dataclass
class _FirstTokens:
    """The first tokens a prefill sampled for fresh sequences, on the device, not read yet."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [len(seqs)]


def mean_position(seqs: list[Sequence]) -> float:
    """The mean position of the next token of `seqs` (non-empty): their mean context."""
    return sum(s.num_cached for s in seqs) / len(seqs)


def _rows_held(seqs: list[Sequence], source: _Round | _FirstTokens | None) -> list[list[int]]:
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


@dataclass
class RoundRecord:
    """One speculative round, for the server's metrics: the k it verified (0: an AR step), draft
    tokens verified per sequence (k, or less for a request that limits it; 0 when decoding
    target-only), accepted drafts per sequence that the round committed (fewer than accepted
    where a stop token or max_tokens ended the request inside the round), and the draft and
    verify phase times."""

    k: int
    draft_tokens: list[int]
    accepted: list[int]
    draft_seconds: float
    verify_seconds: float


class Engine:
    def __init__(
        self,
        runner: TargetRunner,
        proposer: Proposer | None,
        allocator: BlockAllocator,
        config: EngineConfig,
        *,
        tokenizer=None,
        eos_token_ids: Iterable[int] = (),
        max_model_len: int,
    ):
        self.runner = runner
        self.proposer = proposer
        self.allocator = allocator
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.block_size = proposer.block_size if proposer is not None else 1
        self.scheduler = Scheduler(allocator, config, lookahead=self.block_size)
        self.device = runner.target.device
        self.vocab_size = runner.target.embedding_rows
        self.sequences: dict[str, Sequence] = {}
        self.timings = StepTimings()
        self._ids = itertools.count()
        self._seed_rng = random.Random(0)
        self._outputs: list[RequestOutput] = []
        self._in_flight: _Round | None = None  # launched, not read: the host works while it runs
        self._groups: list[_Group] = []  # two groups in flight, or none
        self.min_group_size = MIN_GROUP_SIZE
        self._last_read_at: float | None = None  # when the host last read a round's results
        # Chain rounds (`step`). On a CPU nothing overlaps, and a chained round after a request's
        # last one is wasted work, so there only the tests turn it on (to run the same loop).
        self.chain_rounds = config.async_scheduling and self.device.type == "cuda"
        # On a CPU an AR step's context rows wait for the next round that drafts (or for their
        # blocks to change hands) and go in one injection: each injection reads the drafter's
        # projections whole, and one a step cost AR steps 2.0–2.7 % at batch 1 and 8 (BENCHMARKS).
        # On a GPU the injection is queued behind the verify (or inside its graph) and overlaps.
        self.defer_context = self.device.type == "cpu"
        self._deferred: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (features, positions, slots)
        self.graphs: RoundGraphs | None = None  # set by the loader on CUDA
        self.prefill_graphs: PrefillGraphs | None = None  # likewise
        self.proposer_losses = 0
        # The rounds since the owner last drained it. Bounded: the embedded API never drains it.
        self.round_log: collections.deque[RoundRecord] = collections.deque(maxlen=4096)
        # Benchmark-only: force the mean accepted length τ of every round (labelled wherever used).
        self.synthetic_tau: float | None = config.synthetic_acceptance_length
        if self.synthetic_tau is not None:
            log.warning("SYNTHETIC acceptance (benchmarks only): every drafting round accepts to a mean length of %g; "
                        "outputs are not the target's", self.synthetic_tau)
        self._synthetic_debt = 0.0
        # How many drafts each round verifies; its costs come from `measure_round_costs`.
        self.speculation = SpeculationPolicy(config, self.block_size)
        self.round_cost_cache: RoundCostCache | None = None  # set by the loader where costs are kept

    # -- public API -----------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request; raises ValueError saying what to fix when it can never be served."""
        params.validate(max_tokens_limit=self.config.max_tokens_limit)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        bad = [t for t in params.stop_token_ids if not t < self.vocab_size]  # validate(): none negative
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this engine was built without one")
        # Room for the prompt, the generated tokens and one round's lookahead.
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens; this model takes at most {self.max_model_len - 1}")
        capacity = self.allocator.num_blocks * self.allocator.block_size
        needed = len(prompt_ids) + min(params.max_tokens, room) + self.block_size
        if needed > capacity:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) needs {needed} KV slots; "
                f"the cache holds {capacity}: lower max_tokens or raise num_kv_blocks"
            )
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids) if self.tokenizer is not None else None
        if params.max_tokens > room:  # generation ends at the model's length limit
            params = dataclasses.replace(params, max_tokens=room)
        stop = StopChecker(params, eos_token_ids=self.eos_token_ids, prompt_len=len(prompt_ids), detokenizer=detok)
        seq = Sequence(request_id, list(prompt_ids), params, resolve_seed(params, self._seed_rng), stop)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def cancel(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks; False if it is unknown or already done."""
        seq = self.sequences.get(request_id)
        if seq is None or seq.status is SequenceStatus.FINISHED:
            return False
        self._finish(seq, FinishReason.CANCELLED)
        return True

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use (both pools share the block tables)."""
        return self.allocator.usage

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        """Advance every request by one round (and prefill what fits). With chained rounds the
        device runs this step's round while the host commits the last one's tokens: a step
        returns the outputs of the round before."""
        if self._groups_go_on():
            # A's round, then B's: the drafter drafts each group while the target verifies the other.
            for group in self._groups:
                self._guarded(self._group_turn, group, group.seqs)
            outputs, self._outputs = self._outputs, []
            return outputs
        self._end_groups()
        previous, self._in_flight = self._in_flight, None
        if previous is not None and self._room_for_chained_round(previous):
            # Same batch as the round still on the device: start the next one from its results
            # there, then read it — the GPU never waits for Python between rounds.
            lookahead = self.block_size  # what the new round writes, even if it loses its drafter
            self._in_flight = self._guarded(self._launch_round, previous.seqs, previous.seqs, previous)
            self._guarded(self._finish_round, previous, previous.seqs, lookahead)
            self._observe_round_time(previous)
        else:
            # The batch changes. Where the sequences that stay can chain on the round in flight, the
            # next round is scheduled and launched before that round is read (`_chains_across`).
            chained_on = previous if previous is not None and self._chains_across(previous) else None
            lookahead = self.block_size  # what a round launched on it writes, even if it loses its drafter
            if previous is not None and chained_on is None:
                self._guarded(self._finish_round, previous, previous.seqs)
                self._observe_round_time(previous)
            plan = self.scheduler.schedule()
            if plan.preempted:  # their blocks may go to others: their rows go in first (one
                self._flush_context()  # injection holding both would write a slot twice, in no set order)
            now = time.monotonic()
            for chunk in plan.prefills:
                if chunk.seq.scheduled_time is None:
                    chunk.seq.scheduled_time = now
            first = None
            if plan.prefills:
                first = self._guarded(self._prefill, plan.prefills, [c.seq for c in plan.prefills])
            decodes = [s for s in plan.decodes if s.status is SequenceStatus.RUNNING]  # a failed prefill ended some
            launched = None
            if decodes and chained_on is None and self._two_groups_fit(decodes):
                self._commit_first_tokens(first)  # the groups' first turns start from the host's bonus tokens
                first = None
                decodes = [s for s in decodes if s.status is SequenceStatus.RUNNING]
                self._guarded(self._start_groups, decodes, decodes)
            elif decodes:
                launched = self._guarded(self._launch_round, decodes, decodes, chained_on, None, first)
            if chained_on is not None:
                self._guarded(self._finish_round, chained_on, chained_on.seqs, lookahead)
                self._observe_round_time(chained_on)
            # Read after the launch: the device runs the round while the host waits for them.
            self._commit_first_tokens(first)
            if launched is not None and launched.chainable:
                self._in_flight = launched
            elif launched is not None:
                self._guarded(self._finish_round, launched, launched.seqs)
                self._observe_round_time(launched)
        outputs, self._outputs = self._outputs, []
        return outputs

    def _choose_k(self, seqs: list[Sequence]) -> int:
        """The policy's k for a round over `seqs`, at their mean position (a round's cost grows
        with the context its attention reads; only an adaptive policy reads it)."""
        policy = self.speculation
        context = mean_position(seqs) if policy.adapts else None
        return policy.choose([s.params.num_speculative_tokens for s in seqs], context)

    def _observe_round_time(self, rnd: _Round) -> None:
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

    def _room_for_chained_round(self, previous: _Round) -> bool:
        """Whether the next round can start before `previous` is read: the same sequences (none
        ended, none waiting to be admitted, the same drafter) and KV blocks for both rounds."""
        return (self.proposer is previous.proposer and self._batch_stays(previous.seqs)
                and self.scheduler.grow_for_chained_round(previous.seqs))

    def _chains_across(self, previous: _Round) -> bool:
        """Whether the next round, over a changed batch, can start from `previous`'s results on the
        device before the host reads them: the sequences of `previous` that still run, and prompts
        that join it, in place of requests that ended. Not where a sequence decodes that
        `previous` does not hold (its tokens are the host's, and blocks for it might preempt one
        in flight), nor with another drafter, nor with a drafter in another process (its context
        after acceptance and drafts asked ahead follow the batch: it reads first). Takes the KV
        blocks of two rounds ahead for the ones that stay (as `grow_for_chained_round`), so
        scheduling never preempts them."""
        proposer = self.proposer
        if not previous.chainable or proposer is not previous.proposer:
            return False
        if proposer is not None and proposer.drafts_in_background:
            return False
        held = {id(s) for s in previous.seqs}
        running = self.scheduler.running
        if any(id(s) not in held for s in running if not s.is_prefilling):
            return False
        return self.scheduler.grow_for_chained_round([s for s in previous.seqs if s.status is SequenceStatus.RUNNING])

    def _batch_stays(self, seqs: list[Sequence]) -> bool:
        """Whether the running batch is `seqs`, in order, and nothing waits to be admitted."""
        running = self.scheduler.running
        if len(running) != len(seqs) or any(a is not b for a, b in zip(running, seqs)):
            return False
        return not self._admission_waits()

    def _admission_waits(self) -> bool:
        """A request waits for a free place in the batch: the batch must change (admit it first)."""
        return bool(self.scheduler.waiting) and len(self.scheduler.running) < self.config.max_num_seqs

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

    def _start_groups(self, seqs: list[Sequence]) -> None:
        """Split the batch in two and run each group's first turn; both ask for drafts first, so
        the drafter drafts B's first round while the target verifies A's."""
        half = (len(seqs) + 1) // 2
        self._groups = [_Group(0, seqs[:half]), _Group(1, seqs[half:])]
        for group in self._groups:
            k = self._choose_k(group.seqs)
            group.k = self._ask_for_drafts(group.seqs, None, [s.bonus for s in group.seqs],
                                           [s.num_cached for s in group.seqs], k, group.index)
        for group in self._groups:
            self._group_turn(group)

    def _group_turn(self, group: _Group) -> None:
        """Launch the group's round with the drafts its last turn asked for, read the round
        before it, then ask for the next round's drafts."""
        previous = group.in_flight
        lookahead = self.block_size  # what the new round writes, even if it loses its drafter
        group.in_flight = self._launch_round(group.seqs, previous, group)
        group.k = None  # taken
        if previous is not None:
            self._finish_round(previous, lookahead)
        self._ask_for_group(group)

    def _ask_for_group(self, group: _Group) -> None:
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

    def drain(self) -> None:
        """Read the rounds still on the device, if any, and inject deferred context rows: before
        anything that changes the batch or the caches outside the step loop (their outputs go out
        with the next step's)."""
        self._end_groups()
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            self._guarded(self._finish_round, previous, previous.seqs)
        self._flush_context()

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[RequestOutput]:
        """Run one request to completion, yielding its outputs as they come (other queued requests
        are stepped along with it)."""
        request_id = self.add_request(prompt_ids, params)
        try:
            while True:
                for out in self.step():
                    if out.request_id == request_id:
                        yield out
                        if out.finished:
                            return
        finally:  # also when the caller stops iterating early: free its blocks, forget it
            self.cancel(request_id)
            self.sequences.pop(request_id, None)

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[Sequence]:
        """Run a batch of requests to completion; returns their finished sequences in order."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        while any(self.sequences[i].status is not SequenceStatus.FINISHED for i in ids):
            self.step()
        return [self.sequences.pop(i) for i in ids]

    def release(self, request_id: str) -> Sequence | None:
        """Drop a finished request's record (the server does this once it has streamed it)."""
        seq = self.sequences.get(request_id)
        if seq is not None and seq.status is SequenceStatus.FINISHED:
            return self.sequences.pop(request_id)
        return None

    # -- one step -------------------------------------------------------------------------------

    def _guarded(self, phase, work, seqs: list[Sequence], *args):
        """A failing forward fails its requests, frees their blocks and leaves the engine serving."""
        try:
            return phase(work, *args)
        except Exception as err:  # noqa: BLE001 - any failure of a batch must not take the others down
            log.exception("engine step failed for %d request(s)", len(seqs))
            for seq in seqs:
                if seq.status is not SequenceStatus.FINISHED:
                    seq.error = f"{type(err).__name__}: {err}"
                    self._finish(seq, FinishReason.ERROR)

    def _prefill(self, chunks: list[PrefillChunk]) -> _FirstTokens | None:
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
            first = _FirstTokens(seqs, tokens[:, 0])
        self.timings.prefill += time.perf_counter() - t0
        return first

    def _commit_first_tokens(self, first: _FirstTokens | None) -> None:
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

    def _ask_for_drafts(self, seqs: list[Sequence], previous: _Round | None, bonus: list[int] | torch.Tensor,
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

    def _launch_round(self, seqs: list[Sequence], previous: _Round | None = None,
                      group: _Group | None = None, first: _FirstTokens | None = None) -> _Round:
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
        return _Round(
            seqs=seqs, proposer=proposer, k=k, verified=verified,
            times_draft=k > 0 and proposer.drafts_in_background and group is None,
            results=results, ready=ready, next_bonus=next_bonus, next_starts=next_starts, clock=clock,
            chainable=self.chain_rounds, context=context, sampling=sampling,
            launched_at=t0, host_seconds=launch_seconds, chained=previous is not None,
        )

    def _bonus_tokens(self, seqs: list[Sequence], first: _FirstTokens | None, previous: _Round | None
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
        if (graphs is not None and n <= graphs.max_batch and graphs.fits(self.proposer, block)
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
        if (not grouped and inputs.bucket is not None and (self.synthetic_tau is None or not k) and min(verified) == k
                and self.graphs.accepts(sampling)):
            return self.graphs.accept(inputs.bucket, k, sampling, n)
        target_tokens = sample_tokens(logits.view(n, k + 1, -1), sampling, inputs.positions + 1)
        limits = verified
        if self.synthetic_tau is not None and k:  # an AR round accepts nothing, and owes nothing
            # Every draft as the target's own token, up to the synthetic length.
            length = self._synthetic_accept_length(k)
            drafts, limits = target_tokens[:, :-1], [min(v, length) for v in verified]
        limits_t = to_device(limits, torch.long, self.device) if min(limits) < k else None
        return accept_round(target_tokens, inputs.starts, drafts, limits_t)

    def _send_every_slot(self, rnd: _Round) -> None:
        """Give a drafter that takes context after acceptance the feature rows of every slot of
        `rnd` before the host has read which were accepted (see the module doc). Their positions
        and KV slots come from the host's cached counts, which `rnd` has not advanced yet: no wait
        for the device."""
        features = rnd.context[0]
        rnd.context = None  # `_finish_round` must not send the accepted ones again
        kv, width = self.allocator.block_size, rnd.k + 1
        positions = [p for seq in rnd.seqs for p in range(seq.num_cached, seq.num_cached + width)]
        tables = [seq.block_table for seq in rnd.seqs for _ in range(width)]
        slots = [table[p // kv] * kv + p % kv for table, p in zip(tables, positions)]
        self.proposer.inject_context(features, positions, slots)

    def _finish_round(self, rnd: _Round, lookahead: int = 0) -> None:
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

    def _lose_proposer(self, err: Exception) -> None:
        log.warning("drafter lost (%s): continuing target-only until it is back", err)
        self._deferred.clear()
        self.proposer.release()
        self.proposer = None  # the graphs no longer fit (RoundGraphs.fits): the fallback runs eagerly
        self.block_size = self.scheduler.lookahead = 1
        self.proposer_losses += 1

    def attach_proposer(self, proposer: Proposer) -> None:
        """Speculate again with a (new) drafter. Its context is empty, so every running sequence
        is preempted and prefilled again — which rebuilds the drafter's context from the committed
        tokens alone; their outputs so far are kept and the results stay lossless."""
        self.drain()
        self.scheduler.preempt_all()
        # Cached blocks hold no context rows of this drafter: nothing of them may be reused.
        self.allocator.reset_prefix_cache()
        if self.proposer is not None and self.proposer is not proposer:
            self.proposer.release()
        self.proposer = proposer
        self.block_size = self.scheduler.lookahead = proposer.block_size
        if self.speculation.block_size != proposer.block_size:  # a drafter back after a loss keeps what was learnt
            self.speculation = SpeculationPolicy(self.config, proposer.block_size)
        if self.speculation.costs is None:
            self.measure_round_costs()

    def measure_round_costs(self, context: int = COST_CONTEXT) -> None:
        """Give the speculation policy the costs of this engine's round shapes, measured now or at
        an earlier start (`round_costs.load_or_measure`), where it or the two-group gate needs them."""
        costs = load_or_measure(self, context)
        if costs is not None:
            self.speculation.costs = costs

    def _synthetic_accept_length(self, k: int) -> int:
        """Accepted drafts of a round verifying k: the drafter's whole block matches the target up
        to a length whose running mean plus one tracks synthetic_tau (over every drafting round,
        whatever its k), and the round accepts the part it verified — as with real drafts, what a
        smaller k leaves unverified is lost, not owed to later rounds."""
        self._synthetic_debt += self.synthetic_tau - 1
        a = min(int(self._synthetic_debt + 0.5), self.block_size - 1)
        self._synthetic_debt -= a
        return min(a, k)

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        return SamplingBatch.build([s.params for s in seqs], [s.seed for s in seqs], self.device)

    def _commit(self, seq: Sequence, tokens: list[int]) -> int:
        """Append a round's tokens up to the first stop; stream them; finish the request if it
        stopped. Returns how many were kept."""
        kept, text, reason = seq.stop.append(tokens)
        seq.output_ids.extend(kept)
        if reason is not None:
            self._finish(seq, reason, kept, text)
        else:
            self._emit(seq, kept, text)
        return len(kept)

    def _finish(self, seq: Sequence, reason: FinishReason, tokens: list[int] | None = None, text: str = "") -> None:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        if reason is not FinishReason.ERROR:  # after a failed forward, keep only what was cached before
            self.scheduler.offer_committed_blocks(seq)
        self._flush_context()  # before its blocks go back, as for a preemption (`step`)
        self.scheduler.remove(seq)
        if self.proposer is not None:
            self.proposer.forget([seq.request_id])
        self._emit(seq, tokens or [], text)

    def _emit(self, seq: Sequence, tokens: list[int], text: str) -> None:
        self._outputs.append(
            RequestOutput(
                request_id=seq.request_id,
                new_token_ids=tokens,
                new_text=text,
                finished=seq.status is SequenceStatus.FINISHED,
                finish_reason=seq.finish_reason,
                num_prompt_tokens=len(seq.prompt_ids),
                num_output_tokens=len(seq.output_ids),
                stats=seq.stats,
                error=seq.error,
            )
        )
