"""Prefix caching: full blocks of committed tokens shared between requests and kept after they
finish. Outputs are the same with and without it (greedy and seeded), hit counts are what the
block arithmetic says, no write ever reaches a shared block, the drafter's context after a hit is
the dense recomputation's, and under memory pressure nothing leaks."""

from __future__ import annotations

import itertools

import pytest
import torch

from dflash_serve.services.engine.draft_runner import DraftRunner
from dflash_serve.services.engine.round import MAX_DEFERRED_STEPS
from dflash_serve.services.engine.kv_cache import BlockAllocator, hash_block_tokens
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.stopping import FinishReason
from tests.conftest import drafter_config, random_drafter
from tests.engine.harness import (
    OracleProposer,
    assert_draft_context_is_committed_rows,
    assert_no_write_can_reach_a_shared_block,
    build_engine,
    hf_greedy,
)
from tests.targets import tiny_target

V, B, KV = 96, 4, 4  # vocabulary, draft block (3 drafts), tokens per KV block


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4, vocab=V, seed=21).float()


@pytest.fixture(scope="module")
def drafter():
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=4, num_hidden_layers=2,
                         layer_types=["full_attention"] * 2, dflash_config={"mask_token_id": V - 1, "target_layer_ids": [0, 2]})
    return random_drafter(cfg, seed=5, dtype=torch.float32)


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V - 1, (n,), generator=g).tolist()


def _assert_all_blocks_free(engine):
    alloc = engine.allocator
    assert alloc.num_free == alloc.num_blocks
    assert all(alloc.refs(b) == 0 for b in range(alloc.num_blocks))


def _run(engine, checks=()):
    while engine.has_unfinished():
        engine.step()
        for check in checks:
            check(engine)


def test_allocator_shares_registered_blocks_and_evicts_the_least_recently_released():
    alloc = BlockAllocator(4, 2)
    first = hash_block_tokens(b"", [1, 2])
    keys = [first, hash_block_tokens(first, [3, 4])]
    assert hash_block_tokens(b"", [3, 4]) != keys[1]  # a key names the whole prefix, not one block
    a: list[int] = []
    alloc.grow(a, 5)
    assert alloc.register(a[0], keys[0]) and alloc.register(a[1], keys[1])
    assert not alloc.register(a[2], keys[0])  # the key is cached in another block: this one stays private
    b = alloc.cached_prefix(keys + [hash_block_tokens(keys[1], [5, 6])])
    assert b == a[:2] and alloc.refs(a[0]) == alloc.refs(a[1]) == 2
    alloc.release(list(a))
    assert alloc.num_free == 2 and alloc.refs(a[0]) == 1  # the shared ones are still held by b
    alloc.release(b)
    assert alloc.num_free == 4 and alloc.num_cached_blocks == 2 and alloc.usage == 0.0
    c: list[int] = []
    alloc.grow(c, 4)  # never-registered blocks go first
    assert a[0] not in c and a[1] not in c and alloc.num_cached_blocks == 2
    alloc.grow(c, 6)  # then the least recently released: the tail of a released prefix first
    assert c[2] == a[1] and alloc.num_cached_blocks == 1
    assert alloc.cached_prefix(keys) == [a[0]]
    alloc.release(c)
    with pytest.raises(RuntimeError, match="released more often than taken"):
        alloc.release([a[1]])
    alloc.release([a[0]])
    alloc.reset_prefix_cache()
    assert alloc.num_cached_blocks == 0 and alloc.num_free == 4 and alloc.cached_prefix(keys) == []
    with pytest.raises(ValueError, match="not held"):
        alloc.register(a[0], keys[0])


def _committed_with_kv(prompt_len: int, max_tokens: int, speculative: bool) -> int:
    """Positions whose tokens and K/V a finished request leaves behind, when every draft is
    accepted: the last token has K/V only when the final round verified it as a draft, i.e. when
    that round's block was cut short by max_tokens (AR rounds never verify a token after the bonus)."""
    n = prompt_len + max_tokens
    return n if speculative and (max_tokens - 1) % B else n - 1


@pytest.mark.parametrize("mode", ["ar", "speculative"])
def test_multi_turn_conversation_hits_its_whole_history_exactly_and_stays_lossless(target, mode):
    turns, max_tokens = [_tokens(11, 1), _tokens(3, 2), _tokens(6, 3)], [9, 10, 13]
    prompts, expected_hits, history = [], [], []
    for k, (user, m) in enumerate(zip(turns, max_tokens, strict=True)):
        prompt = history + user
        prompts.append(prompt)
        if k:
            previous = prompts[k - 1]
            committed = _committed_with_kv(len(previous), max_tokens[k - 1], mode == "speculative")
            expected_hits.append(min(committed, len(prompt) - 1) // KV * KV)
        else:
            expected_hits.append(0)
        history = prompt + hf_greedy(target, prompt, m)
    refs = {f"t{k}": p + hf_greedy(target, p, m + B) for k, (p, m) in enumerate(zip(prompts, max_tokens, strict=True))}

    for caching in (True, False):
        proposer = OracleProposer(B, V, refs, {rid: [B - 1] for rid in refs}) if mode == "speculative" else None
        engine = build_engine(target, proposer=proposer, kv_block_size=KV, enable_prefix_caching=caching)
        for k, (prompt, m) in enumerate(zip(prompts, max_tokens, strict=True)):
            hits, queries = engine.scheduler.prefix_cache_hits, engine.scheduler.prefix_cache_queries
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=m), f"t{k}")
            _run(engine, [assert_no_write_can_reach_a_shared_block])
            seq = engine.sequences[f"t{k}"]
            assert seq.output_ids == refs[f"t{k}"][len(prompt) : len(prompt) + m]
            assert seq.finish_reason is FinishReason.LENGTH
            if caching:
                assert engine.scheduler.prefix_cache_hits - hits == expected_hits[k], k
                assert engine.scheduler.prefix_cache_queries - queries == len(prompt)
        if caching:
            assert engine.allocator.num_cached_blocks > 0  # kept after the conversation ended
        else:
            assert engine.scheduler.prefix_cache_queries == engine.scheduler.prefix_cache_hits == 0
            assert engine.allocator.num_cached_blocks == 0
        _assert_all_blocks_free(engine)
    assert all(expected_hits[1:])


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_real_drafter_after_a_hit_sees_the_dense_context_and_outputs_do_not_change(target, drafter, sampling):
    """Multi-turn with an (untrained) DFlash drafter: with and without prefix caching the same
    tokens and the same acceptance, and the drafter's context rows of every running sequence,
    those of the blocks it hit included, equal a dense recomputation after every step."""
    turns = [_tokens(14, 4), _tokens(5, 5)]

    def params(k):
        if sampling == "greedy":
            return SamplingParams(temperature=0.0, max_tokens=17)
        return SamplingParams(temperature=1.0, top_k=20, seed=10 + k, max_tokens=17)

    def context_check(engine):
        for seq in engine.scheduler.running:
            if seq.num_cached:
                assert_draft_context_is_committed_rows(engine.proposer, seq, KV)

    results = {}
    for caching in (True, False):
        engine = build_engine(target, drafter=drafter, kv_block_size=KV, enable_prefix_caching=caching)
        history, outputs = [], []
        for k, user in enumerate(turns):
            prompt = history + user
            engine.add_request(prompt, params(k), f"t{k}")
            engine.step()
            # Another conversation with the same opening joins while this one decodes.
            engine.add_request(prompt[:9] + _tokens(4, 40 + k), params(k), f"u{k}")
            _run(engine, [assert_no_write_can_reach_a_shared_block] + ([context_check] if caching else []))
            for rid in (f"t{k}", f"u{k}"):
                seq = engine.sequences[rid]
                outputs.append((seq.output_ids, seq.stats.accepted_per_position))
            history = prompt + engine.sequences[f"t{k}"].output_ids
            if sampling == "greedy":
                assert engine.sequences[f"t{k}"].output_ids == hf_greedy(target, prompt, 17)
        if caching:
            # u0 and u1: the opening's 2 full blocks; t1: 28 of its 30 or 31 committed positions.
            assert engine.scheduler.prefix_cache_hits == 8 + 28 + 8
        _assert_all_blocks_free(engine)
        results[caching] = outputs
    assert results[True] == results[False]


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_a_shared_system_prompt_is_prefilled_once_and_never_written_by_the_sharers(target, drafter, sampling):
    """Requests joining while the first one with the same system prompt still decodes take its
    blocks (each hits the system prompt's 3 full blocks exactly), speculate on top of them and,
    with one cancelled midway, leave those blocks' target K/V and drafter context bit-identical."""
    system = _tokens(13, 6)  # 3 full blocks + 1 token
    questions = [_tokens(5 + i, 7 + i) for i in range(5)]
    prompts = [system + q for q in questions]

    def params(i):
        if sampling == "greedy":
            return SamplingParams(temperature=0.0, max_tokens=20)
        return SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=20)

    outputs = {}
    for caching in (True, False):
        engine = build_engine(target, drafter=drafter, kv_block_size=KV, enable_prefix_caching=caching)
        engine.add_request(prompts[0], params(0), "r0")
        engine.step()  # r0's prompt is prefilled: its full blocks are cached
        shared = engine.sequences["r0"].block_table[:3]
        pools = (engine.runner.pool, engine.proposer.pool)
        before = [t[:, shared].clone() for pool in pools for t in (pool.k, pool.v)]
        hits = engine.scheduler.prefix_cache_hits
        for i in range(1, 4):
            engine.add_request(prompts[i], params(i), f"r{i}")
        engine.step()
        if caching:
            assert engine.scheduler.prefix_cache_hits - hits == 3 * 12
            for i in range(4):
                assert engine.sequences[f"r{i}"].block_table[:3] == shared
            assert all(engine.allocator.refs(b) == 4 for b in shared)
        engine.step()
        assert engine.cancel("r2")
        engine.add_request(prompts[4], params(4), "r4")  # after the cancel: still cached
        _run(engine, [assert_no_write_can_reach_a_shared_block])
        if caching:
            assert engine.scheduler.prefix_cache_hits - hits == 4 * 12
            after = [t[:, shared] for pool in pools for t in (pool.k, pool.v)]
            for a, b in zip(before, after, strict=True):
                assert torch.equal(a, b)
        outputs[caching] = [engine.sequences[f"r{i}"].output_ids for i in range(5)]
        for i in (0, 1, 3, 4):
            assert len(outputs[caching][i]) == 20
            if sampling == "greedy":
                assert outputs[caching][i] == hf_greedy(target, prompts[i], 20)
        _assert_all_blocks_free(engine)
    r2 = min(len(outputs[True][2]), len(outputs[False][2]))  # cancelled: compare what both produced
    assert outputs[True][2][:r2] == outputs[False][2][:r2]
    assert [o for i, o in enumerate(outputs[True]) if i != 2] == [o for i, o in enumerate(outputs[False]) if i != 2]


def test_preemption_and_eviction_under_memory_pressure_stay_lossless_and_leak_nothing(target):
    """24 blocks of 4 tokens for five requests sharing a 10-token opening: sequences are
    preempted and come back through the cache (their own blocks), cached blocks are evicted to
    make room, outputs are the target's, and every block is back at the end."""
    opening = _tokens(10, 8)
    prompts = [opening + _tokens(3 + 2 * i, 20 + i) for i in range(5)]
    refs = {f"q{i}": p + hf_greedy(target, p, 40 + B) for i, p in enumerate(prompts)}
    oracle = OracleProposer(B, V, refs, {rid: [B - 1, 1, 0, 2] for rid in refs})
    engine = build_engine(target, proposer=oracle, num_blocks=24, kv_block_size=KV, max_num_seqs=5)
    for i, (rid, p) in enumerate(zip(refs, prompts, strict=True)):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=40), rid)
        if i == 0:
            engine.step()  # the opening is cached before the others arrive
    _run(engine, [assert_no_write_can_reach_a_shared_block])
    assert engine.scheduler.num_preemptions > 0, "the test did not exercise preemption"
    # Every admission but the first hits the opening's 2 full blocks, and preempted ones more
    # (the blocks they had filled themselves).
    admissions = len(prompts) + engine.scheduler.num_preemptions
    assert engine.scheduler.prefix_cache_hits > (admissions - 1) * 8
    for rid, p in zip(refs, prompts, strict=True):
        assert engine.sequences.pop(rid).output_ids == refs[rid][len(p) : len(p) + 40], rid
    _assert_all_blocks_free(engine)

    # New prompts fill the pool: the old blocks are evicted, and the first prompt again hits less.
    for i in range(3):
        fresh, rid = _tokens(30, 50 + i), f"fresh{i}"
        refs[rid], oracle.patterns[rid] = fresh + hf_greedy(target, fresh, 8 + B), [B - 1]
        engine.add_request(fresh, SamplingParams(temperature=0.0, max_tokens=8), rid)
        _run(engine, [assert_no_write_can_reach_a_shared_block])
        assert engine.sequences[rid].output_ids == refs[rid][30:38]
    hits = engine.scheduler.prefix_cache_hits
    oracle.planned.clear()
    engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=40), "q0")
    _run(engine, [assert_no_write_can_reach_a_shared_block])
    assert engine.scheduler.prefix_cache_hits - hits < (len(prompts[0]) - 1) // KV * KV
    assert engine.sequences["q0"].output_ids == refs["q0"][len(prompts[0]) : len(prompts[0]) + 40]
    _assert_all_blocks_free(engine)
    assert engine.allocator.num_cached_blocks <= engine.allocator.num_blocks


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_rows_that_ar_steps_defer_reach_the_drafter_before_it_drafts_and_before_their_blocks_change_hands(
        target, drafter, sampling):
    """On a CPU the context rows of AR steps wait (`Engine.defer_context`) for the next round that
    drafts, a prefill, or the release of their blocks. Rounds forced to runs of AR steps between
    drafting rounds — one request alone for longer than MAX_DEFERRED_STEPS, then five under memory
    pressure (preemptions, cached blocks evicted and reused) and a cancellation while rows wait:
    whenever a round drafts, and after every step where none wait, a real drafter's context of
    every running sequence equals a dense recomputation, and outputs and acceptance equal those of
    an engine that injects every step's rows at once."""
    opening = _tokens(10, 8)
    prompts = [opening + _tokens(3 + 2 * i, 30 + i) for i in range(5)]

    def params(i):
        tokens = 2 * MAX_DEFERRED_STEPS if i == 0 else 16
        if sampling == "greedy":
            return SamplingParams(temperature=0.0, max_tokens=tokens)
        return SamplingParams(temperature=1.0, top_k=20, seed=i, max_tokens=tokens)

    results, seen = {}, {}
    for defer in (True, False):
        engine = build_engine(target, drafter=drafter, num_blocks=28, kv_block_size=KV, max_num_seqs=5)
        assert engine.defer_context  # a CPU engine defers
        engine.defer_context = defer
        schedule = itertools.chain([0] * (MAX_DEFERRED_STEPS + 3), itertools.cycle([B - 1, 0, 0, 0, 1, 0, 0, 2]))
        engine._choose_k = lambda seqs, schedule=schedule: next(schedule)
        runner, drafted, stale = engine.proposer, [], []

        def request_drafts(request_ids, *args, runner=runner, drafted=drafted, stale=stale, **kwargs):
            for rid in request_ids:  # the draft attends over every committed row (noted here: the
                try:                 # engine would fail the requests of a step that raises)
                    assert_draft_context_is_committed_rows(runner, engine.sequences[rid], KV)
                except AssertionError as err:
                    stale.append((rid, err))
            drafted.append(len(request_ids))
            DraftRunner.request_drafts(runner, request_ids, *args, **kwargs)

        runner.request_drafts = request_drafts
        engine.add_request(prompts[0], params(0), "q0")
        waiting, steps = [], 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
            if steps == MAX_DEFERRED_STEPS + 2:  # q0 alone so far: the rest join while its rows wait
                for i in range(1, 5):
                    engine.add_request(prompts[i], params(i), f"q{i}")
            if steps == MAX_DEFERRED_STEPS + 8:
                waiting.append(len(engine._deferred))
                assert engine.cancel("q2")
            waiting.append(len(engine._deferred))
            assert_no_write_can_reach_a_shared_block(engine)
            if not engine._deferred:
                for seq in engine.scheduler.running:
                    if seq.num_cached:
                        assert_draft_context_is_committed_rows(engine.proposer, seq, KV)
        assert not engine._deferred  # the last request's end injected what waited
        results[defer] = [(engine.sequences[f"q{i}"].output_ids, engine.sequences[f"q{i}"].stats.accepted_per_position)
                          for i in range(5)]
        assert not stale and len(drafted) >= 6
        assert all(engine.sequences[f"q{i}"].finish_reason is not FinishReason.ERROR for i in range(5))
        seen[defer] = (engine.scheduler.num_preemptions, max(waiting), waiting[MAX_DEFERRED_STEPS + 7])
        if sampling == "greedy":
            for i in (0, 1, 3, 4):
                assert results[defer][i][0] == hf_greedy(target, prompts[i], params(i).max_tokens)
        _assert_all_blocks_free(engine)
    assert results[True] == results[False]
    preemptions, most_waiting, waiting_at_cancel = seen[True]
    assert preemptions > 0, "the test did not exercise preemption"
    assert most_waiting == MAX_DEFERRED_STEPS - 1 and waiting_at_cancel > 0, seen[True]
    assert seen[False][1:] == (0, 0)


def test_a_new_drafter_starts_from_an_empty_prefix_cache(target):
    """Cached blocks hold the old drafter's context rows, which a new drafter does not have: after
    attach_proposer nothing is hit, and the output is still the target's."""
    prompt = _tokens(17, 9)
    refs = {rid: prompt + hf_greedy(target, prompt, 20 + B) for rid in ("a", "b", "c")}
    engine = build_engine(target, proposer=OracleProposer(B, V, refs, {rid: [2] for rid in refs}), kv_block_size=KV)
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20), "a")
    _run(engine)
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20), "b")
    engine.step()
    assert engine.scheduler.prefix_cache_hits == 16
    engine.attach_proposer(OracleProposer(B, V, refs, {rid: [1] for rid in refs}))
    assert engine.allocator.num_cached_blocks == 0
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=20), "c")
    _run(engine)
    assert engine.scheduler.prefix_cache_hits == 16  # neither b (preempted, readmitted) nor c hit
    for rid in ("a", "b", "c"):
        assert engine.sequences[rid].output_ids == refs[rid][17:37]
    _assert_all_blocks_free(engine)
