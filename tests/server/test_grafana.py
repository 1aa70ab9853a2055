"""examples/grafana: every series the dashboard queries is one the live server's /metrics
exports, counters and histograms are only read through rate(), and the Prometheus, Grafana
provisioning and compose files fit together."""

from __future__ import annotations

import json
import os
import re

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import ROOT

EXAMPLES = os.path.join(ROOT, "examples", "grafana")


def load(name: str):
    with open(os.path.join(EXAMPLES, name)) as f:
        return json.load(f) if name.endswith(".json") else yaml.safe_load(f)


def expressions(dashboard: dict) -> list[str]:
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_queried_series_is_exported_by_the_server(server):
    # One finished request, so that the per-reason counter has a sample.
    assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    text = httpx.get(server.url + "/metrics", timeout=30).text
    exported = {
        sample.name: family.type for family in text_string_to_metric_families(text) for sample in family.samples
    }
    dashboard = load("jaxllm-dashboard.json")
    queried = {name for expr in expressions(dashboard) for name in re.findall(r"jaxllm:[a-z0-9_]+", expr)}
    assert len(queried) >= 14
    assert queried <= set(exported), queried - set(exported)
    for expr in expressions(dashboard):
        assert expr.count("(") == expr.count(")"), expr
        for name in re.findall(r"jaxllm:[a-z0-9_]+", expr):
            # rate() over counters and histogram series; gauges read as they are.
            through_rate = re.search(r"rate\(" + re.escape(name) + r"\{", expr) is not None
            assert through_rate == (exported[name] in ("counter", "histogram")), (name, expr)
    label = "label_values(jaxllm:num_requests_running, model_name)"
    assert label in json.dumps(dashboard["templating"])
    assert f'model_name="{server.model}"' in text


def test_dashboard_panels_are_well_formed():
    dashboard = load("jaxllm-dashboard.json")
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    titles = {panel["title"] for panel in dashboard["panels"]}
    assert {
        "Token throughput",
        "Time to first token",
        "Time per output token",
        "End-to-end request latency",
        "Requests running and waiting",
        "KV cache usage",
        "Prefix cache hit rate",
        "Preemptions",
    } <= titles
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"]
        assert {"x", "y", "w", "h"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        assert all(t["refId"] for t in panel["targets"])


def test_compose_provisions_prometheus_and_the_dashboard():
    prometheus = load("prometheus.yml")
    job = prometheus["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"][0].endswith(":8000")
    compose = load("docker-compose.yml")
    mounted = [
        volume.split(":")[0].removeprefix("./")
        for service in compose["services"].values()
        for volume in service.get("volumes", [])
    ]
    assert sorted(mounted) == sorted(["prometheus.yml", "datasource.yml", "dashboards.yml", "jaxllm-dashboard.json"])
    assert all(os.path.exists(os.path.join(EXAMPLES, name)) for name in mounted)
    assert load("datasource.yml")["datasources"][0]["url"] == "http://prometheus:9090"
