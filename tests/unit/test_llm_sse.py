"""The stream worker's own decoding of a chat-completions body (agentq.llm.sse)."""

from __future__ import annotations

import json

import pytest

from agentq.errors import MalformedStreamChunk, ModelHTTPError
from agentq.llm.sse import SseLines, chunk_of


def payloads(*feeds: bytes) -> tuple[list[bytes], bool]:
    lines = SseLines()
    out: list[bytes] = []
    for feed in feeds:
        out += lines.feed(feed)
    return out, lines.done


def test_events_end_at_a_blank_line_whatever_the_line_ends() -> None:
    # A CR that ends a read waits for the next (it may be half of a CRLF).
    assert payloads(b'data: {"a":1}\n\ndata: {"b":2}\r\n\r\ndata:{"c":3}\r\r', b":") == (
        [b'{"a":1}', b'{"b":2}', b'{"c":3}'],
        False,
    )


def test_a_line_split_across_reads_waits_for_its_end() -> None:
    # A CR at the end of a read may be half of a CRLF: the event is not cut there.
    got, _ = payloads(b'data: {"a', b'":1}\r', b"\n", b"data: 2\r", b"\n\r\n")
    assert got == [b'{"a":1}\n2']


def test_comments_and_other_fields_are_skipped_and_done_ends_the_stream() -> None:
    got, done = payloads(
        b": keep-alive\n\nevent: message\nid: 7\nretry: 10\ndata: 1\n\n",
        b"data: [DONE]\n\ndata: 2\n\n",
    )
    assert (got, done) == ([b"1"], True)


def test_an_event_without_its_blank_line_is_not_one() -> None:
    assert payloads(b"data: 1\n") == ([], False)


def test_chunks_parse_and_errors_in_the_stream_are_the_servers() -> None:
    assert chunk_of(b'{"choices":[]}', 0) == {"choices": []}
    with pytest.raises(ModelHTTPError, match="error in the stream: overloaded") as err:
        chunk_of(json.dumps({"error": {"message": "overloaded"}}).encode(), 0)
    assert err.value.status_code == 200 and not err.value.retryable
    with pytest.raises(ModelHTTPError, match="An error occurred during streaming"):
        chunk_of(b'{"error": "x"}', 0)
    with pytest.raises(MalformedStreamChunk, match="chunk #3: not valid JSON"):
        chunk_of(b'{"choices": [', 3)
    with pytest.raises(MalformedStreamChunk, match=r"chunk #3: not valid JSON.*UTF-8"):
        chunk_of(b'{"t": "\xff"}', 3)
