"""A small server-sent events parser for tests and scripts (the client side of the gateway).

with httpx.stream("GET", url + handle["events_url"]) as resp:
    for msg in iter_sse(resp):
        if msg.comment is None:
            print(msg.id, msg.event, msg.json())
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

__all__ = ["SSEMessage", "iter_sse", "parse_sse"]


@dataclass(frozen=True)
class SSEMessage:
    """One dispatched message, or one comment line (``comment`` set, nothing else)."""

    event: str = "message"
    data: str = ""
    id: str | None = None
    retry_ms: int | None = None
    comment: str | None = None

    def json(self) -> Any:
        return json.loads(self.data)


def parse_sse(lines: Iterable[str]) -> Iterator[SSEMessage]:
    """Messages from lines without their line endings, per the HTML SSE rules.

    Comments are yielded as they come (they matter to tests of keep-alives); a ``retry``
    field alone is yielded as a message with only ``retry_ms`` set.
    """
    event = ""
    data: list[str] = []
    id_: str | None = None
    retry: int | None = None
    for line in lines:
        if line == "":
            if data or retry is not None or id_ is not None:
                yield SSEMessage(
                    event=event or "message", data="\n".join(data), id=id_, retry_ms=retry
                )
            event, data, id_, retry = "", [], None, None
            continue
        if line.startswith(":"):
            yield SSEMessage(event="", comment=line[1:].strip())
            continue
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if name == "event":
            event = value
        elif name == "data":
            data.append(value)
        elif name == "id":
            id_ = value
        elif name == "retry" and value.isdigit():
            retry = int(value)


def iter_sse(response: httpx.Response) -> Iterator[SSEMessage]:
    """Parse a streaming httpx response as it arrives."""
    return parse_sse(response.iter_lines())
