"""The split topology without Ray: a DrafterServer in a thread, the engine with a RemoteProposer
over the real frame channel and shared buffers. Lossless, one frame per round, and a lost
drafter means target-only decoding, not failed requests."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest
import torch

from dflash_serve.services.drafter.server import DrafterServer
from dflash_serve.services.engine.draft_runner import Proposer
from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.verifier.remote_drafter import RemoteProposer
from tests.conftest import drafter_config, gemma4_drafter, random_drafter
from tests.engine import harness
from tests.engine.harness import assert_draft_context_is_committed_rows, build_engine, hf_greedy
from tests.targets import gemma4_31b_twin, tiny_target

V, B = 96, 5


@pytest.fixture
def pair():
    target = tiny_target("llama", layers=4, vocab=V, seed=13).float()
    cfg = drafter_config(block_size=B, vocab_size=V, num_target_layers=4, num_hidden_layers=2,
                         layer_types=["full_attention"] * 2, dflash_config={"mask_token_id": V - 1, "target_layer_ids": [1, 3]})
    return target, random_drafter(cfg, seed=8, dtype=torch.float32)


def _remote_engine(target, drafter, shared, draft_groups: int = 1, **engine_options):
    server = DrafterServer(drafter)
    server.start()
    engine = build_engine(target, proposer=_Placeholder(drafter), **engine_options)  # captures the drafter's layers
    proposer = RemoteProposer.connect(server.address, target=engine.runner.target, block_size=B,
                                      kv_block_size=engine.allocator.block_size,
                                      num_kv_blocks=engine.runner.pool.num_blocks, capacity_rows=64,
                                      max_num_seqs=engine.config.max_num_seqs, shared=shared,
                                      draft_groups=draft_groups)
    engine.attach_proposer(proposer)
    return engine, server, proposer


class _Placeholder(Proposer):
    """Stands in until the remote proposer is attached (the harness sizes the engine from it)."""

    def __init__(self, drafter):
        self.block_size = drafter.config.block_size
        self.target_layer_ids = drafter.config.target_layer_ids

    def request_drafts(self, *args, **kwargs):
        raise AssertionError("replaced before the first round")

    receive_drafts = inject_context = request_drafts


@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_remote_drafter_matches_local_drafter_and_plain_greedy(pair, sampling):
    target, drafter = pair
    prompts = [[1, 2, 3, 4], list(range(10, 40)), [7] * 6]
    params = (SamplingParams(temperature=0.0, max_tokens=30) if sampling == "greedy" else
              [SamplingParams(temperature=1.0, top_k=20, seed=s, max_tokens=30) for s in (3, 4, 5)])
    local = build_engine(target, drafter=drafter).generate(prompts, params)
    shared = []
    engine, server, proposer = _remote_engine(target, drafter, shared)
    # Mapped by both sides, the segments' names are gone already: nothing to leak on a SIGKILL.
    assert not any(os.path.exists(f"/dev/shm/{buffer.describe().shm_name}") for buffer in shared)
    chained, request = [], proposer.request_drafts
    proposer.request_drafts = lambda ids, bonus, *rest, **group: (chained.append(isinstance(bonus, torch.Tensor)),
                                                                  request(ids, bonus, *rest, **group))
    remote = engine.generate(prompts, params)
    # Chained rounds name their bonus tokens from the last round's results, unread by the host.
    assert any(chained) == harness.CHAIN_ROUNDS and not all(chained)
    for prompt, a, b in zip(prompts, local, remote, strict=True):
        assert b.output_ids == a.output_ids and len(b.output_ids) == 30
        assert sampling == "seeded" or b.output_ids == hf_greedy(target, prompt, 30)
        assert b.stats.accepted_per_position == a.stats.accepted_per_position  # the same drafts, remotely
    deadline = time.monotonic() + 10  # releases are sent without a reply: the server reads them in turn
    while server.stats()["live_sequences"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.stats()["live_sequences"] == 0  # every finished sequence was released
    # One frame per round: each round's feature rows ride on its draft request.
    assert server.stats()["steps"] == len(proposer.draft_seconds) > 0
    assert engine.allocator.num_free == engine.allocator.num_blocks
    proposer.release()
    for buffer in shared:
        buffer.close()


def test_a_dropped_channel_falls_back_to_target_only_without_failing_requests(pair):
    target, drafter = pair
    shared = []
    engine, server, proposer = _remote_engine(target, drafter, shared)
    prompts = [[5, 6, 7], [9, 8, 7, 6, 5]]
    ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=40)) for p in prompts]
    engine.step()
    engine.step()
    proposer.channel.close()  # the drafter process went away
    while engine.has_unfinished():
        engine.step()
    assert engine.proposer is None and engine.proposer_losses == 1
    for rid, prompt in zip(ids, prompts, strict=True):
        seq = engine.sequences[rid]
        assert seq.error is None and seq.output_ids == hf_greedy(target, prompt, 40)
    for buffer in shared:
        buffer.close()


def test_a_verifier_speaking_another_protocol_version_is_refused_with_the_reason(pair):
    from dflash_serve.services.api.dflash.v1 import drafter_pb2
    from dflash_serve.services.transport import connect

    _, drafter = pair
    server = DrafterServer(drafter)
    server.start()
    channel = connect(server.address, timeout=10)
    channel.send(drafter_pb2.DrafterRequest(hello=drafter_pb2.Hello(protocol_version=drafter_pb2.PROTOCOL_VERSION_1)))
    reply = channel.recv(drafter_pb2.DrafterReply, timeout=10).hello
    assert reply.error == "protocol version 1 is not supported; this drafter speaks 3"
    channel.close()


def test_a_tied_embedding_and_lm_head_are_shared_as_one_buffer(pair):
    target, drafter = pair
    target.lm_head.weight = target.model.embed_tokens.weight  # tie them, as SmolLM2 and Gemma do
    prompts = [[1, 2, 3, 4], list(range(10, 30))]
    local = build_engine(target, drafter=drafter).generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    shared = []
    engine, server, proposer = _remote_engine(target, drafter, shared)
    assert [b.buffer_id for b in shared] == ["features", "embedding", "chained_inputs", "drafts"]
    head = server.session.runner.target
    assert head.lm_head_weight.data_ptr() == head.input_embeddings.weight.data_ptr()
    remote = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))
    assert [s.output_ids for s in remote] == [s.output_ids for s in local]
    proposer.release()
    for buffer in shared:
        buffer.close()


def test_prefix_cache_hits_in_the_split_topology_bring_the_drafters_context_rows(pair):
    """The drafter's pool follows the verifier's block ids, so a block the verifier's prefix cache
    hits holds the drafter's context rows of those tokens too: a multi-turn conversation drafts
    exactly as a local drafter that prefills everything, and the rows of the hit blocks in the
    drafter process equal a dense recomputation."""
    target, drafter = pair
    shared = []
    engine, server, proposer = _remote_engine(target, drafter, shared)
    local = build_engine(target, drafter=drafter, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=15)
    history = []
    for user in ([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [8, 9, 7, 9], [3, 2, 3, 8, 4, 6]):
        prompt = history + user
        (remote,) = engine.generate([prompt], params)
        (dense,) = local.generate([prompt], params)
        assert remote.output_ids == dense.output_ids == hf_greedy(target, prompt, 15)
        assert remote.stats.accepted_per_position == dense.stats.accepted_per_position
        history = prompt + remote.output_ids
    # Turn 2 hits 24 of turn 1's 25 or 26 committed positions, turn 3 44 of turn 2's 44 or 45.
    assert engine.scheduler.prefix_cache_hits == 24 + 44
    # Turn 3's rounds were drafted after the rows of those 11 blocks reached the drafter.
    kv = engine.allocator.block_size
    blocks = engine.allocator.cached_prefix(remote.block_keys[:11])
    assert len(blocks) == 11
    hit = SimpleNamespace(num_cached=11 * kv, tokens=history, block_table=blocks)
    runner = SimpleNamespace(target=engine.runner.target, drafter=drafter, pool=server.session.runner.pool)
    assert_draft_context_is_committed_rows(runner, hit, kv)
    engine.allocator.release(blocks)
    assert engine.allocator.num_free == engine.allocator.num_blocks
    proposer.release()
    for buffer in shared:
        buffer.close()


@pytest.mark.parametrize("rounds", ["k0", "k2", "changing", "adaptive"])
def test_remote_drafter_is_lossless_for_every_k(pair, rounds):
    """Rounds verifying k of the drafts with the drafter in another process: k 0 sends it no draft
    request (its context rows still go), a k that changes every round follows chained rounds of
    another k, and the adaptive policy learns the drafter's cost from the rounds."""
    target, drafter = pair
    prompts = [[1, 2, 3, 4], list(range(10, 40)), [7] * 6]
    params = [SamplingParams(temperature=0.0, max_tokens=30), SamplingParams(temperature=1.0, seed=4, max_tokens=30),
              SamplingParams(temperature=0.9, top_k=12, seed=5, max_tokens=30)]
    reference = [s.output_ids for s in build_engine(target).generate(prompts, params)]
    options = {"k0": {"spec_table": {1: 0}}, "k2": {"spec_table": {1: 2}}, "changing": {},
               "adaptive": {"speculation": "adaptive"}}[rounds]
    shared = []
    engine, server, proposer = _remote_engine(target, drafter, shared, **options)
    if rounds == "changing":
        order = iter([2, 0, 4, 1, 0, 3] * 100)
        engine.speculation.choose = lambda caps, context: next(order)
    if rounds == "adaptive":  # measured at attach: the verify only; the drafter's cost is learnt
        assert engine.speculation.costs is not None and not engine.speculation.costs.measured_draft
    done = engine.generate(prompts, params)
    assert [s.output_ids for s in done] == reference
    assert reference[0] == hf_greedy(target, prompts[0], 30)
    ks = {r.k for r in engine.round_log}
    assert ks == {"k0": {0}, "k2": {2}, "changing": {0, 1, 2, 3, 4}}.get(rounds, ks)
    if rounds == "k0":
        assert not proposer.draft_seconds  # never asked for drafts
    if rounds == "adaptive" and max(ks) > 0:
        assert max(engine.speculation.costs.draft) > 0  # learnt from the rounds that drafted
    assert engine.allocator.num_free == engine.allocator.num_blocks
    proposer.release()
    for buffer in shared:
        buffer.close()


def test_a_gemma4_target_of_two_kv_groups_drafts_remotely_as_locally():
    """The 31B twin (sliding and global layers of two KV geometries) with a drafter of the z-lab
    Gemma-4 layout in another process: its features and block ids cross the transport as for any
    target, so the remote pair decodes the local pair's tokens, the target's own."""
    target, drafter = gemma4_31b_twin(seed=2), gemma4_drafter(block_size=B, seed=9)
    prompts = [list(range(10, 22)), [7, 30, 12, 5, 61, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=20)
    local = build_engine(target, drafter=drafter).generate(prompts, params)
    shared = []
    engine, server, proposer = _remote_engine(target, drafter, shared)
    assert len(engine.runner.pool.groups) == 2
    remote = engine.generate(prompts, params)
    for prompt, a, b in zip(prompts, local, remote, strict=True):
        assert b.output_ids == a.output_ids == hf_greedy(target, prompt, 20)
        assert b.stats.accepted_per_position == a.stats.accepted_per_position
    proposer.release()
    for buffer in shared:
        buffer.close()
