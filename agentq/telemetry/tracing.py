"""OpenTelemetry traces of turns: a turn is a trace, each step, model round and tool call
a span under the turn's span.

A turn spans processes, so its context travels as data: the client that starts it draws
its W3C `traceparent` (in the caller's trace if a span is current) into the turn's state,
and each step passes it on to the rounds and calls it sends. The turn's own span is
recorded last, by the step that ends it, with the ids drawn at the start and `created_at`
as its start, so the tree is whole whichever processes took part. Off unless configured
(`wanted`); without the `agentq[otel]` extra, agentq runs untraced and says why once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import secrets
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from agentq.telemetry import logs

log = logging.getLogger("agentq.telemetry")

enabled = False
"""True once this process records spans; every hook tests it first."""

SPAN_TURN = "agentq.turn"
SPAN_STEP = "agentq.turn.step"
SPAN_ROUND = "agentq.llm.round"
CALL_SPAN_PREFIX = "agentq.tool."
"""A call's span is named like its Celery task: `agentq.tool.<tool name>`."""

ATTR_TURN_ID = "agentq.turn_id"
ATTR_CALL_ID = "agentq.call_id"
ATTR_TOOL = "agentq.tool"
ATTR_STATUS = "agentq.status"
ATTR_AGENT = "agentq.agent"
ATTR_TASK_ID = "agentq.task_id"
ATTR_ROUND = "agentq.round_no"
ATTR_TTFT_MS = "agentq.ttft_ms"
ATTR_INPUT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"

OK_STATUSES = frozenset({"ok", "finished", "waiting", "ended", "busy", "unknown"})
"""Statuses that are not failures of the span's work (denied or cancelled are errors)."""

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")

_tracer: Any = None
_provider: Any = None


def wanted(otel: bool | None = None, environ: Mapping[str, str] | None = None) -> bool:
    """Whether tracing is configured: `otel` (AGENTQ_OTEL) if set, else the OTEL_* variables
    (an OTLP endpoint, or `OTEL_TRACES_EXPORTER` other than `none`)."""
    env = os.environ if environ is None else environ
    if otel is not None:
        return otel
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    )


def parse(traceparent: object) -> tuple[int, int] | None:
    """(trace_id, span_id) of a W3C traceparent, or None if it is not one."""
    m = _TRACEPARENT.match(traceparent) if isinstance(traceparent, str) else None
    if m is None:
        return None
    trace_id, span_id = int(m.group(1), 16), int(m.group(2), 16)
    return (trace_id, span_id) if trace_id and span_id else None


def format_traceparent(trace_id: int, span_id: int) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-01"


def new_turn_trace() -> tuple[str, str | None]:
    """The new turn's traceparent (no SDK needed), and the caller's if a span is current."""
    trace_id = 0
    caller: str | None = None
    with contextlib.suppress(ImportError):
        from opentelemetry import trace

        sc = trace.get_current_span().get_span_context()
        if sc.is_valid:
            trace_id = sc.trace_id
            caller = format_traceparent(sc.trace_id, sc.span_id)
    # An all-zero id is invalid (W3C).
    trace_id = trace_id or secrets.randbits(128) or 1
    return format_traceparent(trace_id, secrets.randbits(64) or 1), caller


def setup(
    service: str,
    *,
    otel: bool | None = None,
    spans_file: str | None = None,
    exporter: Any = None,
) -> bool:
    """Record spans in this process if tracing is configured (or `exporter` is given, for
    tests); True if on. Safe to call again."""
    global enabled, _tracer, _provider
    if enabled:
        return True
    if exporter is None and not (spans_file or wanted(otel)):
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        processor: Any
        if exporter is not None:
            processor = SimpleSpanProcessor(exporter)
        elif spans_file:
            from agentq.telemetry import spans

            # Written as each span ends: a prefork child may be killed at any time.
            processor = SimpleSpanProcessor(spans.exporter(spans_file))
        else:
            processor = BatchSpanProcessor(_standard_exporter())
    except ImportError:
        log.warning(
            "tracing is configured but OpenTelemetry or its OTLP exporter is not installed: "
            "agentq runs untraced (pip install 'agentq[otel]')"
        )
        return False
    except ValueError as exc:
        log.warning("%s: agentq runs untraced", exc)
        return False
    attributes = (
        {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": f"agentq-{service}"}
    )
    # An IdGenerator by its methods: the SDK's base class needs the optional extra.
    ids: Any = _PresetIds()
    _provider = TracerProvider(resource=Resource.create(attributes), id_generator=ids)
    _provider.add_span_processor(processor)
    if isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        # Tools' own instrumentation (httpx, databases) nests under the call's span.
        trace.set_tracer_provider(_provider)
    _tracer = _provider.get_tracer("agentq")
    enabled = True
    return True


def _standard_exporter() -> Any:
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")[0].strip().lower()
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind not in ("otlp", ""):
        raise ValueError(f"OTEL_TRACES_EXPORTER={kind} is not supported by agentq (otlp, console)")
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()


def shutdown() -> None:
    """Export what is buffered and stop (a worker process that ends)."""
    global enabled
    if _provider is not None:
        with contextlib.suppress(Exception):
            _provider.force_flush()
            _provider.shutdown()
    enabled = False


_preset = threading.local()
"""The ids of the turn span this thread starts now (`end_turn`)."""


class _PresetIds:
    """Random ids, except for the turn's span, whose ids were drawn when the turn began."""

    def generate_span_id(self) -> int:
        ids = getattr(_preset, "ids", None)
        return ids[1] if ids else random.getrandbits(64) or 1  # type: ignore[no-any-return]

    def generate_trace_id(self) -> int:
        ids = getattr(_preset, "ids", None)
        return ids[0] if ids else random.getrandbits(128) or 1  # type: ignore[no-any-return]

    def is_trace_id_random(self) -> bool:
        return True


def start_span(
    name: str,
    traceparent: object,
    attributes: Mapping[str, Any],
    start_s: float | None = None,
    *,
    root: bool = False,
) -> Any:
    """A span under `traceparent`, or a root span (`root`); None when tracing is off or
    there is no parent."""
    if not enabled or (parse(traceparent) is None and not root):
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {"traceparent": traceparent} if isinstance(traceparent, str) else {}
    parent = TraceContextTextMapPropagator().extract(carrier)
    clean = {k: v for k, v in attributes.items() if v is not None}
    start_ns = None if start_s is None else int(start_s * 1e9)
    return _tracer.start_span(name, context=parent, attributes=clean, start_time=start_ns)


def end_span(
    span: Any,
    status: str | None,
    attributes: Mapping[str, Any] | None = None,
    error: str | None = None,
) -> None:
    if span is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_attributes({k: v for k, v in (attributes or {}).items() if v is not None})
    if status is not None:
        span.set_attribute(ATTR_STATUS, status)
        if status not in OK_STATUSES:
            span.set_status(Status(StatusCode.ERROR, error or status))
    span.end()


def active(span: Any) -> contextlib.AbstractContextManager[Any]:
    """Make `span` current while the block runs (a tool's own spans nest under it)."""
    if span is None:
        return contextlib.nullcontext()
    from opentelemetry import trace

    return trace.use_span(span, end_on_exit=False, record_exception=False)


@contextlib.contextmanager
def observed(
    name: str,
    traceparent: object,
    ids: logs.LogContext,
    attributes: Mapping[str, Any],
    ends: type[BaseException] = BaseException,
) -> Iterator[Any]:
    """While the block runs, `ids` bound for the logs and a span under `traceparent` current;
    yields the span for the caller to end (ended "error" here if an `ends` escapes)."""
    bound = logs.bind(*ids)
    ids_attrs = {ATTR_TURN_ID: ids.turn_id, ATTR_CALL_ID: ids.call_id, ATTR_TASK_ID: ids.task_id}
    span = start_span(name, traceparent, {**ids_attrs, **attributes})
    try:
        with active(span):
            yield span
    except ends as exc:
        end_span(span, "error", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        logs.unbind(bound)


def end_turn(
    traceparent: object,
    caller: object,
    attributes: Mapping[str, Any],
    *,
    created_at: float | None,
    status: str,
    error: str | None = None,
) -> None:
    """Record the turn's span with the ids its traceparent names, from its creation to now."""
    ids = parse(traceparent) if enabled else None
    if ids is None:
        return
    _preset.ids = ids
    try:
        span = start_span(SPAN_TURN, caller, attributes, created_at, root=True)
    finally:
        _preset.ids = None
    end_span(span, status, error=error)


def record_settled(
    traceparent: object, turn_id: str, result: Any, settled_by: str = "turn"
) -> None:
    """The span of a call settled by someone else than its worker: a step (refused, denied,
    lost) or, for a killed child, its worker's parent ("worker")."""
    rec = result.record
    attrs = call_attributes(turn_id, result.call_id, result.tool, rec.task_id, rec.attempt)
    attrs["agentq.settled_by"] = settled_by
    span = start_span(CALL_SPAN_PREFIX + result.tool, traceparent, attrs, rec.started_at)
    end_span(span, result.status, error=result.error or result.reason)


def call_attributes(
    turn_id: str, call_id: str, tool: str, task_id: str | None, attempt: int
) -> dict[str, Any]:
    return {
        ATTR_TURN_ID: turn_id,
        ATTR_CALL_ID: call_id,
        ATTR_TOOL: tool,
        ATTR_TASK_ID: task_id,
        "agentq.attempt": attempt,
    }
