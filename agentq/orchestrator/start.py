"""Starting a turn: check the request, store the turn, send its first step.

The Python API (`Client.start`, behind `POST /v1/turns` and `agentq run`) and the ticks of
schedules start turns here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import secrets
import time
from typing import TYPE_CHECKING, Any

from celery import Celery

from agentq.agents import require_known
from agentq.config import Settings
from agentq.errors import BrokerUnavailable, PayloadTooLarge
from agentq.fleet.broker import BROKER_RETRY_S, send_step
from agentq.models import TurnHandle, TurnRequest, check_messages
from agentq.state.conversations import open_conversation
from agentq.state.turn_state import TurnState
from agentq.telemetry import tracing
from agentq.webhooks.target import check_for_turn
from agentq.webhooks.task import WAITING_RECHECK_S, deliveries

if TYPE_CHECKING:
    from agentq.state.store import TurnStore

log = logging.getLogger("agentq.api")


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def start_turn(
    store: TurnStore,
    app: Celery,
    settings: Settings,
    req: TurnRequest,
    *,
    owner: str | None = None,
    admin: bool = False,
    operator: bool = False,
    traced: bool = False,
    turn_id: str | None = None,
    extra_state: TurnState | None = None,
) -> TurnHandle:
    """Queue a turn owned by the key name `owner` (None: no key); see `Client.start_turn`.

    `turn_id` (default: a new random one) and `extra_state` (fields stored with the turn's
    state) are for starters other than a client: a schedule's tick.
    """
    new = req.initial_messages()
    if not new:
        raise ValueError("a turn needs a prompt or messages")
    # Again here: a TurnRequest built with model_construct() skipped its validators.
    check_messages(new)
    size = len(json.dumps(new).encode())
    if size > settings.max_prompt_bytes:
        raise PayloadTooLarge("prompt", size, settings.max_prompt_bytes)
    webhook_url = req.webhook_url or settings.webhook_urls.get(owner or "")
    if webhook_url:
        check_for_turn(webhook_url, settings)
    require_known(store.redis, req.agent)
    prior: list[dict[str, Any]] = []
    conversation_token = None
    if req.conversation_id:
        opened = open_conversation(
            store.redis,
            req.conversation_id,
            new_bytes=size,
            max_bytes=settings.max_conversation_bytes,
            ttl_s=settings.state_ttl_s,
            owner=owner,
            admin=admin,
            operator=operator,
            token=req.conversation_token,
        )
        prior, conversation_token = opened.prior, opened.token
    # 128 random bits (a uuid4 has 122): the id alone opens the turn's event stream.
    turn_id = turn_id or secrets.token_hex(16)
    token = secrets.token_urlsafe(32)
    state: TurnState = {
        "status": "queued",
        "created_at": time.time(),
        "headless": req.headless,
        "detach": req.detach,
        "conversation_id": req.conversation_id,
        "parent_turn_id": req.parent_turn_id,
        "agent": req.agent,
        "owner": owner,
        "token_sha256": hash_token(token),
        "history_start": len(prior),
        "round": 0,
        "call_count": 0,
        **(extra_state or {}),
    }
    if webhook_url:
        state["webhook_url"] = webhook_url
        # Before the turn exists: whatever happens to the step that ends it, a sweep
        # finds the turn here and queues its delivery.
        deliveries(store, settings).wait_for(turn_id, time.time() + WAITING_RECHECK_S)
    if traced:
        state["traceparent"], state["trace_caller"] = tracing.new_turn_trace()
    store.create(turn_id, state, prior + new)
    try:
        # Every call in the messages has its result (check_messages): the first step
        # sends a model round, so a stream worker takes it.
        send_step(app, turn_id, model_first=True)
    except BrokerUnavailable as exc:
        # The turn is stored: a turn worker's sweep starts it once the broker is back.
        log.warning("%s; the turn starts when the broker is back", exc)
        store.wake_by(turn_id, time.time() + BROKER_RETRY_S)
    return TurnHandle(
        turn_id=turn_id,
        token=token,
        events_url=f"/v1/turns/{turn_id}/events",
        conversation_token=conversation_token,
    )
