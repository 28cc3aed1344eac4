"""A span exporter for tests across processes: each finished span as one JSON line in the
file `AGENTQ_OTEL_SPANS_FILE` names (tracing is then on)."""

from __future__ import annotations

import json
import os
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import ConsoleSpanExporter


def span_record(span: ReadableSpan) -> dict[str, Any]:
    """What a test needs of a span, with ids as hex like a traceparent's."""
    ctx = span.get_span_context()
    parent = span.parent
    return {
        "name": span.name,
        "trace_id": f"{ctx.trace_id:032x}" if ctx is not None else None,
        "span_id": f"{ctx.span_id:016x}" if ctx is not None else None,
        "parent_span_id": f"{parent.span_id:016x}" if parent is not None else None,
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "service": (span.resource.attributes.get("service.name") if span.resource else None),
        "pid": os.getpid(),
    }


def exporter(path: str) -> ConsoleSpanExporter:
    """OpenTelemetry's console exporter writing `span_record`s to `path`, appended and
    flushed one write a line, so lines of several processes never interleave."""
    out = open(path, "a", encoding="utf-8", opener=lambda p, flags: os.open(p, flags, 0o600))  # noqa: SIM115 (open while the process records spans)
    return ConsoleSpanExporter(
        out=out, formatter=lambda s: json.dumps(span_record(s), default=str) + "\n"
    )
