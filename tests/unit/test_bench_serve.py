"""`dflash bench`: its statistics on synthetic records (our keys and vLLM bench's); Poisson
arrivals; the embedded engine end to end (CLI and report files), closed and open loop; the gRPC
load loop against a real in-process gRPC server hosting the real Router in front of a real
(colocated) Verifier, without Ray; and the OpenAI backend against a small OpenAI-protocol HTTP
server on a real socket (tests/openai_server.py). The engine's benchmark-only synthetic acceptance
fixes every round's acceptance, so tau and per-position acceptance are known. Conversations
(sharegpt-2turn) on all three backends: the second turn carries the first turn's answer as
streamed and is sent only after it arrived; latencies per turn; prefix caching on and off.
`--api-key` against servers that require a key, over gRPC and HTTP."""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import socket
import threading
import time
from types import SimpleNamespace

import grpc
import pytest

from dflash_serve.services.api.dflash.v1 import generation_pb2_grpc
from dflash_serve.services.bench.prompts import (
    MAX_TURN_CHARS,
    Conversation,
    Prompt,
    load_conversations,
    random_prompts,
)
from dflash_serve.services.bench.load_generators import EmbeddedBackend, GrpcBackend, OpenAIBackend
from dflash_serve.services.bench.report import comparison_lines, markdown_report
from dflash_serve.services.bench.serve_bench import (
    PASS_SEED_STRIDE,
    default_slices,
    run_bench,
    run_interleaved,
    slice_orders,
)
from dflash_serve.services.bench.summary import (
    PrefixCacheCounters,
    SpecCounters,
    distribution_ms,
    parse_prefix_cache_counters,
    parse_spec_counters,
    summarize,
)
from dflash_serve.services.bench.workload import BenchSampling, Load, RequestRecord
from dflash_serve.services.config import EngineConfig
from dflash_serve.services.engine.loader import build_engine
from dflash_serve.services.engine.synthetic_acceptance import SyntheticAcceptance
from dflash_serve.services.router.auth import ApiKeys
from dflash_serve.services.router.router import Router, RpcFailed
from dflash_serve.services.verifier.verifier import Verifier
from tests import openai_server
from tests.bench_data import REAL_DATA_DIR, write_tiny_bench_data
from tests.openai_server import OpenAIProtocolServer
from tests.served_pair import VOCAB, save_tiny_pair

BLOCK = 6
PROMPTS = [Prompt("toy", str(i), text) for i, text in enumerate(
    ["def fib(n):", "Write a haiku about the sea.", "import os\nprint(os.getcwd())", "What is 2 + 2?", "Hello"])]
# 1 token from the prefill, then rounds of 3 (synthetic tau 3): 1 + 3 + 3 = 7, exactly 2 rounds.
SAMPLING = BenchSampling(max_tokens=7, ignore_eos=True)
CONVERSATIONS = [Conversation("chat", str(i), turns) for i, turns in enumerate(
    [("Name a prime.", "And a larger one?"), ("Write a haiku.", "Now one about the sea."),
     ("def fib(n):", "Make it iterative.")])]
API_KEY = "sk-bench-0123456789"


# -- statistics -----------------------------------------------------------------------------------


def record(start, arrivals, tokens, rounds=0, accepted=0, per_position=(), error=None, input_tokens=0,
           end=None) -> RequestRecord:
    end = end if end is not None or not arrivals else arrivals[-1][0]
    return RequestRecord(start=start, arrivals=list(arrivals), end=end, input_tokens=input_tokens,
                         output_tokens=tokens, rounds=rounds, draft_tokens=rounds * (BLOCK - 1),
                         accepted_tokens=accepted, accepted_per_position=list(per_position), error=error)


def test_latencies_of_one_request():
    r = record(1.0, [(1.5, 1), (1.7, 3), (2.3, 2)], tokens=6)
    assert r.ttft == pytest.approx(0.5)
    assert r.tpot == pytest.approx(0.8 / 5)  # first token to last, over the 5 tokens after the first
    assert r.itls() == pytest.approx([0.2 / 3] * 3 + [0.3] * 2)  # a message's gap, spread over its tokens
    assert record(0.0, [(0.1, 1)], tokens=1).tpot is None and record(0.0, [], tokens=0).ttft is None


def test_distribution_in_ms():
    stats = distribution_ms([i / 1e3 for i in range(1, 101)])  # 1..100 ms
    # p99 interpolated linearly; std of the population, as numpy's (and vLLM's)
    assert stats == pytest.approx({"mean": 50.5, "median": 50.5, "std": 28.866070, "p99": 99.01})
    assert distribution_ms([]) == {"mean": None, "median": None, "std": None, "p99": None}


def test_summary_pools_rounds_and_leaves_failed_requests_out():
    records = [
        record(0.0, [(0.1, 1), (0.2, 4)], tokens=5, rounds=1, accepted=3, per_position=[1, 1, 1, 0, 0]),
        record(0.0, [(0.3, 1), (0.4, 1), (0.5, 2)], tokens=4, rounds=2, accepted=1, per_position=[1, 0, 0, 0, 0]),
        record(0.0, [], tokens=0, error="RESOURCE_EXHAUSTED"),
        record(0.0, [(0.1, 1)], tokens=0, error="INTERNAL"),
    ]
    s = summarize(records, duration=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (4, 2, 2)
    assert s["error_codes"] == {"RESOURCE_EXHAUSTED": 1, "INTERNAL": 1}
    assert s["output_tokens"] == 9 and s["output_tok_s"] == 4.5 and s["request_throughput"] == 1.0
    assert s["tau"] == pytest.approx(1 + 4 / 3)  # pooled over rounds, not a mean of per-request taus
    assert s["tau_per_request"] == pytest.approx(((1 + 3) + (1 + 1 / 2)) / 2)  # DFlash's script's mean
    assert s["acceptance_rate"] == pytest.approx(4 / 15)
    assert s["accepted_per_position"] == [2, 1, 1, 0, 0]
    assert s["acceptance_per_position"] == pytest.approx([2 / 3, 1 / 3, 1 / 3, 0, 0])
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)  # (100 + 300) / 2: failed requests are left out


def test_vllm_bench_keys_beside_ours():
    records = [
        record(0.0, [(0.1, 1), (0.3, 4)], tokens=5, rounds=1, accepted=3, per_position=[1, 1, 1, 0, 0],
               input_tokens=10, end=0.4),
        record(0.2, [(0.5, 1), (0.7, 1), (1.1, 2)], tokens=4, rounds=2, accepted=1, per_position=[1, 0, 0, 0, 0],
               input_tokens=6, end=1.2),
        record(0.0, [], tokens=0, error="UNAVAILABLE"),
    ]
    s = summarize(records, duration=2.0)
    assert (s["completed"], s["failed"], s["duration"]) == (2, 1, 2.0)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (16, 9)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 4.5 and s["total_token_throughput"] == 12.5
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["std_ttft_ms"] == pytest.approx(100.0) and s["p99_ttft_ms"] == s["ttft_ms"]["p99"]
    assert s["mean_tpot_ms"] == pytest.approx((200 / 4 + 600 / 3) / 2)
    assert s["mean_itl_ms"] == s["itl_ms"]["mean"] and s["p99_itl_ms"] == s["itl_ms"]["p99"]
    assert s["mean_e2el_ms"] == pytest.approx((400 + 1000) / 2)
    # 1 + 4 + 1 + 1 tokens arrive in the run's first second, 2 in its second; the two overlap.
    assert s["max_output_tokens_per_s"] == 7.0 and s["max_concurrent_requests"] == 2
    assert s["input_lens"] == [10, 6] and s["output_lens"] == [5, 4] and s["ttfts"] == pytest.approx([0.1, 0.3])
    assert s["spec_decode_acceptance_length"] == s["tau"] == pytest.approx(1 + 4 / 3)
    assert s["spec_decode_acceptance_rate"] == pytest.approx(100 * 4 / 15)  # a percentage, as vLLM's
    assert (s["spec_decode_num_drafts"], s["spec_decode_draft_tokens"], s["spec_decode_accepted_tokens"]) == (3, 15, 4)
    assert s["spec_decode_per_position_acceptance_rates"] == pytest.approx([2 / 3, 1 / 3, 1 / 3, 0, 0])


def test_server_counters_replace_the_requests_own():
    server = SpecCounters(drafts=4, draft_tokens=20, accepted=10, per_position=(4, 3, 2, 1, 0))
    s = summarize([record(0.0, [(0.1, 1), (0.2, 3)], tokens=4)], duration=1.0, server_spec=server)
    assert s["tau"] == pytest.approx(3.5) and s["acceptance_rate"] == pytest.approx(0.5)
    assert s["acceptance_per_position"] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert s["tau_per_request"] is None  # the server's counters are not per request


def test_spec_counters_are_read_under_vllms_names_and_ours():
    ours = (
        'ray_dflash_spec_decode_num_drafts_total{model_name="m",replica="a"} 3.0\n'
        'ray_dflash_spec_decode_num_drafts_total{model_name="m",replica="b"} 1.0\n'
        'ray_dflash_spec_decode_num_draft_tokens_total{model_name="m"} 20.0\n'
        'ray_dflash_spec_decode_num_accepted_tokens_total{model_name="m"} 6.0\n'
        'ray_dflash_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 2.0\n'
        'ray_dflash_spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0\n'
        'ray_dflash_generation_tokens_total{model_name="m"} 99.0\n'
    )
    assert parse_spec_counters(ours) == SpecCounters(4.0, 20.0, 6.0, (4.0, 2.0))
    with OpenAIProtocolServer() as server:
        server.completed = 2
        assert parse_spec_counters(server.metrics_text()) == SpecCounters(
            4.0, 20.0, 6.0, tuple(2.0 * c for c in openai_server.ACCEPTED_PER_POS))
    assert SpecCounters(5, 25, 8, (5, 3)) - SpecCounters(4, 20, 6, (4,)) == SpecCounters(1, 5, 2, (1, 3))


def test_prefix_cache_counters_are_read_under_vllms_names_and_ours():
    ours = ('ray_dflash_prefix_cache_queries_total{model_name="m",replica="a"} 30.0\n'
            'ray_dflash_prefix_cache_queries_total{model_name="m",replica="b"} 10.0\n'
            'ray_dflash_prefix_cache_hits_total{model_name="m",replica="a"} 16.0\n'
            'ray_dflash_spec_decode_num_drafts_total{model_name="m"} 3.0\n')
    assert parse_prefix_cache_counters(ours) == PrefixCacheCounters(40.0, 16.0)
    with OpenAIProtocolServer() as server:
        server.completed = 3
        assert parse_prefix_cache_counters(server.metrics_text()) == PrefixCacheCounters(
            3.0 * openai_server.CACHE_QUERIES, 3.0 * openai_server.CACHE_HITS)
    s = summarize([record(0.0, [(0.1, 1)], tokens=1)], 1.0, prefix_cache=PrefixCacheCounters(40.0, 16.0))
    assert (s["prefix_cache_queries"], s["prefix_cache_hits"], s["prefix_cache_hit_rate"]) == (40.0, 16.0, 0.4)
    assert summarize([record(0.0, [(0.1, 1)], tokens=1)], 1.0)["prefix_cache_hit_rate"] is None


def test_latencies_per_turn_of_the_conversations():
    records = [record(0.0, [(0.4, 1), (0.6, 2)], tokens=3, input_tokens=10),
               record(0.0, [(0.2, 1)], tokens=1, input_tokens=12),
               record(0.7, [(0.8, 1), (1.0, 1)], tokens=2, input_tokens=30),
               record(0.3, [], tokens=0, error="INVALID_ARGUMENT")]
    for r, turn in zip(records, (1, 1, 2, 2)):
        r.turn = turn
    one, two = summarize(records, duration=1.0)["turns"]
    assert (one["turn"], one["requests"], one["completed"], one["output_tokens"]) == (1, 2, 2, 4)
    assert one["mean_input_tokens"] == 11 and one["ttft_ms"]["mean"] == pytest.approx(300.0)
    assert one["ttft_ms"]["median"] == pytest.approx(300.0) and one["ttft_ms"]["p99"] == pytest.approx(398.0)
    assert (two["turn"], two["requests"], two["completed"], two["mean_input_tokens"]) == (2, 2, 1, 30)
    assert two["ttft_ms"]["mean"] == pytest.approx(100.0) and two["tpot_ms"]["mean"] == pytest.approx(200.0)
    assert two["e2el_ms"]["mean"] == pytest.approx(300.0)
    # Single requests are all turn 1.
    assert [t["turn"] for t in summarize(records[:2], duration=1.0)["turns"]] == [1]


def test_target_only_has_no_tau():
    s = summarize([record(0.0, [(0.1, 1), (0.2, 1)], tokens=2)], duration=1.0)
    assert s["tau"] is None and s["tau_per_request"] is None
    assert s["acceptance_rate"] is None and s["acceptance_per_position"] == []


# -- loads and prompts -----------------------------------------------------------------------------


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    offsets = Load(request_rate=20.0, seed=3).arrival_offsets(20000)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    assert offsets == Load(request_rate=20.0, seed=3).arrival_offsets(20000)
    assert offsets != Load(request_rate=20.0, seed=4).arrival_offsets(20000)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.03)
    # Exponential gaps: the standard deviation equals the mean.
    mean = sum(gaps) / len(gaps)
    assert (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 == pytest.approx(mean, rel=0.05)
    assert Load(request_rate=float("inf")).arrival_offsets(3) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(("load", "says"), [
    (dict(concurrency=None), "closed-loop load needs a concurrency"),
    (dict(request_rate=0.0), "--request-rate must be positive"),
    (dict(concurrency=0, request_rate=1.0), "concurrency must be positive"),
])
def test_bad_loads_are_refused(load, says):
    with pytest.raises(ValueError, match=says):
        Load(**load)


def test_random_prompts_are_token_ids_of_the_asked_lengths():
    prompts = random_prompts(4, input_len=7, output_len=5, vocab_size=VOCAB, seed=1)
    assert [len(p.token_ids) for p in prompts] == [7] * 4 and {p.max_tokens for p in prompts} == {5}
    assert all(0 <= t < VOCAB for p in prompts for t in p.token_ids)
    assert prompts == random_prompts(4, input_len=7, output_len=5, vocab_size=VOCAB, seed=1)
    assert prompts != random_prompts(4, input_len=7, output_len=5, vocab_size=VOCAB, seed=2)
    texts = random_prompts(2, 3, 5, VOCAB, seed=1, decode=lambda ids: " ".join(map(str, ids)))
    assert texts[0].text == " ".join(map(str, texts[0].token_ids))
    with pytest.raises(ValueError, match="--input-len"):
        random_prompts(4, input_len=0, output_len=5, vocab_size=VOCAB)


def test_conversations_are_built_from_the_sharegpt_file(tmp_path):
    data = write_tiny_bench_data(tmp_path / "bench-data")
    conversations = load_conversations("sharegpt-2turn", data)
    # Its first two user turns; conversations without two (or opening with an answer, or too long) left out.
    assert [(c.id, c.turns) for c in conversations] == [
        ("c0", ("Name a prime.", "And a larger one?")), ("c1", ("Write a haiku.", "Now one about the sea."))]
    assert [c.id for c in load_conversations("sharegpt-2turn", data, limit=3)] == ["c0", "c1", "c0"]
    first = conversations[0].first()
    assert (first.turn, first.messages()) == (1, [{"role": "user", "content": "Name a prime."}])
    second = conversations[0].after(first, "7, a prime.")
    assert second.turn == 2 and second.messages() == [
        {"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7, a prime."},
        {"role": "user", "content": "And a larger one?"}]
    assert conversations[0].after(second, "11") is None  # two turns, then done
    with pytest.raises(ValueError, match="unknown conversation set 'alpaca'"):
        load_conversations("alpaca", data)
    with pytest.raises(ValueError, match="sharegpt_sample4k.jsonl.gz not found: --data-dir"):
        load_conversations("sharegpt-2turn", tmp_path)


@pytest.mark.skipif(not REAL_DATA_DIR.is_dir(), reason=f"no bench data at {REAL_DATA_DIR}")
def test_the_shared_sharegpt_sample_gives_its_two_turn_conversations():
    conversations = load_conversations("sharegpt-2turn", REAL_DATA_DIR)
    assert len(conversations) == 1656
    assert conversations[0].turns == (
        "Sample definition, example and code of pairs trading in python using ADF test, z-score, trading signal, "
        "execution and calculation of strategy MtM and strategy PnL",
        "python code for MEAN-REVERSION STATISTICAL ARBITRAGE STRATEGY IN STOCKS")
    assert all(len(c.turns) == 2 and 0 < len(turn) <= MAX_TURN_CHARS for c in conversations for turn in c.turns)


# -- the embedded engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_pair(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("models"), block_size=BLOCK)


def check_known_acceptance(run: dict, requests: int) -> None:
    """Synthetic τ = 3: every request takes 2 rounds that each accept the first 2 of B-1 drafts."""
    assert (run["completed"], run["failed"]) == (requests, 0)
    assert run["output_tokens"] == SAMPLING.max_tokens * requests
    assert run["rounds"] == 2 * requests
    assert run["tau"] == run["tau_per_request"] == pytest.approx(3.0)  # equal when every request is alike
    assert run["acceptance_rate"] == pytest.approx(2 / (BLOCK - 1))
    assert run["acceptance_per_position"] == pytest.approx([1.0, 1.0, 0.0, 0.0, 0.0])


def test_a_run_shorter_than_min_seconds_sends_its_prompts_again_and_reports_them_pooled(model_pair):
    """The set runs until its runs add up to min_seconds (a repeat takes a while: here, time is
    made to pass 1 s a repeat: 3 repeats to reach 2.9 s while a run itself takes under 0.45 s — 0.3 s
    with 0.8 s got 2 on a loaded 2-core machine); the pooled run counts every request and every round."""
    target, drafter = model_pair
    engine = build_engine(EngineConfig(target=target, drafter=drafter, max_num_seqs=4, speculation="fixed",
                                       synthetic_acceptance_length=3.0))
    backend = EmbeddedBackend(engine)
    repeats, events = [], []
    run, clear = backend.run, backend.clear_prefix_cache

    def slow_run(*args, **kwargs):
        repeats.append(1)
        events.append("run")
        time.sleep(1.0)
        return run(*args, **kwargs)

    backend.run = slow_run
    backend.clear_prefix_cache = lambda: events.append("clear") or clear()
    (once,) = run_bench(backend, {"toy": PROMPTS}, [Load(4)], SAMPLING, warmup=0, show_progress=False)
    assert once["repeats"] == 1
    repeats.clear()
    events.clear()
    (pooled,) = run_bench(backend, {"toy": PROMPTS}, [Load(4)], SAMPLING, warmup=0, show_progress=False,
                          min_seconds=2.9)
    assert pooled["repeats"] == len(repeats) == 3 and pooled["duration_s"] >= 2.9
    check_known_acceptance(pooled, 3 * len(PROMPTS))
    assert events == ["clear", "run"] * 3  # each repeat starts from an empty prefix cache, as a run does
    table = markdown_report({"target": target, "max_tokens": 7, "temperature": 0.0, "warmup": 0, "min_seconds": 2.9},
                            [pooled])
    assert "A run under 2.9 s sent its prompts again" in table and f"| {3 * len(PROMPTS)} | 0 |" in table


def test_embedded_runs_at_each_concurrency(model_pair):
    target, drafter = model_pair
    engine = build_engine(EngineConfig(target=target, drafter=drafter, max_num_seqs=4, speculation="fixed",
                                       synthetic_acceptance_length=3.0))
    runs = run_bench(EmbeddedBackend(engine), {"toy": PROMPTS}, [Load(1), Load(4)], SAMPLING, warmup=1,
                     show_progress=False)
    assert [(r["dataset"], r["concurrency"]) for r in runs] == [("toy", 1), ("toy", 4)]
    for run in runs:
        check_known_acceptance(run, len(PROMPTS))
        # The engine's own count of the run's rounds (the warm-up's left out: one a request's
        # round at c = 1, fewer where a round serves several), and their phases.
        timed = run["engine_ms_per_round"]
        assert timed["rounds"] == run["rounds"] if run["concurrency"] == 1 else timed["rounds"] < run["rounds"]
        assert min(timed[k] for k in ("host", "draft", "verify")) > 0
        assert timed["rounds_by_k"] == {BLOCK - 1: timed["rounds"]}  # fixed: every round verifies B − 1
        # Each round read in the step loop has a period, within the run.
        ((read, ms),) = timed["period_ms_by_k"].values()
        assert set(timed["period_ms_by_k"]) == {BLOCK - 1} and 0 < read <= timed["rounds"]
        assert 0 < read * ms <= 1e3 * run["duration_s"]
        assert "policy" not in run  # no adaptive choice to report
    table = markdown_report({"target": target, "max_tokens": 7, "temperature": 0.0, "warmup": 1}, runs)
    timed = runs[1]["engine_ms_per_round"]
    assert f"| toy | c=4 | {timed['rounds']} | {timed['host']:.3f} | {timed['draft']:.3f} |" in table
    read, ms = timed["period_ms_by_k"][BLOCK - 1]
    assert f"| toy | c=4 | {BLOCK - 1} | {read} | {ms:.3f} |" in table
    assert not engine.sequences and engine.allocator.num_free == engine.allocator.num_blocks  # all released


def test_embedded_open_loop_sends_each_request_no_earlier_than_its_arrival(model_pair):
    target, drafter = model_pair
    engine = build_engine(EngineConfig(target=target, drafter=drafter, max_num_seqs=4, speculation="fixed"))
    engine.synthetic = SyntheticAcceptance(3.0)
    load = Load(concurrency=2, request_rate=40.0, seed=7)
    start = time.perf_counter()
    records = EmbeddedBackend(engine).run(PROMPTS, SAMPLING, load)
    for r, due in zip(records, load.arrival_offsets(len(PROMPTS))):  # in sending order
        assert r.start >= start + due
    run = summarize(records, time.perf_counter() - start)
    check_known_acceptance(run, len(PROMPTS))
    assert run["max_concurrent_requests"] <= 2
    assert not engine.sequences and engine.allocator.num_free == engine.allocator.num_blocks


def test_embedded_random_prompts_are_sent_as_token_ids(model_pair):
    target, _ = model_pair
    engine = build_engine(EngineConfig(target=target))
    prompts = random_prompts(3, input_len=9, output_len=4, vocab_size=VOCAB, seed=0)
    run = summarize(EmbeddedBackend(engine).run(prompts, BenchSampling(max_tokens=64, ignore_eos=True), Load(2)), 1.0)
    assert run["input_lens"] == [9, 9, 9] and run["output_lens"] == [4, 4, 4]  # each prompt's output length


def test_embedded_counts_refused_requests_as_failed(model_pair):
    target, _ = model_pair
    engine = build_engine(EngineConfig(target=target, max_tokens_limit=16))
    records = EmbeddedBackend(engine).run(PROMPTS[:2], BenchSampling(max_tokens=17), Load(2))
    assert summarize(records, 1.0)["error_codes"] == {"INVALID_ARGUMENT": 2}


def test_the_cli_writes_json_markdown_and_a_plot(model_pair, tmp_path, capsys):
    from dflash_serve.services.cli import main

    target, drafter = model_pair
    out = tmp_path / "bench"
    data = write_tiny_bench_data(tmp_path / "bench-data")
    assert main(["bench", "--backend", "embedded", "--target", target, "--drafter", drafter, "--dataset", "gsm8k,mbpp",
                 "--data-dir", str(data), "--num-prompts", "2", "--concurrency", "1,2", "--warmup", "1",
                 "--max-tokens", "5", "--ignore-eos", "--speculation", "fixed", "--out", str(out)]) == 0
    # fixed: every round verifies B−1 drafts, so every position has an acceptance (adaptive may verify fewer)
    results = json.loads((out / "results.json").read_text())
    assert results["setup"]["drafter"] == drafter and results["setup"]["block_size"] == BLOCK
    assert [(r["dataset"], r["concurrency"]) for r in results["runs"]] == [
        ("gsm8k", 1), ("mbpp", 1), ("gsm8k", 2), ("mbpp", 2)]
    for run in results["runs"]:
        assert run["completed"] == 2 and run["output_tokens"] == 10
        assert run["tau"] == pytest.approx(1 + sum(run["accepted_per_position"]) / run["rounds"])
        assert len(run["acceptance_per_position"]) == BLOCK - 1
    table = (out / "results.md").read_text()
    assert "| dataset | load | ok | failed | output tok/s | TTFT | TPOT | ITL | τ | τ per request | acceptance |" in table
    assert "| gsm8k | c=2 | 2 | 0 |" in table and "Acceptance per draft position" in table
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert table in capsys.readouterr().out


class RecordingBackend(EmbeddedBackend):
    """An embedded backend that logs which prompts each of its runs sent, under its name."""

    def __init__(self, engine, name: str, log: list):
        super().__init__(engine)
        self.name, self.log = name, log

    def run(self, items, sampling, load, progress=lambda: None):
        self.log.append((self.name, [p.id for p in items]))
        return super().run(items, sampling, load, progress)


def test_compared_engines_run_every_slice_back_to_back_in_every_order(model_pair):
    """--compare: each slice on every engine, the order changing through the permutations; per
    engine one run over all its slices, its own rounds counted, nothing left held."""
    target, drafter = model_pair
    log: list = []
    backends = {name: RecordingBackend(build_engine(EngineConfig(target=target, drafter=d, max_num_seqs=4,
                                                                 speculation=how)), name, log)
                for name, d, how in (("ar", None, "fixed"), ("fixed", drafter, "fixed"),
                                     ("adaptive", drafter, "adaptive"))}
    sampling = BenchSampling(max_tokens=6)
    runs = run_interleaved(backends, {"toy": PROMPTS}, [Load(1), Load(2)], sampling, warmup=1, slices=3,
                           show_progress=False)
    keys = [p.id for p in PROMPTS]
    warm = [(name, keys[:1]) for name in backends]
    # c = 1: slices of 1, 2 and 2 prompts; c = 2: two slices (three would hold fewer than 2 prompts)
    assert log == [*warm, ("ar", keys[:1]), ("fixed", keys[:1]), ("adaptive", keys[:1]),
                   ("ar", keys[1:3]), ("adaptive", keys[1:3]), ("fixed", keys[1:3]),
                   ("fixed", keys[3:]), ("ar", keys[3:]), ("adaptive", keys[3:]),
                   *warm, ("ar", keys[:2]), ("fixed", keys[:2]), ("adaptive", keys[:2]),
                   ("ar", keys[2:]), ("adaptive", keys[2:]), ("fixed", keys[2:])]
    assert [(r["engine"], r["concurrency"]) for r in runs] == [(e, c) for c in (1, 2) for e in backends]
    for run in runs:
        assert run["completed"] == len(PROMPTS) and run["failed"] == 0
        assert len(run["slice_output_tok_s"]) == (3 if run["concurrency"] == 1 else 2)
        assert "pass" not in run  # one pass
        assert run["engine_ms_per_round"]["rounds"] > 0  # its own rounds, the warm-up's left out
        by_k = run["engine_ms_per_round"]["rounds_by_k"]
        assert sum(by_k.values()) == run["engine_ms_per_round"]["rounds"]
        assert set(by_k) <= set(backends[run["engine"]].engine.speculation.ks)
        periods = run["engine_ms_per_round"]["period_ms_by_k"]
        assert set(periods) <= set(by_k) and all(0 < periods[k][0] <= by_k[k] for k in periods)
    assert [r["engine_ms_per_round"]["rounds_by_k"] for r in runs[::3]] == [
        {0: r["engine_ms_per_round"]["rounds"]} for r in runs[::3]]  # ar: AR steps only
    for run in runs[2::3]:  # adaptive: the policy's view of the run's batch at its end, at its rounds' mean context
        policy = run["policy"]
        assert policy["batch"] == min(run["concurrency"], len(PROMPTS)) and len(policy["acceptance"]) == BLOCK - 1
        assert policy["context"] > 0
        ks = set(backends["adaptive"].engine.speculation.ks)
        assert set(policy["expected_tokens"]) == set(policy["round_ms"]) == ks
        assert policy["expected_tokens"][0] == 1.0 and min(policy["round_ms"].values()) > 0
    last = runs[-1]["policy"]  # priced at its context (the adaptive engine ran no more after it)
    at_context = backends["adaptive"].engine.speculation.estimates(last["batch"], last["context"])
    assert last["round_ms"] == pytest.approx(at_context["round_ms"], rel=1e-3)
    assert "policy" not in runs[0] and "policy" not in runs[1]
    assert runs[0]["tau"] is None and runs[1]["tau"] >= 1.0  # ar drafts nothing
    for engine in backends.values():
        assert not engine.engine.sequences and engine.engine.allocator.num_free == engine.engine.allocator.num_blocks


def test_passes_repeat_the_comparison_on_the_same_engines_with_other_seeds(model_pair):
    """--passes: every (load, set) again on the same engines, warm-up and slices alike, each pass's
    requests with other seeds; each run and table row names its pass."""
    target, drafter = model_pair
    seeds: list = []

    class SeedLog(EmbeddedBackend):
        def run(self, items, sampling, load, progress=lambda: None):
            seeds.append(sampling.seed)
            return super().run(items, sampling, load, progress)

    backends = {how: SeedLog(build_engine(EngineConfig(target=target, drafter=drafter, max_num_seqs=2,
                                                       speculation=how))) for how in ("fixed", "adaptive")}
    runs = run_interleaved(backends, {"toy": PROMPTS}, [Load(2)], BenchSampling(max_tokens=4, seed=7), warmup=1,
                           slices=2, passes=2, show_progress=False)
    assert [(r["pass"], r["engine"]) for r in runs] == [(1, "fixed"), (1, "adaptive"), (2, "fixed"), (2, "adaptive")]
    assert all(r["completed"] == len(PROMPTS) and len(r["slice_output_tok_s"]) == 2 for r in runs)
    # per pass and engine: a warm-up and two slices
    assert seeds == [7] * 6 + [7 + PASS_SEED_STRIDE] * 6
    table = comparison_lines(runs)
    assert [line.split(" | ")[:2] for line in table[4:]] == [["| toy, pass 1", "c=2"], ["| toy, pass 2", "c=2"]]
    report = markdown_report({"target": target, "max_tokens": 4, "temperature": 0.0, "warmup": 1,
                              "engines": list(backends), "slices": 2, "passes": 2}, runs)
    assert "2 slices a run, 2 passes on the same engines." in report and "| toy, pass 2 (adaptive) | c=2 |" in report
    for backend in backends.values():
        assert not backend.engine.sequences and backend.engine.allocator.num_free == backend.engine.allocator.num_blocks


def test_slice_orders_balance_positions_and_neighbours():
    orders = slice_orders(["ar", "adaptive", "fixed"])
    assert len(orders) == 6 and len(set(orders)) == 6 == default_slices(3)
    assert default_slices(2) == 4  # two orders, each twice
    for name in ("ar", "adaptive", "fixed"):  # each position twice
        assert [o.index(name) for o in orders].count(0) == [o.index(name) for o in orders].count(2) == 2
    pairs = collections.Counter(pair for o in orders for pair in itertools.pairwise(o))
    assert set(pairs.values()) == {2} and len(pairs) == 6  # each engine right after each other one twice


def test_the_comparison_table_gives_ratios_pooled_and_per_slice():
    def run(engine, tok_s, slices):
        return {"engine": engine, "dataset": "gsm8k", "concurrency": 8, "request_rate": "inf",
                "output_tok_s": tok_s, "slice_output_tok_s": slices}

    lines = comparison_lines([run("ar", 100.0, [90.0, 110.0, 100.0]), run("adaptive", 150.0, [99.0, 165.0, 130.0])])
    assert lines[2] == "| dataset | load | ar tok/s | adaptive tok/s | adaptive / ar | by slice |"
    assert lines[4] == "| gsm8k | c=8 | 100.0 | 150.0 | 1.500 | 1.300 (1.100–1.500) |"


def test_the_cli_compares_engines_in_one_process(model_pair, tmp_path, capsys):
    from dflash_serve.services.cli import main

    target, drafter = model_pair
    out = tmp_path / "bench"
    assert main(["bench", "--embedded", "--target", target, "--drafter", drafter, "--dataset", "random",
                 "--input-len", "5", "--output-len", "4", "--num-prompts", "4", "--concurrency", "2",
                 "--warmup", "1", "--compare", "ar,adaptive,fixed", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    # six slices by default for three engines (every order once); four prompts at c = 2 make two
    assert list(results["setup"]["engines"]) == ["ar", "adaptive", "fixed"] and results["setup"]["slices"] == 6
    assert [len(r["slice_output_tok_s"]) for r in results["runs"]] == [2, 2, 2]
    assert results["setup"]["engines"]["ar"]["drafter"] == "" and results["setup"]["drafter"] == drafter
    assert [r["engine"] for r in results["runs"]] == ["ar", "adaptive", "fixed"]
    table = (out / "results.md").read_text()
    assert "| random (adaptive) | c=2 | 4 | 0 |" in table
    assert "| dataset | load | ar tok/s | adaptive tok/s | fixed tok/s | adaptive / ar | by slice | fixed / ar | " \
           "by slice |" in table
    assert table in capsys.readouterr().out


@pytest.mark.parametrize(("args", "says"), [
    (["--compare", "ar"], "two or more of ar, adaptive, fixed"),
    (["--compare", "ar,ar"], "each once"),
    (["--compare", "ar,eagle"], "two or more of ar, adaptive, fixed"),
    (["--compare", "ar,fixed", "--speculation", "fixed"], "leave --speculation out"),
    (["--compare", "ar,fixed", "--slices", "0"], "--slices must be positive"),
    (["--compare", "ar,fixed", "--passes", "0"], "--passes must be positive"),
    (["--compare", "ar,fixed", "--drafter", "none"], "needs a drafter"),
    (["--compare", "ar,fixed", "--min-seconds", "5"], "--compare times its engines on slices of one run"),
])
def test_the_cli_says_what_to_fix_in_a_comparison(model_pair, args, says, capsys):
    from dflash_serve.services.cli import main

    target, _ = model_pair
    assert main(["bench", "--embedded", "--target", target, "--dataset", "random", *args]) == 2
    assert says in capsys.readouterr().err


def test_slices_go_with_a_comparison(capsys):
    from dflash_serve.services.cli import main

    assert main(["bench", "--embedded", "--dataset", "random", "--drafter", "none", "--slices", "4"]) == 2
    assert "--slices cuts the runs of a comparison: give --compare too" in capsys.readouterr().err
    assert main(["bench", "--embedded", "--dataset", "random", "--drafter", "none", "--passes", "3"]) == 2
    assert "--passes repeats a comparison: give --compare too" in capsys.readouterr().err


def test_a_comparison_runs_only_embedded(capsys):
    from dflash_serve.services.cli import main

    assert main(["bench", "--backend", "grpc", "--dataset", "random", "--compare", "ar,fixed"]) == 2
    assert "use it with --backend embedded" in capsys.readouterr().err


def check_second_turns_carry_the_first_answers(records: list[RequestRecord], sent: list[Prompt]) -> None:
    """`records` and the prompts `sent` for them, in sending order, one client: turn 1, then turn 2 of
    each conversation in turn."""
    assert [r.turn for r in records] == [1, 2] * len(CONVERSATIONS)
    assert all(r.error is None and r.answer for r in records)
    for (first, second), (asked, follow_up), conversation in zip(
            zip(records[::2], records[1::2]), zip(sent[::2], sent[1::2]), CONVERSATIONS):
        assert asked.messages() == [{"role": "user", "content": conversation.turns[0]}]
        assert follow_up.messages() == [{"role": "user", "content": conversation.turns[0]},
                                        {"role": "assistant", "content": first.answer},  # as it was streamed
                                        {"role": "user", "content": conversation.turns[1]}]
        assert second.start >= first.end  # sent once the answer had arrived


def check_second_prompts_hold_the_first_turns(records: list[RequestRecord]) -> None:
    """By the server's count: turn 2's prompt holds turn 1's and about its answer (re-tokenized)."""
    for first, second in zip(records[::2], records[1::2]):
        assert second.input_tokens > first.input_tokens + first.output_tokens // 2


def test_embedded_conversations_send_the_first_answer_with_caching_on_and_off(model_pair, monkeypatch):
    target, drafter = model_pair
    answers, hits = {}, {}
    for caching in (True, False):
        engine = build_engine(EngineConfig(target=target, drafter=drafter, max_num_seqs=4, kv_block_size=4,
                                           enable_prefix_caching=caching))
        backend = EmbeddedBackend(engine)
        sent, prompt_ids = [], backend._prompt_ids
        monkeypatch.setattr(backend, "_prompt_ids", lambda prompt, ids=prompt_ids: sent.append(prompt) or ids(prompt))
        before = backend.prefix_cache_counters()
        records = backend.run(CONVERSATIONS, BenchSampling(max_tokens=12, ignore_eos=True), Load(1))
        check_second_turns_carry_the_first_answers(records, sent)
        check_second_prompts_hold_the_first_turns(records)
        answers[caching], hits[caching] = [r.answer for r in records], (backend.prefix_cache_counters() - before).hits
        # What a second turn shares with its first: at least the first turn's prompt, in full blocks.
        ids = [prompt_ids(prompt) for prompt in sent]
        shared = []
        for first_ids, second_ids in zip(ids[::2], ids[1::2]):
            common = next((i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b), len(first_ids))
            shared.append(common // 4 * 4)
        assert not engine.sequences and engine.allocator.num_free == engine.allocator.num_blocks
    assert answers[True] == answers[False]  # greedy: caching changes no output
    assert hits[False] == 0 and hits[True] >= sum(shared) > 0


def test_embedded_conversations_report_latencies_per_turn(model_pair):
    target, drafter = model_pair
    engine = build_engine(EngineConfig(target=target, drafter=drafter, max_num_seqs=4, speculation="fixed"))
    engine.synthetic = SyntheticAcceptance(3.0)
    loads = [Load(2), Load(concurrency=2, request_rate=50.0)]
    runs = run_bench(EmbeddedBackend(engine), {"chat": CONVERSATIONS}, loads, SAMPLING, warmup=1, show_progress=False)
    for run in runs:
        check_known_acceptance(run, 2 * len(CONVERSATIONS))  # both turns of every conversation
        assert [t["turn"] for t in run["turns"]] == [1, 2]
        for turn in run["turns"]:
            assert (turn["requests"], turn["completed"], turn["output_tokens"]) == (3, 3, 3 * SAMPLING.max_tokens)
            for key in ("ttft_ms", "tpot_ms", "e2el_ms"):
                assert all(isinstance(turn[key][stat], float) for stat in ("mean", "median", "p99")), key
        assert run["turns"][1]["mean_input_tokens"] > run["turns"][0]["mean_input_tokens"]
        assert run["prefix_cache_queries"] == sum(run["input_lens"]) and run["prefix_cache_hits"] > 0
    table = markdown_report({"target": target, "max_tokens": 7, "temperature": 0.0, "warmup": 1}, runs)
    assert "| dataset | load | turn | ok | mean prompt tokens | TTFT | TPOT | E2E | prefix-cache hits |" in table
    assert "| chat | c=2 | 1 | 3 |" in table and "| chat | c=2 | 2 | 3 |" in table
    assert not engine.sequences and engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("caching", ["on", "off"])
def test_the_cli_benchmarks_conversations_with_caching_on_and_off(model_pair, tmp_path, caching, capsys):
    from dflash_serve.services.cli import main

    target, drafter = model_pair
    out = tmp_path / "bench"
    data = write_tiny_bench_data(tmp_path / "bench-data")
    assert main(["bench", "--embedded", "--target", target, "--drafter", drafter, "--dataset", "sharegpt-2turn",
                 "--data-dir", str(data), "--num-prompts", "2", "--concurrency", "2", "--warmup", "1",
                 "--max-tokens", "6", "--ignore-eos", f"--{'' if caching == 'on' else 'no-'}enable-prefix-caching",
                 "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["setup"]["prefix_caching"] is (caching == "on")
    (run,) = results["runs"]
    assert (run["dataset"], run["num_prompts"], run["completed"]) == ("sharegpt-2turn", 2, 4)
    assert [(t["turn"], t["completed"]) for t in run["turns"]] == [(1, 2), (2, 2)]
    assert (run["prefix_cache_hits"] > 0) is (caching == "on")
    assert "| sharegpt-2turn | c=2 | 2 | 2 |" in capsys.readouterr().out


# -- over gRPC ------------------------------------------------------------------------------------


class InProcessVerifierHandle:
    """The shape of the verifier's Ray Serve handle (generate.remote(...), an awaitable that
    cancel() cancels; model_info.remote()) over a Verifier in this process."""

    def __init__(self, verifier: Verifier):
        self.verifier = verifier
        self.generate = SimpleNamespace(remote=self._generate)
        self.model_info = SimpleNamespace(remote=self._model_info)
        self.prompts: list[list[int]] = []  # the token ids of every request, as the router sent them

    def _generate(self, prompt_ids, params, request_id, reply_to):
        self.prompts.append(list(prompt_ids))
        return asyncio.ensure_future(self.verifier.generate(prompt_ids, params, request_id, reply_to))

    async def _model_info(self):
        return self.verifier.model_info()


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    """Hosts the router on grpc.aio, as the Serve proxy does."""

    def __init__(self, router: Router):
        self.router = router

    async def Generate(self, request, context):  # noqa: N802
        try:
            async for response in self.router.Generate(request, context):
                yield response
        except RpcFailed:
            return

    async def GetModelInfo(self, request, context):  # noqa: N802
        return await self.router.GetModelInfo(request, context)


@pytest.fixture(scope="module")
def verifier(model_pair):
    target, drafter = model_pair
    # SYNTHETIC acceptance through the config, as a served benchmark pair gets it.
    verifier = Verifier({"engine": {"target": target, "drafter": drafter, "max_num_seqs": 4, "max_tokens_limit": 64,
                                    "speculation": "fixed", "synthetic_acceptance_length": 3.0},
                         "topology": "colocated"})
    yield InProcessVerifierHandle(verifier)
    verifier.shutdown()


@pytest.fixture(scope="module")
def server(verifier, model_pair):
    yield from _grpc_server(Router(verifier, model_pair[0], max_model_len=512, max_tokens_limit=64,
                                   default_max_tokens=16, max_pending=8))


@pytest.fixture(scope="module")
def keyed_server(verifier, model_pair):
    """The same, requiring an API key."""
    yield from _grpc_server(Router(verifier, model_pair[0], max_model_len=512, max_tokens_limit=64,
                                   default_max_tokens=16, max_pending=8, api_keys=ApiKeys([API_KEY])))


def _grpc_server(router: Router):
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def start():
        grpc_server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(router), grpc_server)
        port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        return grpc_server, port

    grpc_server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    yield f"127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(grpc_server.stop(None), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


def test_grpc_runs_against_the_real_router_and_verifier(server, model_pair):
    backend = GrpcBackend(server, timeout=30)
    setup = backend.describe()
    assert (setup["target"], setup["drafter"], setup["topology"]) == (*model_pair, "colocated")
    runs = run_bench(backend, {"toy": PROMPTS}, [Load(1), Load(3)], SAMPLING, warmup=1, show_progress=False)
    for run in runs:
        check_known_acceptance(run, len(PROMPTS))


def test_grpc_failures_are_counted_by_status_code(server):
    records = GrpcBackend(server, timeout=30).run(PROMPTS[:3], BenchSampling(max_tokens=65), Load(2))
    s = summarize(records, 1.0)
    assert (s["completed"], s["failed"], s["error_codes"]) == (0, 3, {"INVALID_ARGUMENT": 3})
    records = GrpcBackend("127.0.0.1:1", timeout=5).run(PROMPTS[:1], SAMPLING, Load(1))
    assert records[0].error == "UNAVAILABLE"



def test_grpc_open_loop_and_token_prompts(server):
    runs = run_bench(GrpcBackend(server, timeout=30), {"toy": PROMPTS}, [Load(concurrency=2, request_rate=50.0)],
                     SAMPLING, warmup=0, show_progress=False)
    check_known_acceptance(runs[0], len(PROMPTS))
    assert runs[0]["max_concurrent_requests"] <= 2 and (runs[0]["request_rate"], runs[0]["max_concurrency"]) == (50.0, 2)
    prompts = random_prompts(2, input_len=11, output_len=3, vocab_size=VOCAB, seed=0)
    s = summarize(GrpcBackend(server, timeout=30).run(prompts, BenchSampling(ignore_eos=True), Load(2)), 1.0)
    assert s["input_lens"] == [11, 11] and s["output_lens"] == [3, 3]


def test_grpc_conversations_send_the_first_answer_in_the_second_turn(server, verifier, model_pair):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_pair[0])
    backend, sent = GrpcBackend(server, timeout=30), []
    records = backend.run(CONVERSATIONS, SAMPLING, Load(1))
    for record, conversation in zip(records[::2], CONVERSATIONS):
        first = conversation.first()
        sent += [first, conversation.after(first, record.answer)]
    check_second_turns_carry_the_first_answers(records, sent)
    check_second_prompts_hold_the_first_turns(records)
    # The router rendered each turn's messages, the first answer included, with the chat template.
    rendered = [tokenizer.apply_chat_template(p.messages(), add_generation_prompt=True, tokenize=True,
                                              return_dict=False) for p in sent]
    assert verifier.prompts[-len(sent):] == [list(ids) for ids in rendered]
    (run,) = run_bench(backend, {"chat": CONVERSATIONS}, [Load(2)], SAMPLING, warmup=0, show_progress=False)
    check_known_acceptance(run, 2 * len(CONVERSATIONS))
    assert [(t["turn"], t["completed"]) for t in run["turns"]] == [(1, 3), (2, 3)]
    assert isinstance(run["turns"][1]["ttft_ms"]["p99"], float)
    assert run["prefix_cache_hit_rate"] is None  # a gRPC server does not say


def test_bench_sends_the_api_key_over_grpc(keyed_server, tmp_path, monkeypatch, capsys):
    from dflash_serve.services.cli import main

    monkeypatch.delenv("DFLASH_API_KEY", raising=False)
    args = ["bench", "--address", keyed_server, "--dataset", "random", "--input-len", "5", "--output-len", "3",
            "--num-prompts", "2", "--concurrency", "2", "--warmup", "0", "--out", str(tmp_path / "bench")]
    assert main([*args, "--api-key", API_KEY]) == 0  # the server refuses every call without the key
    assert json.loads((tmp_path / "bench" / "results.json").read_text())["runs"][0]["completed"] == 2
    monkeypatch.setenv("DFLASH_API_KEY", API_KEY)  # the default
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args, "--api-key", "sk-wrong"]) == 2
    assert (f"error: the server at {keyed_server} refused the API key given: pass the server's key with --api-key "
            "KEY (or in $DFLASH_API_KEY)") in capsys.readouterr().err
    monkeypatch.delenv("DFLASH_API_KEY")
    assert main(args) == 2
    assert "requires an API key and none was given" in capsys.readouterr().err
    # Requests themselves with a wrong key: counted as UNAUTHENTICATED.
    records = GrpcBackend(keyed_server, timeout=30, api_key="sk-wrong").run(PROMPTS[:2], SAMPLING, Load(2))
    assert summarize(records, 1.0)["error_codes"] == {"UNAUTHENTICATED": 2}


# -- over OpenAI HTTP -----------------------------------------------------------------------------


@pytest.fixture
def openai():
    with OpenAIProtocolServer(api_key="sk-test") as server:
        yield server


def test_openai_completions_stream_with_usage_and_server_counters(openai):
    backend = OpenAIBackend(openai.base_url, api_key="sk-test", metrics_url=openai.base_url + "/metrics", timeout=10)
    setup = backend.describe()
    assert (setup["backend"], setup["target"], setup["endpoint"]) == ("openai", openai_server.MODEL, "/v1/completions")
    sampling = BenchSampling(max_tokens=7, seed=10, ignore_eos=True)
    (run,) = run_bench(backend, {"toy": PROMPTS}, [Load(3)], sampling, warmup=1, show_progress=False)
    assert (run["completed"], run["failed"]) == (len(PROMPTS), 0)
    assert run["output_lens"] == [7] * len(PROMPTS) and run["total_output_tokens"] == 7 * len(PROMPTS)
    assert sorted(run["input_lens"]) == sorted(len(p.text.split()) for p in PROMPTS)
    assert run["mean_ttft_ms"] > 0 and run["mean_tpot_ms"] > 0 and run["p99_itl_ms"] > 0
    # τ and acceptance from the server's counters over the measured requests only (warm-up excluded).
    n = len(PROMPTS)
    assert run["spec_decode_num_drafts"] == openai_server.DRAFTS * n
    assert run["spec_decode_acceptance_length"] == pytest.approx(1 + openai_server.ACCEPTED / openai_server.DRAFTS)
    assert run["spec_decode_acceptance_rate"] == pytest.approx(100 * openai_server.ACCEPTED / openai_server.DRAFT_TOKENS)
    assert run["spec_decode_per_position_acceptance_rates"] == pytest.approx(
        [c / openai_server.DRAFTS for c in openai_server.ACCEPTED_PER_POS])
    body = openai.requests[-1]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["temperature"] == 0.0
    assert sorted(b["seed"] for b in openai.requests[1:]) == [10 + i for i in range(n)]  # warm-up first


def test_openai_chat_and_token_prompts(openai):
    chat = OpenAIBackend(openai.base_url, endpoint="/v1/chat/completions", model=openai_server.MODEL,
                         api_key="sk-test", timeout=10)
    s = summarize(chat.run(PROMPTS[:2], BenchSampling(max_tokens=5), Load(2)), 1.0)
    assert (s["completed"], s["output_lens"]) == (2, [5, 5])
    assert s["spec_decode_acceptance_length"] is None  # no --metrics-url: the server's counters are unknown
    assert {b["messages"][0]["content"] for b in openai.requests} == {p.text for p in PROMPTS[:2]}
    assert all(b["max_completion_tokens"] == 5 and "max_tokens" not in b for b in openai.requests)
    completions = OpenAIBackend(openai.base_url, model=openai_server.MODEL, api_key="sk-test", timeout=10)
    prompts = random_prompts(2, input_len=6, output_len=3, vocab_size=VOCAB, seed=0)
    s = summarize(completions.run(prompts, BenchSampling(max_tokens=64), Load(2)), 1.0)
    assert s["input_lens"] == [6, 6] and s["output_lens"] == [3, 3]
    assert sorted(b["prompt"] for b in openai.requests[2:]) == sorted(list(p.token_ids) for p in prompts)
    with pytest.raises(ValueError, match="token prompts go to /v1/completions"):
        chat.payload(0, prompts[0], SAMPLING)


def test_openai_failures_are_counted(openai):
    backend = OpenAIBackend(openai.base_url, model=openai_server.MODEL, api_key="sk-test", timeout=10)
    prompts = [Prompt("toy", "0", "fail-400"), Prompt("toy", "1", "fail-mid"), PROMPTS[0]]
    s = summarize(backend.run(prompts, SAMPLING, Load(3)), 1.0)
    assert s["error_codes"] == {"HTTP_400": 1, "STREAM_ERROR": 1} and s["completed"] == 1
    wrong_key = OpenAIBackend(openai.base_url, model=openai_server.MODEL, api_key="sk-other", timeout=10)
    assert summarize(wrong_key.run(PROMPTS[:1], SAMPLING, Load(1)), 1.0)["error_codes"] == {"HTTP_401": 1}
    closed = OpenAIBackend("http://127.0.0.1:1", model=openai_server.MODEL, timeout=5)
    assert closed.run(PROMPTS[:1], SAMPLING, Load(1))[0].error == "ConnectError"


def test_the_cli_benchmarks_an_openai_server_with_random_prompts(openai, model_pair, tmp_path, monkeypatch, capsys):
    from dflash_serve.services.cli import main

    target, _ = model_pair  # its tokenizer: the random set's vocabulary
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    out = tmp_path / "bench"
    assert main(["bench", "--backend", "openai", "--base-url", openai.base_url, "--tokenizer", target,
                 "--metrics-url", openai.base_url + "/metrics", "--dataset", "random", "--input-len", "12",
                 "--output-len", "6", "--num-prompts", "4", "--request-rate", "100", "--max-concurrency", "2",
                 "--warmup", "0", "--seed", "1", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["setup"]["target"] == openai_server.MODEL and results["setup"]["input_len"] == 12
    (run,) = results["runs"]
    assert (run["request_rate"], run["max_concurrency"], run["num_prompts"], run["completed"]) == (100.0, 2, 4, 4)
    assert run["input_lens"] == [12] * 4 and run["total_output_tokens"] == 24
    for key in ["mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms",
                "request_throughput", "output_throughput", "total_token_throughput", "spec_decode_acceptance_length"]:
        assert isinstance(run[key], float), key
    assert "| random | 100/s ≤2 | 4 | 0 |" in capsys.readouterr().out


def test_openai_conversations_send_the_first_answer_in_the_second_turn(openai):
    backend = OpenAIBackend(openai.base_url, endpoint="/v1/chat/completions", model=openai_server.MODEL,
                            api_key="sk-test", timeout=10)
    records = backend.run(CONVERSATIONS, BenchSampling(max_tokens=5), Load(1))
    sent = [Prompt("chat", "", body["messages"][-1]["content"],
                   history=tuple((m["role"], m["content"]) for m in body["messages"][:-1])) for body in openai.requests]
    check_second_turns_carry_the_first_answers(records, sent)
    assert records[0].answer == "x" * 5  # what the server streamed
    with pytest.raises(ValueError, match="use --endpoint /v1/chat/completions"):
        OpenAIBackend(openai.base_url, model=openai_server.MODEL).payload(0, sent[1], SAMPLING)


def test_bench_sends_the_api_key_over_http(openai, model_pair, tmp_path, monkeypatch, capsys):
    from dflash_serve.services.cli import main

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    args = ["bench", "--backend", "openai", "--base-url", openai.base_url, "--tokenizer", model_pair[0],
            "--dataset", "random", "--input-len", "5", "--output-len", "3", "--num-prompts", "2", "--concurrency", "2",
            "--warmup", "0", "--out", str(tmp_path / "bench")]
    assert main([*args, "--api-key", "sk-test"]) == 0
    assert json.loads((tmp_path / "bench" / "results.json").read_text())["runs"][0]["completed"] == 2
    assert openai.authorizations == ["Bearer sk-test"] * 3  # /v1/models, then each completion
    capsys.readouterr()
    assert main([*args, "--api-key", "sk-wrong"]) == 2
    assert (f"error: the server at {openai.base_url} refused the API key given: pass the server's key with "
            "--api-key KEY (or in $OPENAI_API_KEY) (HTTP 401)") in capsys.readouterr().err
    assert main(args) == 2
    assert "requires an API key and none was given" in capsys.readouterr().err
    assert openai.authorizations[3:] == ["Bearer sk-wrong", None] and len(openai.requests) == 2


@pytest.mark.parametrize(("args", "says"), [
    (["--dataset", "humaneval"], "give --data-dir"),
    (["--backend", "openai", "--dataset", "random"], "give --tokenizer"),
    (["--concurrency", "2", "--request-rate", "5"], "bound it with --max-concurrency"),
    (["--max-concurrency", "2"], "give --request-rate too"),
    (["--request-rate", "fast"], "--request-rate takes comma-separated numbers"),
    (["--backend", "grpc", "--endpoint", "/v1/chat/completions"], "go with --backend openai"),
    (["--backend", "openai", "--dataset", "sharegpt-2turn", "--data-dir", "."], "give --endpoint /v1/chat/completions"),
    (["--backend", "grpc", "--no-enable-prefix-caching"], "the engine's flags go with --backend embedded"),
])
def test_the_cli_says_what_to_fix(openai, args, says, monkeypatch, capsys):
    from dflash_serve.services.cli import main

    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    base = ["--base-url", openai.base_url] if "openai" in args else []
    assert main(["bench", "--backend", "embedded", *args, *base] if "--backend" not in args
                else ["bench", *args, *base]) == 2
    assert says in capsys.readouterr().err


def test_openai_streams_are_read_to_their_end_so_the_connection_is_reused():
    """A client pools a connection only once its response body was read to the end: one that
    stops at `data: [DONE]` opens a connection per request (a TCP handshake in every TTFT)."""
    import re

    accepted = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer.get_extra_info("peername"))
        try:
            while True:  # HTTP/1.1 keep-alive: requests one after the other on this connection
                head = await reader.readuntil(b"\r\n\r\n")
                body = json.loads(await reader.readexactly(int(re.search(rb"content-length: *(\d+)", head, re.I)[1])))
                tokens = body["max_tokens"]
                events = [{"object": "text_completion", "choices": [{"index": 0, "text": "x" * tokens,
                                                                      "finish_reason": "length"}]},
                          {"object": "text_completion", "choices": [],
                           "usage": {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": 3 + tokens}}]
                payload = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n"
                             % len(payload) + payload)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(asyncio.start_server(handle, "127.0.0.1", 0))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        backend = OpenAIBackend(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", model="toy", timeout=10)
        records = backend.run(PROMPTS, BenchSampling(max_tokens=4), Load(1))
    finally:
        async def shut_down() -> None:
            server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(shut_down(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    assert [r.error for r in records] == [None] * len(PROMPTS) and all(r.output_tokens == 4 for r in records)
    assert len(accepted) == 1


def test_an_openai_server_that_stops_answering_is_a_read_timeout():
    """A request whose server accepts it and then says nothing fails as ReadTimeout after --timeout."""
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        port = silent.getsockname()[1]
        backend = OpenAIBackend(f"http://127.0.0.1:{port}", model=openai_server.MODEL, timeout=0.5)
        (record,) = backend.run(PROMPTS[:1], SAMPLING, Load(1))
        assert record.error == "ReadTimeout"
    finally:
        silent.close()
