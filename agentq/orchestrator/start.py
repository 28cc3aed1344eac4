"""Starting a turn (`Client.start`, `POST /v1/turns`, `agentq run`, a schedule's tick): check
the request, store the turn, send its first step."""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import secrets
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, cast

from agentq.agents import published_agent_details, require_known
from agentq.config import Settings
from agentq.errors import AgentqError, BudgetInvalid, ConversationBusy, PayloadTooLarge
from agentq.llm.limits import CHARS_PER_TOKEN
from agentq.models import MultitaskMode, TurnHandle, TurnRequest, check_messages
from agentq.orchestrator import conversation
from agentq.orchestrator.wake import request_abort, send_step_or_wake
from agentq.state.budget import day_of
from agentq.state.conversation_lua import Admit
from agentq.state.conversations import binding, held_bindings
from agentq.state.idempotency import check_key, fingerprint, start_once
from agentq.state.spend import Spend
from agentq.state.turn_state import TurnState, queued_state
from agentq.telemetry import tracing
from agentq.webhooks.target import check_for_turn

if TYPE_CHECKING:
    from celery import Celery

    from agentq.state.store import TurnStore


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def token_matches(state: TurnState, token: str | None) -> bool:
    """`token` is the turn's own token (its sha256 is on the state); constant-time."""
    if not token:
        return False
    return hmac.compare_digest(hash_token(token), str(state.get("token_sha256", "")))


def start_turn(
    store: TurnStore,
    app: Celery,
    settings: Settings,
    req: TurnRequest,
    *,
    owner: str | None = None,
    any_owner: bool = False,
    traced: bool = False,
    turn_id: str | None = None,
    extra_state: TurnState | None = None,
    idempotency_key: str | None = None,
) -> TurnHandle:
    """Queue a turn owned by the key `owner` (see `Client.start`); `any_owner`: an admin or an
    operator, who may continue any conversation; `turn_id` and `extra_state`: a tick's."""
    # 128 random bits (a uuid4 has 122): the id alone opens the turn's event stream.
    new_id = turn_id or secrets.token_hex(16)

    def start() -> TurnHandle:
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
        token = secrets.token_urlsafe(32)
        state = queued_state(
            hash_token(token),
            headless=req.headless,
            detach=req.detach,
            conversation_id=req.conversation_id,
            parent_turn_id=req.parent_turn_id,
            agent=req.agent,
            owner=owner,
            webhook_url=webhook_url,
        )
        asked = {"max_tokens", "max_cost_usd", "multitask"}
        asked_for = req.model_dump(include=asked, exclude_none=True)
        state.update(cast(TurnState, {**(extra_state or {}), **asked_for}))
        check_budgets(store, settings, state, size)
        if req.conversation_id and size > settings.max_conversation_bytes:
            raise PayloadTooLarge(
                f"conversation {req.conversation_id}", size, settings.max_conversation_bytes
            )
        return launch(
            store,
            app,
            settings,
            Launch(new_id, token, state, new, size),
            any_owner=any_owner,
            traced=traced,
            conversation_token=req.conversation_token,
        )

    if idempotency_key is None:
        return start()
    body = fingerprint(req.model_dump(mode="json", exclude_none=True))
    return start_once(store.redis, owner or "", check_key(idempotency_key), body, new_id, start)


@dataclass(frozen=True)
class Launch:
    """A new turn as it is stored, and the size of what it brings to its conversation."""

    turn_id: str
    token: str
    state: TurnState
    history: list[dict[str, object]]
    size: int
    records: dict[str, str] = field(default_factory=dict)
    """Call records it starts with (a retry's or fork's settled calls), by field."""


def launch(
    store: TurnStore,
    app: Celery,
    settings: Settings,
    new: Launch,
    *,
    any_owner: bool,
    traced: bool,
    conversation_token: str | None = None,
    in_place_of: str | None = None,
) -> TurnHandle:
    """Store a checked turn (one write), admit it to its conversation, send its first step.
    `in_place_of`: a retry to replace that turn's exchange (else ConversationMovedOn)."""
    turn_id, token, state, history = new.turn_id, new.token, new.state, new.history
    cid = state.get("conversation_id")
    if cid:
        # Stored before admitted (a conversation's holder always exists), its messages aside
        # until its first step reads the conversation's history.
        state["conversation_waiting"], state["pending_messages"], history = True, history, []
    if traced:
        state["traceparent"], state["trace_caller"] = tracing.new_turn_trace()
    store.create(turn_id, state, history, new.records)
    handle: dict[str, object] = {"turn_id": turn_id}
    done = False
    if cid and in_place_of:
        conversation.admit_in_place(store, app, cid, turn_id, in_place_of)
    elif cid:
        admitted, done = _admit(store, app, settings, new, any_owner, conversation_token)
        handle.update(admitted)
    if not done:
        send_step_or_wake(store, app, turn_id)
    events_url = f"/v1/turns/{handle['turn_id']}/events"
    return TurnHandle(token=token, events_url=events_url, **handle)  # type: ignore[arg-type]


def _admit(
    store: TurnStore,
    app: Celery,
    settings: Settings,
    new: Launch,
    any_owner: bool,
    conversation_token: str | None,
) -> tuple[dict[str, object], bool]:
    """Admit a stored turn to its conversation: run, queue or refuse it (then removed again).
    The handle's fields, and whether the caller is done (first step sent, or it waits)."""
    turn_id, owner = new.turn_id, new.state.get("owner")
    cid = str(new.state.get("conversation_id"))
    new_token = None if owner else secrets.token_urlsafe(32)
    mode = cast(MultitaskMode, new.state.get("multitask") or "enqueue")
    decide = partial(
        conversation.conversations(store).admit,
        cid,
        turn_id,
        mode,
        new_bytes=new.size,
        max_bytes=settings.max_conversation_bytes,
        claim=binding("owner", owner) if owner else binding("secret", str(new_token)),
        may=held_bindings(owner, conversation_token),
        any_owner=any_owner,
    )
    try:
        admitted = decide()
        running, handed = admitted.running, False
        if admitted.outcome is not Admit.RUN and running and not conversation.alive(store, running):
            # The turn ahead has ended, its hand-off under way or never to come: hand off for
            # it rather than wait (or refuse) behind it; the release script lets one act.
            handed = conversation.release_for(store, app, cid, running) == turn_id
            if admitted.outcome is Admit.BUSY:
                admitted = decide()  # refused behind a turn that is over: asked once more
                running = admitted.running
            else:
                running = None  # over: not interrupted, nothing joins it
        if admitted.outcome is Admit.BUSY:
            raise ConversationBusy(cid, str(running))
        if admitted.outcome is Admit.INTERRUPTED and running:
            request_abort(store, running, "rollback" if mode == "rollback" else "interrupt")
        elif admitted.outcome is Admit.INJECTED and running:
            conversation.conversations(store).note_injected(running)
    except AgentqError:
        # Busy, too large, not found or not the caller's: nothing of the request stays.
        conversation.forget(store, turn_id)
        raise
    handle: dict[str, object] = {"conversation_token": new_token} if admitted.created else {}
    queued = admitted.outcome is not Admit.RUN and not handed
    if queued:
        # Its predecessor's hand-off sends its first step, perhaps already: said only if queued.
        fields = {"position": admitted.position, "behind": admitted.behind}
        store.bus.publish(turn_id, "turn_queued", **fields)
        if admitted.outcome is Admit.INJECTED:
            handle.update(injected=True, message_turn_id=turn_id, turn_id=admitted.running)
        handle.update(queued=True, **fields)
    return handle, queued or handed


def check_budgets(store: TurnStore, settings: Settings, state: TurnState, size: int) -> None:
    """Refuse a turn whose `max_cost_usd` has no price (BudgetInvalid) or key is over budget."""
    model, agent, owner = state.get("model"), state.get("agent"), state.get("owner")
    if agent and not model:
        details = {a["name"]: a for a in published_agent_details(store.redis)}
        model = (details.get(agent) or {}).get("model")
    model = model or settings.llm_model
    price = settings.llm_prices.get(model)
    if state.get("max_cost_usd") is not None and price is None:
        raise BudgetInvalid(
            f"max_cost_usd needs a price for model {model!r}: it has none in "
            "AGENTQ_LLM_PRICES (max_tokens bounds a turn of any model)"
        )
    if (owner or "") not in settings.key_budgets:
        return
    # The least first round, reserved without a reservation: a check of the key's budgets.
    prompt = math.ceil(size / CHARS_PER_TOKEN)
    Spend(store.redis, settings).reserve(owner, day_of(time.time()), prompt, price)
