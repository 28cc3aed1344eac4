"""The Python API: start, follow, answer and abort turns from any process that reaches Redis."""

from __future__ import annotations

import hmac
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, cast

from pydantic import BaseModel

from agentq import constants as k
from agentq.config import Settings, get_settings
from agentq.errors import TokenInvalid, TurnNotFound
from agentq.events.bus import SEQ_FIELD, TERMINAL_TYPES, WATCHERS_FIELD
from agentq.events.follow import follow
from agentq.models import (
    TERMINAL_STATUSES,
    Event,
    InteractionAnswer,
    MultitaskMode,
    TurnHandle,
    TurnRequest,
)
from agentq.orchestrator.conversation import conversations, release_for
from agentq.orchestrator.start import hash_token, start_turn
from agentq.orchestrator.steps import run_step
from agentq.state.budget import day_of
from agentq.state.interactions import Interactions
from agentq.state.spend import GROUPS, NO_KEY, Spend, usage_report
from agentq.state.turn_state import TurnState
from agentq.telemetry import tracing

if TYPE_CHECKING:
    from celery import Celery

    from agentq.state.store import TurnStore


M = TypeVar("M", bound=BaseModel)

_HIDDEN = frozenset({"token_sha256", WATCHERS_FIELD, SEQ_FIELD, *k.BOOKKEEPING_FIELDS})
"""State fields a client's view leaves out: the token's hash, the bus's and the rounds'
bookkeeping."""


class TurnView(TypedDict):
    """A turn as `Client.get` reads it."""

    turn_id: str
    state: TurnState
    """Its state, bookkeeping and the token's hash left out."""
    history: list[dict[str, Any]]
    """Its messages, in order (OpenAI chat format)."""
    invocations: list[dict[str, Any]]
    """The records of its settled calls (`InvocationRecord` as JSON)."""
    spend: dict[str, Any]
    """Its tokens and cost with its sub-agents' (reservations in flight included), and its
    limits (docs/spend.md)."""


class RunningCall(TypedDict):
    call_id: str
    tool: str | None


class ActiveTurn(TypedDict):
    """An open turn as `Client.active` lists it."""

    turn_id: str
    owner: str | None
    agent: str | None
    parent_turn_id: str | None
    status: str | None
    created_at: float | None
    started_at: float | None
    current_tools: list[RunningCall]
    """Its calls sent and not settled."""
    call_count: int


class Client:
    """A handle on agentq from outside the workers: the CLI, the gateway, your code."""

    def __init__(self, settings: Settings | None = None, *, app: Celery | None = None) -> None:
        from agentq.fleet.runtime import get_store

        self.settings = settings or get_settings()
        self._store: TurnStore = get_store(self.settings)
        """The fleet's store, for agentq's own processes that hold a Client (the gateway,
        the CLI); not part of the public API."""
        # The Celery app is built on first use: `agentq abort` of a turn no task holds
        # never needs it, and building it costs that command most of its start-up.
        self._app = app
        self.interactions = Interactions(self._store)
        s = self.settings
        self.traced = bool(s.otel_spans_file) or tracing.wanted(s.otel)
        if self.traced:
            # The workers record a turn's spans; this process records those of the abort
            # steps it runs (the turn's own span, when such a step ends it).
            tracing.setup("client", otel=s.otel, spans_file=s.otel_spans_file)

    # -- starting ------------------------------------------------------------------

    def _lazy_app(self) -> Celery:
        """The app, built only when something is sent with it."""
        from celery.local import Proxy

        return cast("Celery", Proxy(lambda: self.app))

    @property
    def app(self) -> Celery:
        """The Celery app this client sends tasks with."""
        if self._app is None:
            from agentq.fleet.runtime import get_app

            self._app = get_app()
        return self._app

    def start_turn(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict[str, Any]] | None = None,
        conversation_id: str | None = None,
        conversation_token: str | None = None,
        headless: bool = False,
        detach: bool = False,
        parent_turn_id: str | None = None,
        operator: bool = False,
        agent: str | None = None,
        webhook_url: str | None = None,
        multitask: MultitaskMode | None = None,
        idempotency_key: str | None = None,
        max_tokens: int | None = None,
        max_cost_usd: float | None = None,
    ) -> TurnHandle:
        """Queue a turn; returns at once with its id and the token that controls it.

        `max_tokens`, `max_cost_usd`: the turn's budget, its sub-agents' spend included (a
        request may lower its agent's, not raise it); past it the turn ends with
        `turn_error` code `budget_exceeded`. `max_cost_usd` needs a price for the model
        (BudgetInvalid); a key over its AGENTQ_KEY_BUDGETS raises BudgetExceeded.

        `multitask` (with `conversation_id`): what the message does while another turn of
        the conversation runs: "enqueue" (the default: it runs after it), "reject"
        (ConversationBusy), "interrupt", "rollback" or "inject" (docs/conversations.md).

        `idempotency_key`: a second call with the same key (within 24 h) starts nothing
        and returns the first call's turn; with other arguments, IdempotencyKeyReused.

        `agent` names the Agent the turn runs as; one no turn worker runs raises
        UnknownAgent (with the known ones).

        `webhook_url` gets a signed POST when the turn ends (see docs/webhooks.md); a URL
        that can never be delivered to raises WebhookRefused.

        `operator=True` may continue any conversation: for tools that hold Redis
        credentials (`agentq run --conversation`), which could read it anyway.
        """
        req = TurnRequest(
            prompt=prompt,
            messages=messages,
            conversation_id=conversation_id,
            conversation_token=conversation_token,
            headless=headless,
            detach=detach,
            parent_turn_id=parent_turn_id,
            agent=agent,
            webhook_url=webhook_url,
            multitask=multitask,
            max_tokens=max_tokens,
            max_cost_usd=max_cost_usd,
        )
        return self.start(req, operator=operator, idempotency_key=idempotency_key)

    def start(
        self,
        req: TurnRequest,
        *,
        owner: str | None = None,
        admin: bool = False,
        operator: bool = False,
        idempotency_key: str | None = None,
    ) -> TurnHandle:
        """Queue a turn owned by the key name `owner` (None: no key); see `start_turn`."""
        return start_turn(
            self._store,
            self.app,
            self.settings,
            req,
            owner=owner,
            admin=admin,
            operator=operator,
            traced=self.traced,
            idempotency_key=idempotency_key,
            abort=self._abort,
        )

    # -- control ---------------------------------------------------------------------

    def check_token(self, turn_id: str, token: str | None) -> TurnState:
        """The turn's state if `token` is its token; constant-time comparison."""
        state = self._store.state(turn_id)
        if state is None:
            raise TurnNotFound(turn_id)
        expected = str(state.get("token_sha256", ""))
        if not token or not hmac.compare_digest(hash_token(token), expected):
            raise TokenInvalid(turn_id)
        return state

    def abort(
        self, turn_id: str, token: str | None, reason: str = "user", *, operator: bool = False
    ) -> None:
        """Abort a running turn and its sub-agents; unknown or finished turns raise TurnNotFound.

        `operator=True` skips the token: for tools that already hold Redis credentials
        (the `agentq abort` command), which could do anything to the turn anyway.
        """
        if operator:
            state = self._store.state(turn_id) or TurnState()
            if not state:
                raise TurnNotFound(turn_id)
        else:
            state = self.check_token(turn_id, token)
        if state.get("status") in TERMINAL_STATUSES:
            raise TurnNotFound(turn_id)
        self._abort(turn_id, reason)

    def _abort(self, turn_id: str, reason: str) -> None:
        # Flag, notice and the children in one round trip: abort latency is user-facing.
        children = self._store.flag_cancel(turn_id, reason)
        for child in children:
            if self._store.status(child) not in TERMINAL_STATUSES:
                self._abort(child, reason)
        # The abort is a step like any other: taken here at once when no step holds the
        # turn, else by the step that holds it, which sees the flag when it releases.
        if not self._store.wake_here(turn_id):
            return
        # A proxy, so an abort step with nothing to revoke or send never builds the app.
        run_step(turn_id, store=self._store, app=self._lazy_app(), settings=self.settings)

    def answer(
        self,
        turn_id: str,
        request_id: str,
        token: str | None,
        decision: str,
        value: str | None = None,
        *,
        operator: bool = False,
    ) -> None:
        """Answer an interaction; raises if unknown (404) or closed already (409).

        `operator=True` skips the token, as for `abort` (the `agentq answer` command).
        """
        if operator:
            if self._store.state(turn_id) is None:
                raise TurnNotFound(turn_id)
        else:
            self.check_token(turn_id, token)
        self.interactions.answer(
            turn_id,
            request_id,
            InteractionAnswer.model_validate({"decision": decision, "value": value}),
        )

    # -- reading -----------------------------------------------------------------------

    def get(self, turn_id: str) -> TurnView:
        whole = self._store.snapshot(turn_id)
        if whole is None:
            raise TurnNotFound(turn_id)
        state = cast(TurnState, {f: v for f, v in whole.state.items() if f not in _HIDDEN})
        return {
            "turn_id": turn_id,
            "state": state,
            "history": whole.history,
            "invocations": [r.record.model_dump() for r in whole.results.values()],
            "spend": Spend(self._store.redis, self.settings).turn_totals(
                whole.state.get("owner"), turn_id
            ),
        }

    def output(self, turn_id: str, output_type: type[M] | None = None) -> M | Any:
        """The typed output of a finished turn whose agent declares an `output_type`: its
        JSON value, or validated as `output_type` (pass the agent's model). None when the
        turn has none (no output type, or it did not finish with an answer)."""
        state = self._store.state(turn_id)
        if state is None:
            raise TurnNotFound(turn_id)
        value = state.get("output")
        if value is None or output_type is None:
            return value
        return output_type.model_validate(value)

    def active(self) -> list[ActiveTurn]:
        """The open turns, oldest first, with the calls each has out."""
        out: list[ActiveTurn] = []
        for turn_id in self._store.active():
            state = self._store.state(turn_id)
            if state is None or state.get("status") in TERMINAL_STATUSES:
                continue
            results = self._store.results(turn_id)
            running: list[RunningCall] = [
                {"call_id": cid, "tool": d.get("tool")}
                for cid, d in self._store.dispatches(turn_id).items()
                if cid not in results
            ]
            out.append(
                {
                    "turn_id": turn_id,
                    "owner": state.get("owner"),
                    "agent": state.get("agent"),
                    "parent_turn_id": state.get("parent_turn_id"),
                    "status": state.get("status"),
                    "created_at": state.get("created_at"),
                    "started_at": state.get("started_at"),
                    "current_tools": running,
                    "call_count": state.get("call_count", 0),
                }
            )
        return sorted(out, key=lambda t: float(t["created_at"] or 0))

    # -- conversations -------------------------------------------------------------------

    def conversation(
        self,
        conversation_id: str,
        *,
        owner: str | None = None,
        token: str | None = None,
        operator: bool = False,
    ) -> dict[str, Any]:
        """A conversation: idle or busy, its running and queued turns, its messages.

        The caller is its owner's key name, or holds its conversation token; `operator`
        (an admin key, a holder of Redis credentials) may read any. Anyone else, and an
        unknown id: ConversationNotFound."""
        convs = conversations(self._store)
        convs.check_access(conversation_id, owner=owner, token=token, any_owner=operator)
        view = convs.view(conversation_id)
        running = view.running_turn_id
        if running and self._store.status(running) in TERMINAL_STATUSES:
            # Its turn wrote its end (and `turn_finished`) before it appends its exchange:
            # a reader that saw the end is shown the history with it, as the next start
            # would be, by the same hand-off.
            release_for(self._store, self._lazy_app(), conversation_id, running)
            view = convs.view(conversation_id)
        return view.public()

    def usage(
        self,
        *,
        since: float | None = None,
        until: float | None = None,
        key: str | None = None,
        group_by: str = "model",
        owner: str | None = None,
        admin: bool = True,
    ) -> dict[str, Any]:
        """Tokens and cost of the UTC days from `since` to `until` (epoch s; default the
        last 30 days), totals and rows grouped by model, agent or key (docs/spend.md).
        `owner` (a caller that is not `admin`) sees its own key's only; an admin sees
        `key`'s, or every key's."""
        if group_by not in GROUPS:
            raise ValueError(f"group_by: one of {', '.join(GROUPS)}, not {group_by!r}")
        now = time.time()
        until = now if until is None else until
        since = until - 29 * 86400 if since is None else since
        if since > until:
            raise ValueError("since: after until")
        keep_s = self.settings.usage_retention_days * 86400
        days = [day_of(t) for t in range(int(max(since, now - keep_s)), int(until) + 1, 86400)]
        if day_of(until) not in days:
            days.append(day_of(until))
        spend = Spend(self._store.redis, self.settings)
        if not admin:
            owners = [owner or NO_KEY]
        elif key is not None:
            owners = [key]
        else:
            owners = spend.owners()
        report = usage_report(spend.days(owners, days), group_by)
        return {"since": days[0], "until": days[-1], "group_by": group_by, **report}

    def conversations(
        self,
        *,
        owner: str | None = None,
        operator: bool = False,
        limit: int = 50,
        before: float | None = None,
    ) -> list[dict[str, Any]]:
        """The caller's conversations (every one for an operator), most recent first."""
        return conversations(self._store).listing(
            owner=owner, any_owner=operator, limit=limit, before=before
        )

    def delete_conversation(
        self,
        conversation_id: str,
        *,
        owner: str | None = None,
        token: str | None = None,
        operator: bool = False,
    ) -> list[str]:
        """Abort the conversation's running and queued turns and remove it; returns them."""
        convs = conversations(self._store)
        convs.check_access(conversation_id, owner=owner, token=token, any_owner=operator)
        turns = convs.delete(conversation_id)
        for turn_id in turns:
            if self._store.status(turn_id) not in (None, *TERMINAL_STATUSES):
                self._abort(turn_id, "user")
        return turns

    def events(
        self,
        turn_id: str,
        *,
        after_id: str = "0-0",
        heartbeat_s: float | None = None,
        depth: int = 1,
    ) -> Iterator[Event | None]:
        """The turn's events, the log first, then live, up to its terminal event.

        The events of the sub-agents it calls are relayed `depth` levels down (0: none),
        each with `path`. `after_id` is an event's `cursor` (or a stream id) to resume
        after; None is yielded every `heartbeat_s` of silence.
        """
        if self._store.state(turn_id) is None:
            raise TurnNotFound(turn_id)
        return follow(
            self._store.bus, turn_id, after=after_id, heartbeat_s=heartbeat_s, depth=depth
        )

    def wait(self, turn_id: str, timeout_s: float = 300.0) -> Event:
        """Block until the turn ends; return its terminal event."""
        deadline = time.monotonic() + timeout_s
        for ev in follow(self._store.bus, turn_id, heartbeat_s=1.0):
            if ev is not None and ev.type in TERMINAL_TYPES:
                return ev
            if time.monotonic() > deadline:
                break
        raise TimeoutError(f"turn {turn_id} did not end within {timeout_s}s")
