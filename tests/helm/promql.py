"""PromQL checks shared by the dashboards' and the PrometheusRule's tests: an expression parses,
names only series services/metrics.py exports (with Ray's `ray_` prefix) and labels those series
carry, and takes rates of counters and histograms only."""

from __future__ import annotations

import re

import promql_parser

from dflash_serve.services.metrics import SPECS, TAG_KEYS, exported_names

# Grafana's built-in interval variables, replaced by a duration so the expression parses.
INTERVALS = re.compile(r"\$__(rate_interval|interval|range)\b")
# Labels Prometheus adds to every scraped series (a PodMonitor's target labels and the chart's
# monitor's relabelings), besides ours.
TARGET_LABELS = {"namespace", "pod", "container", "job", "instance", "ray_io_cluster", "ray_io_node_type"}
METRIC_LABELS = set(TAG_KEYS) | {tag for spec in SPECS for tag in spec.extra_tags} | {"le"}
COUNTER_SUFFIXES = ("_total", "_bucket", "_sum", "_count")


def parse(expr: str):
    return promql_parser.parse(INTERVALS.sub("5m", expr))


def walk(expr: str) -> list:
    nodes = []
    promql_parser.walk(parse(expr), nodes.append)
    return nodes


def metric_names(expr: str) -> set[str]:
    return {node.name for node in walk(expr) if isinstance(node, promql_parser.VectorSelector)}


def label_names(expr: str) -> set[str]:
    names = set()
    for node in walk(expr):
        if isinstance(node, promql_parser.VectorSelector):
            names.update(m.name for m in node.matchers.matchers)
        elif isinstance(node, promql_parser.AggregateExpr) and node.modifier:
            names.update(node.modifier.labels)
        elif isinstance(node, promql_parser.BinaryExpr) and node.modifier and node.modifier.matching:
            names.update(node.modifier.matching.labels)
    return names


def check_names(expr: str) -> set[str]:
    """Asserts the expression names only exported series; returns them."""
    names = metric_names(expr)
    assert names and None not in names, f"no plain metric name in {expr}"
    exported = exported_names()
    assert names <= exported, f"{sorted(names - exported)} are not exported by services/metrics.py: {expr}"
    return names


def check_labels(expr: str) -> None:
    unknown = label_names(expr) - METRIC_LABELS - TARGET_LABELS
    assert not unknown, f"labels {sorted(unknown)} are on no series: {expr}"


def check_rates(expr: str) -> None:
    for node in walk(expr):
        if isinstance(node, promql_parser.Call) and node.func.name in ("rate", "increase"):
            (selector,) = node.args
            assert selector.vector_selector.name.endswith(COUNTER_SUFFIXES), expr
