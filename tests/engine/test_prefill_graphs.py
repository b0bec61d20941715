"""Prefill through `PrefillGraphs`' padded forward — the forward its CUDA graphs capture, run
eagerly on the CPU here: the same logits, features, target KV and drafter context as the eager
prefill, and the same outputs, for prompts of mixed lengths, chunked prefills, prefix-cache hits,
and plans too large for the buckets (which prefill eagerly)."""

from __future__ import annotations

import pytest
import torch

from dflash_serve.services.engine.engine import Engine
from dflash_serve.services.engine.prefill_graphs import ALIGN_BYTES, PrefillChunkView, PrefillGraphs
from dflash_serve.services.engine.sampling_params import SamplingParams
from tests.conftest import drafter_config, random_drafter
from tests.engine.harness import (
    OracleProposer,
    assert_draft_context_is_committed_rows,
    assert_prefill_paths_agree,
    build_engine,
    hf_greedy,
)
from tests.targets import tiny_target

V, B, KV = 96, 4, 4  # vocabulary, draft block, tokens per KV block
BUCKETS = ((8, 16, 32), (1, 2, 4))  # tokens, chunks: small, so that plans are padded and some overflow


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4, vocab=V, seed=31).float()


@pytest.fixture(scope="module")
def drafter():
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=4, num_hidden_layers=2,
                         layer_types=["full_attention"] * 2,
                         dflash_config={"mask_token_id": V - 1, "target_layer_ids": [0, 2]})
    return random_drafter(cfg, seed=7, dtype=torch.float32)


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V - 1, (n,), generator=g).tolist()


@pytest.mark.parametrize("lengths, max_prefill", [([5], 64), ([5, 11, 7], 64), ([3, 9], 64), ([40], 16)],
                         ids=["one", "three-chunks", "two-chunks", "chunked"])
def test_padded_forward_equals_the_eager_forward(target, drafter, lengths, max_prefill):
    """Chunk by chunk of each step's plan: logits of the sampled rows, features, positions, slots,
    the target's K/V and the drafter's context K/V are the eager prefill's (float32)."""
    engine = build_engine(target, drafter=drafter, max_prefill_tokens=max_prefill, prefill_buckets=BUCKETS)
    assert engine.prefill_graphs.injects_for(engine.proposer) and not engine.prefill_graphs.injects_for(None)
    for i, n in enumerate(lengths):
        engine.add_request(_tokens(n, seed=i), SamplingParams(temperature=0.0, max_tokens=1))
    steps = 0
    while engine.has_unfinished():
        plan = engine.scheduler.schedule()
        chunks = plan.prefills
        assert chunks and not plan.decodes  # every request ends (is cancelled) once its prompt is in
        assert_prefill_paths_agree(engine, chunks, rtol=1e-5)
        for c in chunks:  # as Engine._prefill commits a chunk, without sampling
            c.seq.num_cached = c.start + c.length
        for c in chunks:
            if c.completes_prefill:
                engine.cancel(c.seq.request_id)
        steps += 1
    assert steps == (3 if lengths == [40] else 1)


def test_every_input_buffer_starts_aligned(target, drafter):
    """Triton compiles a kernel per pointer alignment: every input the graphs' forward reads
    starts at ALIGN_BYTES, as the eager forward's own tensors do, so both share one variant."""
    graphs = build_engine(target, drafter=drafter, prefill_buckets=BUCKETS).prefill_graphs
    tokens, chunks = graphs.max_tokens, graphs.chunk_buckets[-1]
    inputs = {"ids": tokens, "positions": tokens, "slots": tokens, "sample_rows": chunks, "seq_lens": chunks,
              "query_start": chunks + 1, "block_tables": chunks * graphs.max_blocks}
    for name, numel in inputs.items():
        tensor = getattr(graphs, name)
        assert tensor.numel() == numel and tensor.data_ptr() % ALIGN_BYTES == 0, name


def test_padding_writes_only_the_scratch_slot(target, drafter):
    """Padding tokens write their K/V and context rows into the scratch slot alone: every other
    slot of both pools is as the real tokens left it."""
    engine = build_engine(target, drafter=drafter, prefill_buckets=BUCKETS)
    graphs = engine.prefill_graphs
    pools = (engine.runner.pool, engine.proposer.pool)
    for pool in pools:
        pool.k.fill_(7.0)
        pool.v.fill_(7.0)
    table = [0, 1]
    out = graphs.run([PrefillChunkView(_tokens(5, seed=3), 0, table)], [0])  # 5 tokens padded to 8
    touched = set(out.slots.tolist()) | {graphs.scratch_slot}
    assert out.slots.tolist() == [0, 1, 2, 3, 4]
    for pool in pools:
        flat = pool.k.view(pool.k.shape[0], -1, *pool.k.shape[-2:])
        untouched = [s for s in range(flat.shape[1]) if s not in touched]
        assert bool((flat[:, untouched] == 7.0).all())
        assert not bool((flat[:, graphs.scratch_slot] == 7.0).all())  # the padding rows went there


def test_plans_larger_than_the_buckets_prefill_eagerly(target, drafter, monkeypatch):
    """Up to 4 chunks and 32 tokens a step replays the graph; more prefills eagerly; outputs are
    the target's own greedy tokens either way, and the drafter's context the committed rows."""
    calls = {"graph": 0, "eager": 0}
    run, eager = PrefillGraphs.run, Engine._eager_prefill

    def count(kind, fn):
        def wrapped(*args, **kwargs):
            calls[kind] += 1
            return fn(*args, **kwargs)
        return wrapped

    engine = build_engine(target, drafter=drafter, max_prefill_tokens=48, prefill_buckets=BUCKETS)
    monkeypatch.setattr(PrefillGraphs, "run", count("graph", run))
    monkeypatch.setattr(Engine, "_eager_prefill", count("eager", eager))
    shared = _tokens(12, seed=99)  # a system prompt: later prompts hit the prefix cache
    prompts = [shared + _tokens(n, seed=i) for i, n in enumerate([3, 30, 8, 1, 5, 2])]
    params = SamplingParams(temperature=0.0, max_tokens=10)
    first = engine.generate(prompts[:1], params)  # alone: 15 tokens, one chunk
    rest = engine.generate(prompts[1:], params)  # 5 at once: 5 chunks > 4, then what is left
    for seq, prompt in zip(first + rest, prompts, strict=True):
        assert seq.output_ids == hf_greedy(target, prompt, 10)
    assert calls["graph"] >= 1 and calls["eager"] >= 1
    assert engine.scheduler.prefix_cache_hits > 0


def test_an_oracle_drafter_gets_the_prefill_context_from_the_engine(target):
    """Graphs built without a drafter of this process inject nothing: the engine gives the rows
    to whichever drafter it has, after the replay."""
    prompts = [_tokens(n, seed=10 + n) for n in (6, 13)]
    refs = {f"r{i}": p + hf_greedy(target, p, 24) for i, p in enumerate(prompts)}
    oracle = OracleProposer(B, V, refs, {rid: [1, 3, 0, 2] for rid in refs})
    engine = build_engine(target, proposer=oracle, prefill_buckets=BUCKETS)
    assert engine.prefill_graphs.proposer is None and not engine.prefill_graphs.injects_for(oracle)
    for rid, p in zip(refs, prompts, strict=True):
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=12), request_id=rid)
    while engine.has_unfinished():
        engine.step()
    for rid, p in zip(refs, prompts, strict=True):
        assert engine.sequences[rid].output_ids == refs[rid][len(p):len(p) + 12]
    injected = oracle.injected_positions
    assert all(pos in injected for pos in range(6)) and all(pos in injected for pos in range(13))


def test_the_drafter_context_after_graph_prefills_is_the_committed_rows(target, drafter):
    engine = build_engine(target, drafter=drafter, max_prefill_tokens=16, prefill_buckets=BUCKETS)
    prompts = [_tokens(n, seed=50 + n) for n in (9, 21)]
    for p in prompts:
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=7))
    while engine.has_unfinished():
        engine.step()
        for seq in engine.scheduler.running:
            assert_draft_context_is_committed_rows(engine.proposer, seq, KV)
    for rid, p in zip(list(engine.sequences), prompts, strict=True):
        assert engine.sequences[rid].output_ids == hf_greedy(target, p, 7)
