"""Rounds that verify k of the B−1 drafts (issue 16): lossless for every k, forced or chosen.

Forced k goes through the static table (EngineConfig.num_speculative_tokens_per_batch_size);
a k that changes every round is forced by replacing the policy's choice; the adaptive policy runs
on costs the engine measures. Greedy and seeded sampling requests share each batch; the
reference is target-only decoding (plain transformers for greedy, the target-only engine for
seeded sampling, whose draws are keyed by position and so independent of speculation).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import types

import pytest
import torch

from dflash_serve.services.engine import prefill as prefill_module
from dflash_serve.services.engine import round as round_module
from dflash_serve.services.engine.round_costs import COST_CONTEXT, RoundCosts
from dflash_serve.services.engine.sampling_params import SamplingParams
from tests.conftest import drafter_config, random_drafter
from tests.engine.harness import (
    OracleProposer,
    assert_draft_context_is_committed_rows,
    build_engine,
    hf_greedy,
)
from tests.targets import tiny_target

V, B = 64, 6


@pytest.fixture(scope="module")
def pair():
    target = tiny_target("qwen3", layers=4, vocab=V, seed=21).float()
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=4, num_hidden_layers=2,
                         layer_types=["full_attention"] * 2, dflash_config={"mask_token_id": V - 1, "target_layer_ids": [1, 3]})
    return target, random_drafter(cfg, seed=4, dtype=torch.float32)


PROMPTS = [[1, 2, 3], list(range(10, 31)), [7, 9, 11, 13, 5, 6]]
MAX_TOKENS = 24


def _params():
    """One greedy request and two seeded sampling ones in the same batch."""
    return [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
            SamplingParams(temperature=1.0, seed=11, max_tokens=MAX_TOKENS),
            SamplingParams(temperature=0.8, top_k=10, seed=12, max_tokens=MAX_TOKENS)]


@pytest.fixture(scope="module")
def references(pair):
    target, _ = pair
    return [s.output_ids for s in build_engine(target).generate(PROMPTS, _params())]


def _check_lossless(engine, done, references, target):
    assert [s.output_ids for s in done] == references
    assert references[0] == hf_greedy(target, PROMPTS[0], MAX_TOKENS)
    assert engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("k", range(B))
def test_every_forced_k_is_lossless_and_counts_only_verified_drafts(pair, references, k):
    target, drafter = pair
    engine = build_engine(target, drafter=drafter, spec_table={1: k})
    done = engine.generate(PROMPTS, _params())
    _check_lossless(engine, done, references, target)
    records = list(engine.round_log)
    assert records and {r.k for r in records} == {k}
    assert all(r.draft_tokens == [k] * len(r.accepted) and max(r.accepted) <= k for r in records)
    for seq in done:  # τ and acceptance count verified drafts: k per round, none in an AR round
        assert seq.stats.draft_tokens == k * seq.stats.rounds
        assert seq.stats.rounds > 0 if k else seq.stats.rounds == 0
        assert len(seq.stats.accepted_per_position) == k


def test_a_k_changing_every_round_is_lossless_and_the_drafters_context_stays_exact(pair, references):
    """k cycles through 0..B−1 in a mixed order, so rounds (chained ones too: the suite runs both
    loops) follow rounds of another k
    (and AR rounds, which draft nothing, follow drafted ones); the drafter's paged context holds
    exactly the committed rows after every step where no AR step's rows wait (`Engine.defer_context`:
    they do after an AR step, and go in before the next round drafts)."""
    target, drafter = pair
    engine = build_engine(target, drafter=drafter)
    order = itertools.cycle([3, 0, 5, 1, 0, 4, 2, 5, 0])
    engine.speculation.choose = lambda caps, context: next(order)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, _params(), strict=True)]
    checked = 0
    while engine.has_unfinished():
        engine.step()
        if engine._deferred:
            continue
        checked += 1
        for rid in ids:
            seq = engine.sequences[rid]
            if seq.block_table and not seq.is_prefilling:
                assert_draft_context_is_committed_rows(engine.proposer, seq, engine.allocator.block_size)
    assert checked >= len(engine.round_log) * 2 // 3  # every round but the AR steps' (3 of 9)
    done = [engine.sequences.pop(i) for i in ids]
    _check_lossless(engine, done, references, target)
    assert {r.k for r in engine.round_log} == set(range(B))


def test_the_adaptive_policy_is_lossless_on_measured_costs(pair, references):
    target, drafter = pair
    engine = build_engine(target, drafter=drafter, speculation="adaptive")
    costs = engine.speculation.costs
    assert costs is not None and costs.measured_draft
    assert costs.ks == engine.speculation.ks == (0, 1, 3, 5)
    assert costs.batch_sizes == [1, 4, 8]  # eager: 1, 4, max_num_seqs / 2 (4 here) and max_num_seqs, interpolated between
    assert all(s > 0 for k in costs.ks for s in costs.verify[k])
    # Timed at COST_CONTEXT and again (k = 0 and the draft) at NEAR_COST_CONTEXT: a slope per size.
    assert costs.context == COST_CONTEXT and len(costs.verify_slope) == len(costs.draft_slope) == 3
    assert all(s >= 0 for s in costs.verify_slope + costs.draft_slope)
    contexts = []
    choose = engine.speculation.choose
    engine.speculation.choose = lambda caps, context: contexts.append((len(caps), context)) or choose(caps, context)
    done = engine.generate(PROMPTS, _params())
    _check_lossless(engine, done, references, target)
    ks = {r.k for r in engine.round_log}
    assert ks <= set(costs.ks)
    # Whether drafting pays on this CPU's measured costs varies; where a round drafted, the
    # untrained drafter's acceptance was measured.
    assert (max(ks) > 0) == (engine.speculation.tracker.trials[0] > 0)
    # Each round is costed at its batch's mean position: the prompts' mean length, then growing
    # by what rounds commit while the three decode together (then the requests left).
    assert contexts[0] == (3, sum(map(len, PROMPTS)) / 3)
    together = [c for n, c in contexts if n == 3]
    assert len(together) > 1 and together == sorted(together) and together[-1] < together[0] + MAX_TOKENS


def test_costs_are_measured_for_a_batch_of_one(pair, references):
    """max_num_seqs 1 (`dflash bench --concurrency 1` sizes the engine so): half the largest
    batch is 0, which is no batch to time — the engine failed at start-up on CPU."""
    target, drafter = pair
    engine = build_engine(target, drafter=drafter, speculation="adaptive", max_num_seqs=1)
    assert engine.speculation.costs.batch_sizes == [1]
    done = engine.generate(PROMPTS, _params())
    _check_lossless(engine, done, references, target)


def test_adaptive_rounds_follow_load_and_acceptance_with_known_costs(pair):
    """With costs that make deep rounds pay at batch 1 but not at batch 8, an oracle accepting
    everything gets k = B−1 alone and AR in a full batch; the output is the target's throughout."""
    target, _ = pair
    prompts = [[3 + i, 5, 8 + i] for i in range(8)]
    refs = {f"a{i}": p + hf_greedy(target, p, 30 + B) for i, p in enumerate(prompts)}
    oracle = OracleProposer(B, V, {**refs, "solo": refs["a0"]}, {rid: [B - 1] for rid in [*refs, "solo"]})
    engine = build_engine(target, proposer=oracle, speculation="adaptive")
    engine.speculation.costs = RoundCosts([1, 8], {k: [1.0 + 0.01 * k, 1.0 + 2.0 * k] for k in (0, 1, 3, 5)},
                                          [0.1, 0.5])
    engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=30), "solo")
    while engine.has_unfinished():
        engine.step()
    engine.drain()
    assert {r.k for r in engine.round_log} == {B - 1}
    engine.round_log.clear()
    params = SamplingParams(temperature=0.0, max_tokens=12)
    ids = [engine.add_request(p, params, rid) for p, rid in zip(prompts, refs, strict=True)]
    while engine.has_unfinished():
        engine.step()
    assert 0 in {r.k for r in engine.round_log if len(r.accepted) == 8}
    assert engine.sequences["solo"].output_ids == refs["a0"][3:33]
    for rid, p in zip(ids, prompts, strict=True):
        assert engine.sequences[rid].output_ids == refs[rid][len(p):len(p) + 12]


def test_requests_that_limit_or_opt_out_of_speculation_verify_only_that(pair, references):
    target, drafter = pair
    engine = build_engine(target, drafter=drafter)  # fixed: B−1 drafts for those that allow them
    limits = [None, 0, 2]
    params = [dataclasses.replace(sp, num_speculative_tokens=c) for sp, c in zip(_params(), limits, strict=True)]
    done = engine.generate(PROMPTS, params)
    _check_lossless(engine, done, references, target)
    free, opted_out, capped = (s.stats for s in done)
    assert free.draft_tokens == (B - 1) * free.rounds > 0
    assert opted_out.rounds == opted_out.draft_tokens == 0
    assert capped.draft_tokens == 2 * capped.rounds > 0 and len(capped.accepted_per_position) == 2
    full_batch = [r for r in engine.round_log if len(r.accepted) == 3]
    assert full_batch and all(r.k == B - 1 and r.draft_tokens == [B - 1, 0, 2] for r in full_batch)
    assert all(r.accepted[1] == 0 and r.accepted[2] <= 2 for r in full_batch)
    # A batch of opted-out requests alone decodes AR: nothing drafted at all.
    engine.drain()  # a chained round launched after the last one, dropped unread
    engine.round_log.clear()
    engine.generate([PROMPTS[0]], [params[1]])
    assert {r.k for r in engine.round_log} == {0}


def test_forced_k_with_prefix_cache_hits_across_turns(pair):
    """A second turn hits the first's cached blocks (target and drafter rows) and runs rounds of
    every k: the same output as a dense engine without caching."""
    target, drafter = pair
    cached = build_engine(target, drafter=drafter)
    dense = build_engine(target, drafter=drafter, enable_prefix_caching=False)
    for engine in (cached, dense):
        order = itertools.cycle([2, 0, 5, 1])
        engine.speculation.choose = lambda caps, context, order=order: next(order)
    params = SamplingParams(temperature=0.0, max_tokens=14)
    history = []
    for user in ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 9, 7, 9, 3]):
        prompt = history + user
        (hit,) = cached.generate([prompt], params)
        (full,) = dense.generate([prompt], params)
        assert hit.output_ids == full.output_ids == hf_greedy(target, prompt, 14)
        history = prompt + hit.output_ids
    assert cached.scheduler.prefix_cache_hits > 0
    assert cached.allocator.num_free == cached.allocator.num_blocks


def fake_perf_counter(monkeypatch, clock: list[float]) -> None:
    """The engine's round and prefill timings read `clock[0]` for perf_counter (monotonic stays real)."""
    fake = types.SimpleNamespace(perf_counter=lambda: clock[0], monotonic=time.monotonic)
    for module in (round_module, prefill_module):
        monkeypatch.setattr(module, "time", fake)


def test_the_host_seconds_of_chained_rounds_reach_the_policy(pair, chain_rounds, monkeypatch):
    """A chained round's host time — its launch (choosing k takes 0.25 s on this fake clock) and
    its finish (committing takes 0.5 s) — goes to the policy with its wall time; a round that ran
    alone gives none (`RoundCosts`: the device waited for nothing the host did)."""
    target, drafter = pair
    clock = [0.0]
    fake_perf_counter(monkeypatch, clock)
    # The adaptive policy, its k set by the table: only an adaptive policy is given round times.
    engine = build_engine(target, drafter=drafter, speculation="adaptive", spec_table={1: 3})
    choose_k, commit = engine._choose_k, engine._commit
    engine._choose_k = lambda seqs: clock.__setitem__(0, clock[0] + 0.25) or choose_k(seqs)
    engine._commit = lambda seq, tokens: clock.__setitem__(0, clock[0] + 0.5) or commit(seq, tokens)
    observed = []
    engine.speculation.observe_round_time = lambda n, k, seconds, context, host: observed.append(host)
    launched, launch = [], engine._launch_round
    engine._launch_round = lambda *a: launched.append(launch(*a)) or launched[-1]
    engine.generate([[1, 2, 3]], [SamplingParams(temperature=0.0, max_tokens=12)])
    assert observed and any(r.chained for r in launched) == chain_rounds
    assert set(observed) == ({0.0, 0.75} if chain_rounds else {0.0})
    # One sequence: one commit a round (the last round of a chain, launched as the request ended, commits nothing).
    assert {r.host_seconds for r in launched[:-1]} == {0.75}


def test_a_rounds_time_is_given_at_its_sequences_position_after_its_commit(pair):
    """`_finish_round` sums the positions as it commits: the context a round's wall time comes with
    is where its sequence is once that round's tokens are in, every round a little further."""
    target, drafter = pair
    engine = build_engine(target, drafter=drafter, speculation="adaptive", spec_table={1: 3})
    observed = []

    def observe(n, k, seconds, context, host):
        (seq,) = engine.sequences.values()
        observed.append((context, seq.num_cached))

    engine.speculation.observe_round_time = observe
    engine.generate([[1, 2, 3]], [SamplingParams(temperature=0.0, max_tokens=14)])
    assert len(observed) >= 3
    assert all(context == cached for context, cached in observed)
    assert [c for c, _ in observed] == sorted({c for c, _ in observed})


def test_round_wall_times_hold_batch_changes_and_prefills_but_not_the_loops_waits(pair, chain_rounds, monkeypatch):
    """The policy weighs each k by the wall time its rounds add to the loop: from the later of a
    round's launch and the last round's read, to its read — every round, the batch's changes and
    the prefills read with it included (at c = 32 most rounds are at batch changes). On a fake
    clock where a prefill takes 1000 s and launching a round 1 s: a round in flight across a
    prefill holds it; a round launched alone holds its own launch (and, chained, the next one's); the
    timings' sums are what the policy was given. A round still in flight when its only request
    ended is neither: the loop waited (10⁶ s here) before reading it."""
    target, drafter = pair
    clock = [0.0]
    fake_perf_counter(monkeypatch, clock)

    def engine_on_the_clock(choose=None, max_num_seqs=8):
        engine = build_engine(target, drafter=drafter, speculation="adaptive", spec_table={1: 3},
                              max_num_seqs=max_num_seqs)  # only an adaptive policy is given round times
        prefill, launch = engine._prefill, engine._launch_round
        engine._prefill = lambda *a: clock.__setitem__(0, clock[0] + 1000) or prefill(*a)
        engine._launch_round = lambda *a: (launch(*a), clock.__setitem__(0, clock[0] + 1))[0]  # after its start
        if choose is not None:
            engine.speculation.choose = choose
        observed, contexts = [], []
        engine.speculation.observe_round_time = lambda n, k, seconds, context, host: (
            observed.append((n, k, seconds)), contexts.append(context))
        return engine, observed, contexts

    engine, observed, contexts = engine_on_the_clock()
    engine.generate([[1, 2, 3], [7, 9, 11]], [SamplingParams(temperature=0.0, max_tokens=m) for m in (4, 14)])
    assert (1, 3, 1.0) in observed  # the second request's rounds once the first ended
    assert observed[0] == (2, 3, 2.0 if chain_rounds else 1.0)  # chained: its launch and the next one's
    tm = engine.timings
    assert tm.period_rounds_by_k == {3: len(observed)}
    assert tm.period_by_k[3] == pytest.approx(sum(seconds for _, _, seconds in observed))
    assert tm.period_context == pytest.approx(sum(contexts)) and min(contexts) > 0  # what the bench reports at

    engine, observed, _ = engine_on_the_clock(max_num_seqs=2)
    engine.generate([[1, 2, 3], [7, 9, 11], [4, 5, 6]], [SamplingParams(temperature=0.0, max_tokens=m) for m in (4, 14, 6)])
    # Chained, the third request's prefill, when it joined the second's batch, is in the period of the round in
    # flight across it; synced, no round runs across a prefill.
    assert sum(seconds >= 1000 for _, _, seconds in observed) == (1 if chain_rounds else 0)

    engine, observed, _ = engine_on_the_clock()
    engine.generate([[1, 2, 3]], [SamplingParams(temperature=0.0, max_tokens=5)])
    clock[0] += 1e6  # no request: the loop waits
    engine.generate([[7, 9, 11]], [SamplingParams(temperature=0.0, max_tokens=5)])
    assert observed and all(seconds < 1e6 for _, _, seconds in observed)
    assert max(engine.timings.period_by_k.values()) < 1e6

    order = itertools.cycle([3, 0])  # rounds of either k, each holding the launch of the other's
    engine, observed, _ = engine_on_the_clock(choose=lambda caps, context: next(order))
    engine.generate([[1, 2, 3]], [SamplingParams(temperature=0.0, max_tokens=12)])
    assert {k for _, k, _ in observed} == {0, 3}
