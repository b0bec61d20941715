"""The chart's optional PrometheusRule: recording rules that give the exported series vLLM's names,
and alerts. No CRD schema for PrometheusRule is available offline: its fields are checked here
against the Prometheus Operator's API (monitoring.coreos.com/v1 Rule), and every expression parses
and names only exported series and labels (tests/helm/promql.py, as for the dashboards)."""

from __future__ import annotations

import re

import pytest

from dflash_serve.services.metrics import vllm_series
from tests.helm.chart import NAMESPACE, render, scenario_values
from tests.helm.promql import check_labels, check_names, check_rates, metric_names

ENABLED = {"prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}}}
RULE_FIELDS = {"record", "alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
METRIC_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
DURATION = re.compile(r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$")
# What vLLM's dashboards and scrapers read, by the list.
VLLM_NAMES = {
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_accepted_tokens_per_pos_total",
    "vllm:time_to_first_token_seconds_bucket", "vllm:time_per_output_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
    "vllm:kv_cache_usage_perc", "vllm:num_requests_running", "vllm:num_requests_waiting",
    "vllm:request_success_total",
}
ALERTS = {"DFlashSpeculationOff", "DFlashAcceptanceCollapsed", "DFlashDrafterRestarts", "DFlashKVCacheFull",
          "DFlashQueueGrowing"}


def rule_object(values: dict) -> dict:
    (rule,) = render(values).all("PrometheusRule")
    return rule


def rules(values: dict) -> list[dict]:
    return [r for group in rule_object(values)["spec"]["groups"] for r in group["rules"]]


def test_off_by_default():
    assert render({}).all("PrometheusRule") == []


@pytest.mark.parametrize("values", [ENABLED, scenario_values("split-2gpu")], ids=["enabled", "split-2gpu"])
def test_fields_are_the_operators(values):
    rule = rule_object(values)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE and rule["metadata"]["labels"]["release"] == "prometheus"
    assert rule["spec"].keys() == {"groups"}
    groups = rule["spec"]["groups"]
    assert len({g["name"] for g in groups}) == len(groups) == 2
    for group in groups:
        assert group.keys() <= {"name", "interval", "rules"} and DURATION.match(group["interval"])
        for r in group["rules"]:
            assert r.keys() <= RULE_FIELDS and ("record" in r) != ("alert" in r), r
            assert isinstance(r["expr"], str) and DURATION.match(r.get("for", "0")), r
            assert all(isinstance(v, str) for v in {**r.get("labels", {}), **r.get("annotations", {})}.values()), r
            if "record" in r:
                assert METRIC_NAME.match(r["record"]) and not {"for", "annotations"} & r.keys(), r


@pytest.mark.parametrize("drafter", ["z-lab/Qwen3-8B-DFlash-b16", None], ids=["speculative", "target-only"])
def test_every_expression_parses_and_names_only_exported_series_and_labels(drafter):
    values = {**ENABLED, "dflash": {"engine": {"drafter": drafter}}}
    for r in rules(values):
        check_names(r["expr"])
        check_labels(r["expr"])
        check_rates(r["expr"])


def test_recording_rules_give_every_series_its_vllm_names():
    recorded = {r["record"]: r["expr"] for r in rules(ENABLED) if "record" in r}
    assert VLLM_NAMES <= recorded.keys()
    assert {name: metric_names(expr) for name, expr in recorded.items()} == {
        name: {ours} for name, ours in vllm_series().items()}
    for expr in recorded.values():  # only this release's series: two releases never record one series twice
        assert f'namespace="{NAMESPACE}"' in expr and 'ray_io_cluster=~"dflash-serve-raycluster-.+"' in expr


def test_alerts_with_and_without_a_drafter():
    alerts = {r["alert"]: r for r in rules(ENABLED) if "alert" in r}
    assert alerts.keys() == ALERTS
    assert alerts["DFlashSpeculationOff"]["for"] == "5m"
    assert alerts["DFlashKVCacheFull"]["expr"].endswith("> 0.95")
    assert alerts["DFlashAcceptanceCollapsed"]["expr"].endswith("< 1.5")
    assert all(a["labels"] == {"severity": "warning"} and a["annotations"]["summary"] for a in alerts.values())
    # Target-only serving never speculates: those two would fire forever.
    target_only = {r["alert"] for r in rules({**ENABLED, "dflash": {"engine": {"drafter": None}}}) if "alert" in r}
    assert target_only == ALERTS - {"DFlashSpeculationOff", "DFlashAcceptanceCollapsed"}


def test_thresholds_come_from_values_and_alerts_can_be_left_out():
    alerts = {"kvCacheUsage": {"above": 0.9, "for": "2m"}, "tauCollapse": {"below": 2.5, "for": "30m"},
              "labels": {"severity": "page", "team": "llm"}}
    found = {r["alert"]: r for r in rules({"prometheusRule": {"enabled": True, "alerts": alerts}}) if "alert" in r}
    assert found["DFlashKVCacheFull"]["expr"].endswith("> 0.9") and found["DFlashKVCacheFull"]["for"] == "2m"
    assert found["DFlashAcceptanceCollapsed"]["expr"].endswith("< 2.5")
    assert found["DFlashQueueGrowing"]["labels"] == {"severity": "page", "team": "llm"}
    only_recording = rules({"prometheusRule": {"enabled": True, "alerts": {"enabled": False}}})
    assert all("record" in r for r in only_recording)


def test_notes_say_what_the_rules_need():
    notes = render({"prometheusRule": {"enabled": True}}).notes
    assert "records them under vLLM's names (vllm:*) and alerts." in notes
    assert "scrape with it (or a monitor that adds the same labels)" in notes
    monitored = render({"prometheusRule": {"enabled": True}, "metrics": {"monitor": {"enabled": True}}}).notes
    assert "vllm:*" in monitored and "scrape with it" not in monitored
    assert "vllm:*" not in render({}).notes
