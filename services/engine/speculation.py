"""How many draft slots a round verifies: load-adaptive speculation (issue 16).

Each round the engine verifies k ≤ B−1 of the drafter's B−1 drafts (k = 0: a plain AR step, no
draft forward). A verify of k+1 tokens per sequence costs more as k and the batch grow, and draft
j pays off only when drafts 1..j are all accepted, so the best k falls with load and with
acceptance. The policy picks the k that maximises the batch's expected committed tokens per
second,

    sum_i E[accepted_i + 1 | min(k, cap_i)]  /  (draft(n) [k > 0] + verify(n, k)),

from verify and draft costs the engine measured for its own shapes at start-up (`RoundCosts`, round_costs.py) at
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
from collections import Counter
from collections.abc import Sequence

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.round_costs import OUTLIER_FACTOR, RoundCosts

BASE_K_BUCKETS = (0, 1, 3, 7)
PROBE_INTERVAL = 8  # AR rounds in a row before a probe, at the least (`SpeculationPolicy`)
PROBE_ROUNDS = 2  # a probe's rounds in a row: a round's wall time holds the next one's launch, of the same k
PROBE_BUDGET = 0.01  # what probes are expected to lose against AR, at most this share of the AR steps' time
PROBE_COST_RATE = 0.5  # probes are rare: each of their rounds moves their measured cost this far
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

    def __init__(self, config: EngineConfig, block_size: int, costs: RoundCosts | None = None):
        # adaptive, or fixed (B−1). Only the adaptive choice reads what rounds teach (acceptance, round times, the
        # batch's context).
        self.adapts = config.speculation == "adaptive"
        self.table = dict(config.num_speculative_tokens_per_batch_size)
        self.block_size = block_size
        self.ks = k_buckets(block_size, self.table)
        self.costs = costs
        self._tracker = AcceptanceTracker(max(block_size - 1, 0))
        self._realized = RealizedDrafts()
        # Rounds observed and not yet taken into the estimates, per k: {(verified, accepted): sequences}, and how many
        self._unseen: dict[int, Counter[tuple[int, int]]] = {}
        self._unseen_rounds: Counter[int] = Counter()
        self.probe_interval = PROBE_INTERVAL
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
        return self.block_size > 1 and self.adapts and (not self.table or table_k(self.table, 1) is None)

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
        if not self.adapts:  # fixed
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
