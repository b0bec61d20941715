"""Every Prometheus metric of dflash-serve, defined here once (names follow vLLM's, prefix dflash_).

Metrics are Ray metrics (`ray.util.metrics`), recorded inside the replicas and exported by each
node's metrics agent (the `metrics` port, 8080 under KubeRay) with Ray's `ray_` prefix: the
counter `dflash_spec_decode_num_drafts` is scraped as `ray_dflash_spec_decode_num_drafts_total`,
a histogram `h` as `ray_h_bucket/_sum/_count`. `exported_names()` lists exactly what a scrape
shows, for dashboards and their tests.

vLLM's tooling reads `vllm:`-named series with a `model_name` label: the series carry
`model_name`, `finished_reason` takes vLLM's values, and the chart's optional PrometheusRule
records each series under the vLLM names of its spec (`vllm_series()`), since Ray's exporter
can only add its prefix.

Derived quantities (as vLLM documents them): acceptance rate = rate(accepted) / rate(draft
tokens); mean acceptance length τ = 1 + rate(accepted) / rate(drafts); per-position acceptance =
rate(accepted_per_pos{position}) / rate(drafts).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_serve.services.engine.stopping import FinishReason

PREFIX = "ray_"
TAG_KEYS = ("model_name", "deployment", "replica")
# vLLM's `finished_reason` values (a cancelled request is vLLM's abort).
FINISHED_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.CANCELLED: "abort",
                    FinishReason.ERROR: "error"}

# Latency buckets (seconds): sub-ms inter-token latencies up to minute-long requests.
LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 20.0, 40.0, 80.0]
STEP_BUCKETS = [0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.1, 0.25, 1.0]
ACCEPTANCE_BUCKETS = [float(i) + 0.5 for i in range(1, 33)]  # τ per round is an integer 1..B
K_BUCKETS = [float(i) + 0.5 for i in range(0, 32)]  # k per round is an integer 0..B−1


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: str  # counter | gauge | histogram
    description: str
    extra_tags: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    vllm: tuple[str, ...] = ()  # vLLM's names for the same quantity (without suffixes)


SPECS = (
    MetricSpec("dflash_spec_decode_num_drafts", "counter", "Speculative rounds that carried drafts.",
               vllm=("vllm:spec_decode_num_drafts",)),
    MetricSpec("dflash_spec_decode_num_draft_tokens", "counter", "Draft tokens proposed.",
               vllm=("vllm:spec_decode_num_draft_tokens",)),
    MetricSpec("dflash_spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted (bonus excluded).",
               vllm=("vllm:spec_decode_num_accepted_tokens",)),
    MetricSpec("dflash_spec_decode_num_accepted_tokens_per_pos", "counter",
               "Accepted draft tokens by draft position (0 = first draft).", ("position",),
               vllm=("vllm:spec_decode_num_accepted_tokens_per_pos",)),
    MetricSpec("dflash_spec_decode_tokens_per_round", "histogram",
               "Draft tokens a round verified (k; 0 = an AR step), per round while a drafter serves.",
               buckets=tuple(K_BUCKETS)),
    MetricSpec("dflash_acceptance_length", "histogram", "Tokens committed per round, bonus included (tau).",
               buckets=tuple(ACCEPTANCE_BUCKETS)),
    MetricSpec("dflash_step_phase_seconds", "histogram", "Time per engine step phase.", ("phase",),
               tuple(STEP_BUCKETS)),
    MetricSpec("dflash_time_to_first_token_seconds", "histogram", "Arrival to first token.",
               buckets=tuple(LATENCY_BUCKETS), vllm=("vllm:time_to_first_token_seconds",)),
    # vLLM's time_per_output_token_seconds became an alias of its per-token inter-token latency.
    MetricSpec("dflash_inter_token_latency_seconds", "histogram", "Time between streamed tokens (per token).",
               buckets=tuple(LATENCY_BUCKETS),
               vllm=("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds")),
    MetricSpec("dflash_request_time_per_output_token_seconds", "histogram",
               "Decode time / (output tokens - 1), one sample per request (TPOT).", buckets=tuple(LATENCY_BUCKETS),
               vllm=("vllm:request_time_per_output_token_seconds",)),
    MetricSpec("dflash_e2e_request_latency_seconds", "histogram", "Arrival to last token.",
               buckets=tuple(LATENCY_BUCKETS), vllm=("vllm:e2e_request_latency_seconds",)),
    MetricSpec("dflash_request_queue_time_seconds", "histogram", "Arrival to first scheduling.",
               buckets=tuple(LATENCY_BUCKETS), vllm=("vllm:request_queue_time_seconds",)),
    MetricSpec("dflash_prompt_tokens", "counter", "Prompt tokens of finished requests.",
               vllm=("vllm:prompt_tokens",)),
    MetricSpec("dflash_generation_tokens", "counter", "Generated tokens.", vllm=("vllm:generation_tokens",)),
    MetricSpec("dflash_request_success", "counter", "Finished requests by finish reason (vLLM's values).",
               ("finished_reason",), vllm=("vllm:request_success",)),
    MetricSpec("dflash_num_preemptions", "counter", "Sequences preempted for KV blocks.",
               vllm=("vllm:num_preemptions",)),
    MetricSpec("dflash_drafter_restarts", "counter", "Times the drafter was lost and the verifier fell back to AR."),
    MetricSpec("dflash_num_requests_running", "gauge", "Requests in the running batch.",
               vllm=("vllm:num_requests_running",)),
    MetricSpec("dflash_num_requests_waiting", "gauge", "Requests waiting to be scheduled.",
               vllm=("vllm:num_requests_waiting",)),
    MetricSpec("dflash_kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (0-1).",
               vllm=("vllm:kv_cache_usage_perc",)),
    MetricSpec("dflash_speculative_enabled", "gauge", "1 while a drafter serves this replica, 0 in AR fallback."),
    MetricSpec("dflash_prefix_cache_queries", "counter",
               "Tokens admitted sequences had to prefill, looked up in the prefix cache."),
    MetricSpec("dflash_prefix_cache_hits", "counter", "Of those tokens, the ones found in the prefix cache."),
)
SPEC_BY_NAME = {s.name: s for s in SPECS}


def _suffixes(kind: str) -> tuple[str, ...]:
    return {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}[kind]


def exported_names() -> set[str]:
    """The series names a Prometheus scrape of a Ray node shows for these metrics."""
    return {PREFIX + spec.name + suffix for spec in SPECS for suffix in _suffixes(spec.kind)}


def vllm_series() -> dict[str, str]:
    """vLLM series name -> the exported series it is recorded from (the chart's recording rules)."""
    return {vllm + suffix: PREFIX + spec.name + suffix
            for spec in SPECS for vllm in spec.vllm for suffix in _suffixes(spec.kind)}


class ReplicaMetrics:
    """The metric objects of one replica, created in its process, with its default tags set."""

    def __init__(self, *, model: str, deployment: str, replica: str):
        from ray.util import metrics

        kinds = {"counter": metrics.Counter, "gauge": metrics.Gauge, "histogram": metrics.Histogram}
        self._metrics = {}
        for spec in SPECS:
            kwargs = {"boundaries": list(spec.buckets)} if spec.kind == "histogram" else {}
            metric = kinds[spec.kind](spec.name, description=spec.description,
                                      tag_keys=TAG_KEYS + spec.extra_tags, **kwargs)
            metric.set_default_tags({"model_name": model, "deployment": deployment, "replica": replica})
            self._metrics[spec.name] = metric
            if spec.kind == "counter" and not spec.extra_tags:
                self.start_at_zero(spec.name)
        for reason in FINISHED_REASONS.values():
            self.start_at_zero("dflash_request_success", finished_reason=reason)

    def start_at_zero(self, name: str, **tags: str) -> None:
        """Export a counter's series at 0, so that an alert or panel on it has a series before
        the first event (a drafter restart may never come). Counter.inc refuses 0; recording the
        point is what inc does after that check (ray 2.60, pinned)."""
        self._metrics[name]._record(0.0, tags=tags or None)

    def inc(self, name: str, value: float = 1.0, **tags: str) -> None:
        if value:
            self._metrics[name].inc(value, tags=tags or None)

    def observe(self, name: str, value: float, **tags: str) -> None:
        self._metrics[name].observe(value, tags=tags or None)

    def set(self, name: str, value: float) -> None:
        self._metrics[name].set(value)
