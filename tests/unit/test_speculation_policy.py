"""The load-adaptive speculation policy on known costs and acceptance (no models)."""

from __future__ import annotations

import collections
import itertools
import math
import random
import statistics

import pytest

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.round_costs import PRIOR_ROUNDS, RoundCosts, context_slope
from dflash_serve.services.engine.speculation import (
    PROBE_BUDGET,
    PROBE_ROUNDS,
    WEIGH_ROUNDS,
    AcceptanceTracker,
    RealizedDrafts,
    SpeculationPolicy,
    expected_tokens,
    k_buckets,
    table_k,
)

B = 16


def _costs(verify, draft=0.0, sizes=(1, 8, 32), ks=(0, 1, 3, 7, 15)) -> RoundCosts:
    """verify(n, k) and draft(n) given as functions, tabulated at `sizes`."""
    return RoundCosts(sizes, {k: [verify(n, k) for n in sizes] for k in ks},
                      [draft(n) if callable(draft) else draft for n in sizes])


def _policy(costs=None, acceptance=None, **config) -> SpeculationPolicy:
    policy = SpeculationPolicy(EngineConfig(target="t", **config), B, costs)
    if acceptance is not None:
        policy.tracker.acceptance = list(acceptance)
    return policy


def _choice_once_weighed(policy, caps) -> int:
    """The k `policy` chooses once it has weighed its estimates again: it holds a batch's k for
    WEIGH_ROUNDS rounds (rounds it chooses AR count towards a probe)."""
    return [policy.choose(caps) for _ in range(WEIGH_ROUNDS)][-1]


def _best_k_by_brute_force(costs, acceptance, caps):
    n = len(caps)

    def rate(k):
        gain = sum(expected_tokens(acceptance)[min(k, B - 1 if c is None else c)] for c in caps)
        return gain / (costs.verify_seconds(n, k) + (costs.draft_seconds(n) if k else 0))

    return max(costs.ks, key=lambda k: (rate(k), -k))


def test_buckets_and_the_static_table():
    assert k_buckets(16) == (0, 1, 3, 7, 15)
    assert k_buckets(6) == (0, 1, 3, 5)  # 7 is above B-1
    assert k_buckets(16, {"1": 10, 8: 2}) == (0, 1, 2, 3, 7, 10, 15)
    assert k_buckets(1) == (0,)  # AR
    table = {"1": 15, 8: 7, 32: 0}  # string keys, as YAML through Helm gives them
    assert [table_k(table, n) for n in (1, 7, 8, 31, 32, 64)] == [15, 15, 7, 7, 0, 0]
    assert table_k({4: 3}, 2) is None  # below the smallest entry: the policy decides


def test_expected_tokens_is_one_plus_the_products_of_conditional_acceptance():
    assert expected_tokens([0.5, 0.5, 0.5]) == pytest.approx([1.0, 1.5, 1.75, 1.875])
    assert expected_tokens([1.0, 0.0, 1.0]) == [1.0, 2.0, 2.0, 2.0]


def test_costs_interpolate_linearly_between_measured_batch_sizes():
    costs = RoundCosts([1, 4, 16], {0: [1.0, 2.0, 8.0], 3: [2.0, 5.0, 11.0]}, [0.5, 1.0, 4.0])
    assert costs.verify_seconds(1, 0) == 1.0
    assert costs.verify_seconds(2, 0) == pytest.approx(1 + 1 / 3)
    assert costs.verify_seconds(10, 3) == pytest.approx(8.0)
    assert costs.verify_seconds(16, 3) == 11.0
    assert costs.verify_seconds(32, 3) == pytest.approx(19.0)  # beyond: the last segment's line
    assert costs.draft_seconds(7) == pytest.approx(1.0 + 3.0 * 3 / 12)
    assert costs.ks == (0, 3)


def test_noisy_measurements_are_made_monotone_in_batch_size_and_k():
    costs = RoundCosts([1, 4], {0: [2.0, 1.5], 1: [1.0, 3.0]}, [0.3, 0.2])
    assert costs.verify[0] == [2.0, 2.0]  # a larger batch never costs less
    assert costs.verify[1] == [2.0, 3.0]  # nor a larger k
    assert costs.draft == [0.3, 0.3]


def test_costs_follow_the_batchs_mean_context():
    """Measured at position 256; every position of context adds its batch size's slope — the
    verify's to every round, the draft's to a speculative one."""
    costs = RoundCosts([1, 16], {0: [1.0, 10.0], 3: [2.0, 16.0]}, [0.5, 4.0], context=256,
                       verify_slope=[0.001, 0.02], draft_slope=[0.0, 0.004])
    assert costs.predicted_seconds(16, 0) == costs.predicted_seconds(16, 0, 256) == 10.0
    assert costs.predicted_seconds(16, 0, 128) == pytest.approx(10.0 - 128 * 0.02)
    assert costs.predicted_seconds(16, 3, 128) == pytest.approx(16.0 + 4.0 - 128 * (0.02 + 0.004))
    assert costs.predicted_seconds(8, 0, 512) == pytest.approx(1.0 + 9.0 * 7 / 15 + 256 * (0.001 + 0.019 * 7 / 15))
    assert costs.round_seconds(16, 0, 128) == costs.predicted_seconds(16, 0, 128)  # no wall time observed
    # The wall factor is learnt against the prediction at the round's own context.
    costs.observe_round(16, 0, 2 * costs.predicted_seconds(16, 0, 64), 64)
    assert costs.wall_factor.get((False, 1)) == pytest.approx(1 + 1 / (PRIOR_ROUNDS + 1))  # from the prior 1
    # Never below nothing, and slopes are monotone in the batch size like the costs.
    assert RoundCosts([1], {0: [1.0]}, None, context=256, verify_slope=[0.1]).predicted_seconds(1, 0, 0) == 0.0
    assert RoundCosts([1, 4], {0: [1.0, 2.0]}, None, verify_slope=[0.2, 0.1]).verify_slope == [0.2, 0.2]
    with pytest.raises(ValueError, match="verify slope: 1 values for 2 batch sizes"):
        RoundCosts([1, 4], {0: [1.0, 2.0]}, None, verify_slope=[0.1])


def test_every_ks_round_seconds_at_once_equal_each_ks_own():
    """The policy weighs every k each round through `round_seconds_by_k`, which computes the
    batch's shared terms once: the same numbers as asking k by k — below, between and beyond the
    measured sizes, at another context, with wall factors and host times learnt."""
    costs = RoundCosts([1, 8, 32], {k: [1.0 + 0.1 * k, 2.0 + 0.2 * k, 5.0 + 0.3 * k] for k in (0, 1, 3, 7, 15)},
                       [0.5, 1.0, 2.0], context=256, verify_slope=[0.001, 0.002, 0.004], draft_slope=[0.0, 0.001, 0.002])
    costs.observe_round(8, 0, 3.0, 200, host_seconds=2.5)
    costs.observe_round(32, 7, 9.0, 300)
    for n, context in itertools.product((1, 5, 8, 20, 32, 48), (None, 0, 100, 256, 700)):
        assert costs.round_seconds_by_k(n, context) == [(k, costs.round_seconds(n, k, context)) for k in costs.ks]


def test_context_slope_from_two_timings():
    assert context_slope([3.0, 9.0], [1.0, 2.0], 256, 32) == pytest.approx([2 / 224, 7 / 224])
    assert context_slope([1.0], [1.2], 256, 32) == [0.0]  # noise: the near one read slower
    assert context_slope([1.0], [0.01], 256, 32) == [1.0 / 256]  # the line from far never goes below 0 at 0
    with pytest.raises(ValueError, match="far one must be larger"):
        context_slope([1.0], [1.0], 32, 32)


def test_an_unobserved_kind_of_round_takes_the_other_kinds_factor_up_to_1():
    """Start-up timings that read slow for both kinds (load, context) must not leave the kind the
    policy never chooses looking slow — it would never be measured; a kind's own extra work,
    above 1, is not the other's."""
    costs = _costs(lambda n, k: 1.0)
    for _ in range(200):
        costs.observe_round(8, 7, 0.8)
    assert costs.round_seconds(8, 7) == pytest.approx(0.8, rel=0.01)
    assert costs.round_seconds(8, 0) == pytest.approx(0.8, rel=0.01)  # unobserved: the speculative factor
    costs.observe_round(8, 0, 1.0)
    assert costs.round_seconds(8, 0) == pytest.approx(0.8 + 0.2 / (PRIOR_ROUNDS + 1), rel=0.01)  # then its own
    assert costs.round_seconds(1, 0) == 1.0  # another size: none observed
    for _ in range(400):  # (the prior counts as PRIOR_ROUNDS of them)
        costs.observe_round(1, 0, 3.0)
    assert costs.round_seconds(1, 0) == pytest.approx(3.0, rel=0.01)
    assert costs.round_seconds(1, 7) == 1.0  # above 1: the prediction


def test_a_remote_drafters_cost_is_learnt_from_rounds_starting_optimistic():
    costs = RoundCosts([1, 8], {0: [1.0, 2.0], 7: [1.5, 3.0]}, None)
    assert not costs.measured_draft and costs.draft_seconds(4) == 0.0
    assert costs.round_seconds(8, 7) == 3.0 and costs.round_seconds(4, 7) == pytest.approx(1.5 + 1.5 * 3 / 7)
    costs.observe_draft(8, 0.4)
    assert costs.draft_seconds(8) == 0.4  # the first observation replaces the optimistic 0
    costs.observe_draft(8, 0.6)
    assert costs.draft_seconds(8) == pytest.approx(0.4 + 0.1 * 0.2)
    costs.observe_draft(2, 0.2)  # nearest measured size is 1: scaled to it
    assert costs.draft_seconds(1) == pytest.approx(0.1)
    # A round's cost per batch size, computed once a size, follows the draft time learnt since.
    for n in (1, 4, 8):
        assert costs.round_seconds(n, 7) == pytest.approx(costs.verify_seconds(n, 7) + costs.draft_seconds(n))
        assert costs.round_seconds(n, 0) == pytest.approx(costs.verify_seconds(n, 0))


@pytest.mark.parametrize("acceptance", [0.95, 0.8, 0.6, 0.3, 0.05])
@pytest.mark.parametrize("n", [1, 4, 8, 20, 32])
def test_the_policy_picks_the_k_with_the_most_tokens_per_second(n, acceptance):
    # A memory-bound verify at small batches, compute-bound at large: cost ~ max(1, tokens / 64).
    costs = _costs(lambda n, k: 1.0 + max(0.0, n * (k + 1) - 64) / 64, draft=lambda n: 0.2 + 0.01 * n)
    acc = [acceptance] * (B - 1)
    policy = _policy(costs, acc)
    caps = [None] * n
    assert policy.choose(caps) == _best_k_by_brute_force(costs, acc, caps)


@pytest.mark.parametrize("acceptance", [0.95, 0.6, 0.3])
@pytest.mark.parametrize("n", [1, 8, 32])
def test_the_estimates_report_what_the_choice_weighs(n, acceptance):
    costs = _costs(lambda n, k: 1.0 + max(0.0, n * (k + 1) - 64) / 64, draft=lambda n: 0.2 + 0.01 * n)
    acc = [acceptance * (0.97 ** j) for j in range(B - 1)]
    policy = _policy(costs, acc)
    policy.realized.expected, policy.realized.accepted = 10.0, 7.0  # deep drafts returned 0.7 of the expected
    report = policy.estimates(n)
    assert report["batch"] == n and report["acceptance"] == pytest.approx(acc, abs=1e-4)
    assert set(report["expected_tokens"]) == set(report["round_ms"]) == set(costs.ks)
    factor = policy.realized.factor
    assert report["realized_factor"] == pytest.approx(factor, abs=1e-4)
    full = expected_tokens(acc)
    for k in costs.ks:  # 1 + a_1 (1 + f · the deeper drafts' expectation)
        deeper = (full[k] - 1 - acc[0]) / acc[0] if k else 0.0
        assert report["expected_tokens"][k] == pytest.approx((1 + acc[0] * (1 + factor * deeper)) if k else 1.0,
                                                             abs=1e-4)
        assert report["round_ms"][k] == pytest.approx(1e3 * costs.round_seconds(n, k), abs=1e-4)
    best = max(costs.ks, key=lambda k: (report["expected_tokens"][k] / report["round_ms"][k], -k))
    assert policy.choose([None] * n) == best


def test_small_batches_speculate_deep_and_large_batches_decode_ar():
    costs = _costs(lambda n, k: 1.0 + max(0.0, n * (k + 1) - 32) / 32, draft=0.2)
    policy = _policy(costs, [0.8] * (B - 1))
    assert policy.choose([None]) == 15
    assert policy.choose([None] * 32) == 0
    # At low acceptance a drafted round does not pay even at batch 1.
    assert _policy(costs, [0.1] * (B - 1)).choose([None]) == 0


def test_request_limits_cap_k_and_an_all_opted_out_batch_decodes_ar():
    costs = _costs(lambda n, k: 1.0, draft=0.0)  # verifying costs nothing extra: as deep as allowed
    policy = _policy(costs, [0.9] * (B - 1))
    assert policy.choose([None, None]) == 15
    assert policy.choose([0, 0]) == 0
    assert policy.choose([2, 3]) == 3  # the largest bucket within what some request can use
    assert policy.choose([0, 5]) == 3  # 5 is no bucket: the largest bucket below
    # fixed: every draft, within the requests' limits (rounded down to a bucket)
    fixed = _policy(speculation="fixed")
    assert fixed.choose([None] * 32) == 15 and fixed.choose([0, 9]) == 7 and fixed.choose([0]) == 0


def test_a_batchs_k_is_weighed_again_every_few_rounds_and_at_once_for_another_batch():
    """Weighing every k each round cost the H200's host 30–37 µs at batch 32: the policy holds a
    batch's k for WEIGH_ROUNDS rounds, and weighs at once where the batch's size or caps change (and
    after a probe: `test_a_probe_of_every_draft_returns_the_policy_to_speculating_after_a_hard_set`)."""
    costs = _costs(lambda n, k: 1.0 + 0.05 * k, draft=0.2)
    policy = _policy(costs, [0.9] * (B - 1))
    assert policy.choose([None] * 8) == 15
    policy.tracker.acceptance = [0.05] * (B - 1)  # the drafter turns useless
    held = [policy.choose([None] * 8) for _ in range(WEIGH_ROUNDS)]
    assert held == [15] * (WEIGH_ROUNDS - 1) + [0]
    # another batch size, or the same size with other caps, is weighed at once
    policy = _policy(costs, [0.9] * (B - 1))
    assert policy.choose([None] * 8) == 15
    policy.tracker.acceptance = [0.05] * (B - 1)
    assert policy.choose([None] * 9) == 0
    assert policy.choose([None] * 8) == 0
    policy.tracker.acceptance = [0.9] * (B - 1)
    assert policy.choose([None] * 7 + [0]) == 15

def test_the_static_table_overrides_the_policy_and_fixed_mode():
    table = {1: 15, 8: 3, 32: 0}
    for mode in ("adaptive", "fixed"):
        policy = _policy(speculation=mode, num_speculative_tokens_per_batch_size=table)
        assert not policy.needs_costs()  # the table covers every batch size
        assert [policy.choose([None] * n) for n in (1, 7, 8, 31, 32)] == [15, 15, 3, 3, 0]
        assert policy.choose([1] * 8) == 1  # and requests still cap it
    partial = _policy(costs=_costs(lambda n, k: 1.0 + n * k), num_speculative_tokens_per_batch_size={8: 2})
    assert partial.needs_costs() and partial.choose([None] * 8) == 2
    assert partial.ks == (0, 1, 2, 3, 7, 15)


def test_an_adaptive_policy_without_costs_says_what_to_do():
    with pytest.raises(RuntimeError, match="measure_round_costs"):
        _policy().choose([None])


def test_acceptance_is_measured_per_position_conditionally():
    tracker = AcceptanceTracker(4, prior=0.5, rate=1.0, drift=0.0)  # rate 1: the last trial's outcome
    tracker.observe_round([4], [2])  # drafts 1, 2 accepted, 3 rejected, 4 never a trial
    assert tracker.acceptance == [1.0, 1.0, 0.0, 0.5] and tracker.trials == [1, 1, 1, 0]
    tracker.observe_round([1, 0], [1, 0])  # k 1: one trial; an opted-out sequence: none
    assert tracker.acceptance == [1.0, 1.0, 0.0, 0.5] and tracker.trials == [2, 1, 1, 0]
    tracker.observe_round([3], [3])  # all 3 verified accepted: draft 4 was not verified
    assert tracker.acceptance == [1.0, 1.0, 1.0, 0.5]


def test_the_prior_counts_as_a_few_trials_then_the_moving_average_takes_over():
    """A position's estimate is the mean of its trials and the prior's `prior_trials` until it has
    had 1/rate trials: a deep position, tried rarely, reads what its trials said, not the prior."""
    tracker = AcceptanceTracker(2, prior=0.9, rate=0.25, drift=0.0, prior_trials=2)
    tracker.observe_round([2], [0])  # draft 1 rejected: (2 × 0.9 + 0) / 3
    assert tracker.acceptance[0] == pytest.approx(0.6) and tracker.acceptance[1] == 0.9
    tracker.observe_round([2], [1])  # draft 1 accepted, draft 2 rejected: means over 4 and 3
    assert tracker.acceptance == pytest.approx([0.7, 0.6])
    tracker.observe_round([1], [1])  # draft 1's 3rd trial: 1/5 < rate, the moving average from here
    assert tracker.acceptance[0] == pytest.approx(0.7 + 0.25 * 0.3)
    no_prior = AcceptanceTracker(1, prior_trials=0)
    no_prior.observe_round([1], [0])  # the first trial replaces the prior
    assert no_prior.acceptance == [0.0]


def test_a_rounds_trials_at_a_position_move_it_as_that_many_trials_of_their_mean():
    """A batch's order means nothing: while the prior's trials count, the estimate is the exact
    mean of them and every trial; past 1/rate trials, each further trial moves it by rate."""
    tracker = AcceptanceTracker(2, prior=0.9, rate=0.1, drift=0.0, prior_trials=2)
    tracker.observe_round([2, 2, 2], [0, 2, 0])  # draft 1: 3 trials, 1 hit; draft 2: 1 trial, 1 hit
    assert tracker.acceptance == pytest.approx([(2 * 0.9 + 1) / 5, (2 * 0.9 + 1) / 3])
    assert tracker.trials == [3, 1]
    crossing = AcceptanceTracker(1, prior=0.9, rate=0.25, drift=0.0, prior_trials=2)
    crossing.observe_round([1, 1, 1, 1], [1, 0, 1, 1])  # 4 trials of mean 0.75: 2 in the mean, then 2 at the rate
    in_the_mean = (2 * 0.9 + 2 * 0.75) / 4
    assert crossing.acceptance[0] == pytest.approx(in_the_mean + (1 - 0.75**2) * (0.75 - in_the_mean))


def test_positions_beyond_the_verified_ones_drift_back_to_the_prior():
    tracker = AcceptanceTracker(3, prior=0.9, rate=1.0, drift=0.5)
    tracker.observe_round([3], [1])  # 1 accepted, 2 rejected: [1, 0, 0.9]
    tracker.observe_round([1], [1])  # positions 2 and 3 were not verified: halfway back
    assert tracker.acceptance == [1.0, 0.45, 0.9]
    tracker.observe_round([0], [0])  # an AR round measures nothing and moves nothing
    assert tracker.acceptance == [1.0, 0.45, 0.9]


def test_realized_drafts_are_discounted_sums_with_a_prior_and_a_factor_at_most_1():
    realized = RealizedDrafts(rate=0.5, prior_drafts=2.0, drift=0.25)
    assert realized.factor == 1.0  # the prior
    realized.observe_round(3, 6.0, 1, 1)  # one sequence: expected 2 × 0.5 + 6 = 7, accepted 2 × 0.5 + 1 = 2
    assert realized.factor == pytest.approx(2 / 7)
    realized.observe_round(15, 0.0, 4, 1)  # more accepted than expected in the sums: capped at 1
    assert (realized.expected, realized.accepted) == pytest.approx((3.5, 5.0)) and realized.factor == 1.0
    realized.observe_round(15, 0.0, 0, 0)  # no sequence had its first draft accepted: nothing
    assert (realized.expected, realized.accepted) == pytest.approx((3.5, 5.0))
    realized.observe_round(7, 1.0, 2, 2)  # two sequences: the sums discounted twice
    assert (realized.expected, realized.accepted) == pytest.approx((3.5 / 4 + 1, 5.0 / 4 + 2))
    realized.expected, realized.accepted = 3.5, 5.0
    realized.observe_round(1, 0.0, 0, 1)  # a round of 1 has no drafts past the first: a drift towards 1
    assert realized.accepted == pytest.approx(5.0 + 0.25 * (3.5 - 5.0))
    realized.observe_round(0, 0.0, 0, 0)  # an AR round: nothing
    assert realized.accepted == pytest.approx(5.0 + 0.25 * (3.5 - 5.0))
    with pytest.raises(ValueError, match="prior_drafts"):
        RealizedDrafts(prior_drafts=0.0)


def test_rounds_that_accept_less_deep_than_the_tracker_expects_make_shallower_ks_pay():
    """The tracker reads 0.8 at every position, but rounds accept half the drafts past the first
    that it makes them expect: where deep verifies cost more, the policy moves to a shallower k."""
    costs = _costs(lambda n, k: 1.0 + 0.025 * k, draft=0.2)
    policy = _policy(costs, [0.8] * (B - 1))
    assert policy.choose([None] * 8) == 15
    deep = expected_tokens([0.8] * (B - 2))
    for _ in range(50):
        policy.realized.observe_round(15, 8 * (deep[14] - 1), round(4 * (deep[14] - 1)), 8)
    assert policy.realized.factor == pytest.approx(0.5, abs=0.02)
    assert _choice_once_weighed(policy, [None] * 8) == 7
    # Where a deeper verify costs nothing more, the deepest k stays best: one factor serves every k.
    flat = _policy(_costs(lambda n, k: 1.0, draft=0.2), [0.8] * (B - 1))
    flat.realized.expected, flat.realized.accepted = policy.realized.expected, policy.realized.accepted
    assert flat.choose([None] * 8) == 15
    # Through the policy: drafts past the first of the sequences whose first was accepted, what
    # the tracker expected of them before it learns from the round.
    policy = _policy(costs, [0.8] * (B - 1))
    policy.observe_round(15, [15, 15, 15, 1], [3, 0, 1, 1])
    assert (policy.realized.expected, policy.realized.accepted) == pytest.approx(
        (0.99**2 * 8 + 2 * (deep[14] - 1), 0.99**2 * 8 + 2 + 0))


def test_rounds_taken_in_together_move_the_estimates_as_one_by_one():
    """The policy counts each round and takes rounds into its estimates when it reads them, or after
    WEIGH_ROUNDS rounds: the same trials, and the same estimates within a hair, but in the first
    rounds, where the prior's deep expectations last a few rounds longer."""
    rng = random.Random(0)
    one_by_one, together = _policy(_costs(lambda n, k: 1.0)), _policy(_costs(lambda n, k: 1.0))
    factors = set()
    for i in range(800):
        k = rng.choice((1, 3, 7, 15))
        accepted = [min(k, rng.choice((0, 0, 1, 2, 4, 15))) for _ in range(8)]
        one_by_one.observe_round(k, [k] * 8, accepted)
        factors.add(round(one_by_one.realized.factor, 3))  # read: taken in at once
        together.observe_round(k, [k] * 8, accepted)
        if i % WEIGH_ROUNDS == WEIGH_ROUNDS - 1:  # taken in by itself, unread
            assert together._unseen == {}
            assert together.tracker.trials == one_by_one.tracker.trials
            assert together.tracker.acceptance == pytest.approx(one_by_one.tracker.acceptance, abs=0.005)
            if i >= 40:
                assert together.realized.factor == pytest.approx(one_by_one.realized.factor, abs=0.02)
    assert len(factors) > 10  # the factor moved: the comparison means something


def test_the_realized_factor_weighs_sequences_not_rounds():
    """At batch 1 a round holds at most one sequence's deep drafts, and their count is heavy-tailed
    (T 1, humaneval on the H200: the first draft accepted in 44 % of rounds, then 0–14 more): the
    factor is discounted per sequence, so it averages as many at batch 1 as at batch 32. Discounted
    per round (0.05), it averaged ~9 at batch 1 and read 0.83 ± 0.20 where the tracker's positions
    were right; the policy went to AR steps when it read low (grid at 197b4c5: 0.22, 0.19, 0.01 at
    the end of a set)."""
    ge = [453, 208, 113, 67, 44, 27, 22, 17, 11, 8, 5, 4, 4, 4, 4]  # rounds of 1,028 with ≥ j drafts accepted
    policy = _policy(_costs(lambda n, k: 1.0 + 0.01 * k, draft=0.1))
    rng = random.Random(0)
    factors = []
    for i in range(4000):
        u = rng.random() * 1028
        policy.observe_round(15, [15], [sum(1 for g in ge if u < g)])
        if i >= 500:
            factors.append(policy.realized.factor)
    assert 0.9 < statistics.mean(factors) and statistics.pstdev(factors) < 0.1
    # A round of 8 sequences moves the sums as 8 rounds of one, each with the same drafts.
    one, eight = RealizedDrafts(), RealizedDrafts()
    for _ in range(8):
        one.observe_round(15, 1.5, 2, 1)
    eight.observe_round(15, 8 * 1.5, 8 * 2, 8)
    assert (eight.expected, eight.accepted) == pytest.approx((one.expected, one.accepted), rel=0.05)


def test_the_factor_scales_only_drafts_past_the_first():
    """With the first draft's acceptance at 0.5 and the rest at 1, a round of 3 expects 1 + 0.5 × 3
    tokens; a factor of 0.5 makes that 1 + 0.5 × (1 + 0.5 × 2) = 2, as a round of 1
    (1.5) at a cost that makes them tie sits just below."""
    costs = _costs(lambda n, k: {0: 1.0, 1: 1.2, 3: 1.65, 7: 100.0, 15: 100.0}[k])
    policy = _policy(costs, [0.5] + [1.0] * (B - 2))
    assert policy.choose([None]) == 3  # 2.5 / 1.65 against 1.5 / 1.2
    policy.realized.expected, policy.realized.accepted = 10.0, 5.0
    assert _choice_once_weighed(policy, [None]) == 1  # 2.0 / 1.65 = 1.21 < 1.25


def test_the_policy_learns_and_keeps_exploring_after_it_chose_ar():
    costs = _costs(lambda n, k: 1.0 + 0.05 * k, draft=0.3)
    policy = _policy(costs)
    assert policy.choose([None]) == 15  # the optimistic prior speculates at once
    chosen = []
    while not chosen or chosen[-1] > 0:  # a drafter whose drafts are always rejected
        chosen.append(policy.choose([None]))
        policy.observe_round(chosen[-1], [chosen[-1]], [0])
        assert len(chosen) < 500
    # AR rounds measure nothing; after a run of them a probe of the k the prior would choose (15),
    # two rounds long, as soon as what it is expected to lose against AR steps, at the estimates,
    # is within PROBE_BUDGET of their time: the estimates say speculating nearly pays, so soon.
    assert policy.rounds_between_probes(1, 15) < 30
    chosen = [0]
    for _ in range(20_000):
        k = policy.choose([None])
        chosen.append(k)
        policy.observe_round(k, [k], [0])
    runs = [(k, len(list(run))) for k, run in itertools.groupby(chosen)]
    assert {k for k, _ in runs} == {0, 15} and all(n == 2 for k, n in runs if k)
    # Each probe's rejections lower the first draft's estimate, so probes come later and later,
    # towards the 210 AR steps a probe's whole extra time (2 × 1.05 AR steps) would allow.
    ar_runs = [n for k, n in runs[:-1] if k == 0]
    assert ar_runs == sorted(ar_runs) and ar_runs[0] < 30 and 150 < ar_runs[-1] <= 210
    # Where every draft is rejected they cost ~1.2 % of the AR steps' time: the deep drafts' estimates stay
    # at the prior, never tried, and the first draft's comes down as a mean of its trials.
    late = chosen[5000:]
    assert sum(0.05 * k + 0.3 for k in late if k) <= 0.0125 * late.count(0)
    # The drafter recovers: the probes measure it, and the policy speculates again, beyond a probe.
    chosen = []
    while chosen[-PROBE_ROUNDS - 1:] != [15] * (PROBE_ROUNDS + 1):
        chosen.append(policy.choose([None]))
        policy.observe_round(chosen[-1], [chosen[-1]], [chosen[-1]])
        assert len(chosen) < 2000


def test_probes_that_cost_several_ar_steps_come_less_often():
    """Where nothing is accepted, a probe loses its whole extra time, kept within PROBE_BUDGET of
    the AR steps between probes: where a speculative round costs 2 AR steps at batch 8 (as on a
    CPU), a probe of two rounds comes after 200 AR steps; at batch 1, where it costs 1.125, after 25."""
    costs = _costs(lambda n, k: 1.0 + (n / 8 if k else 0.0), draft=0.0)  # an AR step: 1 s
    policy = _policy(costs)
    policy.tracker.acceptance = [0.0] * (B - 1)  # nothing accepted: AR, with a probe now and then
    assert policy.rounds_between_probes(8, 15) == math.ceil(PROBE_ROUNDS * (2.0 - 1.0) / PROBE_BUDGET) == 200
    assert policy.rounds_between_probes(1, 15) == math.ceil(PROBE_ROUNDS * 0.125 / PROBE_BUDGET) == 25
    chosen = [policy.choose([None] * 8) for _ in range(1000)]
    runs = [(k, len(list(run))) for k, run in itertools.groupby(chosen)]
    assert set(runs[:-1]) == {(0, 199), (15, 2)} and runs[0][0] == 0
    probes_extra_s, ar_s = chosen.count(15) * (2.0 - 1.0), chosen.count(0) * 1.0
    assert probes_extra_s <= PROBE_BUDGET * ar_s * 1.01  # 199 AR steps a probe: the probe's first round is the 200th choice


def test_probes_are_spaced_by_what_rounds_of_their_k_took():
    """The cost model has one wall factor for every k > 0: where rounds of k = 7 take what it
    predicts and a probe's round of k = 15 takes 2.4 AR steps for its predicted 1.25 (as a probe
    of k = 1 did on the CPU at batch 8), the probes are spaced by the 2.4 they take — every 280 AR
    steps, not 50 — and keep within PROBE_BUDGET; one stalled probe round moves their cost by at
    most OUTLIER_FACTOR."""
    costs = _costs(lambda n, k: 1.0 + 0.1 * (k > 0) + 0.01 * k, draft=0.0)
    policy = _policy(costs, [0.0] * (B - 1))  # nothing accepted: a probe loses its whole extra time
    for _ in range(100):  # speculative rounds of k = 7 took what the model predicts
        policy.observe_round_time(8, 7, costs.predicted_seconds(8, 7))
    assert policy.rounds_between_probes(8, 15) == 50  # the estimate: 2 × 0.25 extra AR steps
    wall = {0: 1.0, 15: 2.4}
    chosen = []
    for _ in range(6000):
        k = policy.choose([None] * 8)
        policy.observe_round_time(8, k, wall[k])
        chosen.append(k)
    assert set(chosen) == {0, 15}
    # The probes' slow rounds move the drift the AR steps share a little, until AR steps pull it back.
    assert policy.rounds_between_probes(8, 15) == pytest.approx(math.ceil(PROBE_ROUNDS * (2.4 - 1.0) / PROBE_BUDGET),
                                                                rel=0.02)
    # Measured within three probes (the model's shared factor, moved by 0.05 a round, would take tens).
    ar_runs = [len(list(run)) for k, run in itertools.groupby(chosen) if k == 0]
    assert ar_runs[0] == 49 and min(ar_runs[3:-1]) >= 250  # the probe is the 50th choice
    later = chosen[2000:]
    assert later.count(15) * (2.4 - 1.0) <= PROBE_BUDGET * later.count(0) * 1.08  # (the drift, above)
    measured = policy.rounds_between_probes(8, 15)
    policy.observe_round_time(8, 15, 100.0)  # outside a probe: the probe's cost is what probes took
    assert policy.rounds_between_probes(8, 15) == measured
    while policy.choose([None] * 8) != 15:
        pass
    policy.observe_round_time(8, 15, 100.0)  # a probe round stalled by a collection
    assert measured < policy.rounds_between_probes(8, 15) <= math.ceil(PROBE_ROUNDS * (2 * 2.4 - 1.0) / PROBE_BUDGET)


def test_probes_verify_the_k_the_prior_would_choose_at_the_batchs_size_and_caps():
    """A probe verifies what speculating would rely on: at batch 1, where a deep verify costs
    little more, every draft (k = 15); at batch 32, where each draft verified costs more, k = 3;
    a batch whose requests allow one draft, k = 1."""
    costs = _costs(lambda n, k: 1.0 + 0.02 * n * k, draft=0.2)
    for caps, probe in (([None], 15), ([None] * 32, 3), ([1, 1], 1)):
        policy = _policy(costs, [0.0] * (B - 1))  # nothing accepted: AR, but for the probes
        chosen = [policy.choose(caps) for _ in range(2000)]
        assert set(chosen) == {0, probe}, caps


def test_a_probe_of_every_draft_returns_the_policy_to_speculating_after_a_hard_set():
    """As on CPU at c = 1, T 0 after gsm8k's hard prompts (session 28's grid): the first draft
    reads 0.45, the realized factor 0.4, and an AR step (86 ms) beats a round of k = 15 (169 ms);
    the drafter now accepts 0.9 a draft. The first probe, of k = 15, measures the deep drafts
    and the factor, and the policy speculates from there on — where probes of k = 1 (152 ms),
    which teach only the first draft, kept it in AR steps for over 600 rounds."""
    costs = RoundCosts([1, 8], {0: [86.0, 90.0], 1: [152.0, 160.0], 3: [169.0, 180.0], 7: [169.0, 190.0],
                                15: [169.0, 200.0]}, [0.0, 0.0])
    policy = SpeculationPolicy(EngineConfig(target="t"), B, costs)
    policy.tracker.acceptance = [0.45, 0.52, 0.59, 0.81, 0.75, 0.79] + [0.8] * (B - 7)
    policy.tracker.trials = [10_000] * (B - 1)
    policy.realized.expected, policy.realized.accepted = 20.0, 8.0
    # The first probe comes once its expected loss at these estimates, two rounds of 169/86 AR steps
    # for 1.80 tokens each, is within PROBE_BUDGET of the AR steps' time.
    gain = 1 + 0.45 * (1 + policy.realized.factor * (expected_tokens(policy.tracker.acceptance[1:])[-1] - 1))
    assert gain == pytest.approx(1.80, abs=0.01)
    first_probe = policy.rounds_between_probes(1, 15) - 1
    assert first_probe == math.ceil(PROBE_ROUNDS * (169 / 86 - gain) / PROBE_BUDGET - 1e-9) - 1 == 33
    rng = random.Random(0)
    chosen = []
    for _ in range(1000):
        k = policy.choose([None])
        accepted = next((a for a in range(k) if rng.random() >= 0.9), k)
        policy.observe_round(k, [k], [accepted])
        policy.observe_round_time(1, k, {0: 86.0, 1: 152.0}.get(k, 169.0))
        chosen.append(k)
    assert chosen[:first_probe] == [0] * first_probe and set(chosen[first_probe:]) == {15}


def test_a_first_draft_estimate_under_the_break_even_is_probed_back_soon():
    """T 1 alpaca at c = 1 on the H200: a k = 15 round (1.167 ms) pays over an AR step (0.959) once
    the first draft is accepted in more than ~0.20 of rounds, and fixed B's were in 0.238. An estimate
    that the noise of its trials took to 0.14 is probed after 8 AR steps — each of its rounds is expected
    to lose ~0.03 AR steps — and the policy speculates in every round from round 500 on. Probes spaced
    by their extra time came every 64 AR steps, and 126 of those 1,000 rounds were AR steps."""
    ms = {0: 0.959, 1: 1.14, 3: 1.1498, 7: 1.1673, 15: 1.1673}  # the policy's costs at the end of that run
    policy = SpeculationPolicy(EngineConfig(target="t"), B, RoundCosts([1], {k: [v] for k, v in ms.items()}, [0.0]))
    policy.tracker.acceptance = [0.14, 0.21, 0.29, 0.4, 0.5] + [0.0] * (B - 6)  # fixed B: 0.238, then as here
    policy.tracker.trials = [10_000] * (B - 1)
    policy.realized.expected = policy.realized.accepted = 20.0
    assert policy.choose([None]) == 0 and policy.rounds_between_probes(1, 15) == policy.probe_interval == 8
    accepted_at = [245, 51, 15, 6, 3]  # fixed B's rounds (of 1,028) that accepted draft j
    rng = random.Random(0)
    chosen = []
    for _ in range(1500):
        k = policy.choose([None])
        u = rng.random() * 1028
        policy.observe_round(k, [k], [min(k, sum(u < g for g in accepted_at))])
        policy.observe_round_time(1, k, ms[k])
        chosen.append(k)
    assert 0 not in chosen[500:]


def test_no_probes_where_no_acceptance_could_make_speculation_pay():
    costs = _costs(lambda n, k: 1.0 + n * k, draft=5.0)  # drafting costs 5 AR steps
    policy = _policy(costs)
    assert {policy.choose([None] * 8) for _ in range(1000)} == {0}


def test_wall_times_of_rounds_correct_the_start_up_costs():
    """Start-up replays time only the forwards: here a speculative round looks as cheap as an AR
    step, but its host work and sampling make it take three times as long. Once rounds of both
    kinds are observed, the policy decodes AR at an acceptance where drafts cannot pay for that."""
    costs = _costs(lambda n, k: 1.0, draft=0.0)
    policy = _policy(costs, [0.5] * (B - 1))
    assert policy.choose([None] * 8) == 15  # never observed: the prediction
    wall = lambda k: 3.0 if k else 1.0  # noqa: E731
    chosen = []
    for _ in range(2000):  # a speculative round's time corrects every k > 0; AR, once unmeasured, is tried
        k = policy.choose([None] * 8)
        policy.observe_round_time(8, k, wall(k))
        chosen.append(k)
    assert set(chosen) == {0, 15}
    # E[tokens] of any k at 0.5 is ≤ 2, for up to 3× the time (as far as the moving average has
    # learnt): AR, but for a probe of two rounds, each expected to lose about an AR step, so every
    # ~200 AR steps (PROBE_BUDGET)
    assert 150 < policy.rounds_between_probes(8, 15) <= 210
    assert set(chosen[-500:]) == {0, 15} and chosen[-500:].count(15) <= 6
    assert 2.4 < costs.round_seconds(8, 15) <= 3.0  # a moving average, fed by the rounds speculated
    assert costs.round_seconds(8, 0) == pytest.approx(1.0)
    # Another batch size keeps its own correction (none yet: the prediction).
    assert costs.round_seconds(32, 15) == pytest.approx(1.0)


def test_wall_times_are_averaged_from_the_prediction_and_ignored_by_fixed_speculation():
    costs = _costs(lambda n, k: 2.0)
    costs.observe_round(1, 7, 4.0)
    costs.observe_round(1, 7, 2.0)
    # The prediction (factor 1) counts as PRIOR_ROUNDS rounds; 4 s is capped at twice the estimate (2), then 1
    factor = 1 + 1 / (PRIOR_ROUNDS + 1)
    assert costs.round_seconds(1, 7) == pytest.approx(2.0 * (factor + (1.0 - factor) / (PRIOR_ROUNDS + 2)))
    assert costs.round_seconds(1, 3) == costs.round_seconds(1, 7)  # one factor for every k > 0
    assert costs.round_seconds(1, 0) == 2.0  # AR steps keep their own
    fixed = _policy(_costs(lambda n, k: 2.0), speculation="fixed")
    fixed.observe_round_time(1, 7, 100.0)
    assert fixed.costs.wall_factor.base == {}


def test_where_the_host_takes_longer_than_the_device_every_k_costs_the_host_time():
    """Chained rounds on the H100 at batch 32: the device's verify grows with k (k = 3 at 1.5 ms,
    k = 15 at 1.8), the host's ~2 ms a round does not, and a round takes the longer of the two.
    The device's differences, scaled by a wall factor, made deep ks look dear and the policy chose
    k = 3 where k = 15 returned more tokens in the same time; bounded by the host's time they
    vanish, and the policy verifies what returns the most. Unchained rounds (a CPU) give no host
    time: the prediction alone, as before."""
    device = lambda n, k: 1.5e-3 if k <= 3 else (1.6e-3 if k == 7 else 1.8e-3)  # noqa: E731
    acceptance = [0.5, 0.5, 0.5, 0.55, 0.6, 0.6, 0.6] + [0.9] * (B - 8)
    chained, unchained = _policy(_costs(device), acceptance), _policy(_costs(device), acceptance)
    for _ in range(200):
        for k in chained.ks:  # each k keeps its own host time
            chained.observe_round_time(32, k, 2.1e-3, host_seconds=2.0e-3)
        for k in (3, 15):
            unchained.observe_round_time(32, k, 2.1e-3 if k == 3 else 2.2e-3)
    costs = chained.costs
    # (What is left of each k's start after 200 rounds: the first, AR steps', at the device's 1.5 ms.)
    assert costs.round_seconds(32, 3) == pytest.approx(costs.round_seconds(32, 15), rel=5e-3)
    assert costs.round_seconds(32, 15) == pytest.approx(2.1e-3, rel=0.01)
    assert costs.host.get((3, 2)) == pytest.approx(2.0e-3, rel=5e-3)
    assert costs.host.get((15, 2)) == pytest.approx(2.0e-3, rel=5e-3)
    assert chained.choose([None] * 32) == 15
    assert unchained.costs.host.base == {} and unchained.choose([None] * 32) < 15  # the device's differences, scaled
    # Where the device takes longer than the host, it is the device's time that counts.
    costs.observe_round(32, 15, 2.1e-3, host_seconds=1.0e-3)
    assert 1.9e-3 < costs.host.get((15, 2)) < 1.95e-3  # a moving average (its own 1 %, the drift's 5 %)
    slow = _costs(lambda n, k: 4e-3)
    slow.observe_round(32, 15, 4.0e-3, host_seconds=1.0e-3)
    assert slow.round_seconds(32, 15) == pytest.approx(4.0e-3)
    # The host's time starts from the device's prediction and moves by a capped moving average:
    # one stalled round (50 ms here) cannot make speculation look dear for good.
    fresh = _costs(device)
    fresh.observe_round(32, 3, 1.5e-3, host_seconds=50e-3)
    assert fresh.host.get((3, 2)) == pytest.approx(1.5e-3 * (1 + 1 / (PRIOR_ROUNDS + 1)))  # the prior, as rounds


def test_each_k_is_bounded_by_its_own_host_time():
    """The H100 at batch 32, T 1 on alpaca: rounds of k = 3 cost the host what AR steps did, deep
    ones ~0.2 ms more, and one host average for every k > 0, learnt from the deep rounds chosen,
    priced k = 3 as dear as k = 15 — every round at k = 3 ran 1.12–1.21 × AR where the policy
    verified ~10 drafts a sequence-round at 0.85–0.92 of it. Each k keeps its own host time; one
    not chosen yet takes an AR step's, so that it is tried, and a first observation moves on from
    there, not from the device's cheaper prediction."""
    costs = _costs(lambda n, k: 1.0e-3 + 0.02e-3 * k)
    for _ in range(400):  # (the start's prior counts as PRIOR_ROUNDS of them)
        costs.observe_round(32, 0, 1.9e-3, host_seconds=1.8e-3)
        costs.observe_round(32, 15, 2.3e-3, host_seconds=2.2e-3)
    ar_host, deep_host = costs.host.get((0, 2)), costs.host.get((15, 2))
    assert ar_host == pytest.approx(1.8e-3, rel=1e-3) and deep_host == pytest.approx(2.2e-3, rel=1e-3)
    assert 3 not in {k for k, _ in costs.host.base}
    factor = costs.wall_factor.get((True, 2))
    assert costs.round_seconds(32, 3) == pytest.approx(ar_host * factor)  # an AR step's host time
    assert costs.round_seconds(32, 15) == pytest.approx(deep_host * factor)
    costs.observe_round(32, 3, 2.0e-3, host_seconds=1.9e-3)
    assert costs.host.get((3, 2)) == pytest.approx(ar_host + (1.9e-3 - ar_host) / (PRIOR_ROUNDS + 1))  # from AR's
    assert costs.host.get((0, 2)) == ar_host and costs.host.get((15, 2)) == deep_host  # a new k moves no drift


def test_a_policy_that_chose_deep_rounds_moves_to_the_shallow_k_that_costs_the_host_less():
    """The H100 at batch 32, T 1 on alpaca, traced (BENCHMARKS, twenty-fourth session): a process
    whose one host average for every k > 0 came from its rounds of k = 15 (2.0 ms of host against
    AR's 1.41 and k = 3's 1.53) priced every k > 0 alike: 941 of its 1,093 rounds at batch 32 were
    AR steps or k = 15, and it ran 0.85 × AR. With those host times per k and that acceptance, the
    policy leaves both for the shallow ks once it has tried them (one host time for every k > 0
    settles on AR steps here)."""
    host = {0: 1.41e-3, 1: 1.65e-3, 3: 1.53e-3, 7: 1.56e-3, 15: 2.0e-3}
    acceptance = [0.2, 0.18, 0.29, 0.59, 0.64, 0.73, 0.8] + [0.9] * (B - 8)
    policy = _policy(_costs(lambda n, k: 1.0e-3 + 0.02e-3 * k), acceptance)
    for k in (0, 15) * 100:  # what that process had learnt
        policy.observe_round_time(32, k, 1.07 * host[k], host_seconds=host[k])
    chosen = []
    for _ in range(300):
        k = policy.choose([None] * 32)
        policy.observe_round_time(32, k, 1.07 * host[k], host_seconds=host[k])
        chosen.append(k)
    last = collections.Counter(chosen[-100:])
    assert 15 not in last and last[3] + last[7] >= 90, last


def test_a_kind_the_policy_stopped_choosing_follows_the_hosts_speed():
    """The H200 at batch 32, T 1 on alpaca over 14 passes (BENCHMARKS, thirty-second session): AR
    steps last measured in a slow pass kept 1.22 ms of host (× 1.10 wall) for twelve passes while
    the host sped up under rounds of k = 3; the policy read AR steps at 1.35 ms where its own took
    ~1.0, verified k = 3 (1.26 tokens a sequence-round for ~1.4 ms) in 96 % of the rounds and ran
    0.95 × AR. Host times share one drift: what the rounds of k = 3 show of the host's speed moves
    AR steps' estimate too, and the policy returns to them."""
    acceptance = [0.2, 0.2, 0.3] + [0.1] * (B - 4)  # a round of k = 3: 1.25 tokens a sequence
    policy = _policy(_costs(lambda n, k: 0.9e-3, ks=(0, 3)), acceptance)  # the two kinds the trace chose
    host = {0: 1.0e-3, 3: 1.4e-3}  # at the host's speed 1; each round's wall time 2 % over its host's

    def rounds(k, count, speed):
        for _ in range(count):
            policy.observe_round_time(32, k, 1.02 * speed * host[k], host_seconds=speed * host[k])

    for _ in range(100):  # a slow pass: both kinds measured
        rounds(0, 2, 1.3)
        rounds(3, 2, 1.3)
    assert policy.choose([None] * 32) == 0
    rounds(3, 300, 1.0)  # the host speeds up while the policy speculates (a probe, an acceptance high for a while)
    assert policy.costs.round_seconds(32, 0) == pytest.approx(1.02 * host[0], rel=0.03)
    assert policy.choose([None] * 32) == 0
    # Each kind's own difference stays its own: k = 3 still costs 1.4 AR steps.
    assert policy.costs.round_seconds(32, 3) / policy.costs.round_seconds(32, 0) == pytest.approx(1.4, rel=0.03)


def test_the_wall_factor_of_chained_rounds_does_not_count_the_host_averages_lag():
    """The H100 at batch 32, AR steps of T 1 on alpaca: each took 2.19 ms of wall time, 1.94 of it
    the host's, against 0.99 predicted for the device. The host's moving average starts at the
    device's prediction; a wall factor learnt against that average while it climbed kept its gap
    (1.36 after 47 rounds) on top of it, and the model read 2.64 ms for a 2.19 ms step. Against
    each round's own host time every ratio is 2.19 / 1.94 from the first round: the estimate climbs
    to the wall time and never past it."""
    costs = _costs(lambda n, k: 0.99e-3)
    wall, host = 2.19e-3, 1.94e-3
    seen = []
    for _ in range(200):
        costs.observe_round(32, 0, wall, host_seconds=host)
        seen.append(costs.round_seconds(32, 0))
    assert max(seen) <= wall * (1 + 1e-9)
    assert seen[46] > 0.9 * wall and seen[-1] == pytest.approx(wall, rel=0.01)
    assert costs.wall_factor.get((False, 2)) == pytest.approx(wall / host, rel=3e-3)  # (the prior 1, as rounds)
    # A round that ran alone gives no host time: its wall over the host's estimate, as before (1 % of the
    # error to the kind's own factor, 5 % of the rest to the drift).
    before = costs.wall_factor.get((False, 2))
    gap = 1.5 * wall / costs.host.get((0, 2)) - before
    costs.observe_round(32, 0, 1.5 * wall)
    assert before + 0.05 * gap < costs.wall_factor.get((False, 2)) < before + 0.06 * gap


def test_the_policy_state_is_bounded_however_long_it_runs():
    policy = _policy(_costs(lambda n, k: 1.0 + 0.1 * k, draft=0.1))
    sizes = lambda: {name: len(value) for name, value in vars(policy.tracker).items() if isinstance(value, list)}  # noqa: E731
    before = sizes()
    for i in range(20000):
        k = policy.choose([None] * (1 + i % 8))
        policy.observe_round(k, [k] * (1 + i % 8), [i % (k + 1)] * (1 + i % 8))
    assert sizes() == before == {"acceptance": B - 1, "trials": B - 1}
    assert all(0.0 <= p <= 1.0 for p in policy.tracker.acceptance)


def test_config_validation_names_the_bad_value():
    with pytest.raises(ValueError, match="speculation='dynamic'"):
        EngineConfig(target="t", speculation="dynamic")
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
        EngineConfig(target="t", num_speculative_tokens_per_batch_size={0: 3})
    with pytest.raises(ValueError, match="num_speculative_tokens_per_batch_size"):
        EngineConfig(target="t", num_speculative_tokens_per_batch_size={4: -1})
    EngineConfig(target="t", num_speculative_tokens_per_batch_size={"1": 15, 8: 0})
