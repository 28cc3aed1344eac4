"""Waking a turn from outside its steps: send its step, or ask it to abort."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from agentq.errors import BrokerUnavailable
from agentq.fleet.broker import BROKER_RETRY_S, send_step
from agentq.models import TERMINAL_STATUSES
from agentq.state.base import statuses

if TYPE_CHECKING:
    from celery import Celery

    from agentq.state.store import TurnStore

log = logging.getLogger("agentq.turn")


def send_step_or_wake(store: TurnStore, app: Celery, turn_id: str) -> bool:
    """Send a stored turn's step; with the broker away (False), the sweep sends it later."""
    try:
        send_step(app, turn_id)
    except BrokerUnavailable as exc:
        log.warning("%s; the step of turn %s is sent when the broker is back", exc, turn_id)
        store.wake_by(turn_id, time.time() + BROKER_RETRY_S)
        return False
    return True


def request_abort(store: TurnStore, turn_id: str, reason: str, *, walk: bool = True) -> None:
    """Abort a turn (and, if `walk`, its running children) from outside its steps: flag, wake
    and children in one round trip (abort latency is user-facing); its step, or its wakeup
    should this caller die, aborts it. A parent's step does not walk: each child's does."""
    woken, children = store.flag_cancel(turn_id, reason)
    if walk:
        abort_running(store, children, reason)
    if woken:
        store.send_step(turn_id)


def abort_running(store: TurnStore, turn_ids: list[str], reason: str, *, walk: bool = True) -> None:
    """`request_abort` those of these turns that still run (statuses read in one trip)."""
    for t, status in zip(turn_ids, statuses(store.redis, turn_ids), strict=True):
        if status not in (None, *TERMINAL_STATUSES):
            request_abort(store, t, reason, walk=walk)
