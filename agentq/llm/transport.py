"""An HTTP client whose sockets another thread can cut, to unblock a stalled read.

Closing a socket from another thread does not wake a thread blocked in `recv` on
it (and the peer never sees the close until that `recv` returns), so the watchdog
shuts the socket down instead: the blocked read returns end-of-file at once and the
server sees the connection go.
"""

from __future__ import annotations

import functools
import socket
import ssl
import threading
from collections.abc import Iterable
from typing import Any

import httpcore2
import httpx2
import openai


class SocketTracker:
    """The network streams one HTTP client has open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._streams: dict[int, httpcore2.NetworkStream] = {}

    def add(self, stream: httpcore2.NetworkStream) -> None:
        with self._lock:
            self._streams[id(stream)] = stream

    def discard(self, stream: httpcore2.NetworkStream) -> None:
        with self._lock:
            self._streams.pop(id(stream), None)

    def add_response(self, response: httpx2.Response) -> None:
        """Track the connection under a response, should the transport hook be missing."""
        stream = response.extensions.get("network_stream")
        if isinstance(stream, httpcore2.NetworkStream):
            self.add(stream)

    def shutdown_all(self) -> int:
        """Shut down every tracked socket; returns how many were shut down."""
        with self._lock:
            streams = list(self._streams.values())
        done = 0
        for stream in streams:
            sock = stream.get_extra_info("socket")
            if not isinstance(sock, socket.socket):
                continue
            try:
                # The plain socket method, because SSLSocket.shutdown would also drop
                # the TLS object under the reading thread's feet.
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
                done += 1
            except OSError:
                pass
        return done


class _TrackedStream(httpcore2.NetworkStream):
    def __init__(self, inner: httpcore2.NetworkStream, tracker: SocketTracker) -> None:
        self._inner = inner
        self._tracker = tracker
        tracker.add(self)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, timeout)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, timeout)

    def close(self) -> None:
        self._tracker.discard(self)
        self._inner.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore2.NetworkStream:
        wrapped = self._inner.start_tls(ssl_context, server_hostname, timeout)
        self._tracker.discard(self)
        return _TrackedStream(wrapped, self._tracker)

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _TrackingBackend(httpcore2.NetworkBackend):
    def __init__(self, inner: httpcore2.NetworkBackend, tracker: SocketTracker) -> None:
        self._inner = inner
        self._tracker = tracker

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.NetworkStream:
        stream = self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _TrackedStream(stream, self._tracker)

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore2.NetworkStream:
        stream = self._inner.connect_unix_socket(path, timeout, socket_options)
        return _TrackedStream(stream, self._tracker)

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


@functools.cache
def _ssl_context() -> ssl.SSLContext:
    """Loading the CA bundle costs ~60 ms of CPU: once per process, not per model round."""
    return httpx2.create_ssl_context()


def _tracking_transport(tracker: SocketTracker) -> httpx2.HTTPTransport:
    transport = httpx2.HTTPTransport(verify=_ssl_context())
    # httpx2 has no public hook for the connection pool's network backend; without
    # it only sockets registered from a response (after its headers) can be cut.
    pool = getattr(transport, "_pool", None)
    backend = getattr(pool, "_network_backend", None)
    if isinstance(pool, httpcore2.ConnectionPool) and isinstance(backend, httpcore2.NetworkBackend):
        pool._network_backend = _TrackingBackend(backend, tracker)
    return transport


def tracked_http_client(tracker: SocketTracker, timeout: httpx2.Timeout) -> httpx2.Client:
    """An httpx2 client with the openai SDK's defaults whose sockets `tracker` can cut."""
    return openai.DefaultHttpxClient(transport=_tracking_transport(tracker), timeout=timeout)
