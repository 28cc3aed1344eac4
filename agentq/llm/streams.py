"""The stream worker's process-wide state: its model clients, the rounds it streams with
their claims and capacity leases (kept alive by one thread), and a round's end told to
capacity."""

from __future__ import annotations

import collections
import logging
import os
import socket
import threading
import time
import zlib
from typing import TYPE_CHECKING

from agentq.aio.host import LoopHost
from agentq.errors import (
    AgentqError,
    ModelBusy,
    ModelConnectionError,
    ModelHTTPError,
    StreamIdleTimeout,
)
from agentq.llm.apis import ApiChoice
from agentq.llm.capacity import Capacity, capacity_for, wake_granted
from agentq.llm.headers import parse_rate_headers
from agentq.llm.limits import DEFAULT_DEPLOYMENT
from agentq.llm.publisher import Publisher
from agentq.models import LlmRoundRequest, LlmRoundResult

if TYPE_CHECKING:
    import openai
    from pydantic import SecretStr

log = logging.getLogger("agentq.llm")


STREAMS_PER_CLIENT = 128
"""Streams per model client (and connection pool) at full capacity."""


class Streams:
    """Per process: the shared model clients, the events publisher and the rounds streaming now."""

    def __init__(self, host: LoopHost) -> None:
        s = host.settings
        self.host = host
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.lease_ms = int(s.turn_lease_s * 1000)
        self.alive: collections.Counter[tuple[str, int]] = collections.Counter()
        """Rounds to keep claimed, counted: a redelivered round may run twice here."""
        self._alive_lock = threading.Lock()
        # Several clients, each with its own connection pool: httpx2's pool (the fallback
        # transport) scans all of its connections on every request and every response end,
        # which with thousands of streams in one pool cost more than the streams themselves.
        n = max(1, -(-s.io_capacity // STREAMS_PER_CLIENT))
        self.clients = self._clients(s.llm_base_url, s.llm_api_key, n) if s.llm_base_url else []
        self.capacity: Capacity = capacity_for(host.store.redis, s)
        self.apis = ApiChoice(host.store.redis)
        self.publisher = Publisher(host)
        host.cancels.on_watch = self.publisher.watched
        self.deployed: dict[str, list[openai.AsyncOpenAI]] = {}
        """Clients of configured deployments with their own endpoint or key, made on first use."""
        self.leases: dict[tuple[str, int], str] = {}
        self._leases_renewed = time.monotonic()
        # Its own thread, not the loop's store pool: with thousands of rounds streaming,
        # a renewal queued behind their store calls lapsed and every round was sent again.
        self.renewer = threading.Thread(target=self._renew, name="agentq-llm-lease", daemon=True)
        self.renewer.start()

    def client_for(
        self, turn_id: str, model: str, deployment: str | None
    ) -> tuple[openai.AsyncOpenAI | None, str]:
        """The client of this turn's rounds on `deployment` (None: no model server
        configured), and the model name that deployment knows the model by."""
        dep = None
        if deployment and deployment != DEFAULT_DEPLOYMENT:
            dep = self.capacity.entry(model).deployment(deployment)
        pool = self.clients
        if dep is not None and (dep.base_url or dep.api_key):
            pool = self.deployed.get(dep.name) or []
            if not pool:
                s = self.host.settings
                url, key = dep.base_url or s.llm_base_url or "", dep.api_key or s.llm_api_key
                pool = self.deployed[dep.name] = self._clients(url, key, 1)
        if not pool:
            return None, model
        client = pool[zlib.crc32(turn_id.encode()) % len(pool)]
        return client, (dep.model if dep is not None and dep.model else model)

    def _clients(self, base_url: str, key: SecretStr | None, n: int) -> list[openai.AsyncOpenAI]:
        from agentq.llm.aclient import client_timeout, make_client

        s = self.host.settings
        return [
            make_client(
                base_url=base_url,
                api_key=key.get_secret_value() if key else None,
                max_connections=s.io_capacity + 100,
                timeout=client_timeout(s.llm_request_timeout_s, s.stream_idle_timeout_ms),
            )
            for _ in range(n)
        ]

    def hold(self, key: tuple[str, int], lease_id: str | None) -> None:
        """Keep the round claimed, and its capacity lease (if any) alive, until `release`."""
        with self._alive_lock:
            self.alive[key] += 1
            if lease_id:
                self.leases[key] = lease_id

    def release(self, key: tuple[str, int]) -> None:
        with self._alive_lock:
            self.alive[key] -= 1
            if self.alive[key] <= 0:
                del self.alive[key]
                self.leases.pop(key, None)

    def settle(
        self,
        req: LlmRoundRequest,
        model: str,
        result: LlmRoundResult,
        failure: AgentqError | None,
        headers: dict[str, str],
    ) -> None:
        """Blocking: tell the fleet's capacity what the round's answer said, a failure against
        the deployment's breaker, and give its grant back with its real usage."""
        cap, deployment = self.capacity, req.deployment or DEFAULT_DEPLOYMENT
        busy = failure if isinstance(failure, ModelBusy) else None
        try:
            if busy is not None or headers:
                said = parse_rate_headers(busy.headers if busy is not None else headers)
                cap.note_answer(model, deployment, said, status=busy.status_code if busy else 200)
            if result.ok:
                cap.report_success(model, deployment, unleased=not req.lease_id)
            elif busy is None and failure is not None and (kind := deployment_failure(failure)):
                cap.report_failure(model, deployment, kind)
            used = None
            if result.message is not None and result.message.usage is not None:
                used = result.message.usage.total_tokens
            elif busy is not None:
                used = 0
            wake_granted(self.host.store, cap.release(req.lease_id or "", tokens_used=used))
        except Exception:
            # The lease lapses by itself and the turn goes on: capacity is bookkeeping here.
            log.warning("capacity bookkeeping of a round failed", exc_info=True)

    def _renew(self) -> None:
        # A third of the shorter lease: the round claims' or the capacity leases'.
        every_s = min(self.lease_ms, self.capacity.lease_ttl_ms) / 3000
        while True:
            time.sleep(every_s)
            try:
                with self._alive_lock:
                    rounds = dict.fromkeys(self.alive, self.worker)
                self.host.store.llm_rounds_alive(rounds, self.lease_ms)
            except Exception:
                log.warning("llm heartbeat failed", exc_info=True)
            if time.monotonic() - self._leases_renewed >= self.capacity.lease_ttl_ms / 3000:
                self._leases_renewed = time.monotonic()
                with self._alive_lock:
                    leases = list(self.leases.values())
                for lease in leases:
                    try:
                        self.capacity.renew(lease)
                    except Exception:
                        log.warning("capacity lease renewal failed", exc_info=True)


_streams: Streams | None = None
_streams_lock = threading.Lock()


def get_streams(host: LoopHost) -> Streams:
    global _streams
    with _streams_lock:
        if _streams is None:
            _streams = Streams(host)
        return _streams


def deployment_failure(exc: AgentqError) -> str:
    """What a failure says against the deployment ("" if nothing)."""
    if isinstance(exc, ModelConnectionError):
        return "connection"
    if isinstance(exc, ModelHTTPError) and exc.status_code >= 500:
        return "5xx"
    if isinstance(exc, StreamIdleTimeout):
        return "stall"
    return ""
