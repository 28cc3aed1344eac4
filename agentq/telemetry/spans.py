"""A span exporter for tests across processes: each finished span as one JSON line in a
file, so a test reads the spans its worker processes recorded.

Workers use it when `AGENTQ_OTEL_SPANS_FILE` names the file (tracing is then on).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult


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


class JsonLinesSpanExporter(SpanExporter):  # type: ignore[misc]
    """Appends finished spans to `path`, one JSON object a line, safe across processes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        data = "".join(json.dumps(span_record(s), default=str) + "\n" for s in spans).encode()
        # One O_APPEND write per batch: lines of several processes never interleave.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        return SpanExportResult.SUCCESS
