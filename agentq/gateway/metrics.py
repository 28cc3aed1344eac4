"""Prometheus metrics of the gateway, in a registry of their own (no process/GC collectors).

What each metric counts, and where it comes from:

- ``agentq_tool_duration_seconds{tool,status}`` histogram: ``duration_ms`` of every
  ``tool_finished`` event that carries one.
- ``agentq_tool_results_total{tool,status}``: every ``tool_finished`` event, i.e. every
  settled call, with or without a duration (denied calls have none).
- ``agentq_tool_timeouts_total{tool}``: ``tool_finished`` with status ``timeout`` (the
  hard limit killed the call; ``lost`` calls are counted under results only).
- ``agentq_llm_tokens_total{kind}``: ``usage`` of every ``llm_finished`` event, ``kind``
  ``prompt`` or ``completion``.
- ``agentq_llm_model_tokens_total{model,kind}``: the same by model (``llm_finished``
  carries its ``model``): ``rate(...[1m]) * 60`` is a model's tokens per minute.
- ``agentq_llm_rounds_queued_total{model}``: model rounds that had to wait for model
  capacity: the ``llm_queued`` event that starts a wait (``first``); the ones published
  as the round moves up the queue are not counted again. A round the provider refused
  as busy that waits again counts again.
- ``agentq_llm_queue_wait_seconds{model}`` histogram: ``queued_ms`` of ``llm_started``,
  how long a round that waited for capacity waited (rounds sent at once are not in it).
- ``agentq_llm_busy_total{model,deployment,status}``: a provider's busy answers (HTTP
  429, 503, 529): ``llm_finished`` with code ``EBUSY``.
- ``agentq_llm_ttft_seconds`` histogram: ``ttft_ms`` of ``llm_finished`` (from the round's
  start, retries included, to its first text, reasoning or tool call).
- ``agentq_llm_round_duration_seconds{outcome}`` histogram: ``duration_ms`` of
  ``llm_finished`` (``ok`` or ``error``).
- ``agentq_step_duration_seconds`` histogram: every turn step of the fleet, read from
  Redis at scrape time (each process adds its counts every ``AGENTQ_METRICS_FLUSH_S``).
- ``agentq_webhook_attempts_total{outcome}`` (``ok``, ``http_500``, ``timed_out``,
  ``refused``, ``unreachable`` ...), ``agentq_webhook_deliveries_total{status}``
  (``created``, ``delivered``, ``gone``, ``failed``), ``agentq_webhook_backlog`` (deliveries
  still to be accepted): fleet-wide, read from Redis at scrape time.
- ``agentq_turn_aborts_total{reason}``: ``turn_aborted`` events by reason (user,
  disconnect, timeout, error).
- ``agentq_turns_ended_total{outcome}``: terminal events (finished, aborted, error).
- ``agentq_watchdog_trips_total``: model streams cut by the inactivity watchdog, seen
  as an ``llm_retry`` or a failed ``llm_finished`` with code ``ETIMEDOUT`` (each trip
  ends in exactly one of the two).
- ``agentq_events_streamed_total{type}``: SSE messages this gateway wrote (one per
  client per event).
- ``agentq_sse_connections`` gauge: SSE responses open now.
- ``agentq_active_turns{status}`` gauge: turns in Redis' active set (queued, running),
  read from ``Client.active()`` when /metrics is scraped.
- ``agentq_running_tool_calls`` gauge: dispatched calls of active turns without a result
  yet, read at scrape time too.
- ``agentq_redis_up`` gauge: 1 if the scrape-time read of Redis worked, else 0.
- ``agentq_llm_queued{model,class}``, ``agentq_llm_streams_in_use{model}`` and
  ``agentq_llm_paused{model}`` (1 while the model is paused fleet-wide, e.g. after a 429)
  gauges: the capacity manager's state of every model the gateway knows (configured in
  ``AGENTQ_LLM_LIMITS``, ``AGENTQ_LLM_MODEL``, the published agents' models), read from
  Redis at scrape time (``class`` ``interactive`` or ``background``).

The event-derived metrics come from an :class:`EventObserver`: a subscription to the
channel where the publish scripts copy every turn's events of the types counted here
(`MEASURED_EVENTS_CHANNEL`; never deltas or progress, and an `llm_started` only when it
carries the `queued_ms` the queue-wait histogram observes), so they count the whole fleet's
events, whether or not anyone is watching a turn. Pub/sub delivers at most once: events
published while the gateway is down are not counted, and every gateway replica counts the
same events (aggregate replicas with `max`, not `sum`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import threading
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from agentq.constants import MEASURED_EVENTS_CHANNEL
from agentq.errors import REDIS_ERRORS, ModelBusy

log = logging.getLogger("agentq.gateway.metrics")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, float("inf"))
ROUND_BUCKETS_S = (0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120, float("inf"))
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, float("inf"))
QUEUE_BUCKETS_S = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, float("inf"))
MAX_TOOL_LABELS = 200
"""Tool names come from the model (an unknown tool still settles); cap the label set."""
MAX_MODEL_LABELS = 100
"""Models and deployments come from the fleet's configuration; capped all the same."""

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_.:/@+-]{1,128}$")
_ABORT_REASONS = frozenset({"user", "disconnect", "timeout", "error"})
_TERMINAL = {"turn_finished": "finished", "turn_aborted": "aborted", "turn_error": "error"}
_TOOL_STATUSES = frozenset({"ok", "error", "timeout", "cancelled", "denied", "lost"})


class _Labels:
    """A capped set of label values: past `limit` distinct ones, or one that does not
    match `pattern`, a value is counted as ``other``."""

    def __init__(self, pattern: re.Pattern[str], limit: int) -> None:
        self.pattern = pattern
        self.limit = limit
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, value: object) -> str:
        label = str(value)
        if not self.pattern.match(label):
            return "other"
        with self._lock:
            if label in self._seen:
                return label
            if len(self._seen) >= self.limit:
                return "other"
            self._seen.add(label)
            return label


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.tool_duration = Histogram(
            "agentq_tool_duration_seconds",
            "Duration of settled tool calls.",
            ["tool", "status"],
            buckets=DURATION_BUCKETS_S,
            registry=r,
        )
        self.tool_results = Counter(
            "agentq_tool_results", "Settled tool calls.", ["tool", "status"], registry=r
        )
        self.tool_timeouts = Counter(
            "agentq_tool_timeouts", "Tool calls stopped by their hard limit.", ["tool"], registry=r
        )
        self.aborts = Counter(
            "agentq_turn_aborts", "Aborted turns by reason.", ["reason"], registry=r
        )
        self.turns_ended = Counter(
            "agentq_turns_ended", "Turns that ended, by outcome.", ["outcome"], registry=r
        )
        self.watchdog_trips = Counter(
            "agentq_watchdog_trips", "Model streams cut by the inactivity watchdog.", registry=r
        )
        self.events_streamed = Counter(
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
        self.tokens = Counter(
            "agentq_llm_tokens", "Model tokens by kind (prompt, completion).", ["kind"], registry=r
        )
        self.ttft = Histogram(
            "agentq_llm_ttft_seconds",
            "Time to first token of model rounds.",
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.round_duration = Histogram(
            "agentq_llm_round_duration_seconds",
            "Duration of model rounds, by outcome.",
            ["outcome"],
            buckets=ROUND_BUCKETS_S,
            registry=r,
        )
        self.model_tokens = Counter(
            "agentq_llm_model_tokens",
            "Model tokens by model and kind (prompt, completion).",
            ["model", "kind"],
            registry=r,
        )
        self.rounds_queued = Counter(
            "agentq_llm_rounds_queued",
            "Model rounds that had to wait for model capacity.",
            ["model"],
            registry=r,
        )
        self.queue_wait = Histogram(
            "agentq_llm_queue_wait_seconds",
            "How long model rounds waited for model capacity.",
            ["model"],
            buckets=QUEUE_BUCKETS_S,
            registry=r,
        )
        self.busy = Counter(
            "agentq_llm_busy",
            "Busy answers (429, 503, 529) of model providers.",
            ["model", "deployment", "status"],
            registry=r,
        )
        self.steps = StepDurations()
        r.register(self.steps)
        self.capacity = CapacityGauges()
        r.register(self.capacity)
        self.webhooks = WebhookMetrics()
        r.register(self.webhooks)
        for status in ("queued", "running"):
            self.active_turns.labels(status=status).set(0)
        for kind in ("prompt", "completion"):
            self.tokens.labels(kind=kind)
        self._tool_label = _Labels(_TOOL_NAME, MAX_TOOL_LABELS)
        self._model_label = _Labels(_MODEL_NAME, MAX_MODEL_LABELS)
        self._deployment_label = _Labels(_MODEL_NAME, MAX_MODEL_LABELS)

    def _model(self, event: dict[str, Any]) -> str:
        model = event.get("model")
        return "unknown" if model is None else self._model_label(model)

    def observe(self, event: dict[str, Any]) -> None:
        """Fold one event (as published) into the counters."""
        type_ = event.get("type")
        if type_ == "tool_finished":
            tool = self._tool_label(event.get("tool"))
            status = str(event.get("status"))
            status = status if status in _TOOL_STATUSES else "other"
            self.tool_results.labels(tool=tool, status=status).inc()
            duration_ms = event.get("duration_ms")
            if isinstance(duration_ms, (int, float)) and duration_ms >= 0:
                self.tool_duration.labels(tool=tool, status=status).observe(duration_ms / 1000)
            if status == "timeout":
                self.tool_timeouts.labels(tool=tool).inc()
        elif type_ == "llm_finished":
            self._llm_finished(event)
        elif type_ == "llm_queued":
            # Published again as the round moves up the queue: only its first one counts.
            if event.get("first") is True:
                self.rounds_queued.labels(model=self._model(event)).inc()
        elif type_ == "llm_started":
            queued_ms = event.get("queued_ms")
            if isinstance(queued_ms, (int, float)) and queued_ms >= 0:
                self.queue_wait.labels(model=self._model(event)).observe(queued_ms / 1000)
        if type_ in ("llm_retry", "llm_finished") and event.get("code") == "ETIMEDOUT":
            self.watchdog_trips.inc()
        if type_ in _TERMINAL:
            self.turns_ended.labels(outcome=_TERMINAL[str(type_)]).inc()
            if type_ == "turn_aborted":
                reason = str(event.get("reason"))
                self.aborts.labels(reason=reason if reason in _ABORT_REASONS else "other").inc()

    def _llm_finished(self, event: dict[str, Any]) -> None:
        usage = event.get("usage")
        if isinstance(usage, dict):
            model = self._model(event)
            for kind in ("prompt", "completion"):
                n = usage.get(f"{kind}_tokens")
                if isinstance(n, int) and n > 0:
                    self.tokens.labels(kind=kind).inc(n)
                    self.model_tokens.labels(model=model, kind=kind).inc(n)
        if event.get("code") == ModelBusy.code:
            status = event.get("status")
            self.busy.labels(
                model=self._model(event),
                deployment=self._deployment_label(event.get("deployment")),
                status=str(status) if isinstance(status, int) and 100 <= status < 600 else "other",
            ).inc()
        ttft_ms = event.get("ttft_ms")
        if isinstance(ttft_ms, (int, float)) and ttft_ms >= 0:
            self.ttft.observe(ttft_ms / 1000)
        duration_ms = event.get("duration_ms")
        if isinstance(duration_ms, (int, float)) and duration_ms >= 0:
            outcome = "error" if event.get("error") else "ok"
            self.round_duration.labels(outcome=outcome).observe(duration_ms / 1000)

    def streamed(self, type_: str) -> None:
        self.events_streamed.labels(type=type_ if len(type_) <= 40 else "other").inc()

    def refresh_active(self, active: list[dict[str, Any]]) -> None:
        """Set the scrape-time gauges from `Client.active()`."""
        by_status = {"queued": 0, "running": 0}
        running = 0
        for turn in active:
            status = str(turn.get("status"))
            if status in by_status:
                by_status[status] += 1
            running += len(turn.get("current_tools") or [])
        for status, n in by_status.items():
            self.active_turns.labels(status=status).set(n)
        self.running_tools.set(running)
        self.redis_up.set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StepDurations:
    """``agentq_step_duration_seconds`` from the fleet's totals, as last read from Redis."""

    NAME = "agentq_step_duration_seconds"
    HELP = "Duration of turn steps, fleet-wide."

    def __init__(self) -> None:
        self.snapshot: tuple[list[tuple[str, float]], float] | None = None

    def describe(self) -> list[HistogramMetricFamily]:
        return [HistogramMetricFamily(self.NAME, self.HELP)]

    def collect(self) -> list[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.NAME, self.HELP)
        snap = self.snapshot
        if snap is not None:
            family.add_metric([], buckets=snap[0], sum_value=snap[1])
        return [family]


class WebhookMetrics:
    """The webhook counters of the fleet, as last read from Redis (none if the read failed)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.backlog: int | None = None

    def describe(self) -> list[Metric]:
        return self._families()

    @staticmethod
    def _families() -> list[Metric]:
        return [
            CounterMetricFamily(
                "agentq_webhook_attempts", "Webhook attempts by outcome.", labels=["outcome"]
            ),
            CounterMetricFamily(
                "agentq_webhook_deliveries", "Webhook deliveries by status.", labels=["status"]
            ),
            GaugeMetricFamily("agentq_webhook_backlog", "Webhook deliveries not yet accepted."),
        ]

    def collect(self) -> list[Metric]:
        attempts, deliveries, backlog = families = self._families()
        for name, n in sorted(self.counts.items()):
            kind, _, label = name.partition(":")
            target = attempts if kind == "attempts" else deliveries
            target.add_metric([label], n)  # type: ignore[attr-defined]
        if self.backlog is not None:
            backlog.add_metric([], self.backlog)  # type: ignore[attr-defined]
        return families


class CapacityGauges:
    """The capacity gauges from the models' `Capacity.snapshot`s, as last read from Redis
    (none when the last read failed: a stale queue length would mislead)."""

    def __init__(self) -> None:
        self.snapshots: list[dict[str, Any]] = []

    def describe(self) -> list[GaugeMetricFamily]:
        return self._families()

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily(
                "agentq_llm_queued",
                "Model rounds waiting for model capacity, by class.",
                labels=["model", "class"],
            ),
            GaugeMetricFamily(
                "agentq_llm_streams_in_use", "Model streams open now.", labels=["model"]
            ),
            GaugeMetricFamily(
                "agentq_llm_paused",
                "1 while the model is paused fleet-wide (a provider said it was busy).",
                labels=["model"],
            ),
        ]

    def collect(self) -> list[GaugeMetricFamily]:
        queued, streams, paused = families = self._families()
        for snap in self.snapshots:
            model = str(snap["model"])
            for cls in ("interactive", "background"):
                queued.add_metric([model, cls], snap["queued"][cls])
            streams.add_metric([model], snap["streams_in_use"])
            until = snap.get("paused_until_ms")
            paused.add_metric([model], 1 if until and until > snap["now_ms"] else 0)
        return families


class EventObserver:
    """A daemon thread that feeds every turn's published events to :class:`GatewayMetrics`."""

    def __init__(
        self,
        client: redis.Redis,
        metrics: GatewayMetrics,
        *,
        poll_s: float = 0.5,
        retry_s: float = 1.0,
    ) -> None:
        self.redis = client
        self.metrics = metrics
        self.poll_s = poll_s
        self.retry_s = retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="agentq-metrics", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
            try:
                pubsub.subscribe(MEASURED_EVENTS_CHANNEL)
                while not self._stop.is_set():
                    msg = pubsub.get_message(timeout=self.poll_s)
                    if msg is None:
                        continue
                    try:
                        event = json.loads(msg["data"])
                    except (TypeError, ValueError):
                        continue
                    if isinstance(event, dict):
                        self.metrics.observe(event)
            except REDIS_ERRORS as exc:
                # Redis restarts are survivable: resubscribe once it answers again.
                log.warning("metrics observer lost Redis (%s); retrying", exc)
                self._stop.wait(self.retry_s)
            finally:
                with contextlib.suppress(redis.RedisError):
                    pubsub.close()
