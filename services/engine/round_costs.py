"""What a round costs: the model the speculation policy and the two-group gate read, and its
measurement at start-up.

`RoundCosts` holds the seconds of a round's verify (per batch size and k bucket) and draft forward,
timed once for the engine's own shapes (`load_or_measure`: by replaying the CUDA graphs, else by
eager forwards; kept between starts by `round_cost_cache`), and corrects them online by the wall
time rounds actually take, which drift with the host (`DriftingEstimates`).
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING

import torch

from dflash_serve.services.engine.kv_cache import AttentionBatch, OutOfKVBlocks

if TYPE_CHECKING:
    from dflash_serve.services.engine.engine import Engine
    from dflash_serve.services.engine.draft_runner import Proposer
    from dflash_serve.services.engine.round_cost_cache import RoundCostCache
    from dflash_serve.services.engine.speculation import SpeculationPolicy

log = logging.getLogger(__name__)
# Where every sequence sits when round costs are measured: attention's share of a round grows
# with the context, so they are measured at two (a short chat's, and a prompt's first blocks) and
# the policy takes them at each batch's mean position.
COST_CONTEXT = 256
NEAR_COST_CONTEXT = 32
# The largest batch whose eager rounds are timed at start-up (a CPU takes seconds per full batch).
MAX_TIMED_BATCH = 32
OUTLIER_FACTOR = 2.0  # a round's wall time counts as at most this many times the current estimate
PRIOR_ROUNDS = 4  # a kind of round's cost averages its first rounds from its prior, which counts as this many


class DriftingEstimates:
    """A cost per kind of round (a key) that moves with the host: each key's estimate is its own
    base times one drift factor shared by every key. A round observed moves its key's base at
    `rate` — after averaging its first trials from the prior it started at, counted as
    `prior_trials` trials — and, once the key is settled (that average done), the drift at
    `drift_rate` with what its base left of the error. Bounded: one base per key.

    Why shared: the host's speed changes under the policy (H200, T 1 alpaca at c = 32: AR steps alone
    ran 12.7k–20.2k tok/s from one 3-s pass to the next), and a kind of round the policy stops
    choosing is not measured again. Each kind kept its own moving average, and AR steps at batch 32
    kept the 1.22 ms of host (× 1.10 wall) they read in a slow pass for ten passes, while rounds of
    k = 3 tracked the host at 0.95–1.45 ms: the policy priced AR steps at 1.35 ms where its own AR
    steps took 0.97–1.04, verified k = 3 in 96 % of the rounds, and ran 0.95 × AR (BENCHMARKS).
    A key's start moves no drift: from its prior (an AR step's host time for a new k) to its own
    cost is that kind's difference, not the host's.
    """

    def __init__(self, *, rate: float = 0.005, drift_rate: float = 0.05, prior_trials: int = PRIOR_ROUNDS):
        if not 0 < rate <= 1 or not 0 < drift_rate <= 1 or prior_trials < 0:
            raise ValueError(f"rate {rate} and drift_rate {drift_rate} must be in (0, 1], "
                             f"prior_trials {prior_trials} ≥ 0")
        self.rate, self.drift_rate, self.prior_trials = rate, drift_rate, prior_trials
        self.drift = 1.0
        self.base: dict = {}
        self.trials: dict = {}

    def get(self, key) -> float | None:
        """The key's estimate now (None: never observed)."""
        base = self.base.get(key)
        return None if base is None else base * self.drift

    def observe(self, key, value: float, prior: float) -> None:
        """A round of `key` measured `value`; `prior`: what the caller took for it until now, where
        it has no estimate of its own. One observation counts for at most OUTLIER_FACTOR times the
        estimate (see `RoundCosts`)."""
        drift, trials = self.drift, self.trials.get(key, 0)
        base = self.base.get(key, prior / drift)
        value = min(value, OUTLIER_FACTOR * base * drift)
        weight = max(self.rate, 1 / (self.prior_trials + trials + 1))
        base += weight * (value / drift - base)
        self.base[key], self.trials[key] = base, trials + 1
        if weight == self.rate:  # settled
            self.drift = drift + self.drift_rate * (value / base - drift)


class RoundCosts:
    """Seconds of a round's verify (per batch size and k bucket) and draft forward (per batch
    size), at the batch sizes measured; between them, linear in the batch size. Measured with
    every sequence at position `context`; a batch at another mean context adds `verify_slope`
    (and, with a draft, `draft_slope`) seconds per position, per batch size — the attention's
    reads of the context, measured for k = 0 and taken for every k (on CPU, the default pair at
    32 sequences: from context 32 to 256 a verify took 64 ms more at k = 0, 61 at k = 1, 74 at
    k = 7, 85 at k = 15, on a k = 0 step of 92 ms). Without it, costs measured at position 256
    made an AR step of 16 sequences at context ~120 cost 103 ms where it took 84, and the
    policy speculated where AR was faster.

    A drafter in another process cannot be timed at start-up: its cost is learnt from the rounds
    (`observe_draft`), starting at 0 where unobserved — optimistic, so that rounds speculate and
    measure it.

    A round's wall time is not its forwards' device time: the host's work per round, and
    sampling, come on top, more so for a speculative round than an AR step. Wall times of rounds
    (`observe_round`) keep, per kind of round — an AR step, or speculative whatever its k — and
    measured batch size, an estimate of wall / predicted seconds that scales `round_seconds`: its own
    times a drift every kind and size shares (`DriftingEstimates`), so that a kind the policy stopped
    choosing follows what the other kind's rounds show of the host; a kind and size never observed
    keeps the start-up prediction, which underestimates it — so it is tried, and measured, once
    chosen. One observation counts for at most OUTLIER_FACTOR times the estimate: on a shared host
    a round only ever takes longer than its work (another process, a collection), and one slow
    round must not make a kind of round look slow until the policy, no longer choosing it, never
    measures it again. One factor
    serves every k > 0: on the H100 at batch 32 it was 1.11, 1.13 and 1.14 for k = 1, 7 and 15
    (1.20 for AR steps beside a drafter), and every speculative round keeps it current, where a
    factor per k kept, for the ks the policy stopped choosing, whatever their few rounds said. A
    kind never observed at a size takes the other kind's factor there where that is below 1 (a
    start-up that read slow, e.g. under load, did so for both): with 1 for AR steps beside 0.95
    measured for speculative rounds, AR looked dearer than it was and was never chosen, so never
    measured. Above 1 it keeps 1: a speculative round's own extra work (sampling more rows) is
    not an AR step's, and an unobserved kind must look no worse than its prediction to be tried.

    Where rounds chain (a GPU), the device runs a round while the host finishes the one before and
    launches the next, so a round takes the longer of the two: the host's own seconds per round
    (`host_seconds`, an estimate per k and size sharing one drift, as the wall factors do; a k not
    yet chosen takes an AR step's) bound
    the prediction from below, and the wall factor (per kind and size) corrects that: it is each
    chained round's wall time over the longer of that round's own host time and the device's
    prediction. Over the moving average of the host time instead, the factor counted the average's
    lag twice: the average starts at the device's prediction and takes ~50 rounds to reach the
    host's time, and the factor, learnt in those rounds, kept the gap — on the H100 at batch 32, T 1
    on alpaca, AR steps took 2.19 ms (host 1.94) and the model read 2.64 (1.94 × 1.36) after 47 of
    them, while speculative rounds, observed twice as often, had lost it (2.18 read for 2.62): it
    speculated where AR steps were the faster. A prediction alone, scaled, kept the device's
    differences between ks where the host's time hid them: on the H100 at batch 32 the host took
    1.7–2.0 ms a round against the device's 1.3–1.5, the start-up costs read k = 3 at 1.5 ms and
    k = 15 at 1.8, and the policy verified k = 3 or 7 in 76–87 % of the rounds at T 0 on alpaca,
    τ 1.94 against fixed B's 2.00, at 0.89–0.98 of its speed. One host time for every k > 0, learnt from
    the ks chosen, priced a shallow k as the deep ones: on the H100 at batch 32, T 1 on alpaca, a
    process whose average came from rounds of k = 15 priced every k > 0 at 2.14 ms against AR's
    1.96, though rounds of k = 3 cost its host 1.5, verified k = 15 in most speculative rounds and
    ran 0.85 × AR; per k, twelve processes ran 0.94–1.13 × AR against 0.84–1.16 (BENCHMARKS).
    """

    def __init__(self, batch_sizes: Sequence[int], verify: dict[int, Sequence[float]],
                 draft: Sequence[float] | None, *, context: int = 0, verify_slope: Sequence[float] | None = None,
                 draft_slope: Sequence[float] | None = None, draft_rate: float = 0.1, wall_rate: float = 0.05,
                 own_rate: float = 0.005):
        self.batch_sizes = list(batch_sizes)
        if self.batch_sizes != sorted(set(self.batch_sizes)) or not self.batch_sizes:
            raise ValueError(f"batch sizes {batch_sizes} must be distinct and ascending")
        for k, seconds in verify.items():
            if len(seconds) != len(self.batch_sizes):
                raise ValueError(f"verify costs of k={k}: {len(seconds)} values for {len(self.batch_sizes)} batch sizes")
        # Timing noise must not make a larger batch or k look cheaper: running maxima both ways.
        ks = sorted(verify)
        by_k = {k: monotone(verify[k]) for k in ks}
        by_size = [monotone([by_k[k][i] for k in ks]) for i in range(len(self.batch_sizes))]
        self.verify = {k: [by_size[i][j] for i in range(len(self.batch_sizes))] for j, k in enumerate(ks)}
        self.ks = tuple(ks)
        self.measured_draft = draft is not None
        self.draft = monotone(draft) if draft is not None else [0.0] * len(self.batch_sizes)
        self.context = context
        for name, slope in (("verify", verify_slope), ("draft", draft_slope)):
            if slope is not None and len(slope) != len(self.batch_sizes):
                raise ValueError(f"{name} slope: {len(slope)} values for {len(self.batch_sizes)} batch sizes")
        self.verify_slope = monotone(verify_slope or [0.0] * len(self.batch_sizes))
        self.draft_slope = monotone(draft_slope or [0.0] * len(self.batch_sizes))
        self.draft_rate = draft_rate
        # (k > 0, index of the nearest batch size) -> wall / predicted; (k, that index) -> host seconds a chained round
        self.wall_factor = DriftingEstimates(rate=own_rate, drift_rate=wall_rate)
        self.host = DriftingEstimates(rate=own_rate, drift_rate=wall_rate)
        self._by_size: dict[int, tuple[int, dict[int, tuple[float, float]]]] = {}  # `_size_terms`

    def _blend(self, n: int) -> tuple[int, int, float, float]:
        """Where batch n falls among the measured sizes, as (i, j, w, scale): a value per size
        interpolates to (values[i] + (values[j] − values[i]) · w) · scale — linear between the two
        sizes around n (beyond the largest, along the last two), towards 0 below the smallest."""
        sizes = self.batch_sizes
        if n <= sizes[0] or len(sizes) == 1:
            return 0, 0, 0.0, n / sizes[0] if n < sizes[0] else 1.0
        at = min(bisect.bisect_left(sizes, n), len(sizes) - 1)
        lo, hi = sizes[at - 1], sizes[at]
        return at - 1, at, (n - lo) / (hi - lo), 1.0

    @staticmethod
    def _at(values: Sequence[float], blend: tuple[int, int, float, float]) -> float:
        i, j, w, scale = blend
        return (values[i] + (values[j] - values[i]) * w) * scale

    def _interpolate(self, values: Sequence[float], n: int) -> float:
        return self._at(values, self._blend(n))

    def verify_seconds(self, n: int, k: int) -> float:
        return self._interpolate(self.verify[k], n)

    def draft_seconds(self, n: int) -> float:
        return self._interpolate(self.draft, n)

    def _size_terms(self, n: int) -> tuple[int, dict[int, tuple[float, float]]]:
        """Batch n's nearest measured size index, and per k its forwards' seconds at the measured
        context and their seconds per position of context: what every round at batch n shares,
        computed once per batch size (bounded by the largest batch; a draft time learnt clears them)."""
        terms = self._by_size.get(n)
        if terms is None:
            blend = self._blend(n)
            draft, slope = self._at(self.draft, blend), self._at(self.verify_slope, blend)
            draft_slope = self._at(self.draft_slope, blend)
            terms = self.nearest(n), {k: (self._at(self.verify[k], blend) + (draft if k else 0.0),
                                          slope + (draft_slope if k else 0.0)) for k in self.ks}
            self._by_size[n] = terms
        return terms

    def _shift(self, context: float | None) -> float | None:
        return None if context is None else context - self.context

    @staticmethod
    def _predicted(terms: tuple[float, float], shift: float | None) -> float:
        seconds, slope = terms
        return seconds if shift is None else max(seconds + slope * shift, 0.0)

    def _host(self, k: int, at: int) -> float:
        """The host's seconds a chained round of k at the measured size `at`: its own, else an AR
        step's (0: none measured) — a k not yet chosen looks no dearer than an AR step, so it is tried."""
        own = self.host.get((k, at))
        return own if own is not None else self.host.get((0, at)) or 0.0

    def predicted_seconds(self, n: int, k: int, context: float | None = None) -> float:
        """A round's forwards at batch n verifying k drafts (no draft forward when k = 0), with
        the sequences at mean position `context` (None: where they were measured)."""
        return self._predicted(self._size_terms(n)[1][k], self._shift(context))

    def round_seconds(self, n: int, k: int, context: float | None = None) -> float:
        """The expected wall time of such a round: the prediction — or the host's time for such a
        round where rounds overlap it and it is the longer — corrected by what rounds took."""
        at, per_k = self._size_terms(n)
        return max(self._host(k, at), self._predicted(per_k[k], self._shift(context))) * self._wall_factor(k > 0, at)

    def round_seconds_by_k(self, n: int, context: float | None = None) -> list[tuple[int, float]]:
        """(k, `round_seconds`) for every k bucket, ascending. The policy weighs them every round, on
        the host's critical path: the batch's terms come once per batch size (`_size_terms`), each
        kind's wall factor once a call (`dflash_serve.services.bench.policy`,
        BENCHMARKS: asked k by k, the choice took about twice as long at batch 8)."""
        at, per_k = self._size_terms(n)
        shift = self._shift(context)
        factors = self._wall_factor(False, at), self._wall_factor(True, at)
        return [(k, max(self._host(k, at), self._predicted(per_k[k], shift)) * factors[k > 0]) for k in self.ks]

    def observe_round(self, n: int, k: int, seconds: float, context: float | None = None,
                      host_seconds: float = 0.0) -> None:
        """A round at batch n verifying k drafts, at mean position `context`, added `seconds` of
        wall time to the loop; `host_seconds`: the host's own time for it where the device ran the
        next round meanwhile (chained rounds; 0: none given)."""
        at = self.nearest(n)
        key = (k > 0, at)
        device = self.predicted_seconds(n, k, context)
        if host_seconds > 0 and device > 0:
            # From what the model used until now (an AR step's host time, or the device's
            # prediction), so that one slow round (the first after start-up, a collection) cannot
            # make a k look dear until the policy never tries it again.
            self.host.observe((k, at), host_seconds, max(self._host(k, at), device))
        # The wall time over the round's own bound: its own host time where given, not the moving
        # average, which lags it, so that the factor does not count that lag on top of the host time.
        bound = max(host_seconds if host_seconds > 0 else self._host(k, at), device)
        if bound <= 0 or seconds <= 0:
            return
        self.wall_factor.observe(key, seconds / bound, self._wall_factor(*key))

    def _wall_factor(self, speculative: bool, at: int) -> float:
        """The factor of a kind of round at a size: its own, else the other kind's there up to 1."""
        own = self.wall_factor.get((speculative, at))
        other = self.wall_factor.get((not speculative, at))
        return own if own is not None else min(1.0, 1.0 if other is None else other)

    def nearest(self, n: int) -> int:
        """The index of the measured batch size nearest n (the smaller on a tie)."""
        sizes = self.batch_sizes
        at = bisect.bisect_left(sizes, n)
        if at == len(sizes) or (at > 0 and n - sizes[at - 1] <= sizes[at] - n):
            return max(at - 1, 0)
        return at

    def observe_draft(self, n: int, seconds: float) -> None:
        """A remote drafter's round at batch `n` took `seconds`: into the nearest measured size's
        moving average (its first observation replaces the optimistic 0)."""
        at = self.nearest(n)
        scaled = seconds * self.batch_sizes[at] / n  # to that size, as if linear in n nearby
        old = self.draft[at]
        self.draft[at] = scaled if old == 0.0 else old + self.draft_rate * (scaled - old)
        self._by_size.clear()  # their draft terms



def time_call(run: Callable[[], None], sync: Callable[[], None], *, reps: int = 3, budget_s: float = 0.02,
              warm_up: bool = True) -> float:
    """Seconds one call of `run` takes: a warm-up, then the minimum over up to `reps` timed calls
    (fewer when one takes longer than `budget_s`). The minimum, not the mean: on a shared CPU
    other processes only ever add time, so the fastest call is the least disturbed."""
    if warm_up:
        run()
        sync()
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        sync()
        best = min(best, time.perf_counter() - t0)
        if best > budget_s:
            break
    return best


def context_slope(far: Sequence[float], near: Sequence[float], far_context: int, near_context: int) -> list[float]:
    """Seconds per position of context, per batch size, from the same round timed at two
    contexts. Never negative (timing noise), and never so steep that the line through `far`
    would cost less than nothing at position 0."""
    span = far_context - near_context
    if span <= 0:
        raise ValueError(f"contexts {near_context} and {far_context}: the far one must be larger")
    return [min(max(0.0, (f - n) / span), f / far_context) for f, n in zip(far, near, strict=True)]


def monotone(values: Sequence[float]) -> list[float]:
    """Running maximum: a larger shape never costs less (removes timing noise that would make
    the policy prefer a larger k or batch for being cheaper)."""
    out, top = [], 0.0
    for v in values:
        top = max(top, v)
        out.append(top)
    return out


def needs_costs(proposer: Proposer | None, policy: SpeculationPolicy) -> bool:
    """Whether rounds with this drafter need measured costs: for the adaptive policy, or for the
    two-group gate of a drafter that can pipeline (`two_groups.TwoGroups._two_groups_pay`)."""
    return proposer is not None and (policy.needs_costs() or proposer.draft_groups == 2)


def load_or_measure(engine: Engine, proposer: Proposer | None, policy: SpeculationPolicy,
                    context: int = COST_CONTEXT) -> RoundCosts | None:
    """The costs of the engine's own round shapes with `proposer`, kept from an earlier start or
    measured now, all at once (`CostMeasurement`, whose doc says what is timed); the deferred CUDA
    graphs are captured first, as the rounds will replay them. None where none are needed."""
    if not needs_costs(proposer, policy):
        return None
    measurement = CostMeasurement(engine, proposer, policy, context)
    if measurement.costs is None:
        while engine.graphs_pending:
            engine.capture_next_graph()
        while not measurement.measure_next():
            pass
    return measurement.costs


class CostMeasurement:
    """The costs of the engine's own round shapes with `proposer` for the adaptive policy and the
    two-group gate: the verify of every k bucket and the draft, at a few batch sizes, every
    sequence at position `context`; and the verify of k = 0 and the draft again at
    NEAR_COST_CONTEXT, for what a position of context adds. With CUDA graphs, by replaying them
    (on scratch blocks: every graph must be captured first); else by eager forwards on borrowed
    free blocks, which all rows of a batch share (the writes collide harmlessly: only the time
    counts). Loaded instead where an earlier start kept them (`engine.round_cost_cache`), then
    in `costs` at once.

    Measured one timed round at a time (`measure_next`), so that an engine that serves
    meanwhile stops for one at most: a CPU's eager timings of the default pair take ~16 s,
    which a first start's requests waited for when they held the engine's loop (BENCHMARKS,
    restarts). The engine's own state is read, not changed: the proposer is not attached yet."""

    def __init__(self, engine: Engine, proposer: Proposer, policy: SpeculationPolicy, context: int = COST_CONTEXT):
        self.proposer, self.policy = proposer, policy
        # Within the model's length, and the cache's (the eager timings borrow blocks for it).
        capacity = engine.allocator.num_blocks * engine.allocator.block_size
        context = max(0, min(context, min(engine.max_model_len, capacity) - proposer.block_size))
        # What else the times depend on: the drafter's kind and place, the rounds timed, graphs or not.
        graphs = engine.graphs
        shapes = {"proposer": type(proposer).__name__, "draft_groups": proposer.draft_groups,
                  "ks": list(policy.ks), "context": context, "block_size": proposer.block_size,
                  "graphs": None if graphs is None else [graphs.buckets, graphs.k_buckets]}
        self.costs: RoundCosts | None = None
        self._steps = None
        cache = engine.round_cost_cache
        kept = cache.load(shapes) if cache is not None else None
        if kept is not None:
            kept["verify"] = {int(k): seconds for k, seconds in kept["verify"].items()}  # JSON keys are text
            log.info("round costs from %s (measured at an earlier start)", cache.path(shapes))
            self.costs = RoundCosts(**kept)
        else:
            self._steps = _measuring(engine, proposer, policy.ks, context, cache, shapes)

    def measure_next(self) -> bool:
        """Time the next round shape; True once every one is (the costs are then in `costs`)."""
        if self.costs is None:
            try:
                next(self._steps)
            except StopIteration as done:
                self.costs = done.value
        return self.costs is not None

    def cancel(self) -> None:
        """Stop measuring: the blocks borrowed for the eager timings go back."""
        if self._steps is not None:
            self._steps.close()


def _measuring(engine: Engine, proposer: Proposer, ks: tuple[int, ...], context: int,
               cache: RoundCostCache | None, shapes: dict) -> Generator[None, None, RoundCosts]:
    """`CostMeasurement`'s timings, a step between each; returns the costs (and keeps them)."""
    started, timing = time.perf_counter(), 0.0
    near = min(NEAR_COST_CONTEXT, context // 2)
    # An eager draft of k drafts takes the LM head over k rows only (`DraftRunner.draft_logits`):
    # the draft is timed for each k > 0, and at `near` for the fewest, as `draft` holds.
    drafted = [k for k in ks if k] or [proposer.block_size - 1]
    sizes, verify, draft, timing = yield from _time_rounds(engine, proposer, context, ks, drafted)
    measured = {"batch_sizes": sizes, "verify": verify, "draft": draft, "context": context}
    if near < context:
        _, verify_near, draft_near, near_timing = yield from _time_rounds(engine, proposer, near, (0,), drafted[:1])
        timing += near_timing
        measured["verify_slope"] = context_slope(verify[0], verify_near[0], context, near)
        if draft is not None:
            measured["draft_slope"] = context_slope(draft, draft_near, context, near)
    log.info("round costs measured in %.0f ms of timing, over %.1f s (batch sizes %s, k %s)", 1e3 * timing,
             time.perf_counter() - started, sizes, list(ks))
    if cache is not None:
        cache.store(shapes, measured)
    return RoundCosts(**measured)


def _time_rounds(engine: Engine, proposer: Proposer, context: int, ks: tuple[int, ...], drafted: list[int]):
    """Batch sizes, the verify seconds of each k in `ks` per size, the draft's per size (None
    where this process does not draft) and the seconds spent timing, every sequence at position
    `context`: by the graphs' replays where they serve every k the policy may choose (their draft
    covers the whole block; ~0.3 s on an H200, in one step), else eagerly (`_time_eager_rounds`,
    with drafts of each of `drafted`)."""
    graphs = engine.graphs
    if graphs is not None and graphs.fits(proposer, proposer.block_size) and set(ks) <= set(graphs.k_buckets):
        t0 = time.perf_counter()
        timed = graphs.time_round(context)
        sizes = sorted(timed["verify"])
        verify = {k: [timed["verify"][n][k] for n in sizes] for k in ks}
        draft = [timed["draft"][n] for n in sizes] if timed["draft"] else None
        yield
        return sizes, verify, draft, time.perf_counter() - t0
    return (yield from _time_eager_rounds(engine, proposer, context, ks, drafted))


def _time_eager_rounds(engine: Engine, proposer: Proposer, context: int, ks: tuple[int, ...], drafted: list[int]):
    """Eager forwards at batch sizes 1, 4, half of max_num_seqs and max_num_seqs, one a step;
    `RoundCosts` interpolates between them. On a CPU a forward's time is not linear in the batch,
    so the line through 1 and 4 alone misjudged a full batch both ways for the default pair (16
    sequences: the draft 56 ms predicted, 111 measured; an AR step 160 predicted, 108
    measured), and the line from 4 to 32 a half batch (16 sequences, k = 7: 396 ms
    predicted, 516 measured), and the policy speculated where AR was faster. Each size
    costs start-up time on a CPU (seconds at max_num_seqs 32, the default pair), so the
    largest size timed is at most MAX_TIMED_BATCH; larger batches extrapolate from it.

    Each forward runs on blocks borrowed for it alone and given back before the next step: an
    engine serving meanwhile has its whole cache between timings, and while its requests hold
    every block the timing waits for some to be free."""
    block, page, device = proposer.block_size, engine.allocator.block_size, engine.device
    runner, allocator = engine.runner, engine.allocator
    largest = min(engine.config.max_num_seqs, MAX_TIMED_BATCH)
    sizes = sorted({max(1, min(n, largest)) for n in (1, 4, largest // 2, largest)})  # max_num_seqs 1: just 1
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    verify: dict[int, list[float]] = {k: [] for k in ks}
    draft: list[float] | None = None if proposer.drafts_in_background else []
    timing = 0.0

    def shapes(table: list[int], n: int, width: int):
        tables = torch.tensor([table] * n, dtype=torch.int32, device=device)
        starts = torch.full((n,), context, dtype=torch.long, device=device)
        batch = AttentionBatch.for_round(tables, starts, width, page)
        positions = (starts[:, None] + torch.arange(width, device=device)).flatten()
        return torch.zeros(n * width, dtype=torch.long, device=device), starts, positions, batch

    def verify_call(n: int, k: int):
        def make(table: list[int]):
            ids, _, positions, batch = shapes(table, n, k + 1)
            rows = torch.arange(n * (k + 1), device=device)
            return lambda: runner.forward(ids, positions, batch, rows)
        return make

    def draft_call(n: int, k: int):
        def make(table: list[int]):
            ids, starts, _, batch = shapes(table, n, block)

            def call():
                proposer.request_drafts((), ids[:n], starts, [table] * n, batch, num_drafts=k)
                return proposer.receive_drafts()
            return call
        return make

    def timed(make_call, *, first: bool = False):
        """Seconds of the call `make_call` builds on borrowed blocks, a step after (with `first`,
        one untimed call: it allocates and picks kernels)."""
        nonlocal timing
        table: list[int] = []
        while True:
            try:
                allocator.grow(table, context + block)
                break
            except OutOfKVBlocks:
                yield  # the running requests hold the cache: again at a later step
        try:
            call = make_call(table)
            t0 = time.perf_counter()
            with torch.inference_mode():
                if first:
                    call()
                    sync()
                    seconds = 0.0
                else:
                    seconds = time_call(call, sync, warm_up=False)
            timing += time.perf_counter() - t0
        finally:
            allocator.release(table)
        yield
        return seconds

    # `draft` holds the draft of the fewest drafts; what more drafts add goes with the verify of k.
    yield from timed(verify_call(sizes[-1], block - 1), first=True)
    if draft is not None:
        yield from timed(draft_call(sizes[-1], block - 1), first=True)
    for n in sizes:
        for k in verify:
            verify[k].append((yield from timed(verify_call(n, k))))
        if draft is not None:
            by_k = {}
            for k in drafted:
                by_k[k] = yield from timed(draft_call(n, k))
            draft.append(by_k[drafted[0]])
            for k in drafted[1:]:
                verify[k][-1] += max(0.0, by_k[k] - by_k[drafted[0]])
    return sizes, verify, draft, timing
