"""The metric definitions: what Ray's metric layer accepts and what a scrape shows."""

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


def test_spec_decode_counters_count_verified_drafts_and_the_chosen_k():
    """A round that verified k=3 of the drafts, for a request that limits them to 2 and one that
    opted out: draft and acceptance counters see only what each request verified; k is observed
    once per round, an AR round's 0 too."""
    import collections
    from types import SimpleNamespace

    from dflash_serve.services.engine.engine import RoundRecord
    from dflash_serve.services.verifier.verifier import Verifier

    counts, observed = collections.Counter(), collections.defaultdict(list)

    class Recorder:
        def inc(self, name, value=1.0, **tags):
            counts[(name, tuple(tags.values()))] += value

        def observe(self, name, value, **tags):
            observed[(name, tuple(tags.values()))].append(value)

    log = collections.deque([RoundRecord(3, [3, 2, 0], [3, 1, 0], 0.01, 0.02), RoundRecord(0, [0, 0], [0, 0], 0.0, 0.01)])
    verifier = SimpleNamespace(metrics=Recorder(), engine=SimpleNamespace(round_log=log, proposer=object()),
                               _remote_proposer=None, _set_gauges=lambda: None)
    Verifier._record_step(verifier)
    assert counts[("dflash_spec_decode_num_drafts", ())] == 2
    assert counts[("dflash_spec_decode_num_draft_tokens", ())] == 5
    assert counts[("dflash_spec_decode_num_accepted_tokens", ())] == 4
    assert counts[("dflash_spec_decode_num_accepted_tokens_per_pos", ("0",))] == 2
    assert counts[("dflash_spec_decode_num_accepted_tokens_per_pos", ("2",))] == 1
    assert observed[("dflash_acceptance_length", ())] == [4, 2]
    assert observed[("dflash_spec_decode_tokens_per_round", ())] == [3, 0]
    assert not log
