"""A run's metrics from its requests' records, under our keys and vLLM bench's (`summarize`), and the
server-side counters they may come from instead: speculative decoding and the prefix cache, as a
Prometheus scrape has them (vLLM's names, or ours as Ray exports them)."""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dflash_serve.services.bench.workload import RequestRecord


def distribution_ms(seconds: Sequence[float]) -> dict:
    if not seconds:
        return {"mean": None, "median": None, "std": None, "p99": None}
    ms = 1e3 * np.asarray(seconds, dtype=np.float64)
    return {"mean": float(ms.mean()), "median": float(np.median(ms)), "std": float(ms.std()),
            "p99": float(np.percentile(ms, 99))}


@dataclass(frozen=True)
class SpecCounters:
    """Speculative-decoding counts of a run: rounds with drafts, drafted and accepted tokens, and
    accepted tokens by draft position."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_position: tuple[float, ...] = ()

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        positions = max(len(self.per_position), len(before.per_position))

        def at(counts, j):
            return counts[j] if j < len(counts) else 0.0

        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted,
                            tuple(at(self.per_position, j) - at(before.per_position, j) for j in range(positions)))


def _peaks(records: Sequence[RequestRecord]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s (tokens arrived in the busiest whole second of the run) and
    max_concurrent_requests (most requests in flight at once)."""
    if not records:
        return 0.0, 0
    origin = min(r.start for r in records)
    per_second = Counter()
    for r in records:
        for at, count in r.arrivals:
            per_second[int(at - origin)] += count
    edges = sorted([(r.start, 1) for r in records if r.end is not None] +
                   [(r.end, -1) for r in records if r.end is not None])
    in_flight = most = 0
    for _, step in edges:
        in_flight += step
        most = max(most, in_flight)
    return float(max(per_second.values(), default=0)), most


@dataclass(frozen=True)
class PrefixCacheCounters:
    """Prompt tokens looked up in the prefix cache, and of those the ones found (vLLM's counts)."""

    queries: float = 0.0
    hits: float = 0.0

    def __sub__(self, before: PrefixCacheCounters) -> PrefixCacheCounters:
        return PrefixCacheCounters(self.queries - before.queries, self.hits - before.hits)


def turn_summaries(records: Sequence[RequestRecord]) -> list[dict]:
    """Per turn of the conversations: its requests' latencies (failed ones left out)."""
    turns = []
    for turn in sorted({r.turn for r in records}):
        mine = [r for r in records if r.turn == turn]
        ok = [r for r in mine if r.error is None]
        turns.append({
            "turn": turn,
            "requests": len(mine),
            "completed": len(ok),
            "mean_input_tokens": statistics.fmean(r.input_tokens for r in ok) if ok else None,
            "output_tokens": sum(r.output_tokens for r in ok),
            "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
            "tpot_ms": distribution_ms([r.tpot for r in ok if r.tpot is not None]),
            "e2el_ms": distribution_ms([r.latency for r in ok if r.latency is not None]),
        })
    return turns


def summarize(records: Sequence[RequestRecord], duration: float, server_spec: SpecCounters | None = None,
              prefix_cache: PrefixCacheCounters | None = None) -> dict:
    """The run's metrics, under our keys and vLLM bench's. Speculation counters are pooled over the
    successful requests' rounds, or are the server's (`server_spec`) where requests carry none;
    `prefix_cache`: the run's prefix-cache counts, where the backend knows them."""
    ok = [r for r in records if r.error is None]
    input_tokens = sum(r.input_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    if server_spec is None:
        per_position = [0] * max((len(r.accepted_per_position) for r in ok), default=0)
        for r in ok:
            for j, count in enumerate(r.accepted_per_position):
                per_position[j] += count
        spec = SpecCounters(sum(r.rounds for r in ok), sum(r.draft_tokens for r in ok),
                            sum(r.accepted_tokens for r in ok), tuple(per_position))
        per_request = [1 + r.accepted_tokens / r.rounds for r in ok if r.rounds]
    else:
        spec, per_request = server_spec, []
    rounds, drafted, accepted = spec.drafts, spec.draft_tokens, spec.accepted
    per_second = (lambda total: total / duration) if duration > 0 else (lambda total: 0.0)
    latencies = {
        "ttft": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot": distribution_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl": distribution_ms([gap for r in ok for gap in r.itls()]),
        "e2el": distribution_ms([r.latency for r in ok if r.latency is not None]),
    }
    tau = 1 + accepted / rounds if rounds else None
    acceptance_rate = accepted / drafted if drafted else None
    acceptance_per_position = [c / rounds for c in spec.per_position] if rounds else []
    max_tokens_per_s, max_in_flight = _peaks(records)
    vllm = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_second(len(ok)),
        "output_throughput": per_second(output_tokens),
        "total_token_throughput": per_second(input_tokens + output_tokens),
        "max_output_tokens_per_s": max_tokens_per_s,
        "max_concurrent_requests": max_in_flight,
        **{f"{stat}_{name}_ms": dist[stat] for name, dist in latencies.items()
           for stat in ("mean", "median", "std", "p99")},
        "input_lens": [r.input_tokens for r in ok],
        "output_lens": [r.output_tokens for r in ok],
        "ttfts": [r.ttft for r in ok],
        # Target-only serving has no rounds with drafts: the speculation keys do not apply (None).
        "spec_decode_acceptance_rate": None if acceptance_rate is None else 100 * acceptance_rate,  # %, as vLLM
        "spec_decode_acceptance_length": tau,
        "spec_decode_num_drafts": rounds,
        "spec_decode_draft_tokens": drafted,
        "spec_decode_accepted_tokens": accepted,
        "spec_decode_per_position_acceptance_rates": acceptance_per_position,
    }
    return {
        "requests": len(records),
        "error_codes": dict(Counter(r.error for r in records if r.error is not None)),
        "duration_s": duration,
        "output_tokens": output_tokens,
        "output_tok_s": per_second(output_tokens),
        **{f"{name}_ms": dist for name, dist in latencies.items()},
        "rounds": rounds,
        "tau": tau,
        # DFlash's own benchmark script (spec §3.1) averages each request's τ instead; short answers
        # weigh as much as long ones, so it reads higher where they accept more.
        "tau_per_request": statistics.fmean(per_request) if per_request else None,
        "acceptance_rate": acceptance_rate,
        "accepted_per_position": list(spec.per_position),
        "acceptance_per_position": acceptance_per_position,
        # Per turn of the conversations (one entry, turn 1, for single requests).
        "turns": turn_summaries(records),
        "prefix_cache_queries": None if prefix_cache is None else prefix_cache.queries,
        "prefix_cache_hits": None if prefix_cache is None else prefix_cache.hits,
        "prefix_cache_hit_rate": (prefix_cache.hits / prefix_cache.queries
                                  if prefix_cache is not None and prefix_cache.queries else None),
        **vllm,
    }


# Speculative-decoding counters in a Prometheus scrape: vLLM's names, or ours as Ray exports them.
SPEC_COUNTER_NAMES = {
    "drafts": ("vllm:spec_decode_num_drafts_total", "ray_dflash_spec_decode_num_drafts_total"),
    "draft_tokens": ("vllm:spec_decode_num_draft_tokens_total", "ray_dflash_spec_decode_num_draft_tokens_total"),
    "accepted": ("vllm:spec_decode_num_accepted_tokens_total", "ray_dflash_spec_decode_num_accepted_tokens_total"),
    "per_position": ("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                     "ray_dflash_spec_decode_num_accepted_tokens_per_pos_total"),
}


# Prefix-cache counters (prompt tokens looked up, and found): vLLM's names, or ours as Ray exports them.
PREFIX_CACHE_COUNTER_NAMES = {
    "queries": ("vllm:prefix_cache_queries_total", "ray_dflash_prefix_cache_queries_total"),
    "hits": ("vllm:prefix_cache_hits_total", "ray_dflash_prefix_cache_hits_total"),
}


def parse_prefix_cache_counters(text: str) -> PrefixCacheCounters:
    """The prefix-cache counters of a Prometheus text scrape, summed over every series."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"queries": 0.0, "hits": 0.0}
    key_of = {name: key for key, names in PREFIX_CACHE_COUNTER_NAMES.items() for name in names}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in key_of:
                totals[key_of[sample.name]] += sample.value
    return PrefixCacheCounters(totals["queries"], totals["hits"])


def parse_spec_counters(text: str) -> SpecCounters:
    """The speculative-decoding counters of a Prometheus text scrape, summed over every series
    (replicas, models); per-position counts by their `position` label."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {key: 0.0 for key in ("drafts", "draft_tokens", "accepted")}
    per_position: dict[int, float] = {}
    key_of = {name: key for key, names in SPEC_COUNTER_NAMES.items() for name in names}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = key_of.get(sample.name)
            if key == "per_position":
                position = int(sample.labels["position"])
                per_position[position] = per_position.get(position, 0.0) + sample.value
            elif key is not None:
                totals[key] += sample.value
    positions = tuple(per_position.get(j, 0.0) for j in range(max(per_position, default=-1) + 1))
    return SpecCounters(totals["drafts"], totals["draft_tokens"], totals["accepted"], positions)


def round_times_ms(timings) -> dict | None:
    """An embedded run's engine phases per round, in ms (`StepTimings`: host is the Python time of
    launching and finishing rounds; draft, verify, accept are device times on a GPU). The same
    work's host time differs between processes on a shared host: it tells the machine's drift
    from the engine's choices when runs of one cell spread. By k, [rounds, mean ms] of the rounds' periods
    (`StepTimings.period_by_k`): what the adaptive policy weighs."""
    if timings is None or not timings.rounds:
        return None
    per_round = {name: 1e3 * getattr(timings, name) / timings.rounds for name in ("host", "draft", "verify", "accept")}

    def periods(rounds: dict[int, int], seconds: dict[int, float]) -> dict[int, list]:
        return {k: [n, round(1e3 * seconds[k] / n, 4)] for k, n in sorted(rounds.items()) if n}

    return {"rounds": timings.rounds, **per_round, "rounds_by_k": timings.rounds_by_k,
            "period_ms_by_k": periods(timings.period_rounds_by_k, timings.period_by_k)}
