"""A stream's events, decoded once from the response's bytes by orjson: the SDK's own
stream (a `ServerSentEvent` per line through three generators) cost a sixth of a busy
stream worker's CPU. SSE's rules hold, and the SDK's: `[DONE]` ends the stream, and JSON
holding `error` is the server's error inside a 200 stream."""

from __future__ import annotations

import json
from typing import Any

from orjson import loads  # a json.JSONDecodeError for bad JSON and bad UTF-8 alike

from agentq.errors import MalformedStreamChunk, ModelHTTPError

DONE = b"[DONE]"


class SseLines:
    """Feeds of a body's bytes in, complete events' `data` payloads out."""

    __slots__ = ("_data", "_tail", "done")

    def __init__(self) -> None:
        self._tail = b""
        self._data: list[bytes] = []
        self.done = False
        """`[DONE]` came: whatever follows is not read as events."""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads of the events `chunk` completes, in order, up to `[DONE]`."""
        buf = self._tail + chunk if self._tail else chunk
        lines = buf.splitlines(keepends=True)
        # The last line waits for its end; a lone CR too, whose LF may come next.
        self._tail = lines.pop() if lines and not lines[-1].endswith(b"\n") else b""
        out: list[bytes] = []
        for line in lines:
            if self.done:
                break
            self._line(line.rstrip(b"\r\n"), out)
        return out

    def _line(self, line: bytes, out: list[bytes]) -> None:
        if not line:
            if self._data:
                payload = self._data[0] if len(self._data) == 1 else b"\n".join(self._data)
                self._data = []
                if payload.startswith(DONE):
                    self.done = True
                else:
                    out.append(payload)
            return
        if line.startswith(b"data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(b" ") else value)
        # Comments (`:`), `event:`, `id:` and `retry:` say nothing a chat stream needs:
        # an error comes as JSON with `error`, whatever its event is called.


def chunk_of(payload: bytes, index: int) -> Any:
    """The chunk a payload holds (the `index`th); raises ModelHTTPError (status 200) for an
    error event, MalformedStreamChunk for one that is not JSON (or not UTF-8)."""
    try:
        data = loads(payload)
    except json.JSONDecodeError as exc:
        raise MalformedStreamChunk(index, f"not valid JSON: {exc}") from exc
    if isinstance(data, dict) and data.get("error"):
        error = data["error"]
        message = error.get("message") if isinstance(error, dict) else None
        if not message or not isinstance(message, str):
            message = "An error occurred during streaming"
        raise ModelHTTPError(200, f"error in the stream: {message}", False)
    return data
