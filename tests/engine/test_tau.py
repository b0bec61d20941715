"""τ (acceptance length) as vLLM's mean_acceptance_length and the z-lab reference's acceptance
length count it: the tokens a round commits (accepted drafts plus the bonus token, cut at a stop
token or max_tokens), averaged over the rounds that verified drafts (not the prefill's first
token, not a request's rounds without drafts). Per request (SpecStats) and pooled (the round log
the server's Prometheus counters are made of: τ = 1 + accepted / drafts).

The log of rounds is what the engine streamed: one output per commit, the first from the prefill,
then one per round, holding exactly the tokens that round committed.
"""

from __future__ import annotations

import collections

import pytest
import torch

from dflash_serve.services.engine.sampling_params import SamplingParams
from dflash_serve.services.engine.stopping import FinishReason
from tests.engine.harness import OracleProposer, build_engine, hf_greedy
from tests.targets import tiny_target

V = 96
B = 6


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", layers=4, vocab=V, seed=7).float()


def test_tau_is_tokens_committed_per_round_with_drafts_per_request_and_pooled(target):
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, V - 1, (9,), generator=g).tolist()
    ref = hf_greedy(target, prompt, 40)
    # A stop token first seen in the middle of the second round's block, which accepts every draft:
    # drafts after it are accepted too, and are not output.
    stop_at = next(i for i in range(1 + B + 1, 1 + 2 * B - 2) if ref[i] not in ref[:i])
    requests = {  # id -> (planted accepted drafts per round, params)
        "length": ([B - 1], SamplingParams(temperature=0.0, max_tokens=1 + B + 3)),  # cut inside round 2
        "stop": ([B - 1], SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=(ref[stop_at],))),
        "mixed": ([0, 3, B - 1, 1], SamplingParams(temperature=0.0, max_tokens=23)),
        "limited": ([B - 1], SamplingParams(temperature=0.0, max_tokens=16, num_speculative_tokens=2)),
        "opted-out": ([B - 1], SamplingParams(temperature=0.0, max_tokens=12, num_speculative_tokens=0)),
    }
    refs = {rid: prompt + ref + [0] * B for rid in requests}
    oracle = OracleProposer(B, V, refs, {rid: pattern for rid, (pattern, _) in requests.items()})
    engine = build_engine(target, proposer=oracle)
    for rid, (_, params) in requests.items():
        engine.add_request(prompt, params, rid)
    commits = collections.defaultdict(list)  # request id -> tokens of each commit, in order
    while engine.has_unfinished():
        for out in engine.step():
            commits[out.request_id].append(len(out.new_token_ids))

    assert engine.sequences["length"].finish_reason is FinishReason.LENGTH
    assert engine.sequences["stop"].output_ids == ref[: stop_at + 1]
    pooled_tokens = pooled_rounds = 0
    for rid in requests:
        stats = engine.sequences[rid].stats
        rounds = commits[rid][1:]  # the first commit is the prefill's token, not a round
        if rid == "opted-out":  # no round verified a draft of it: none is counted
            assert (stats.rounds, stats.mean_acceptance_length) == (0, 0.0) and len(rounds) == 11
            continue
        assert stats.rounds == len(rounds), rid
        assert stats.mean_acceptance_length == pytest.approx(sum(rounds) / len(rounds)), rid
        pooled_tokens, pooled_rounds = pooled_tokens + sum(rounds), pooled_rounds + len(rounds)
    # The ends that cut a round: its accepted drafts past max_tokens or the stop are not counted.
    for rid in ("length", "stop"):
        stats = engine.sequences[rid].stats
        assert sum(oracle.planned[rid][: stats.rounds]) > stats.accepted_tokens
    assert engine.sequences["limited"].stats.accepted_tokens == 2 * engine.sequences["limited"].stats.rounds

    # Pooled, as the server's counters and acceptance-length histogram have it (services/verifier).
    counted = [(d, a) for r in engine.round_log for d, a in zip(r.draft_tokens, r.accepted, strict=True) if d]
    assert len(counted) == pooled_rounds
    assert 1 + sum(a for _, a in counted) / len(counted) == pytest.approx(pooled_tokens / pooled_rounds)
    assert sorted(a + 1 for _, a in counted) == sorted(n for rid in requests if rid != "opted-out"
                                                       for n in commits[rid][1:])
