"""Continuous batching under pressure: preemption, failures, cancellation, bad input — no block
ever leaks and every surviving request stays lossless."""

from __future__ import annotations

import pytest
import torch

from dflash_serve.services.engine.kv_cache import AttentionBatch, BlockAllocator, OutOfKVBlocks
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.stopping import FinishReason
from tests.engine.harness import OracleProposer, build_engine, hf_greedy
from tests.targets import tiny_target

V, B = 96, 4


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen2", layers=3, vocab=V, seed=9).float()


def test_allocator_grow_trim_release():
    alloc = BlockAllocator(6, 4)
    table: list[int] = []
    alloc.grow(table, 9)
    assert len(table) == 3 and alloc.num_free == 3
    with pytest.raises(OutOfKVBlocks):
        alloc.grow(table, 30)
    assert len(table) == 3  # all or nothing
    alloc.trim(table, 4)
    assert len(table) == 1 and alloc.num_free == 5
    alloc.release(table)
    assert table == [] and alloc.num_free == 6 and alloc.usage == 0.0


def test_attention_batch_slots_follow_the_block_tables():
    batch = AttentionBatch.build([[5, 2], [7]], starts=[3, 1], query_lens=[4, 2], block_size=4, device="cpu")
    # seq 0: positions 3,4,5,6 -> block 5 off 3, block 2 off 0..2; seq 1: positions 1,2 -> block 7
    assert batch.slot_mapping.tolist() == [23, 8, 9, 10, 29, 30]
    assert batch.seq_lens.tolist() == [7, 3] and batch.query_start.tolist() == [0, 4, 6]
    assert batch.max_query_len == 4


def _oracle(target, prompts, max_tokens, pattern=(B - 1, 1, 0)):
    refs = {f"q{i}": p + hf_greedy(target, p, max_tokens + B) for i, p in enumerate(prompts)}
    return refs, OracleProposer(B, V, refs, {k: list(pattern) for k in refs})


def test_preemption_under_block_pressure_stays_lossless_and_leaks_nothing(target):
    prompts = [[(7 * i + j) % 90 for j in range(10 + 3 * i)] for i in range(5)]
    refs, oracle = _oracle(target, prompts, 40)
    # 24 blocks of 4 tokens: one sequence fits alone (10+12+40+4 <= 96), five at once do not.
    engine = build_engine(target, proposer=oracle, num_blocks=24, kv_block_size=4, max_num_seqs=5)
    for rid, p in zip(refs, prompts, strict=True):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=40), rid)
    preempted, peak_usage = 0, 0.0
    while engine.has_unfinished():
        plan_before = len(engine.scheduler.waiting)
        engine.step()
        preempted += max(0, len(engine.scheduler.waiting) - plan_before)
        peak_usage = max(peak_usage, engine.kv_usage)
        assert engine.num_running <= 5 and engine.num_running + engine.num_waiting <= 5
    assert preempted > 0, "the test did not exercise preemption"
    assert engine.scheduler.num_preemptions >= preempted  # what the server's counter reports
    assert 0.5 < peak_usage <= 1.0 and engine.kv_usage == 0.0
    for rid, p in zip(refs, prompts, strict=True):
        assert engine.sequences[rid].output_ids == refs[rid][len(p) : len(p) + 40], rid
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_failed_and_cancelled_requests_free_everything_and_others_continue(target):
    prompts = [[3, 4, 5, 6], [10, 11, 12], [20, 21, 22, 23, 24], [30]]
    refs, oracle = _oracle(target, prompts, 20)
    engine = build_engine(target, proposer=oracle)
    for rid, p in zip(refs, prompts, strict=True):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=20), rid)
    engine.step()
    engine.step()
    oracle.fail_on = {"q1"}  # the drafter fails for one request's batch
    outputs = engine.step()
    failed = [o for o in outputs if o.finish_reason is FinishReason.ERROR]
    assert failed and all("planted drafter failure" in o.error for o in failed)
    oracle.fail_on = set()
    assert engine.cancel("q3") in (True, False)
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.num_free == engine.allocator.num_blocks
    # The whole batch that shared the failing forward fails; a later request is served normally.
    assert engine.release("q0") is not None
    engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=20), "q0")
    while engine.has_unfinished():
        engine.step()
    assert engine.sequences["q0"].output_ids == hf_greedy(target, prompts[0], 20)
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_cancel_while_waiting_and_twice(target):
    engine = build_engine(target, max_num_seqs=1)
    a = engine.add_request([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=50))
    b = engine.add_request([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=50))
    engine.step()
    assert engine.cancel(b) and not engine.cancel(b) and not engine.cancel("nope")
    assert engine.cancel(a)
    assert not engine.has_unfinished() and engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([], SamplingParams(), "prompt is empty"),
        ([1, 500], SamplingParams(), "outside the vocabulary"),
        ([1, 2], SamplingParams(stop_token_ids=(3, 500)), r"stop_token_ids \[500\] are outside the vocabulary"),
        ([1] * 600, SamplingParams(), "takes at most 511"),
        ([1, 2], SamplingParams(max_tokens=5000), "lower max_tokens or raise num_kv_blocks"),
        ([1, 2], SamplingParams(temperature=-1.0), "temperature"),
        ([1, 2], SamplingParams(stop=("x",)), "stop strings need a tokenizer"),
    ],
)
def test_requests_that_can_never_be_served_are_refused(target, prompt, params, message):
    engine = build_engine(target, num_blocks=64, max_model_len=512)
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()


def test_request_n_plus_1_after_a_longer_request_starts_clean(target):
    """llama.cpp #22105: per-request state not reset between requests."""
    refs, oracle = _oracle(target, [[1, 2, 3] * 10, [9]], 30)
    engine = build_engine(target, proposer=oracle)
    engine.add_request([1, 2, 3] * 10, SamplingParams(temperature=0.0, max_tokens=30), "q0")
    while engine.has_unfinished():
        engine.step()
    assert engine.sequences["q0"].output_ids == refs["q0"][30:60]
    engine.add_request([9], SamplingParams(temperature=0.0, max_tokens=30), "q1")
    while engine.has_unfinished():
        engine.step()
    assert engine.sequences["q1"].output_ids == refs["q1"][1:31]


def test_stream_yields_until_finished_and_an_abandoned_stream_frees_its_blocks(target):
    engine = build_engine(target)
    outs = list(engine.stream([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=7)))
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 7
    assert [t for o in outs for t in o.new_token_ids] == hf_greedy(target, [1, 2, 3], 7)
    stream = engine.stream([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=50))
    next(stream)
    stream.close()  # the client went away
    assert not engine.has_unfinished() and not engine.sequences
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_a_lost_drafter_falls_back_to_target_only_and_a_new_one_takes_over_losslessly(target):
    from dflash_serve.services.engine.draft_runner import ProposerLost

    prompts = [[2, 3, 4, 5], [7, 8], [11] * 9]
    refs, oracle = _oracle(target, prompts, 40)

    class Dying(OracleProposer):
        def propose(self, request_ids, bonus_ids, starts, batch):
            if self.dead:
                raise ProposerLost("drafter actor died")
            return super().propose(request_ids, bonus_ids, starts, batch)

    dying = Dying(B, V, refs, {k: [B - 1, 2] for k in refs})
    dying.dead = False
    engine = build_engine(target, proposer=dying)
    for rid, p in zip(refs, prompts, strict=True):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=40), rid)
    for _ in range(3):
        engine.step()
    dying.dead = True
    for _ in range(4):
        engine.step()
    assert engine.proposer is None and engine.proposer_losses == 1
    engine.attach_proposer(OracleProposer(B, V, refs, {k: [1] for k in refs}))
    while engine.has_unfinished():
        engine.step()
    for rid, p in zip(refs, prompts, strict=True):
        seq = engine.sequences[rid]
        assert seq.finish_reason is FinishReason.LENGTH and seq.output_ids == refs[rid][len(p) : len(p) + 40]
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_chained_rounds_run_a_round_ahead_and_fall_back_when_blocks_run_short(target):
    """With chained rounds the drafter is asked for round r+1 before the host has read round r:
    while a request decodes, one more round is planned than committed, and its KV blocks cover
    both rounds. When the free blocks cannot hold two rounds, steps fall back to one host sync
    per round — and the output is the target's either way, with every block back at the end."""
    prompts = [[5, 6, 7, 8, 9], [40, 41]]
    refs, oracle = _oracle(target, prompts, 30)
    engine = build_engine(target, proposer=oracle)
    engine.chain_rounds = True
    taken, take = [0], engine.allocator._take
    engine.allocator._take = lambda: taken.__setitem__(0, taken[0] + 1) or take()
    for rid, p in zip(refs, prompts, strict=True):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=30), rid)
    ahead = 0
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            if len(oracle.planned[seq.request_id]) == seq.stats.rounds + 1:  # a round on the device
                ahead += 1
                assert len(seq.block_table) * 4 >= seq.num_cached + B
    assert ahead > 10, "no round was ever chained"
    for rid, p in zip(refs, prompts, strict=True):
        assert engine.sequences[rid].output_ids == refs[rid][len(p) : len(p) + 30]
    assert engine.allocator.num_free == engine.allocator.num_blocks
    # A chained round's read keeps the blocks the next one takes: each sequence took its blocks
    # once, not a block again every round (given back at the read, taken at the next launch).
    most = sum(engine.allocator.blocks_for(len(p) + 30 + 2 * B) for p in prompts)
    assert taken[0] <= most, f"{taken[0]} blocks taken for {most} held at most"

    # 8 blocks of 4 tokens: 5 + 23 tokens and one round's lookahead fit, near the end two do not.
    refs, oracle = _oracle(target, prompts[:1], 23)
    tight = build_engine(target, proposer=oracle, num_blocks=8, kv_block_size=4)
    tight.chain_rounds = True
    tight.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=23), "q0")
    grown, grow = [], tight.scheduler.grow_for_chained_round
    tight.scheduler.grow_for_chained_round = lambda seqs: grown.append(grow(seqs)) or grown[-1]
    while tight.has_unfinished():
        tight.step()
    assert True in grown and False in grown, grown  # chained, then synced for lack of blocks
    assert tight.sequences["q0"].output_ids == refs["q0"][5:28]
    assert tight.allocator.num_free == tight.allocator.num_blocks


def test_a_round_after_the_batch_changes_chains_on_the_round_in_flight(target):
    """With chained rounds, a request that ends and one admitted in its place do not make the host
    read the round in flight before it launches the next: the sequences that stay start from that
    round's results on the device, the admitted prompt from its prefill's first token. Every
    output is the target's own and no block leaks."""
    prompts = [[5, 6, 7, 8, 9], [40, 41], [60, 61, 62], [20, 21, 22, 23]]
    lengths = {"q0": 6, "q1": 24, "q2": 10, "q3": 14}
    refs, oracle = _oracle(target, prompts, 24)
    engine = build_engine(target, proposer=oracle, max_num_seqs=2)
    engine.chain_rounds = True
    for rid, p in zip(refs, prompts, strict=True):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=lengths[rid]), rid)
    across, launch = [], engine._launch_round

    def launch_and_log(seqs, previous=None, group=None, first=None):
        if previous is not None and [s.request_id for s in seqs] != [s.request_id for s in previous.seqs]:
            across.append(([s.request_id for s in previous.seqs], [s.request_id for s in seqs]))
        return launch(seqs, previous, group, first)
    engine._launch_round = launch_and_log
    while engine.has_unfinished():
        engine.step()
    engine.drain()
    # q0 ends and q2 takes its place, q2 ends and q3 does: each time q1 stays and the new one joins
    assert (["q0", "q1"], ["q1", "q2"]) in across and (["q1", "q2"], ["q1", "q3"]) in across, across
    for rid, p in zip(refs, prompts, strict=True):
        assert engine.sequences[rid].output_ids == refs[rid][len(p) : len(p) + lengths[rid]]
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_prompts_join_the_round_of_the_step_that_prefills_them(target):
    """A prompt whose prefill completes in a step where others decode joins their round, from the
    first token its prefill sampled (on the device, read after the round is launched): one step
    less per admission, and with chained rounds the next round chains on it. In a step where
    nothing decodes none joins (the first tokens go out without waiting for a launch). A prompt
    chunked over several steps joins in its last one; one that may generate only its first token
    does not join; one whose first token is a stop token joins and ends — the round wasted on it
    is dropped, and no block leaks. Every output is the target's own."""
    prompts = [[5, 6, 7, 8, 9], list(range(10, 90)), [40, 41]]
    refs, oracle = _oracle(target, prompts, 12)
    decoded = set(refs["q0"][5:17] + refs["q1"][80:92])
    # q3's first token, as EOS, ends q3 there (and no other request: none decodes it)
    prompts.append(next(p for i in range(80) if hf_greedy(target, p := [i, i + 1, i + 2], 1)[0] not in decoded))
    refs, oracle = _oracle(target, prompts, 12)
    stop_at_first = refs["q3"][3]
    engine = build_engine(target, proposer=oracle, max_prefill_tokens=64, eos=(stop_at_first,))
    params = {"q0": 12, "q1": 12, "q2": 1, "q3": 12}
    for rid, p in zip(refs, prompts, strict=True):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=params[rid]), rid)
    engine.step()  # prefills q0 and the first 59 tokens of q1 (64-token budget); nothing decodes yet
    assert not any(oracle.planned.values()) and engine.sequences["q0"].output_ids == refs["q0"][5:6]
    engine.step()  # q0's round; q1's last 21 tokens, q2 and q3: q1 and q3 join it, q2 (max_tokens 1) does not
    assert {rid for rid in refs if oracle.planned[rid]} == {"q0", "q1", "q3"}
    assert engine.sequences["q2"].output_ids == refs["q2"][2:3] and engine.sequences["q3"].output_ids == [stop_at_first]
    while engine.has_unfinished():
        engine.step()
    engine.drain()
    for rid in ("q0", "q1"):
        p = prompts[int(rid[1])]
        assert engine.sequences[rid].output_ids == refs[rid][len(p) : len(p) + 12]
    assert engine.allocator.num_free == engine.allocator.num_blocks
