"""The Grafana dashboard and the Prometheus scrape config only name what is really exported:
every metric in every PromQL expression is read off a live gateway's and worker's /metrics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import aiohttp

from tests.conftest import StartCluster

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "infra" / "grafana" / "affinity-gateway.json"
PROMETHEUS = ROOT / "infra" / "prometheus" / "prometheus.yml"

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or",
             "unless", "bool", "offset", "inf", "nan"}
_SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count"),
             "gauge": ("",), "info": ("_info",), "summary": ("_sum", "_count", "")}


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions, keywords,
    label names or grouping labels."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # label values
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring)\s*\([^)]*\)", "", text)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        name, call = m.group(1), m.group(2)
        if not call and name not in _KEYWORDS:
            names.add(name)
    return names


def exported(text: str) -> set[str]:
    """Sample names a Prometheus text page can carry, from its # TYPE lines."""
    names = set()
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.MULTILINE):
        for suffix in _SUFFIXES.get(kind, ("",)):
            names.add(name if name.endswith(suffix) else name + suffix)
    return names


def test_promql_parsing() -> None:
    expr = ('histogram_quantile(0.95, sum by (le, worker) (rate(a_seconds_bucket{x="y"}[5m])))'
            ' / on (worker) group_left sum(b:c_total) or vector(0)')
    assert metric_names(expr) == {"a_seconds_bucket", "b:c_total"}


async def test_every_dashboard_expression_names_exported_metrics(
    start_cluster: StartCluster,
) -> None:
    cluster = await start_cluster(workers=1)
    async with aiohttp.ClientSession() as http:
        async with http.get(cluster.gateway_url + "/metrics") as r:
            available = exported(await r.text())
        async with http.get(cluster.worker_urls[0] + "/metrics") as r:
            available |= exported(await r.text())
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "affinity-gateway"
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 15
    used: set[str] = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        missing = names - available
        assert not missing, f"{expr!r} names metrics nobody exports: {sorted(missing)}"
        used |= names
    titles = " ".join(p["title"].lower() for p in dashboard["panels"])
    for topic in ("hit rate per worker", "time to first token", "misses by cause",
                  "load balance", "decisions by kind"):
        assert topic in titles
    for wanted in ("gateway_cache_misses_total", "gateway_time_to_first_token_seconds_bucket",
                   "gateway_route_decisions_total", "vllm:request_queue_time_seconds_bucket"):
        assert wanted in used


def test_prometheus_scrapes_the_compose_services() -> None:
    config = PROMETHEUS.read_text()
    assert '"gateway:8000"' in config
    assert 'names: ["worker"]' in config
    assert "port: 8001" in config
    compose = (ROOT / "docker-compose.yml").read_text()
    assert "./infra/prometheus/prometheus.yml:/etc/prometheus/prometheus.yml" in compose
