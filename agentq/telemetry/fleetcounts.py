"""The fleet's counts for Prometheus: the turn events each process published and the steps
it ran, folded here and added to one Redis hash every `metrics_flush_s` by a thread the
first count starts, so every gateway's /metrics reads the same fleet-wide totals.

An event is counted by the process whose write published it: no PUBLISH an event for the
gateways to count (and lose while none listened), no write per step. A process that dies
loses at most `metrics_flush_s` of counts (a worker flushes as it shuts down).
"""

from __future__ import annotations

import atexit
import bisect
import json
import logging
import os
import re
import threading
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, get_args

import redis

from agentq.constants import FLEET_COUNTS
from agentq.errors import REDIS_ERRORS, ModelBusy
from agentq.models import TERMINAL_STATUSES, AbortReason, ToolStatus

log = logging.getLogger("agentq.telemetry")

TTFT_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60)
ROUND_BUCKETS_S = (0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 60, 120)
DURATION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
QUEUE_BUCKETS_S = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
"""Upper bounds (seconds) of each histogram; past the last one a value counts in +Inf."""


@dataclass(frozen=True)
class Family:
    """One metric, named without `agentq_`: a histogram if it has buckets, else a counter."""

    name: str
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None


FAMILIES = {
    f.name: f
    for f in (
        Family("tool_results", "Settled tool calls.", ("tool", "status")),
        Family("tool_timeouts", "Tool calls stopped by their hard limit.", ("tool",)),
        Family("waitpoints_opened", "Calls whose tool ended its run with a Waitpoint.", ("tool",)),
        Family(
            "waitpoints_settled",
            "Waitpoints settled, by status: ok or error (completed), timeout, cancelled; "
            "open = opened - settled.",
            ("tool", "status"),
        ),
        Family(
            "tool_duration_seconds",
            "Duration of settled tool calls.",
            ("tool", "status"),
            DURATION_BUCKETS_S,
        ),
        Family("turn_aborts", "Aborted turns by reason.", ("reason",)),
        Family("turns_ended", "Turns that ended, by outcome.", ("outcome",)),
        Family("watchdog_trips", "Model streams cut by the inactivity watchdog."),
        Family(
            "llm_tokens",
            "Model tokens by model, kind (prompt, completion, cached) and API key (- for none).",
            ("model", "kind", "key"),
        ),
        Family("llm_cost_usd", "What model rounds cost (priced models), in USD.", ("model", "key")),
        Family(
            "budget_exceeded",
            "Turns ended by a budget, by whose (turn, parent_turn, key).",
            ("scope",),
        ),
        Family(
            "llm_model_tokens",
            "Model tokens by model and kind (prompt, completion).",
            ("model", "kind"),
        ),
        Family(
            "llm_rounds_queued", "Model rounds that had to wait for model capacity.", ("model",)
        ),
        Family(
            "llm_queue_wait_seconds",
            "How long model rounds waited for model capacity.",
            ("model",),
            QUEUE_BUCKETS_S,
        ),
        Family(
            "llm_busy",
            "Busy answers (429, 503, 529) of model providers.",
            ("model", "deployment", "status"),
        ),
        Family("llm_ttft_seconds", "Time to first token of model rounds.", (), TTFT_BUCKETS_S),
        Family(
            "llm_round_duration_seconds",
            "Duration of model rounds, by outcome.",
            ("outcome",),
            ROUND_BUCKETS_S,
        ),
        Family("step_duration_seconds", "Duration of turn steps, fleet-wide.", (), STEP_BUCKETS_S),
    )
}

_TERMINAL = {f"turn_{s}": s for s in TERMINAL_STATUSES}
"""A turn's terminal event types, and the outcome each counts as."""
COUNTED_TYPES = frozenset(_TERMINAL) | {
    "tool_finished",
    "tool_waiting",
    "llm_finished",
    "llm_queued",
    "llm_started",
    "llm_retry",
}
"""The event types any count is taken from."""

EXIT_FLUSH_S = 2.0
"""How long a process that exits waits for its last flush."""
MAX_TOOL_LABELS = 200
"""Tool names come from the model (an unknown tool still settles); cap the label set."""
MAX_MODEL_LABELS = 100
"""Models and deployments come from the fleet's configuration; capped all the same."""
MAX_SERIES = 2000
"""Label sets a family shows at most: the hash gathers every process's, across restarts."""

_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_MODEL_NAME = re.compile(r"^[A-Za-z0-9_.:/@+-]{1,128}$")
_BUDGET_SCOPES = frozenset({"turn", "parent_turn", "key"})
_ABORT_REASONS = frozenset(get_args(AbortReason))
_TOOL_STATUSES = frozenset(get_args(ToolStatus))


class _Labels:
    """Label values, ``other`` past `limit` distinct ones or for one not matching `pattern`."""

    def __init__(self, pattern: re.Pattern[str], limit: int) -> None:
        self.pattern = pattern
        self.limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: object) -> str:
        label = str(value)
        if label not in self._seen:
            if not self.pattern.match(label) or len(self._seen) >= self.limit:
                return "other"
            self._seen.add(label)
        return label


def field_of(family: str, labels: tuple[str, ...], part: str = "") -> str:
    """The hash field of a counter (`part` ""), a histogram's bucket (its index) or sum."""
    return f"{family}|{json.dumps(list(labels))}|{part}"


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 else None


class FleetCounts:
    """This process's counts not yet added to Redis, and the thread that adds them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: defaultdict[str, float] = defaultdict(float)
        """Hash field -> what to add to it: a count, or a histogram's or the cost's sum."""
        self._pid = 0
        self._client: Any = None
        """Where the flusher adds the counts: the Redis of the newest count."""
        self._tool = _Labels(_TOOL_NAME, MAX_TOOL_LABELS)
        self._model = _Labels(_MODEL_NAME, MAX_MODEL_LABELS)
        self._deployment = _Labels(_MODEL_NAME, MAX_MODEL_LABELS)
        self._key = _Labels(_TOOL_NAME, MAX_TOOL_LABELS)

    def _inc(self, family: str, labels: tuple[str, ...] = (), by: float = 1) -> None:
        self._counts[field_of(family, labels)] += by

    def _observe(self, family: str, labels: tuple[str, ...], value: object, per_s: int = 1) -> None:
        """Count `value` (in units of 1/`per_s` s, as published) in a histogram, if a number."""
        number = _number(value)
        if number is None:
            return
        value_s = number / per_s
        buckets = FAMILIES[family].buckets
        assert buckets is not None
        self._counts[field_of(family, labels, str(bisect.bisect_left(buckets, value_s)))] += 1
        self._counts[field_of(family, labels, "sum")] += value_s

    def step(self, seconds: float, client: redis.Redis, flush_s: float) -> None:
        """Count one turn step's duration."""
        with self._lock:
            self._started(client, flush_s)
            self._observe("step_duration_seconds", (), seconds)

    def events(self, events: list[tuple[str, dict[str, Any]]], client: Any, flush_s: float) -> None:
        """Count the events (type, fields) a write published."""
        with self._lock:
            for type_, fields in events:
                if type_ in COUNTED_TYPES:
                    self._started(client, flush_s)
                    self._event(type_, fields)

    def _model_of(self, fields: dict[str, Any]) -> str:
        model = fields.get("model")
        return "unknown" if model is None else self._model(model)

    def _event(self, type_: str, f: dict[str, Any]) -> None:
        if type_ == "tool_finished":
            tool = self._tool(f.get("tool"))
            status = str(f.get("status"))
            status = status if status in _TOOL_STATUSES else "other"
            self._inc("tool_results", (tool, status))
            self._observe("tool_duration_seconds", (tool, status), f.get("duration_ms"), per_s=1000)
            if f.get("waitpoint_id"):
                self._inc("waitpoints_settled", (tool, status))
            elif status == "timeout":
                self._inc("tool_timeouts", (tool,))
        elif type_ == "tool_waiting":
            self._inc("waitpoints_opened", (self._tool(f.get("tool")),))
        elif type_ == "llm_finished":
            self._llm_finished(f)
        elif type_ == "llm_queued":
            # Published again as the round moves up the queue: only its first one counts.
            if f.get("first") is True:
                self._inc("llm_rounds_queued", (self._model_of(f),))
        elif type_ == "llm_started":
            model = self._model_of(f)
            self._observe("llm_queue_wait_seconds", (model,), f.get("queued_ms"), per_s=1000)
        if type_ in ("llm_retry", "llm_finished") and f.get("code") == "ETIMEDOUT":
            self._inc("watchdog_trips")
        if type_ in _TERMINAL:
            self._inc("turns_ended", (_TERMINAL[type_],))
            if type_ == "turn_error" and f.get("code") == "budget_exceeded":
                scope = str(f.get("scope"))
                self._inc("budget_exceeded", (scope if scope in _BUDGET_SCOPES else "other",))
            if type_ == "turn_aborted":
                reason = str(f.get("reason"))
                self._inc("turn_aborts", (reason if reason in _ABORT_REASONS else "other",))

    def _llm_finished(self, f: dict[str, Any]) -> None:
        usage = f.get("usage")
        if isinstance(usage, dict):
            model = self._model_of(f)
            key = self._key(f.get("key") or "-")
            for kind in ("prompt", "completion", "cached"):
                n = usage.get(f"{kind}_tokens")
                if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                    self._inc("llm_tokens", (model, kind, key), n)
                    if kind != "cached":
                        self._inc("llm_model_tokens", (model, kind), n)
            cost = _number(usage.get("cost_usd"))
            if cost:
                self._inc("llm_cost_usd", (model, key), cost)
        if f.get("code") == ModelBusy.code:
            status = f.get("status")
            code = str(status) if isinstance(status, int) and 100 <= status < 600 else "other"
            self._inc("llm_busy", (self._model_of(f), self._deployment(f.get("deployment")), code))
        self._observe("llm_ttft_seconds", (), f.get("ttft_ms"), per_s=1000)
        outcome = "error" if f.get("error") else "ok"
        self._observe("llm_round_duration_seconds", (outcome,), f.get("duration_ms"), per_s=1000)

    def _started(self, client: Any, flush_s: float) -> None:
        # The newest count's Redis: a process that moved to another (a test going from fleet
        # to fleet) must not add to the first, where the new fleet's gateways do not read.
        self._client = client
        if self._pid == os.getpid():
            return
        # A forked child starts with its parent's counts, which the parent flushes itself.
        self._pid = os.getpid()
        self._counts = defaultdict(float)
        thread = threading.Thread(
            target=self._run, args=(flush_s,), name="agentq-fleet-counts", daemon=True
        )
        thread.start()
        # A short-lived process (a CLI abort) ends before its first flush; a prefork child
        # skips atexit and flushes on worker_process_shutdown (agentq.worker).
        atexit.register(self._flush_at_exit)

    def _flush_at_exit(self) -> None:
        # Bounded: with Redis gone, the client's retries would hold the exit for seconds.
        if self._pid == os.getpid() and self._counts:
            last = threading.Thread(target=self.flush, args=(self._client,), daemon=True)
            last.start()
            last.join(EXIT_FLUSH_S)

    def _run(self, flush_s: float) -> None:
        pid = os.getpid()
        while self._pid == pid:
            time.sleep(flush_s)
            self.flush(self._client)

    def flush(self, client: Any) -> None:
        """Add the counts to the fleet's hash (kept for the next flush if Redis fails)."""
        with self._lock:
            counts, self._counts = self._counts, defaultdict(float)
        if not counts:
            return
        try:
            # HINCRBYFLOAT writes a whole number as one ("3"), so counts stay integers.
            pipe = client.pipeline(transaction=False)
            for field, n in counts.items():
                pipe.hincrbyfloat(FLEET_COUNTS, field, n)
            pipe.execute()
        except REDIS_ERRORS as exc:
            log.debug("fleet counts not flushed: %s", exc)
            with self._lock:
                for field, n in counts.items():
                    self._counts[field] += n


fleet_counts = FleetCounts()


def read_counts(client: redis.Redis) -> dict[str, float]:
    """The fleet's counts as the hash holds them (field -> value)."""
    raw: dict[bytes, bytes] = client.hgetall(FLEET_COUNTS)  # type: ignore[assignment]
    return {k.decode(): float(v) for k, v in raw.items()}
