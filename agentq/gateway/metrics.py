"""The gateway's Prometheus metrics (its own registry) and the fleet's, read at scrape time."""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from agentq.agents import published_agent_details
from agentq.config import Settings
from agentq.llm.apis import api_view, read_learned
from agentq.telemetry.fleetcounts import FAMILIES, MAX_SERIES

if TYPE_CHECKING:
    from agentq.events import Event
    from agentq.llm.capacity import Capacity

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# The active turns, the fleet's counts, the capacity snapshots, the webhook counts and backlog.
Scrape = tuple[
    list[dict[str, Any]], dict[str, float], list[dict[str, Any]], tuple[dict[str, int], int | None]
]


class GatewayMetrics:
    """The gateway's own metrics, and what /metrics last read from Redis (`collect`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.events_streamed = PromCounter(
            "agentq_events_streamed", "SSE messages written to clients.", ["type"], registry=r
        )
        self.sse_connections = Gauge("agentq_sse_connections", "Open SSE responses.", registry=r)
        self.active_turns = Gauge(
            "agentq_active_turns", "Turns queued or running.", ["status"], registry=r
        )
        self.running_tools = Gauge(
            "agentq_running_tool_calls", "Dispatched tool calls without a result yet.", registry=r
        )
        self.redis_up = Gauge(
            "agentq_redis_up", "Whether the scrape-time Redis read worked.", registry=r
        )
        self.counts: dict[str, float] = {}
        self.snapshots: list[dict[str, Any]] = []
        self.webhooks: tuple[dict[str, int], int | None] = ({}, None)
        r.register(self)
        for status in ("queued", "running"):
            self.active_turns.labels(status=status).set(0)

    def streamed(self, ev: Event) -> None:
        self.events_streamed.labels(type=ev.type if len(ev.type) <= 40 else "other").inc()

    def refresh(self, scrape: Scrape | None) -> None:
        """Take what /metrics read; None: the read failed (the fleet's counts stay as last
        read: counters only grow; a stale queue length would mislead)."""
        self.redis_up.set(scrape is not None)
        if scrape is None:
            self.snapshots, self.webhooks = [], ({}, None)
            return
        active, self.counts, self.snapshots, self.webhooks = scrape
        by_status = Counter(str(turn.get("status")) for turn in active)
        for status in ("queued", "running"):
            self.active_turns.labels(status=status).set(by_status[status])
        self.running_tools.set(sum(len(turn["current_tools"]) for turn in active))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> list[Metric]:
        return [
            *fleet_families(self.counts),
            *capacity_families(self.snapshots),
            *webhook_families(*self.webhooks),
        ]


def fleet_families(counts: dict[str, float]) -> list[Metric]:
    """The fleet's counters and histograms; each family shows at least its unlabelled samples."""
    series: dict[str, dict[tuple[str, ...], dict[str, float]]] = {}
    for field, value in counts.items():
        name, _, rest = field.partition("|")
        raw_labels, _, part = rest.rpartition("|")
        f = FAMILIES.get(name)
        try:
            labels = tuple(str(v) for v in json.loads(raw_labels))
        except ValueError:
            continue
        if f is None or len(labels) != len(f.labels):
            continue  # a field of another version's families
        of = series.setdefault(name, {})
        if labels not in of and len(of) >= MAX_SERIES:
            labels = ("other",) * len(labels)
        parts = of.setdefault(labels, {})
        parts[part] = parts.get(part, 0.0) + value
    out: list[Metric] = []
    for f in FAMILIES.values():
        kind = CounterMetricFamily if f.buckets is None else HistogramMetricFamily
        family: Metric = kind(f"agentq_{f.name}", f.help, labels=list(f.labels))
        samples = series.get(f.name, {})
        if not samples and not f.labels:
            samples = {(): {}}
        for labels, parts in sorted(samples.items()):
            if f.buckets is None:
                family.add_metric(list(labels), parts.get("", 0.0))  # type: ignore[attr-defined]
                continue
            cumulative = 0.0
            buckets: list[tuple[str, float]] = []
            for i, le in enumerate((*f.buckets, float("inf"))):
                cumulative += parts.get(str(i), 0.0)
                buckets.append(("+Inf" if le == float("inf") else repr(float(le)), cumulative))
            family.add_metric(  # type: ignore[attr-defined]
                list(labels), buckets=buckets, sum_value=parts.get("sum", 0.0)
            )
        out.append(family)
    return out


def webhook_families(counts: dict[str, int], backlog_n: int | None) -> list[Metric]:
    attempts, deliveries, backlog = families = [
        CounterMetricFamily(
            "agentq_webhook_attempts", "Webhook attempts by outcome.", labels=["outcome"]
        ),
        CounterMetricFamily(
            "agentq_webhook_deliveries", "Webhook deliveries by status.", labels=["status"]
        ),
        GaugeMetricFamily("agentq_webhook_backlog", "Webhook deliveries not yet accepted."),
    ]
    for name, n in sorted(counts.items()):
        kind, _, label = name.partition(":")
        target = attempts if kind == "attempts" else deliveries
        target.add_metric([label], n)  # type: ignore[attr-defined]
    if backlog_n is not None:
        backlog.add_metric([], backlog_n)  # type: ignore[attr-defined]
    return families


def capacity_families(snapshots: list[dict[str, Any]]) -> list[GaugeMetricFamily]:
    queued, streams, paused, api = families = [
        GaugeMetricFamily(
            "agentq_llm_queued",
            "Model rounds waiting for model capacity, by class.",
            labels=["model", "class"],
        ),
        GaugeMetricFamily("agentq_llm_streams_in_use", "Model streams open now.", labels=["model"]),
        GaugeMetricFamily(
            "agentq_llm_paused",
            "1 while the model is paused fleet-wide (a provider said it was busy).",
            labels=["model"],
        ),
        GaugeMetricFamily(
            "agentq_llm_api",
            "1 for the API the model is called with (chat or responses), by its setting.",
            labels=["model", "api", "setting"],
        ),
    ]
    for snap in snapshots:
        model = str(snap["model"])
        for cls in ("interactive", "background"):
            queued.add_metric([model, cls], snap["queued"][cls])
        streams.add_metric([model], snap["streams_in_use"])
        until = snap.get("paused_until_ms")
        paused.add_metric([model], 1 if until and until > snap["now_ms"] else 0)
        if "api" in snap:
            api.add_metric([model, snap["api"]["in_use"], snap["api"]["setting"]], 1)
    return families


def read_snapshots(cap: Capacity, settings: Settings) -> list[dict[str, Any]]:
    """The capacity snapshot of every model the gateway knows, with its API (`api`)."""
    learned = read_learned(cap.redis)
    agents = [
        a["model"] for a in published_agent_details(cap.redis) if isinstance(a.get("model"), str)
    ]
    models = {*cap.limits, settings.llm_model, *agents, *learned}
    # A brace would end the model's Redis Cluster hash tag early (as parse_limits refuses).
    return [
        {**cap.snapshot(model), "api": api_view(model, settings, cap.limits, learned)}
        for model in sorted(m for m in models if m.strip() and "{" not in m and "}" not in m)
    ]
