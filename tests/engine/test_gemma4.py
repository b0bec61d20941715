"""Gemma-4 targets end to end: tiny twins of the 31B (sliding and global layers of two KV
geometries, k_eq_v, layer scalars) and of the E4B (per-layer inputs, KV-shared layers, double-wide
MLPs) decode exactly as transformers does with a DFlash drafter of the z-lab Gemma-4 layout
(sliding-window drafter layers then a full one, more target features than drafter layers), and
prefix caching and preemption keep every KV group's contents right. Every test runs over both
target forwards and both round loops (tests/engine/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.kv_cache import LayerKV
from dflash_serve.services.engine.loader import build_engine as build_engine_from_disk
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.models import save_drafter
from tests.conftest import gemma4_drafter
from tests.engine import harness
from tests.engine.harness import (
    OracleProposer,
    assert_draft_context_is_committed_rows,
    assert_no_write_can_reach_a_shared_block,
    build_engine,
    hf_greedy,
)
from tests.targets import gemma4_31b_twin, gemma4_e4b_twin

V, B, KV = 96, 5, 4  # vocabulary, draft block (4 drafts), tokens per KV block
TWINS = {"31B": gemma4_31b_twin, "E4B": gemma4_e4b_twin}


@pytest.fixture(scope="module", params=list(TWINS))
def twin(request):
    return TWINS[request.param](seed=3)


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(5, V, (n,), generator=g).tolist()


def test_a_real_drafter_is_lossless_and_its_context_holds_only_accepted_rows(twin):
    """Prompts longer than the sliding window, at batch 3: the target's own greedy tokens, and
    the drafter's paged context equals a dense recomputation from the committed tokens alone."""
    engine = build_engine(twin, drafter=gemma4_drafter(block_size=B, seed=11), kv_block_size=KV)
    prompts = [_tokens(n, seed) for n, seed in ((6, 1), (19, 2), (11, 3))]
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=24)) for p in prompts]
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            if seq.num_cached:
                assert_draft_context_is_committed_rows(engine.proposer, seq, KV)
    for rid, prompt in zip(ids, prompts, strict=True):
        assert engine.sequences[rid].output_ids == hf_greedy(twin, prompt, 24)
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_prefix_hits_and_preemption_keep_every_kv_group_right(twin):
    """20 blocks of 4 tokens for four requests sharing an 11-token opening: sequences are
    preempted and come back through the cache, the opening's blocks are shared, and no KV group
    (sliding, global, the KV-shared layers' producers) of a shared block is ever written."""
    opening = _tokens(11, 8)
    prompts = [opening + _tokens(2 + 3 * i, 20 + i) for i in range(4)]
    refs = {f"q{i}": p + hf_greedy(twin, p, 30 + B) for i, p in enumerate(prompts)}
    oracle = OracleProposer(B, V, refs, {rid: [B - 1, 1, 0, 2] for rid in refs})
    engine = build_engine(twin, proposer=oracle, num_blocks=20, kv_block_size=KV, max_num_seqs=4)
    pool = engine.runner.pool
    assert len(pool.groups) == 2  # sliding layers of head 8, global layers of head 16
    engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=30), "q0")
    engine.step()  # the opening's 2 full blocks are cached
    shared = engine.sequences["q0"].block_table[:2]
    before = [t[:, shared].clone() for t in pool.tensors()]
    for i in range(1, 4):
        engine.add_request(prompts[i], SamplingParams(temperature=0.0, max_tokens=30), f"q{i}")
    while engine.has_unfinished():
        engine.step()
        assert_no_write_can_reach_a_shared_block(engine)
        if all(engine.allocator.refs(b) for b in shared):
            for was, tensor in zip(before, pool.tensors(), strict=True):
                assert torch.equal(tensor[:, shared], was)
    assert engine.scheduler.num_preemptions > 0, "the test did not exercise preemption"
    assert engine.scheduler.prefix_cache_hits >= 3 * 8
    for rid, p in zip(refs, prompts, strict=True):
        assert engine.sequences[rid].output_ids == refs[rid][len(p):len(p) + 30], rid
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_build_engine_serves_a_saved_gemma4_checkpoint(twin, tmp_path):
    """What a user runs: a Gemma-4 checkpoint folder and a drafter folder through `build_engine`
    (the KV cache sized from the layers' own geometries, the sliding layers' K/V in window slots
    for 2 sequences of window 5, rounds of 5 and prefill chunks of 16: 18 slots beside 64 blocks),
    decoding as transformers does."""
    twin.save_pretrained(tmp_path / "target")
    save_drafter(gemma4_drafter(block_size=B, seed=5), tmp_path / "drafter")
    engine = build_engine_from_disk(EngineConfig(
        target=str(tmp_path / "target"), drafter=str(tmp_path / "drafter"), target_impl=harness.TARGET_IMPL,
        dtype="float32", kv_block_size=KV, num_kv_blocks=64, max_num_seqs=2, max_prefill_tokens=16,
        speculation="fixed",
        round_costs_dir=str(tmp_path / "costs")))
    # The 31B's global layers store their values only (k_eq_v: the keys are derived from them).
    k_eq_v = twin.config.attention_k_eq_v
    sliding, full = LayerKV(2, 8, window=5), LayerKV(1 if k_eq_v else 2, 16, keys_from_values=k_eq_v)
    expected = [sliding, sliding, full, sliding, sliding, full]
    if twin.config.num_kv_shared_layers:  # the last two layers read layers 3 and 2
        expected[4:] = [LayerKV(2, 8, reads_layer=3, window=5), LayerKV(2, 16, reads_layer=2)]
    pool = engine.runner.pool
    assert list(pool.layout) == expected
    assert engine.allocator.num_window_slots == 18
    assert [(g.windowed, g.v.shape[1]) for g in pool.groups] == [(True, 18), (False, 64)]
    prompts = [_tokens(9, 30), _tokens(14, 31)]
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    for prompt, seq in zip(prompts, done, strict=True):
        assert seq.output_ids == hf_greedy(twin, prompt, 16)


def test_sliding_layers_in_window_slots_under_block_pressure_stay_lossless(twin):
    """The sliding layers' K/V in 30 window slots (4 sequences of window 5, rounds of 5, prefill
    chunks of 8) beside 40 blocks, for five requests sharing a 13-token opening, prompts and answers many
    windows long: slots are given back as the window moves on and taken again by other blocks,
    prefix hits end where the window still has its slots, sequences are preempted, outputs are
    the target's, and every slot is back at the end."""
    opening = _tokens(13, 40)
    prompts = [opening + _tokens(4 + 5 * i, 50 + i) for i in range(5)]
    refs = {f"w{i}": p + hf_greedy(twin, p, 30 + B) for i, p in enumerate(prompts)}
    oracle = OracleProposer(B, V, refs, {rid: [B - 1, 0, 2, 1] for rid in refs})
    engine = build_engine(twin, proposer=oracle, num_blocks=40, kv_block_size=KV, max_num_seqs=4,
                          max_prefill_tokens=8)
    allocator = engine.allocator
    assert allocator.window == 5 and allocator.num_window_slots == 30
    engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=30), "w0")
    engine.step()
    for i in range(1, 5):
        engine.add_request(prompts[i], SamplingParams(temperature=0.0, max_tokens=30), f"w{i}")
    blocks_of_slot: dict[int, set[int]] = {}
    while engine.has_unfinished():
        engine.step()
        assert_no_write_can_reach_a_shared_block(engine)
        for seq in engine.scheduler.running:  # every block a query can still see holds a slot
            for block in seq.block_table[max(0, seq.num_cached - 4) // KV:]:
                assert allocator.window_slot(block) >= 0, (seq.request_id, block)
        for block in range(allocator.num_blocks):
            if allocator.window_slot(block) >= 0:
                blocks_of_slot.setdefault(allocator.window_slot(block), set()).add(block)
    assert any(len(blocks) > 1 for blocks in blocks_of_slot.values()), "no slot was taken again"
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.prefix_cache_hits > 0
    for rid, p in zip(refs, prompts, strict=True):
        assert engine.sequences[rid].output_ids == refs[rid][len(p):len(p) + 30], rid
    assert allocator.num_free == allocator.num_blocks and allocator.num_takeable == 30


def test_prefill_through_the_padded_graph_forward_with_window_slots_is_lossless(twin):
    """Prefill chunks through `PrefillGraphs`' padded forward (what its CUDA graphs capture, run
    eagerly here): its padding rows write the scratch block, whose window slot is a scratch slot
    of its own, so no sequence's sliding K/V is touched."""
    engine = build_engine(twin, drafter=gemma4_drafter(block_size=B, seed=13), kv_block_size=KV,
                          max_prefill_tokens=16, prefill_buckets=((8, 16, 32), (1, 2, 4)))
    assert engine.allocator.window == 5
    prompts = [_tokens(n, seed) for n, seed in ((21, 60), (7, 61), (13, 62))]
    done = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16))
    for prompt, seq in zip(prompts, done, strict=True):
        assert seq.output_ids == hf_greedy(twin, prompt, 16)
