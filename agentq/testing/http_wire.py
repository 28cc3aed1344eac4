"""HTTP/1.1 on asyncio streams, as much as agentq's test servers need.

A request is a request line, headers and a Content-Length body; anything else (chunked
request bodies, HTTP/1.0, header folding, oversized heads or bodies) is refused with a
status that says why. Responses carry a Content-Length or are chunked, so a connection
can serve the next request once a response is complete.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus

MAX_HEAD_BYTES = 64 * 1024
"""The stream reader's limit: a request line and headers must fit in it."""
MAX_BODY_BYTES = 64 * 1024 * 1024
SERVER = "agentq-scripted/1"
LAST_CHUNK = b"0\r\n\r\n"

_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_VERSION = re.compile(r"HTTP/\d\.\d")


class BadRequest(Exception):
    """A request we will not parse: answered with `status`, then the connection is closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class ClientGone(Exception):
    """The client closed its end while we were answering."""


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str] = field(default_factory=dict)
    """Names lower-cased; a repeated header's values joined with ", "."""
    body: bytes = b""

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    @property
    def keep_alive(self) -> bool:
        tokens = self.headers.get("connection", "").lower().split(",")
        return "close" not in {t.strip() for t in tokens}


def error_body(kind: str, message: str) -> bytes:
    """An error in the shape OpenAI answers with."""
    error = {"message": message, "type": kind, "param": None, "code": kind}
    return json.dumps({"error": error}).encode()


async def read_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> Request | None:
    """The next request on a connection; None when the client closed it between requests.

    `writer` answers `Expect: 100-continue` before the body is read.
    """
    try:
        raw = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if exc.partial.strip():
            raise BadRequest(400, "the connection closed inside the request head") from None
        return None
    except asyncio.LimitOverrunError:
        raise BadRequest(431, f"request head over {MAX_HEAD_BYTES} bytes") from None
    request = parse_head(raw)
    length = _content_length(request.headers)
    expect = request.headers.get("expect", "").lower()
    if expect and expect != "100-continue":
        raise BadRequest(417, f"unsupported Expect: {expect}")
    if length:
        if expect:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            request.body = await reader.readexactly(length)
        except asyncio.IncompleteReadError:
            raise BadRequest(400, "the connection closed inside the request body") from None
    return request


def parse_head(raw: bytes) -> Request:
    """The request line and headers of `raw`, which ends with the blank line."""
    lines = raw[:-4].split(b"\r\n")
    # A client may send a stray CRLF after a previous body (RFC 9112 section 2.2).
    while lines and not lines[0]:
        lines.pop(0)
    if not lines:
        raise BadRequest(400, "empty request line")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not parts[1].startswith(b"/"):
        raise BadRequest(400, f"malformed request line: {lines[0][:200]!r}")
    method, target, version = (p.decode("latin-1") for p in parts)
    if version != "HTTP/1.1":
        if _VERSION.fullmatch(version):
            raise BadRequest(505, f"{version} is not served: use HTTP/1.1")
        raise BadRequest(400, f"malformed request line: {lines[0][:200]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            raise BadRequest(400, f"malformed header line: {line[:200]!r}")
        key = name.decode("latin-1").lower()
        text = value.strip(b" \t").decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return Request(method=method, target=target, headers=headers)


def _content_length(headers: Mapping[str, str]) -> int:
    if "transfer-encoding" in headers:
        raise BadRequest(411, "request bodies must have a Content-Length, not Transfer-Encoding")
    value = headers.get("content-length")
    if value is None:
        return 0
    values = {v.strip() for v in value.split(",")}
    if len(values) != 1 or not (length := values.pop()).isdigit():
        raise BadRequest(400, f"bad Content-Length: {value!r}")
    if int(length) > MAX_BODY_BYTES:
        raise BadRequest(413, f"request body over {MAX_BODY_BYTES} bytes")
    return int(length)


def response_head(status: int, headers: Mapping[str, str], *, close: bool = False) -> bytes:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    lines = [f"HTTP/1.1 {status} {reason}", f"Server: {SERVER}"]
    lines.append(f"Date: {formatdate(usegmt=True)}")
    lines += [f"{name}: {value}" for name, value in headers.items()]
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def chunk(payload: bytes) -> bytes:
    """One chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(payload), payload)


class Conn:
    """One client connection, as the code answering its current request sees it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.responded = False
        """Whether anything of the current request's response went out."""

    def gone(self) -> bool:
        """The client closed or reset its end (an HTTP client never half-closes mid-request)."""
        reader = self.reader
        return reader.at_eof() or reader.exception() is not None or self.writer.is_closing()

    async def send(self, data: bytes) -> None:
        if self.gone():
            raise ClientGone
        self.responded = True
        self.writer.write(data)
        try:
            await self.writer.drain()
        except ConnectionError as exc:
            raise ClientGone from exc

    async def respond(
        self, status: int, body: bytes, headers: Mapping[str, str], *, close: bool = False
    ) -> None:
        """A whole response with a Content-Length."""
        all_headers = {**headers, "Content-Length": str(len(body))}
        await self.send(response_head(status, all_headers, close=close) + body)

    async def start_chunked(self, status: int, headers: Mapping[str, str]) -> None:
        await self.send(response_head(status, {**headers, "Transfer-Encoding": "chunked"}))

    async def send_chunk(self, payload: bytes) -> None:
        await self.send(chunk(payload))

    async def end_chunked(self, payload: bytes = b"") -> None:
        """Send `payload`, if any, and the last chunk in one write."""
        await self.send((chunk(payload) if payload else b"") + LAST_CHUNK)

    async def wait_gone(self, timeout_s: float | None) -> bool:
        """Whether the client closes within `timeout_s`; what it sends meanwhile is dropped."""
        try:
            return await asyncio.wait_for(self._read_to_eof(), timeout_s)
        except asyncio.TimeoutError:
            return False

    async def _read_to_eof(self) -> bool:
        try:
            while await self.reader.read(65536):
                pass
        except OSError:
            pass
        return True

    def cut(self) -> None:
        """End the connection now, mid-response: what was sent goes out, then a FIN."""
        self.writer.close()
