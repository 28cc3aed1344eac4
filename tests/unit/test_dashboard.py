"""The Grafana dashboard and the observability compose file match what agentq exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import fakeredis
import yaml

from agentq.gateway.metrics import GatewayMetrics
from agentq.telemetry.fleetcounts import FleetCounts, read_counts

COMPOSE = Path(__file__).resolve().parents[2] / "compose"


def exported_names() -> set[str]:
    fc = FleetCounts()
    events: list[dict[str, Any]] = [
        {"type": "tool_finished", "tool": "echo", "status": "timeout", "duration_ms": 5},
        {"type": "llm_finished", "usage": {"prompt_tokens": 1}, "ttft_ms": 1, "duration_ms": 1},
        {"type": "turn_aborted", "reason": "user"},
    ]
    m = GatewayMetrics()
    r = fakeredis.FakeRedis()
    fc.events([(str(e["type"]), e) for e in events], r, flush_s=3600)
    fc.flush(r)
    m.refresh(([], read_counts(r), [], ({}, None)))
    return {
        re.split(r"[{ ]", line, maxsplit=1)[0]
        for line in m.render().decode().splitlines()
        if line and not line.startswith("#")
    }


def exprs(panels: list[dict[str, Any]]) -> list[str]:
    return [t["expr"] for p in panels for t in p.get("targets", [])]


def test_every_dashboard_query_names_an_exported_metric() -> None:
    dash = json.loads((COMPOSE / "grafana" / "agentq-dashboard.json").read_text())
    names = exported_names()
    queries = exprs(dash["panels"])
    assert len(queries) >= 10
    used = {n for q in queries for n in re.findall(r"\bagentq_[a-z_]+", q)}
    assert used - names == set(), sorted(names)
    for wanted in (
        "agentq_llm_tokens_total",
        "agentq_llm_ttft_seconds_bucket",
        "agentq_step_duration_seconds_bucket",
        "agentq_tool_duration_seconds_bucket",
    ):
        assert wanted in used, wanted
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))


def test_observability_override_fits_the_fleet() -> None:
    base = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    over = yaml.safe_load((COMPOSE / "docker-compose.observability.yml").read_text())
    agentq_services = {"gateway", "turns", "llm", "tools", "io"}
    assert agentq_services <= set(base["services"])
    for name in agentq_services:
        env = over["services"][name]["environment"]
        assert env["AGENTQ_LOG_FORMAT"] == "json" and env["OTEL_EXPORTER_OTLP_ENDPOINT"]
    for name in ("jaeger", "prometheus", "grafana"):
        for volume in over["services"][name].get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("./"):
                assert (COMPOSE / source).exists(), source
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    (job,) = prom["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["gateway:8000"]
