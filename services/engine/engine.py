"""The embedded engine: add requests, step, stream, cancel.

One step = prefill chunks for new sequences, then one speculative round for every decoding
sequence (spec §3): draft → verify → accept → commit. Where each part lives:

- scheduler.py: admission, chunked prefill's budget, KV blocks, preemption, prefix caching;
- prefill.py: a step's prompt chunks through the target, their first tokens sampled;
- round.py: a round launched (draft, verify, accept, on the device) and read (commit);
- two_groups.py: two groups in flight, one verified while the other is drafted;
- speculation.py: the k each round verifies; round_costs.py: the costs it weighs, measured at start-up;
- synthetic_acceptance.py: benchmarks only, acceptance forced to a mean length.

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
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import random
import time
from collections.abc import Iterable, Iterator

import torch

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.cuda_graphs import RoundGraphs
from dflash_serve.services.engine.draft_runner import Proposer
from dflash_serve.services.engine.kv_cache import BlockAllocator
from dflash_serve.services.engine.prefill import Prefilling
from dflash_serve.services.engine.prefill_graphs import PrefillGraphs
from dflash_serve.services.engine.request import RequestOutput, Sequence, SequenceStatus
from dflash_serve.services.engine.round import Round, Rounds, StepTimings
from dflash_serve.services.engine.round_record import RoundRecord
from dflash_serve.services.engine.round_cost_cache import RoundCostCache
from dflash_serve.services.engine.round_costs import CostMeasurement, load_or_measure, needs_costs
from dflash_serve.services.engine.sampling import resolve_seed
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.scheduler import Scheduler
from dflash_serve.services.engine.speculation import SpeculationPolicy
from dflash_serve.services.engine.stopping import FinishReason, IncrementalDetokenizer, StopChecker
from dflash_serve.services.engine.target_runner import TargetRunner
from dflash_serve.services.engine.tensor_parallel import TensorParallelError
from dflash_serve.services.engine.two_groups import MIN_GROUP_SIZE, Group, TwoGroups

log = logging.getLogger(__name__)


class Engine(Prefilling, Rounds, TwoGroups):
    """Requests in, outputs out: the public interface, and `step`, which decides each step whether
    rounds chain, two groups run, or the batch is scheduled anew (the module doc)."""

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
        self._in_flight: Round | None = None  # launched, not read: the host works while it runs
        self._groups: list[Group] = []  # two groups in flight, or none
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
        # Benchmarks only: a `SyntheticAcceptance` that makes every drafting round accept to a mean length.
        self.synthetic = None
        if config.synthetic_acceptance_length is not None:
            from dflash_serve.services.engine.synthetic_acceptance import SyntheticAcceptance

            self.synthetic = SyntheticAcceptance(config.synthetic_acceptance_length)
        # How many drafts each round verifies; its costs come from `measure_round_costs`.
        self.speculation = SpeculationPolicy(config, self.block_size)
        self.round_cost_cache: RoundCostCache | None = None  # set by the loader where costs are kept
        self._measurement: CostMeasurement | None = None  # a drafter's costs, timed between steps

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
            self._turn_groups()
        else:
            self._end_groups()
            previous, self._in_flight = self._in_flight, None
            if previous is not None and self._room_for_chained_round(previous):
                self._chain_round(previous)
            else:
                self._schedule(previous)
        outputs, self._outputs = self._outputs, []
        return outputs

    def _chain_round(self, previous: Round) -> None:
        """Same batch as the round still on the device: start the next one from its results
        there, then read it — the GPU never waits for Python between rounds."""
        lookahead = self.block_size  # what the new round writes, even if it loses its drafter
        self._in_flight = self._guarded(self._launch_round, previous.seqs, previous.seqs, previous)
        self._guarded(self._finish_round, previous, previous.seqs, lookahead)
        self._observe_round_time(previous)

    def _schedule(self, previous: Round | None) -> None:
        """The batch changes: schedule, prefill, and launch the step's round. Where the sequences
        that stay can chain on the round in flight, the next round is scheduled and launched before
        that round is read (`_chains_across`)."""
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

    def _room_for_chained_round(self, previous: Round) -> bool:
        """Whether the next round can start before `previous` is read: the same sequences (none
        ended, none waiting to be admitted, the same drafter) and KV blocks for both rounds."""
        return (self.proposer is previous.proposer and self._batch_stays(previous.seqs)
                and self.scheduler.grow_for_chained_round(previous.seqs))

    def _chains_across(self, previous: Round) -> bool:
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

    # -- failures, the drafter, commits -------------------------------------------------------

    def _guarded(self, phase, work, seqs: list[Sequence], *args):
        """A failing forward fails its requests, frees their blocks and leaves the engine serving."""
        try:
            return phase(work, *args)
        except TensorParallelError:
            raise  # a rank is gone: no forward can run any more; the engine's owner ends (the replica restarts)
        except Exception as err:  # noqa: BLE001 - any failure of a batch must not take the others down
            log.exception("engine step failed for %d request(s)", len(seqs))
            for seq in seqs:
                if seq.status is not SequenceStatus.FINISHED:
                    seq.error = f"{type(err).__name__}: {err}"
                    self._finish(seq, FinishReason.ERROR)

    def _lose_proposer(self, err: Exception) -> None:
        log.warning("drafter lost (%s): continuing target-only until it is back", err)
        self._deferred.clear()
        self.proposer.release()
        self.proposer = None  # the graphs no longer fit (RoundGraphs.fits): the fallback runs eagerly
        self.block_size = self.scheduler.lookahead = 1
        self.proposer_losses += 1

    def attach_proposer(self, proposer: Proposer) -> None:
        """Speculate again with a (new) drafter, now: `attach_when_measured`, its warm-up run
        through at once where its round costs are neither known nor kept from an earlier start."""
        self.attach_when_measured(proposer)
        while self.measuring_costs:
            self.warm_up_next()

    def attach_when_measured(self, proposer: Proposer) -> None:
        """`attach_proposer` for an engine that serves meanwhile: where the drafter's round costs
        are needed and not known, it goes on serving as it does (target-only at a start) and
        times them between steps (`warm_up_next`), attaching the drafter once they are."""
        self._cancel_measurement(keeping=proposer)
        policy = self._policy_for(proposer)
        if policy.costs is None and needs_costs(proposer, policy):
            measurement = CostMeasurement(self, proposer, policy)  # loads them where they are kept
            if measurement.costs is None:
                self._measurement = measurement
                return
            policy.costs = measurement.costs
        self._attach(proposer, policy)

    @property
    def measuring_costs(self) -> bool:
        """Whether a drafter waits for its round costs, measured between steps (`warm_up_next`)."""
        return self._measurement is not None

    @property
    def graphs_pending(self) -> bool:
        """Whether some CUDA graph the loader deferred is still to capture (`capture_next_graph`)."""
        return any(graphs is not None and not graphs.complete for graphs in (self.graphs, self.prefill_graphs))

    @property
    def warming_up(self) -> bool:
        """Whether start-up work is left for between steps (`warm_up_next`)."""
        return self.graphs_pending or self.measuring_costs

    def warm_up_next(self) -> None:
        """One piece of the start-up work left, between steps: a deferred CUDA graph's capture,
        else one timed round of the costs a drafter waits for (timed on the graphs, so after
        them), and once they are all measured the drafter's attach."""
        if self.graphs_pending:
            self.capture_next_graph()
            return
        measurement = self._measurement
        if measurement is None:
            return
        self.drain()
        if measurement.measure_next():
            self._measurement = None
            measurement.policy.costs = measurement.costs
            self._attach(measurement.proposer, measurement.policy)

    def capture_next_graph(self) -> None:
        """Capture one more deferred graph — a round's batch bucket, then a prefill bucket —
        between steps: the rounds still on the device are read first (`drain`)."""
        self.drain()
        if self.graphs is not None and not self.graphs.complete:
            self.graphs.capture_next()
        elif self.prefill_graphs is not None:
            self.prefill_graphs.capture_next()

    def measure_round_costs(self) -> None:
        """Give the speculation policy the costs of this engine's round shapes with its drafter,
        measured now or at an earlier start (`round_costs.load_or_measure`), where it or the
        two-group gate needs them."""
        costs = load_or_measure(self, self.proposer, self.speculation)
        if costs is not None:
            self.speculation.costs = costs

    def _policy_for(self, proposer: Proposer) -> SpeculationPolicy:
        """The speculation policy for rounds with `proposer`: the engine's own where the block
        fits (a drafter back after a loss keeps what was learnt), else a new one."""
        if self.speculation.block_size == proposer.block_size:
            return self.speculation
        return SpeculationPolicy(self.config, proposer.block_size)

    def _attach(self, proposer: Proposer, policy: SpeculationPolicy) -> None:
        """Speculate with `proposer` from the next step. Its context is empty, so every running
        sequence is preempted and prefilled again — which rebuilds the drafter's context from the
        committed tokens alone; their outputs so far are kept and the results stay lossless."""
        self.drain()
        self.scheduler.preempt_all()
        # Cached blocks hold no context rows of this drafter: nothing of them may be reused.
        self.allocator.reset_prefix_cache()
        if self.proposer is not None and self.proposer is not proposer:
            self.proposer.release()
        self.proposer, self.speculation = proposer, policy
        self.block_size = self.scheduler.lookahead = proposer.block_size
        log.info("drafter attached; speculative decoding on")

    def _cancel_measurement(self, *, keeping: Proposer) -> None:
        """A drafter that waited for its round costs stops waiting (a drafter is attached now):
        its measurement stops and, unless it is the one `keeping`, it is released."""
        measurement, self._measurement = self._measurement, None
        if measurement is not None:
            measurement.cancel()
            if measurement.proposer is not keeping:
                measurement.proposer.release()

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
