"""How many draft slots a round verifies: load-adaptive speculation (issue 16).

Each round the engine verifies k ≤ B−1 of the drafter's B−1 drafts (k = 0: a plain AR step, no
draft forward). A verify of k+1 tokens per sequence costs more as k and the batch grow, and draft
j pays off only when drafts 1..j are all accepted, so the best k falls with load and with
acceptance. The policy picks the k that maximises the batch's expected committed tokens per
second,

    sum_i E[accepted_i + 1 | min(k, cap_i)]  /  (draft(n) [k > 0] + verify(n, k)),

from verify and draft costs the engine measured for its own shapes at start-up (`RoundCosts`) at
the batch's mean context, corrected online by the wall time rounds of each k actually take (the
host's share and sampling are not in a graph replay, and on a small model they dominate), and the
acceptance measured online per draft position (`AcceptanceTracker`), its drafts past the first
scaled by what speculative rounds returned of them (`RealizedDrafts`). `cap_i` is a
request's own limit (`SamplingParams.num_speculative_tokens`; 0 opts out). It weighs the ks again
every WEIGH_ROUNDS rounds of one batch, and at once when the batch or its limits change.

k is chosen from a few buckets, 0, 1, 3, 7, B−1 (and the values of a static table): on a GPU each
is a set of CUDA graphs per batch-size bucket, so the set stays small; the expected tokens of a
round grow concavely in k (each further draft needs every earlier one accepted), so the verify
widths 1, 2, 4, 8, B (each about double the last) leave little between two buckets to gain.
"""

from __future__ import annotations

import bisect
import itertools
import math
import operator
import time
from collections import Counter
from collections.abc import Callable, Sequence

from dflash_serve.services.config import EngineConfig

BASE_K_BUCKETS = (0, 1, 3, 7)
PROBE_ROUNDS = 2  # a probe's rounds in a row: a round's wall time holds the next one's launch, of the same k
PROBE_BUDGET = 0.01  # what probes are expected to lose against AR, at most this share of the AR steps' time
PROBE_COST_RATE = 0.5  # probes are rare: each of their rounds moves their measured cost this far
OUTLIER_FACTOR = 2.0  # a round's wall time counts as at most this many times the current estimate
PRIOR_ROUNDS = 4  # a kind of round's cost averages its first rounds from its prior, which counts as this many
# A batch's k is weighed again after this many rounds: the estimates are moving averages over hundreds of trials and
# rounds, and weighing every k took the H200's host 30–37 µs a round at batch 32, 2 % of a round (BENCHMARKS).
WEIGH_ROUNDS = 4


def k_buckets(block_size: int, table: dict | None = None) -> tuple[int, ...]:
    """The ks a round may verify with drafts of `block_size` (B): 0, 1, 3, 7, B−1 and the static
    table's values, none above B−1."""
    top = block_size - 1
    values = set(BASE_K_BUCKETS) | {top} | {int(k) for k in (table or {}).values()}
    return tuple(sorted(k for k in values if 0 <= k <= top))


def table_k(table: dict, batch_size: int) -> int | None:
    """The static table's k for a batch: the entry of the largest batch size ≤ `batch_size`
    (None: below its smallest entry). YAML and Helm may give the keys as strings."""
    entries = sorted((int(n), int(k)) for n, k in table.items())
    sizes = [n for n, _ in entries]
    at = bisect.bisect_right(sizes, batch_size) - 1
    return entries[at][1] if at >= 0 else None


def expected_tokens(acceptance: Sequence[float]) -> list[float]:
    """E[accepted + 1] of a round verifying k drafts, for k = 0..len(acceptance), given the
    conditional acceptance of draft j when drafts 1..j−1 were accepted (acceptance[j−1]): 1 plus
    the running products."""
    return list(itertools.accumulate(itertools.accumulate(acceptance, operator.mul, initial=1.0)))


class AcceptanceTracker:
    """Per draft position, the conditional acceptance rate — of draft j, given drafts 1..j−1
    were accepted — as an exponential moving average over trials (bounded: B−1 numbers).

    It starts at an optimistic prior, so the first rounds speculate and measure. The prior counts
    as `prior_trials` trials: until a position has had 1/rate trials its estimate is the mean of
    those and its trials, then the moving average. A deep position has few trials (each needs
    every draft before it accepted), and a moving average from the prior kept what the prior said
    long after its trials said otherwise: on CPU at c = 1, T 1 on humaneval, positions 3–15 read
    0.66–0.91 where their trials accepted 0.58–0.89, the expected tokens of a k = 15 round read
    2.92 against 2.4 measured, and the policy speculated where AR was faster. In a round that
    verified drafts, the positions beyond what it verified drift back towards the prior, so a
    deeper k is tried again once the shallower positions accept well (their estimates may be
    stale from another load or other requests). AR rounds change nothing: the policy probes.

    The rate, 0.005, averages ~400 trials: at rate 0.02 (~100) the first draft's estimate at
    batch 1 wandered ±0.043 around a true 0.24 (T 1 alpaca on the H200), where a k = 15 round
    breaks even at ~0.20, and spent a fifth of its trials under it (BENCHMARKS' model).
    """

    def __init__(self, num_positions: int, *, prior: float = 0.9, rate: float = 0.005, drift: float = 1 / 256,
                 prior_trials: int = 4):
        if not 0 < prior <= 1 or not 0 < rate <= 1 or not 0 <= drift <= 1 or prior_trials < 0:
            raise ValueError(f"prior {prior} and rate {rate} must be in (0, 1], drift {drift} in [0, 1], "
                             f"prior_trials {prior_trials} ≥ 0")
        self.prior, self.rate, self.drift, self.prior_trials = prior, rate, drift, prior_trials
        self.acceptance = [prior] * num_positions
        self.trials = [0] * num_positions  # since start, for tests and logs

    def observe_round(self, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """One round's sequences: drafts verified and accepted by each (verified 0: no trial). A
        position's trials in one round move its estimate as that many trials of their mean — the
        order of a batch's sequences means nothing — which is the exact mean of the prior and the
        trials while those count. Counted per position: trial by trial, the policy's observations of
        a round at batch 32 took twice as long, on the host's critical path
        (`dflash_serve.services.bench.policy`, BENCHMARKS)."""
        self.observe_counts(Counter(zip(verified, accepted, strict=True)))

    def observe_counts(self, rounds: Counter[tuple[int, int]], num_rounds: int = 1) -> None:
        """As `observe_round`, from how many sequences verified v drafts and had a accepted,
        {(v, a): count}, over `num_rounds` rounds of the same k (the positions past it drift back
        once per round): a batch holds few distinct pairs, counted in C, not sequence by sequence."""
        # Every few speculative rounds, on the host's critical path: locals and comparisons, not attribute
        # reads and min/max calls (`dflash_serve.services.bench.policy`, BENCHMARKS).
        acceptance, seen, prior_trials = self.acceptance, self.trials, self.prior_trials
        positions = len(acceptance)
        ends = [0] * (positions + 1)  # ends[d]: sequences whose trials were drafts 1..d
        passes = [0] * (positions + 1)  # passes[a]: sequences that accepted a drafts (a ≤ their end)
        deepest = reach = 0  # the most drafts verified, and tried
        for (k, a), count in rounds.items():
            # Draft j (1-based) is a trial when j ≤ k and drafts before it were accepted (j ≤ a+1).
            end = a + 1 if a < k else k
            ends[end] += count
            passes[a] += count
            if k > deepest:
                deepest = k
            if end > reach:
                reach = end
        if not deepest:
            return
        trials = hits = 0
        averaging = int(1 / self.rate)  # trials while 1/(trials + prior_trials) ≥ rate: the mean
        decay = 1 - self.rate
        for j in range(reach - 1, -1, -1):  # draft j+1's trials and hits: the deeper ends and passes
            trials += ends[j + 1]
            hits += passes[j + 1]
            # Each trial moves the estimate by max(rate, 1/(its trials so far + prior_trials)):
            # what those steps keep of the old estimate, the rest goes to the round's mean.
            before = prior_trials + seen[j]
            mean_steps = averaging - before if before < averaging else 0
            if mean_steps > trials:
                mean_steps = trials
            keep = before / (before + mean_steps) * decay ** (trials - mean_steps)
            acceptance[j] += (1 - keep) * (hits / trials - acceptance[j])
            seen[j] += trials
        drift, prior = 1 - (1 - self.drift) ** num_rounds, self.prior
        for j in range(deepest, positions):
            acceptance[j] += drift * (prior - acceptance[j])


class RealizedDrafts:
    """The drafts beyond the first that speculative rounds had accepted — where the first was —
    over those the acceptance tracker expected of them, as discounted sums: the factor (at most
    1) `SpeculationPolicy` puts on that deeper part of a round's expected drafts.

    The tracker assumes a draft's acceptance, given the drafts before it accepted, is the same
    for every request; it is not, and the deep positions, tried only when every draft before
    them accepted, hold mostly the easy requests' trials (over a longer span of rounds, the
    earlier prompts'), so they overstate what a hard request's deep drafts return. On CPU at
    c = 1, T 0, over the four sets in a row, rounds of k = 15 accepted 0.72–0.88 of the drafts
    the tracker expected, even where every round was of k = 15 (0.84 on humaneval), and the
    policy speculated deep where AR or k = 3 was faster.

    Only the part past the first draft is corrected: the policy chooses when to speculate on
    the first draft's estimate, which moves fastest, so rounds chosen when it read high accept
    less than it said, and a factor learnt from them would make the policy ever more selective
    (a factor on every draft, per k: on the H100 at c = 1, T 1, gsm8k at AR's speed where fixed
    B ran 13 % faster). One factor serves every k, as the wall factor does: one per k, learnt
    only from the ks chosen, left an unchosen k at 1 beside a chosen one's lower factor, so the
    policy turned to shallower ks where on the H100 they cost about the same as k = 15 (c = 1,
    T 0, humaneval: τ 3.52 for fixed B's 3.63, 0.977 of its speed). Above 1 it would only follow
    noise; it drifts back towards 1 in rounds of k = 1 (which have no deeper part), so a policy it
    held to k = 1 tries deeper again. The sums are discounted per sequence that had its first draft
    accepted, not per round: a sequence's deep drafts are few or many (T 1, humaneval on the H200:
    0–14 past the first), and discounted at 0.05 a round the factor held ~9 sequences at batch 1
    and read 0.83 ± 0.20 where the tracker was right — 0.01–0.22 at the end of three of the
    grid's sets at c = 1, T 1, where it took AR steps that fixed B did not need.
    """

    def __init__(self, *, rate: float = 0.01, prior_drafts: float = 8.0, drift: float = 1 / 256):
        if not 0 < rate <= 1 or prior_drafts <= 0 or not 0 <= drift <= 1:
            raise ValueError(f"rate {rate} must be in (0, 1], prior_drafts {prior_drafts} > 0, drift {drift} in [0, 1]")
        self.rate, self.drift = rate, drift
        self.expected = self.accepted = prior_drafts

    @property
    def factor(self) -> float:
        return min(1.0, self.accepted / self.expected)

    def observe_round(self, k: int, expected: float, accepted: int, sequences: int, num_rounds: int = 1) -> None:
        """`num_rounds` rounds verifying up to k drafts a sequence: of their drafts past the first,
        in the `sequences` whose first was accepted, the tracker expected `expected` (summed over
        them) to be accepted and `accepted` were."""
        if k > 1:
            keep = (1 - self.rate) ** sequences
            self.expected = keep * self.expected + expected
            self.accepted = keep * self.accepted + accepted
        elif k == 1:
            self.accepted += (1 - (1 - self.drift) ** num_rounds) * (self.expected - self.accepted)


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


class SpeculationPolicy:
    """Chooses each round's k (see the module doc).

    Exploration: after `probe_interval` AR rounds in a row, PROBE_ROUNDS rounds verify the k the
    prior acceptance would choose — a measurement of every position that k would rely on, of the
    realized factor, and of a speculative round's wall time — but only where speculating would pay
    at the prior (else no acceptance could make it pay, and there is nothing to learn). A policy
    that chose AR under a bad spell, or after slow rounds, thus returns to speculating when
    acceptance or the host recovers. Probes of k = 1 measured only the first draft: on CPU at
    c = 1, T 0, after gsm8k's hard prompts, mbpp ran 917 AR steps, 10 rounds of k = 1 and 24 of
    k = 15 where its own estimates, once measured, put k = 15 at 1.6 × AR's speed (the deep
    positions and the realized factor move only in rounds that verify them).

    The interval keeps what probes are expected to lose against AR steps — their time less the
    tokens the current estimates expect of them, in AR steps — within PROBE_BUDGET of the AR
    steps' time. Where the estimates say speculating nearly pays, a probe costs little and comes
    after `probe_interval` AR rounds; where nothing is accepted it loses its whole extra time, and
    comes as rarely as that allows (on an AVX2-only CPU a round of k = 1 takes 1.65–1.76 × an AR
    step, and a probe every 64 AR steps cost 2–2.4 % of a run that decoded AR). A budget on the
    extra time alone spaced probes as widely near the break-even as far from it: at batch 1 the
    first draft's estimate, once under the break-even by the noise of its trials, then moved by
    the probes' two trials per 64 AR steps only, and stayed there for thousands of rounds (T 1,
    alpaca, c = 1 on the H200: 0.978 × fixed B; BENCHMARKS' model of the policy: 0.94–0.97, and
    0.83 × the better of fixed B and AR on mbpp after gsm8k at the CPU's costs, 1 % of its rounds
    speculative). What a probe costs is what probes of its k took, once measured, not the
    cost model's estimate: that has one wall factor for every k > 0, learnt mostly from the deeper
    rounds, and on the CPU at batch 8 (T 1, alpaca) it read a probe's round of k = 1 as ~1.4 AR
    steps where probes took 1.5–2.4, and probes cost twice their budget.
    """

    def __init__(self, config: EngineConfig, block_size: int, costs: RoundCosts | None = None,
                 tracker: AcceptanceTracker | None = None, *, probe_interval: int = 8):
        self.mode = config.speculation
        # Only the adaptive choice reads what rounds teach (acceptance, round times, the batch's context).
        self.adapts = self.mode == "adaptive"
        self.table = dict(config.num_speculative_tokens_per_batch_size)
        self.block_size = block_size
        self.ks = k_buckets(block_size, self.table)
        self.costs = costs
        self._tracker = tracker or AcceptanceTracker(max(block_size - 1, 0))
        self._realized = RealizedDrafts()
        # Rounds observed and not yet taken into the estimates, per k: {(verified, accepted): sequences}, and how many
        self._unseen: dict[int, Counter[tuple[int, int]]] = {}
        self._unseen_rounds: Counter[int] = Counter()
        self.probe_interval = probe_interval
        self._ar_rounds = 0  # AR rounds chosen in a row by the adaptive policy
        self._prior = [self._tracker.prior] * len(self._tracker.acceptance)
        self._probe_k = 0  # the last probe's k
        self._probe_rounds_unseen = 0  # of its rounds, those whose wall time is still to come
        # (batch size, limit), the k the prior would choose there, and the AR rounds before its probe
        self._prior_choice: tuple[tuple[int, int] | None, int, int] = (None, 0, 0)
        self._probe_rounds_left = 0
        self._probe_cost: dict[tuple[int, int], float] = {}  # (nearest measured batch size, k) -> a round, in AR steps
        # The batch (size, caps) last weighed, the k chosen for it, and its rounds left before it is weighed again
        self._weighed: tuple[tuple | None, int, int] = (None, 0, 0)

    @property
    def tracker(self) -> AcceptanceTracker:
        """The acceptance per draft position, every round observed taken in."""
        self._take_in_rounds()
        return self._tracker

    @property
    def realized(self) -> RealizedDrafts:
        """The realized factor on the drafts past the first, every round observed taken in."""
        self._take_in_rounds()
        return self._realized

    def needs_costs(self) -> bool:
        """Whether some batch size is left to the adaptive policy (the table does not cover all)."""
        return self.block_size > 1 and self.mode == "adaptive" and (not self.table or table_k(self.table, 1) is None)

    def choose(self, caps: Sequence[int | None], context: float | None = None) -> int:
        """k for a batch whose requests allow at most caps[i] drafts (None: no limit), at mean
        position `context` (None: the costs' own)."""
        top, n = self.block_size - 1, len(caps)
        counts: dict[int, int] = {}  # the batch's caps, by how many sequences have each: few distinct
        for cap in set(caps):
            capped = top if cap is None else min(cap, top)
            counts[capped] = counts.get(capped, 0) + caps.count(cap)
        limit = max(counts, default=0)
        if limit == 0:
            return 0
        forced = table_k(self.table, n) if self.table else None
        if forced is not None:
            return self._bucket_at_most(min(forced, limit))
        if self.mode == "fixed":
            return self._bucket_at_most(limit)
        if self.costs is None:
            raise RuntimeError("adaptive speculation has no round costs: call Engine.measure_round_costs() first")
        if self._probe_rounds_left:  # the batch may have changed: at most its limit
            self._probe_rounds_left -= 1
            return self._bucket_at_most(min(self._probe_k, limit))
        k = self._weighed_k(n, counts, limit, context)
        if k:
            self._ar_rounds, self._prior_choice = 0, (None, 0, 0)
            return k
        self._ar_rounds += 1
        if self._ar_rounds < self.probe_interval:
            return 0
        if self._prior_choice[0] != (n, limit):  # once per run of AR rounds and batch: each round's cost 5–7 µs
            k = self._best_k(n, counts, limit, self._prior, context, realized=False)  # could speculating pay at all
            self._prior_choice = (n, limit), k, self.rounds_between_probes(n, k, context, counts) if k else 0
        _, k, interval = self._prior_choice
        if k and self._ar_rounds >= interval:
            self._probe_k, self._ar_rounds, self._probe_rounds_left = k, 0, PROBE_ROUNDS - 1
            self._probe_rounds_unseen = PROBE_ROUNDS
            self._prior_choice = self._weighed = (None, 0, 0)
            return k
        return 0

    def _weighed_k(self, n: int, counts: dict[int, int], limit: int, context: float | None) -> int:
        """`_best_k` at the current estimates, weighed again after WEIGH_ROUNDS rounds of the same
        batch (size and caps), at once for another batch or after a probe."""
        batch, k, left = self._weighed
        key = n, tuple(counts.items())
        if key == batch and left:
            self._weighed = batch, k, left - 1
            return k
        k = self._best_k(n, counts, limit, self.tracker.acceptance, context, realized=True)
        self._weighed = key, k, WEIGH_ROUNDS - 1
        return k

    def rounds_between_probes(self, n: int, k: int, context: float | None = None,
                              counts: dict[int, int] | None = None) -> int:
        """AR rounds in a row before a probe of k at batch n, whose caps are `counts` ({cap: sequences};
        None: none capped): `probe_interval`, or as many as keep what the probe is expected to lose
        against AR steps, at the current estimates, within PROBE_BUDGET of their time."""
        ar = self.costs.round_seconds(n, 0, context)
        if ar <= 0:
            return self.probe_interval
        tokens = self._round_tokens(self.tracker.acceptance, k, realized=True)
        gain = sum(tokens[min(k, cap)] * m for cap, m in (counts or {k: n}).items()) / n
        lost = PROBE_ROUNDS * (self._probe_seconds(n, k, ar, context) / ar - gain)  # in AR steps
        return max(self.probe_interval, math.ceil(lost / PROBE_BUDGET - 1e-9))

    def _probe_seconds(self, n: int, k: int, ar: float, context: float | None) -> float:
        """A probe round's seconds at batch n, given an AR step's (`ar`): as probes of k took, else the estimate."""
        measured = self._probe_cost.get((self.costs.nearest(n), k))
        return measured * ar if measured is not None else self.costs.round_seconds(n, k, context)

    def _bucket_at_most(self, k: int) -> int:
        return max(b for b in self.ks if b <= k)

    def _best_k(self, n: int, counts: dict[int, int], limit: int, acceptance: Sequence[float],
                context: float | None, realized: bool) -> int:
        # Every round chooses, on the host's critical path: per distinct cap, not per sequence, and
        # the batch's share of every k's cost once (`RoundCosts.round_seconds_by_k`).
        tokens = self._round_tokens(acceptance, limit, realized)
        best_k, best_rate = 0, -1.0
        for k, seconds in self.costs.round_seconds_by_k(n, context):
            if k > limit:
                break
            gain = 0.0
            for cap, m in counts.items():
                gain += tokens[min(k, cap)] * m
            rate = gain / seconds if seconds > 0 else math.inf
            if rate > best_rate * (1 + 1e-9):  # ties go to the smaller k
                best_k, best_rate = k, rate
        return best_k

    def _round_tokens(self, acceptance: Sequence[float], limit: int, realized: bool) -> list[float]:
        """E[accepted + 1] of a sequence's round verifying v drafts, for v = 0..limit: 1 + a_1 (1 + f · deep[v − 1]),
        deep[m] the drafts past the first the tracker expects once the first is accepted, f the
        realized factor (1 where not `realized`; f = 1 is `expected_tokens`)."""
        first, factor = acceptance[0], self.realized.factor if realized else 1.0
        return [1.0] + [1 + first * (1 + factor * (e - 1)) for e in expected_tokens(acceptance[1:limit])]

    def estimates(self, n: int, context: float | None = None) -> dict:
        """What the adaptive choice weighs for a batch of n unlimited sequences at mean position
        `context` (None: the costs' own) now, for reports (`dflash bench`): per k bucket the round's
        expected tokens a sequence and its predicted wall ms; the acceptance per draft position; the
        realized factor on the drafts past the first."""
        tokens = self._round_tokens(self.tracker.acceptance, self.block_size - 1, realized=True)
        rounds = self.costs.round_seconds_by_k(n, context)
        return {"batch": n, "context": context if context is None else round(context, 1),
                "acceptance": [round(a, 4) for a in self.tracker.acceptance],
                "realized_factor": round(self.realized.factor, 4),
                "expected_tokens": {k: round(tokens[k], 4) for k, _ in rounds},
                "round_ms": {k: round(1e3 * seconds, 4) for k, seconds in rounds}}

    def observe_round(self, k: int, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """A round of k: the drafts each sequence verified and had accepted. Only the adaptive
        choice reads what they teach, and an AR step's teach nothing. Counted here, and taken into
        the estimates when they are next read or after WEIGH_ROUNDS rounds (`_take_in_rounds`): the
        policy reads them when it weighs, and taking each round in took the H200's host ~29 µs at
        batch 32."""
        if not k or not self.adapts:
            return
        unseen = self._unseen.get(k)
        if unseen is None:
            unseen = self._unseen[k] = Counter()
        unseen.update(zip(verified, accepted, strict=True))
        self._unseen_rounds[k] += 1
        if self._unseen_rounds.total() >= WEIGH_ROUNDS:  # taken in long after they came, the deep drafts'
            self._take_in_rounds()  # expectations would come from estimates that many rounds old

    def _take_in_rounds(self) -> None:
        """The rounds observed since the estimates were last read, into them: each k's rounds as one
        (the tracker weighs a batch's trials at a position as that many trials of their mean), with
        what the tracker expected of their deep drafts before it learns from them."""
        if not self._unseen:
            return
        unseen, rounds_of, self._unseen, self._unseen_rounds = self._unseen, self._unseen_rounds, {}, Counter()
        tracker = self._tracker
        for k, rounds in unseen.items():
            deep = expected_tokens(tracker.acceptance[1:])
            expected, accepted, sequences = 0.0, 0, 0  # drafts past the first, in the sequences whose first was accepted
            for (v, a), count in rounds.items():
                if v > 1 and a:
                    expected += count * (deep[v - 1] - 1)
                    accepted += count * (a - 1)
                    sequences += count
            self._realized.observe_round(k, expected, accepted, sequences, rounds_of[k])
            tracker.observe_counts(rounds, rounds_of[k])

    def observe_round_time(self, n: int, k: int, seconds: float, context: float | None = None,
                           host_seconds: float = 0.0) -> None:
        """Wall seconds of a round in steady decoding at mean position `context`, and the host's
        own seconds for it where rounds chain (see `RoundCosts`)."""
        if self.costs is None or not self.adapts:
            return
        # Only the probe's own rounds: rounds chain, and one is observed after the next is chosen. Every
        # round of the probe's k, when that was k = 15 at c = 1, cost each ~2 µs more here.
        if self._probe_rounds_unseen and k == self._probe_k and seconds > 0:
            self._probe_rounds_unseen -= 1
            ar = self.costs.round_seconds(n, 0, context)
            if ar > 0:
                # In AR steps, from the estimate, and one slow round counts for at most OUTLIER_FACTOR
                # times the current value: a collection must not hold off the probes for thousands of rounds.
                at = (self.costs.nearest(n), k)
                old = self._probe_cost.get(at, self._probe_seconds(n, k, ar, context) / ar)
                self._probe_cost[at] = old + PROBE_COST_RATE * (min(seconds / ar, OUTLIER_FACTOR * old) - old)
        self.costs.observe_round(n, k, seconds, context, host_seconds)
