"""The Grafana dashboards in helm/dflash-serve/dashboards/: every PromQL expression parses, and
every series and label it names is one services/metrics.py exports (with Ray's `ray_` prefix)."""

from __future__ import annotations

import json
import re

import pytest

from dflash_serve.services.metrics import exported_names
from tests.helm.chart import CHART
from tests.helm.promql import check_labels, check_names, check_rates, metric_names

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
LABEL_VALUES = re.compile(r"^label_values\((?:(?P<query>.+),\s*)?(?P<label>\w+)\)$")


def load(path):
    return json.loads(path.read_text())


def panels(dashboard):
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def expressions(dashboard) -> list[str]:
    exprs = [t["expr"] for p in panels(dashboard) for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = LABEL_VALUES.match(variable["query"]["query"])
            assert match, f"variable {variable['name']}: expected label_values(...), got {variable['query']}"
            exprs.append(match["query"])
    return exprs


def test_the_three_dashboards_are_there():
    titles = {load(path)["title"] for path in DASHBOARDS}
    assert titles == {"DFlash acceptance", "DFlash latency", "DFlash load"}
    assert len({load(path)["uid"] for path in DASHBOARDS}) == len(DASHBOARDS)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_metric_in_every_query_is_one_we_export(path):
    assert set().union(*(check_names(expr) for expr in expressions(load(path))))


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_label_in_every_query_is_one_the_series_carry(path):
    for expr in expressions(load(path)):
        check_labels(expr)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_rates_are_taken_of_counters_and_histograms_only(path):
    for expr in expressions(load(path)):
        check_rates(expr)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_panels_are_complete(path):
    dashboard = load(path)
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "namespace", "model_name"} <= variables
    for panel in panels(dashboard):
        assert {"h", "w", "x", "y"} <= panel["gridPos"].keys()
        if panel["type"] == "row":
            continue
        assert panel["title"] and panel["targets"], panel["title"]
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            # Every query follows the dashboard's selectors.
            assert 'namespace=~"$namespace"' in target["expr"], target["expr"]
            assert 'model_name=~"$model_name"' in target["expr"], target["expr"]


def test_acceptance_dashboard_shows_tau_rate_positions_and_step_phases():
    exprs = " ".join(expressions(load(CHART / "dashboards" / "acceptance.json")))
    for series in ["ray_dflash_spec_decode_num_accepted_tokens_total", "ray_dflash_spec_decode_num_drafts_total",
                   "ray_dflash_spec_decode_num_draft_tokens_total",
                   "ray_dflash_spec_decode_num_accepted_tokens_per_pos_total", "ray_dflash_step_phase_seconds_bucket"]:
        assert series in exprs


def test_latency_dashboard_covers_every_latency_histogram():
    exprs = " ".join(expressions(load(CHART / "dashboards" / "latency.json")))
    for name in ["time_to_first_token", "inter_token_latency", "request_time_per_output_token",
                 "e2e_request_latency", "request_queue_time"]:
        assert f"ray_dflash_{name}_seconds_bucket" in exprs, name


def test_load_dashboard_covers_batch_kv_and_throughput():
    exprs = " ".join(expressions(load(CHART / "dashboards" / "load.json")))
    for series in ["ray_dflash_num_requests_running", "ray_dflash_num_requests_waiting",
                   "ray_dflash_kv_cache_usage_perc", "ray_dflash_generation_tokens_total"]:
        assert series in exprs


def test_the_name_check_catches_an_unknown_metric():
    names = metric_names('sum(rate(ray_dflash_spec_decode_num_draft_total{model_name=~"$model_name"}[$__rate_interval]))')
    assert names == {"ray_dflash_spec_decode_num_draft_total"} and not names <= exported_names()


def test_load_dashboard_shows_prefix_cache_hits_and_queries():
    exprs = " ".join(expressions(load(CHART / "dashboards" / "load.json")))
    for series in ["ray_dflash_prefix_cache_queries_total", "ray_dflash_prefix_cache_hits_total"]:
        assert series in exprs
