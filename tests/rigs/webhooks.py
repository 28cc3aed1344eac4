"""A webhook receiver for tests: a real HTTP server on 127.0.0.1 that answers each POST
with the next status of a script and keeps what it received (headers, raw body, time)."""

from __future__ import annotations

import base64
import os
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Received:
    headers: dict[str, str]
    body: bytes
    at: float
    """time.monotonic() when it arrived."""


class WebhookReceiver:
    """`statuses` answer the posts in order; the last one answers every post after them."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.statuses = list(statuses or [200])
        self.received: list[Received] = []
        self._cond = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with receiver._cond:
                    n = len(receiver.received)
                    status = receiver.statuses[min(n, len(receiver.statuses) - 1)]
                    receiver.received.append(
                        Received(
                            {k.lower(): v for k, v in self.headers.items()}, body, time.monotonic()
                        )
                    )
                    receiver._cond.notify_all()
                self.send_response(status)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def answer(self, statuses: list[int]) -> None:
        """From now on, answer with `statuses` (counted from the next post)."""
        with self._cond:
            self.statuses = [200] * len(self.received) + list(statuses)

    def wait(self, count: int, timeout_s: float = 30.0) -> list[Received]:
        """The first `count` posts, once they have arrived; TimeoutError if they do not."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self.received) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{len(self.received)} of {count} webhooks in {timeout_s}s")
                self._cond.wait(left)
            return list(self.received[:count])

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


def new_secret() -> str:
    """A fresh `AGENTQ_WEBHOOK_SECRET` (`whsec_` + base64 of 32 random bytes)."""
    return "whsec_" + base64.b64encode(os.urandom(32)).decode()


def webhook_env(secret: str) -> dict[str, str]:
    """Settings for workers delivering to a test receiver: plain http on 127.0.0.1 allowed,
    short timeouts and retries, a fast sweep."""
    return {
        "AGENTQ_WEBHOOK_SECRET": secret,
        "AGENTQ_WEBHOOK_ALLOW_PRIVATE": "true",
        "AGENTQ_WEBHOOK_ALLOW_HTTP": "true",
        "AGENTQ_WEBHOOK_TIMEOUT_S": "2",
        "AGENTQ_WEBHOOK_RETRY_BASE_S": "0.5",
        "AGENTQ_WEBHOOK_RETRY_MAX_S": "4",
        "AGENTQ_WEBHOOK_SWEEP_INTERVAL_S": "0.1",
    }
