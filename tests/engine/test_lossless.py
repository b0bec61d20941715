"""Speculative output == target-only output, token for token (float32), whatever the drafts are.

The oracle drafter proposes the target's own greedy continuation with one error planted per round,
so each round's acceptance is exactly what the test chose; a real (untrained) DFlash drafter covers
the paged drafter path. The reference is plain transformers greedy decoding over the whole
sequence, independent of the engine's cache, paging and batching.
"""

from __future__ import annotations

import collections

import pytest
import torch

from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.stopping import FinishReason
from tests.conftest import drafter_config, random_drafter
from tests.engine import harness
from tests.engine.harness import OracleProposer, assert_draft_context_is_committed_rows, build_engine, hf_greedy
from tests.targets import tiny_target

V = 96
B = 6  # drafts 0..5 accepted per round


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4, vocab=V, seed=7).float()


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V - 1, (n,), generator=g).tolist() for n in lengths]


def _histogram(values, size=B):
    counts = [0] * size
    for v in values:
        counts[v] += 1
    return counts


def test_greedy_spec_equals_target_only_for_every_acceptance_with_joins_and_cancels(target):
    lengths = [3, 7, 12, 20, 33, 5]
    max_tokens = [24, 30, 17, 26, 21, 40]
    patterns = [[0, 1, 2, 3, 4, 5], [5, 5, 0], [2, 0, 4, 1], [1], [3, 5, 2], [4, 0]]
    prompts = _prompts(lengths)
    ids = [f"r{i}" for i in range(len(prompts))]
    refs = {rid: p + hf_greedy(target, p, m + B) for rid, p, m in zip(ids, prompts, max_tokens, strict=True)}
    oracle = OracleProposer(B, V, refs, dict(zip(ids, patterns, strict=True)))
    engine = build_engine(target, proposer=oracle, max_prefill_tokens=16)

    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in max_tokens]
    for i in range(3):
        engine.add_request(prompts[i], params[i], ids[i])
    outputs = collections.defaultdict(list)
    steps = 0
    while engine.has_unfinished() or steps < 3:
        if steps == 2:  # requests join mid-run
            for i in range(3, 6):
                engine.add_request(prompts[i], params[i], ids[i])
        if steps == 5:
            assert engine.cancel("r4")
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        steps += 1

    for i, rid in enumerate(ids):
        seq = engine.sequences[rid]
        expected = refs[rid][lengths[i] :]
        assert outputs[rid] == seq.output_ids
        if rid == "r4":
            assert seq.finish_reason is FinishReason.CANCELLED
            assert seq.output_ids == expected[: len(seq.output_ids)]
            continue
        assert seq.finish_reason is FinishReason.LENGTH
        assert seq.output_ids == expected[: max_tokens[i]], rid
        # Recorded acceptance equals the planted pattern, round by round, up to the drafts the last
        # round could commit before max_tokens. A chained round launched before the host read the
        # request's last one was proposed too, then dropped unread.
        planned = oracle.planned[rid][: seq.stats.rounds]
        assert len(oracle.planned[rid]) - seq.stats.rounds in ((0, 1) if harness.CHAIN_ROUNDS else (0,))
        room, committed = max_tokens[i] - 1, []  # after the prefill's token
        for a in planned:
            committed.append(min(a, room - 1))
            room -= committed[-1] + 1
        assert room == 0
        counts = _histogram(committed)
        assert seq.stats.accepted_per_position == [sum(counts[j + 1 :]) for j in range(B - 1)]
        assert seq.stats.accepted_tokens == sum(committed)
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_target_only_engine_equals_plain_greedy(target):
    prompts = _prompts([4, 15, 9], seed=1)
    engine = build_engine(target)
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    for prompt, seq in zip(prompts, done, strict=True):
        assert seq.output_ids == hf_greedy(target, prompt, 20)
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_real_drafter_is_lossless_and_its_context_holds_only_accepted_rows(target):
    """An untrained DFlash drafter at batch 3 with mixed acceptance: output is the target's, and
    the drafter's paged context equals a dense recomputation from the committed tokens alone."""
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=4, num_hidden_layers=2,
                         layer_types=["full_attention"] * 2, dflash_config={"mask_token_id": V - 1, "target_layer_ids": [0, 2]})
    drafter = random_drafter(cfg, seed=11, dtype=torch.float32)
    engine = build_engine(target, drafter=drafter)
    prompts = _prompts([6, 19, 11], seed=2)
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=30)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
        running = [engine.sequences[i] for i in ids if engine.sequences[i].num_cached and engine.sequences[i].block_table]
        for seq in running:
            assert_draft_context_is_committed_rows(engine.proposer, seq, engine.allocator.block_size)
    for rid, prompt in zip(ids, prompts, strict=True):
        assert engine.sequences[rid].output_ids == hf_greedy(target, prompt, 30)
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_mask_token_drafts_never_reach_the_output(target):
    mask = V - 1
    prompts = _prompts([5, 9], seed=3)
    refs = {f"m{i}": p + hf_greedy(target, p, 20 + B) for i, p in enumerate(prompts)}
    oracle = OracleProposer(B, V, refs, {k: [0, 2, 1] for k in refs}, wrong_token=mask)
    engine = build_engine(target, proposer=oracle)
    for rid, p in zip(refs, prompts, strict=True):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=20), rid)
    while engine.has_unfinished():
        engine.step()
    for rid, p in zip(refs, prompts, strict=True):
        assert engine.sequences[rid].output_ids == refs[rid][len(p) : len(p) + 20]


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_stop_token_inside_an_accepted_block_ends_exactly_there(target, where):
    prompt = _prompts([8], seed=4)[0]
    ref = hf_greedy(target, prompt, 40)
    # Pick a token whose first occurrence falls at the chosen slot of a fully accepted block.
    index = {"first": 1, "middle": 3, "last": B - 1}[where]
    candidates = [i for i in range(1 + index, 30, B) if ref[i] not in ref[:i]]
    if not candidates:
        pytest.fail(f"the fixed target repeats tokens; no first occurrence at slot {index}")
    stop_at = candidates[0]
    refs = {"s": prompt + ref + [0] * B}
    engine = build_engine(target, proposer=OracleProposer(B, V, refs, {"s": [B - 1]}))
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(ref[stop_at],)), "s")
    while engine.has_unfinished():
        engine.step()
    seq = engine.sequences["s"]
    assert seq.output_ids == ref[: stop_at + 1]  # the stop token is the last id (not streamed as text)
    assert seq.finish_reason is FinishReason.STOP


def test_max_tokens_inside_a_block_and_eos(target):
    prompt = _prompts([6], seed=5)[0]
    ref = hf_greedy(target, prompt, 30)
    eos_at = ref.index(ref[4])  # its first occurrence: inside the first round's block
    refs = {"a": prompt + ref + [0] * B, "b": prompt + ref + [0] * B}
    engine = build_engine(target, proposer=OracleProposer(B, V, refs, {"a": [B - 1], "b": [B - 1]}), eos=[ref[eos_at]])
    # 1 token from prefill + 6 from the first round, then the limit falls inside the second round.
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), "a")
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=30), "b")
    while engine.has_unfinished():
        engine.step()
    a, b = engine.sequences["a"], engine.sequences["b"]
    assert a.output_ids == ref[:8] and a.finish_reason is FinishReason.LENGTH
    assert b.output_ids == ref[: eos_at + 1] and b.finish_reason is FinishReason.STOP


def test_a_gemma3_target_with_sliding_and_global_layers_is_lossless():
    """Gemma-3 (fused or not: the suite runs both): sequences longer than the sliding window, a real
    drafter, the final logit softcap."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(17)
    target = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=5, final_logit_softcapping=10.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"]))
    with torch.no_grad():
        for name, param in target.named_parameters():
            if "norm" in name:
                param.normal_(0.0, 0.5)
    target = target.float().eval()
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=4, num_hidden_layers=2,
                         layer_types=["full_attention"] * 2, dflash_config={"mask_token_id": V - 1, "target_layer_ids": [0, 3]})
    engine = build_engine(target, drafter=random_drafter(cfg, seed=19, dtype=torch.float32))
    prompts = _prompts([3, 14, 9], seed=4)
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24))
    for prompt, seq in zip(prompts, done, strict=True):
        assert seq.output_ids == hf_greedy(target, prompt, 24)
    assert engine.allocator.num_free == engine.allocator.num_blocks
