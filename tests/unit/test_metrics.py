"""The metric definitions: what Ray's metric layer accepts and what a scrape shows."""

import pickle
import subprocess
import sys

from dflash_serve.services.engine.stopping import FinishReason
from dflash_serve.services.metrics import FINISHED_REASONS, SPECS, TAG_KEYS, exported_names, vllm_series


def test_descriptions_and_names_are_ascii():
    # Ray's C++ metric layer refuses non-ASCII descriptions (UnicodeEncodeError at replica start).
    for spec in SPECS:
        spec.name.encode("ascii")
        spec.description.encode("ascii")


def test_exported_names_follow_ray_prefix_and_kind_suffixes():
    names = exported_names()
    assert "ray_dflash_spec_decode_num_drafts_total" in names
    assert "ray_dflash_kv_cache_usage_perc" in names
    assert {"ray_dflash_acceptance_length_bucket", "ray_dflash_acceptance_length_sum",
            "ray_dflash_acceptance_length_count"} <= names
    assert len(names) == sum(3 if s.kind == "histogram" else 1 for s in SPECS)


def test_finished_reasons_are_vllms_for_every_finish_reason():
    assert set(FINISHED_REASONS) == set(FinishReason)
    assert FINISHED_REASONS[FinishReason.CANCELLED] == "abort"
    assert set(FINISHED_REASONS.values()) == {"stop", "length", "abort", "error"}


def test_series_carry_model_name_as_vllms_do():
    assert "model_name" in TAG_KEYS and "model" not in TAG_KEYS


def test_vllm_names_map_onto_exported_series_with_their_suffixes():
    series = vllm_series()
    assert set(series.values()) <= exported_names()
    assert series["vllm:spec_decode_num_accepted_tokens_per_pos_total"] == (
        "ray_dflash_spec_decode_num_accepted_tokens_per_pos_total")
    assert series["vllm:time_to_first_token_seconds_bucket"] == "ray_dflash_time_to_first_token_seconds_bucket"
    # vLLM's deprecated TPOT name is an alias of its per-token inter-token latency.
    assert series["vllm:time_per_output_token_seconds_sum"] == series["vllm:inter_token_latency_seconds_sum"]
    assert series["vllm:kv_cache_usage_perc"] == "ray_dflash_kv_cache_usage_perc"


class _Recorded:
    """A ReplicaMetrics stand-in that keeps every call."""

    def __init__(self):
        import collections

        self.calls = []
        self.counts, self.observed, self.gauges = collections.Counter(), collections.defaultdict(list), {}

    def inc(self, name, value=1.0, **tags):
        self.calls.append(name)
        self.counts[(name, tuple(tags.values()))] += value

    def observe(self, name, value, **tags):
        self.observed[(name, tuple(tags.values()))].append(value)

    def set(self, name, value):
        self.gauges[name] = value


def _engine_metrics():
    """The engine process's events, and the replica's recorder they are handed to."""
    from dflash_serve.services.verifier.engine_metrics import EngineMetrics, MetricEvents

    recorded = _Recorded()
    metrics = EngineMetrics(recorded, period_s=3600.0)  # recorded when the test says
    return MetricEvents(), metrics, recorded


def test_spec_decode_counters_count_verified_drafts_and_the_chosen_k():
    """A round that verified k=3 of the drafts, for a request that limits them to 2 and one that
    opted out: draft and acceptance counters see only what each request verified; k is observed
    once per round, an AR round's 0 too while a drafter serves."""
    from dflash_serve.services.engine.round_record import RoundRecord

    events, metrics, recorded = _engine_metrics()
    events.rounds([RoundRecord(3, [3, 2, 0], [3, 1, 0], 0.01, 0.02), RoundRecord(0, [0, 0], [0, 0], 0.0, 0.01)],
                   speculative=True)
    events.rounds([RoundRecord(0, [0], [0], 0.0, 0.01)], speculative=False)  # target-only: no k observed
    metrics.add(events.take())
    metrics.record_pending()
    counts, observed = recorded.counts, recorded.observed
    assert counts[("dflash_spec_decode_num_drafts", ())] == 2
    assert counts[("dflash_spec_decode_num_draft_tokens", ())] == 5
    assert counts[("dflash_spec_decode_num_accepted_tokens", ())] == 4
    assert counts[("dflash_spec_decode_num_accepted_tokens_per_pos", ("0",))] == 2
    assert counts[("dflash_spec_decode_num_accepted_tokens_per_pos", ("2",))] == 1
    assert observed[("dflash_acceptance_length", ())] == [4, 2]
    assert observed[("dflash_spec_decode_tokens_per_round", ())] == [3, 0]
    assert observed[("dflash_step_phase_seconds", ("verify",))] == [0.02, 0.01, 0.01]
    assert observed[("dflash_step_phase_seconds", ("draft",))] == [0.01]
    metrics.close()


def test_engine_metrics_sum_counters_over_a_period_and_observe_every_token():
    """Counter events of a period become one increment a series; each token of a round is one
    inter-token sample; a finished request records its counts and latencies, a cancelled one its
    reason only; gauges are set as queued; the thread records what is left when closed."""
    from dflash_serve.services.engine.stopping import FinishReason
    from dflash_serve.services.verifier.engine_metrics import EngineMetrics, RequestTimings

    events, metrics, recorded = _engine_metrics()
    for _ in range(5):
        events.count("dflash_num_preemptions", 2)
    events.count("dflash_prefix_cache_hits", 0)  # zeros are not queued
    events.token_gaps([(0.004, 3), (0.01, 1)])
    events.request_finished(FinishReason.STOP, RequestTimings(prompt_tokens=7, output_tokens=5, e2e=0.5,
                                                              queue=0.01, ttft=0.1, tpot=0.1))
    events.request_finished(FinishReason.CANCELLED)
    events.phase_seconds("transport", [0.001, 0.002])
    events.gauges({"dflash_num_requests_running": 3})
    metrics.add(pickle.loads(pickle.dumps(events.take())))  # as they cross the pipe
    assert events.take() == []
    metrics.record_pending()
    assert recorded.calls.count("dflash_num_preemptions") == 1
    assert recorded.counts[("dflash_num_preemptions", ())] == 10
    assert ("dflash_prefix_cache_hits", ()) not in recorded.counts
    assert recorded.observed[("dflash_inter_token_latency_seconds", ())] == [0.004] * 3 + [0.01]
    assert recorded.counts[("dflash_request_success", ("stop",))] == 1
    assert recorded.counts[("dflash_request_success", ("abort",))] == 1
    assert recorded.counts[("dflash_prompt_tokens", ())] == 7
    assert recorded.counts[("dflash_generation_tokens", ())] == 5
    assert recorded.observed[("dflash_time_to_first_token_seconds", ())] == [0.1]
    assert recorded.observed[("dflash_step_phase_seconds", ("transport",))] == [0.001, 0.002]
    assert recorded.gauges == {"dflash_num_requests_running": 3}
    metrics.close()

    threaded = EngineMetrics(recorded := _Recorded(), period_s=3600.0)
    events.count("dflash_drafter_restarts", 1)
    threaded.add(events.take())
    threaded.close()
    assert recorded.counts[("dflash_drafter_restarts", ())] == 1


def test_the_replica_reads_every_metric_event_without_importing_torch():
    """The engine's process sends its metric events to the verifier replica's, which must not import
    torch to read them: a round's record once lived beside the round's torch code, and the replica
    imported torch, Triton and the kernels on its first metrics reply, in the thread that also
    ends its requests' calls, while its first requests ran."""
    from dflash_serve.services.engine.round_record import RoundRecord
    from dflash_serve.services.verifier.engine_metrics import MetricEvents, RequestTimings

    events = MetricEvents()
    events.rounds([RoundRecord(3, [3], [2], 0.01, 0.02)], speculative=True)
    events.token_gaps([(0.01, 2)])
    events.count("dflash_num_preemptions", 1)
    events.request_finished(FinishReason.LENGTH, RequestTimings(5, 8, 0.5, 0.01, 0.02, 0.004))
    events.phase_seconds("transport", [0.001])
    events.gauges({"dflash_num_requests_running": 1.0})
    read = ("import pickle, sys\n"
            "from dflash_serve.services.verifier.engine_metrics import EngineMetrics\n"
            "events = pickle.loads(sys.stdin.buffer.read())\n"
            "assert len(events) == 6 and 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)[:5]")
    child = subprocess.run([sys.executable, "-c", read], input=pickle.dumps(events.take()), capture_output=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr.decode()[-2000:]
