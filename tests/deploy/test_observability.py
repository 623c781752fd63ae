"""deploy/grafana/ and deploy/prometheus/: every metric a dashboard panel or an alert
rule names is one a real gateway exports. The gateway runs on 127.0.0.1 in front of an
engine simulator; its /metrics page is read with Prometheus' own text parser, and a
family's series names follow from its type (a counter `x` is queried as `x_total`, a
histogram as `x_bucket`, `x_count`, `x_sum`)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.conftest import DEPLOY
from tests.online.conftest import Stack
from tests.online.helpers import http_get, http_post, wait_for

DASHBOARD = DEPLOY / "grafana" / "quillcache-gateway.json"
ALERTS = DEPLOY / "prometheus" / "quillcache-alerts.yaml"
# series Prometheus writes itself for every scrape target, not the gateway
PROMETHEUS_OWN = {"up"}
# PromQL words that look like names: binary operators, modifiers, literals
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "gaugehistogram": ("_bucket", "_gcount", "_gsum"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
    "gauge": ("",),
    "unknown": ("",),
    "stateset": ("",),
}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana variables allowed)."""
    s = re.sub(r"label_values\(\s*([^,()]*?)\s*,\s*\w+\s*\)", r"(\1)", expr)
    s = re.sub(r"\$\{?\w+\}?", " ", s)  # $instance, ${datasource}, $__rate_interval
    s = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', " ", s)  # strings
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges and subqueries
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", s):
        if s[m.end() :].lstrip().startswith("("):
            continue  # a function or an aggregation
        if m.group(0).lower() not in _KEYWORDS:
            names.add(m.group(0))
    return names


def dashboard_queries(dashboard: dict[str, Any]) -> dict[str, str]:
    """Where -> PromQL, for every panel target (rows included) and templating query."""
    out: dict[str, str] = {}

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            for t in p.get("targets", []):
                out[f"panel {p['title']!r} {t['refId']}"] = t["expr"]
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            out[f"variable {var['name']}"] = query["query"] if isinstance(query, dict) else query
    return out


def alert_queries(rules: dict[str, Any]) -> dict[str, str]:
    return {
        f"rule {r.get('alert') or r.get('record')}": r["expr"]
        for group in rules["groups"]
        for r in group["rules"]
    }


def exported_names(page: str) -> set[str]:
    names = set()
    for family in text_string_to_metric_families(page):
        names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def test_the_name_extraction() -> None:
    expr = (
        'sum by (instance, le) (rate(quillcache_route_seconds_bucket{instance=~"$instance",'
        ' le!="+Inf"}[$__rate_interval])) / ignoring(le) quillcache_ready offset 5m > 1e-3'
        " and on(instance) label_values(quillcache_kv_sources, instance) unless up == bool 0"
    )
    assert metric_names(expr) == {
        "quillcache_route_seconds_bucket",
        "quillcache_ready",
        "quillcache_kv_sources",
        "up",
    }


def test_dashboard_and_rules_are_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for p in panels:
            ids.append(p["id"])
            if p["type"] != "row":
                assert p["targets"], f"panel {p['title']!r} has no query"
                for t in p["targets"]:
                    assert t["expr"].strip() and t["datasource"]["uid"] == "${datasource}"
            walk(p.get("panels", []))

    walk(dashboard["panels"])
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    rules = yaml.safe_load(ALERTS.read_text())
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    assert alerts and len({r["alert"] for r in alerts}) == len(alerts)
    for r in alerts:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}
        assert r["labels"]["severity"] in {"critical", "warning", "info"}
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert re.fullmatch(r"\d+[smhd]", r.get("for", "0m")), r["alert"]


@pytest.fixture(scope="module")
def gateway_metrics(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """The series names of a real gateway's /metrics after it served a request."""
    stack = Stack(tmp_path_factory.mktemp("metrics"))
    try:
        stack.engine()
        gw = stack.start_gateway({"router": "quillcache"})
        wait_for(lambda: http_get(gw.url + "/ready").status_code == 200, what="/ready")
        answer = http_post(
            gw.url + "/v1/completions",
            json={"model": "sim-model", "prompt": "metrics " * 40, "max_tokens": 2},
        )
        assert answer.status_code == 200, answer.text
        page = http_get(gw.url + "/metrics").text
    finally:
        stack.kill_all()
    return exported_names(page)


def test_suffixes_follow_the_metric_types(gateway_metrics: set[str]) -> None:
    """A counter is only queryable with `_total`, a histogram only by its series."""
    assert "quillcache_requests_total" in gateway_metrics
    assert "quillcache_requests" not in gateway_metrics
    assert {"quillcache_route_seconds_bucket", "quillcache_route_seconds_count"} <= gateway_metrics
    assert "quillcache_route_seconds" not in gateway_metrics
    assert "quillcache_ready" in gateway_metrics


@pytest.mark.parametrize("source", ["dashboard", "alert rules"])
def test_every_metric_named_is_exported(source: str, gateway_metrics: set[str]) -> None:
    if source == "dashboard":
        queries = dashboard_queries(json.loads(DASHBOARD.read_text()))
    else:
        queries = alert_queries(yaml.safe_load(ALERTS.read_text()))
    assert queries
    unknown = {
        where: sorted(names)
        for where, expr in queries.items()
        if (names := metric_names(expr) - gateway_metrics - PROMETHEUS_OWN)
    }
    assert not unknown, f"{source} name metrics the gateway does not export: {unknown}"
    named = set().union(*(metric_names(e) for e in queries.values()))
    assert len(named & gateway_metrics) >= 5, named  # the extraction found real names


def test_a_panel_naming_a_missing_metric_is_caught(gateway_metrics: set[str]) -> None:
    """The check fails on a metric the gateway does not export (here a counter queried
    without its `_total`, as a dashboard written from the docs' family names would)."""
    dashboard = json.loads(DASHBOARD.read_text())
    dashboard["panels"][1]["targets"][0]["expr"] = "sum(rate(quillcache_requests[5m]))"
    missing = {
        where
        for where, expr in dashboard_queries(dashboard).items()
        if metric_names(expr) - gateway_metrics - PROMETHEUS_OWN
    }
    assert missing == {f"panel {dashboard['panels'][1]['title']!r} A"}
