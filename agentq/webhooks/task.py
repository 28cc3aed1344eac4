"""The delivery task (one attempt) and the sweep that sends due ones: never a Celery
countdown, which is held in a worker's memory and dies with it."""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agentq import constants as k
from agentq.config import Settings
from agentq.webhooks.deliveries import (
    AttemptRecord,
    Deliveries,
    Status,
    encode,
    envelope,
    turn_payload,
)
from agentq.webhooks.target import post, signed_headers

if TYPE_CHECKING:
    from celery import Celery

    from agentq.state.store import TurnStore

log = logging.getLogger("agentq.webhooks")

JITTER = 0.2
"""Each wait is shortened by up to this fraction, so retries of many deliveries spread out."""


def retry_delay_s(attempts: int, base_s: float, max_s: float, jitter: float = 0.0) -> float:
    """The wait after the `attempts`-th failed attempt: base, 2 x base, 4 x base ... capped
    at `max_s`; `jitter` in [0, 1) takes up to JITTER of it off."""
    if attempts < 1:
        raise ValueError("attempts counts the attempts made: at least 1")
    # Capped so that a long-failing delivery never overflows a float.
    delay = min(max_s, base_s * 2.0 ** min(attempts - 1, 60))
    return delay * (1 - JITTER * min(max(jitter, 0.0), 0.999))


@dataclass(frozen=True)
class Outcome:
    status: Status
    next_at: float | None


def outcome(
    status_code: int | None,
    *,
    attempts: int,
    created_at: float,
    now: float,
    base_s: float,
    max_s: float,
    max_age_s: float,
    jitter: float = 0.0,
) -> Outcome:
    """After the `attempts`-th attempt answered `status_code` (None: no answer): a 2xx
    delivers, a 410 stops for good, anything else retries until `max_age_s`."""
    if status_code is not None and 200 <= status_code < 300:
        return Outcome("delivered", None)
    if status_code == 410:
        return Outcome("gone", None)
    next_at = now + retry_delay_s(attempts, base_s, max_s, jitter)
    if next_at > created_at + max_age_s:
        return Outcome("failed", None)
    return Outcome("pending", next_at)


def lease_s(settings: Settings) -> float:
    """How long an attempt's message has before a sweep sends another (a late one does nothing)."""
    return 2 * settings.webhook_timeout_s + 5.0


def send_attempt(app: Celery, delivery_id: str, attempts: int) -> None:
    app.send_task(k.TASK_WEBHOOK_DELIVER, args=[delivery_id, attempts], queue=k.QUEUE_WEBHOOKS)


def queue_delivery(
    store: TurnStore, app: Celery, settings: Settings, turn_id: str, url: str
) -> None:
    """Queue the ended turn's delivery and send its first attempt (a second call: no-op)."""
    created = Deliveries(store.redis, settings).create(turn_id, url, lease_s=lease_s(settings))
    if not created:
        return
    try:
        send_attempt(app, created, 0)
    except Exception as exc:
        # The delivery is due in Redis: a sweep sends it once its lease is over.
        log.warning("webhook %s not sent now (%s); a sweep sends it", created, exc)


def queue_waiting(
    store: TurnStore, settings: Settings, turn_id: str, event: dict[str, Any]
) -> str | None:
    """Queue a `turn.waiting` delivery (`event`: tool_waiting's fields) if there is a webhook,
    due now: a sweep sends it."""
    url = json.loads(store.redis.hget(k.turn_key(turn_id), "webhook_url") or "null")
    if not url:
        return None
    payload = envelope("turn.waiting", time.time(), {"turn_id": turn_id, **event})
    delivery_id = f"{k.webhook_id(turn_id)}_{event['call_id']}"
    return Deliveries(store.redis, settings).create(
        turn_id, url, lease_s=0.0, event=(delivery_id, encode(payload))
    )


def attempt(store: TurnStore, settings: Settings, delivery_id: str, attempts_before: int) -> str:
    """Make the delivery's next attempt unless it ended or was made already; what happened."""
    lock = k.webhook_key(delivery_id, "lock")
    redis = store.redis
    if not redis.set(lock, "1", nx=True, px=int(lease_s(settings) * 1000)):
        return "busy"
    try:
        dels = Deliveries(store.redis, settings)
        d = dels.get(delivery_id)
        if d is None or d.status != "pending":
            return "done"
        if d.attempts != attempts_before:
            # A message sent again after a lapsed lease, for an attempt made already.
            return "stale"
        n, now = d.attempts + 1, time.time()
        # An attempt that never reaches the network answers nothing and takes no time.
        code, error, took_ms, jitter = None, None, 0, 0.0
        body = None if d.body is None else d.body.encode()
        if body is None and (payload := turn_payload(store, d.turn_id)) is not None:
            body = dels.set_body(delivery_id, encode(payload))
        secret = settings.webhook_secret
        if body is None:
            # Counted as no attempt: nothing was built, and nothing will be.
            n, error = d.attempts, "the turn is gone"
        elif secret is None:
            error = "AGENTQ_WEBHOOK_SECRET is not set on this worker"
            log.error("webhook %s: %s", d.id, error)
        else:
            started = time.monotonic()
            headers = signed_headers(secret.get_secret_value(), delivery_id, int(now), body)
            code, error = post(d.url, body, headers, settings)
            took_ms = int((time.monotonic() - started) * 1000)
            jitter = random.random()
        out = Outcome("failed", None)
        if body is not None:
            out = outcome(
                code,
                attempts=d.attempts + 1,
                created_at=d.created_at,
                now=time.time(),
                base_s=settings.webhook_retry_base_s,
                max_s=settings.webhook_retry_max_s,
                max_age_s=settings.webhook_max_age_s,
                jitter=jitter,
            )
        record = AttemptRecord(n=n, at=now, status_code=code, error=error, duration_ms=took_ms)
        dels.record(d, record, out.status, out.next_at)
        # No query in the log: it may carry a token.
        url = d.url.split("?", 1)[0]
        log.info("webhook %s attempt %d to %s: %s -> %s", d.id, n, url, error or code, out.status)
        return out.status
    finally:
        redis.delete(lock)


def register_webhook_task(
    app: Celery, get_store: Callable[[], TurnStore], get_settings: Callable[[], Settings]
) -> None:
    @app.task(name=k.TASK_WEBHOOK_DELIVER, acks_late=True, ignore_result=True)
    def deliver(delivery_id: str, attempts_before: int) -> str:
        return attempt(get_store(), get_settings(), delivery_id, attempts_before)


def start_sweeper(store: TurnStore, app: Celery, settings: Settings) -> None:
    """Send the due attempts every `webhook_sweep_interval_s`, on a daemon thread."""
    dels = Deliveries(store.redis, settings)

    def run() -> None:
        while True:
            time.sleep(settings.webhook_sweep_interval_s)
            try:
                for delivery_id, attempts in dels.claim_due(lease_s=lease_s(settings)):
                    send_attempt(app, delivery_id, attempts)
            except Exception:
                log.warning("webhook sweep failed", exc_info=True)

    threading.Thread(target=run, name="agentq-webhook-sweeper", daemon=True).start()
