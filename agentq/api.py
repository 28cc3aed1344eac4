"""The Python API: start, follow, answer and abort turns from any process that reaches Redis."""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypedDict, TypeVar, cast

from pydantic import BaseModel

from agentq import constants as k
from agentq.config import Settings, get_settings
from agentq.errors import TokenInvalid, TurnNotFound, TurnTimeout
from agentq.events import Event
from agentq.events.bus import SEQ_FIELD, WATCHERS_FIELD
from agentq.events.follow import follow
from agentq.llm.responses import public_history
from agentq.models import (
    TERMINAL_STATUSES,
    InteractionAnswer,
    MultitaskMode,
    ToolResult,
    TurnHandle,
    TurnRequest,
)
from agentq.orchestrator import replay
from agentq.orchestrator.conversation import conversations, shown
from agentq.orchestrator.start import start_turn, token_matches
from agentq.orchestrator.wake import request_abort
from agentq.state.listing import TurnLister, Visible
from agentq.state.results import TurnResult, TurnView, settle
from agentq.state.spend import NO_KEY, Spend, usage_days, usage_report
from agentq.state.timeline import timeline
from agentq.state.turn_state import TurnState
from agentq.telemetry import tracing
from agentq.webhooks.deliveries import Deliveries

log = logging.getLogger("agentq.client")

if TYPE_CHECKING:
    from typing import Unpack

    from celery import Celery

    from agentq.agents import Agent
    from agentq.state.store import TurnStore


_HIDDEN = frozenset({"token_sha256", WATCHERS_FIELD, SEQ_FIELD, *k.BOOKKEEPING_FIELDS})
"""State fields a client's view leaves out: the token's hash and bookkeeping."""


def _agent(agent: Agent | str | None) -> tuple[str | None, type[BaseModel] | None]:
    """`agent`'s name and output model (by name: among the agents this process defined)."""
    if not isinstance(agent, str):
        return (None, None) if agent is None else (agent.name, agent.output_type)
    from agentq.agents import all_agents

    found = all_agents().get(agent)
    return agent, None if found is None else found.output_type


DEFAULT_TIMEOUT_S = 300.0


class StartOptions(TypedDict, total=False):
    """`Client.start`'s options (docs/python-api.md): TurnRequest fields and `idempotency_key`."""

    messages: list[dict[str, Any]] | None
    conversation_id: str | None
    conversation_token: str | None
    multitask: MultitaskMode | None
    headless: bool
    detach: bool
    webhook_url: str | None
    idempotency_key: str | None
    max_tokens: int | None
    max_cost_usd: float | None


Done = TypeVar("Done")
"""What a Turn's steering returns: None, or for an AsyncTurn an awaitable of it."""


@dataclass(repr=False, eq=False)
class _Started(Generic[Done]):
    """What a start answered, as `Turn` and `AsyncTurn` show it."""

    _client: Any
    handle: TurnHandle
    _output_type: type[BaseModel] | None

    @property
    def turn_id(self) -> str:
        return self.handle.turn_id

    @property
    def token(self) -> str:
        """The turn's capability: whoever holds it may read, abort and answer it."""
        return self.handle.token

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.turn_id!r})"

    def abort(self) -> Done:
        """Abort it and its sub-agents; TurnNotFound once it has ended."""
        return self._client.abort(self.turn_id, self.token)  # type: ignore[no-any-return]

    def answer(
        self,
        request_id: str,
        decision: str = "approve",
        value: str | None = None,
        *,
        turn_id: str | None = None,
    ) -> Done:
        """Answer its interaction `request_id`; a relayed sub-agent's on the event's `turn_id`
        (the turn's token opens its sub-agents too)."""
        return self._client.answer(  # type: ignore[no-any-return]
            turn_id or self.turn_id, request_id, self.token, decision, value
        )


class Turn(_Started[None]):
    """A running (or ended) turn, as `Client.start` returns it."""

    _client: Client

    def events(self, *, depth: int = 1, after_id: str = "0-0") -> Iterator[Event]:
        """`Client.events` without heartbeats."""
        for ev in self._client.events(self.turn_id, after_id=after_id, depth=depth):
            if ev is not None:
                yield ev

    def wait(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> Event:
        """`Client.wait` on this turn."""
        return self._client.wait(self.turn_id, timeout_s)

    def result(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> TurnResult:
        """Block until the turn ends: its result, or `Client.run`'s errors."""
        terminal = self.wait(timeout_s)
        return settle(self.turn_id, terminal, self._client.get(self.turn_id), self._output_type)


def usage_time(raw: float | str | None, name: str, *, end: bool = False) -> float | None:
    """A UTC day YYYY-MM-DD (with `end`: its last second) or epoch seconds, as epoch seconds."""
    if not isinstance(raw, str):
        return raw
    try:
        day = dt.datetime.strptime(raw, "%Y-%m-%d").replace(tzinfo=dt.timezone.utc)
        return day.timestamp() + (86399 if end else 0)
    except ValueError:
        pass
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}: a UTC day (YYYY-MM-DD) or epoch seconds") from None
    if not 0 <= value <= 1e11:
        raise ValueError(f"{name}: out of range")
    return value


class Client:
    """A handle on agentq from outside the workers: the CLI, the gateway, your code."""

    def __init__(self, settings: Settings | None = None, *, app: Celery | None = None) -> None:
        from agentq.fleet.runtime import get_store

        self.settings = settings or get_settings()
        s = self.settings
        self._store: TurnStore = get_store(s)
        # Built on first use: `agentq abort` rarely needs it, and it costs most of its start-up.
        self._app = app
        self.traced = bool(s.otel_spans_file) or tracing.wanted(s.otel)
        if self.traced:  # the workers record a turn's spans; each turn starts its trace here
            tracing.setup("client", otel=s.otel, spans_file=s.otel_spans_file)

    @property
    def app(self) -> Celery:
        if self._app is None:
            from agentq.fleet.runtime import get_app

            self._app = get_app()
        return self._app

    def start(
        self, agent: Agent | str | None, prompt: str | None = None, **options: Unpack[StartOptions]
    ) -> Turn:
        """Start a turn of `agent` (an Agent, its name, or None: the default model with
        every tool) and return its `Turn` at once (docs/python-api.md). Raises UnknownAgent,
        BudgetInvalid, BudgetExceeded, ConversationBusy, IdempotencyKeyReused or
        WebhookRefused before any turn exists."""
        key = options.pop("idempotency_key", None)
        # A TurnRequest refuses any other keyword (a start's `owner` is the gateway's own).
        fields = cast("dict[str, Any]", options)
        name, output_type = _agent(agent)
        req = TurnRequest(prompt=prompt, agent=name, **fields)
        return Turn(self, self._start_turn(req, idempotency_key=key), output_type)

    def run(
        self,
        agent: Agent | str | None,
        prompt: str | None = None,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **options: Unpack[StartOptions],
    ) -> TurnResult:
        """Start a turn and block until it ends: its result, or TurnFailed, TurnAborted,
        HeadlessInteraction; TurnTimeout past `timeout_s` (the turn keeps running)."""
        return self.start(agent, prompt, **options).result(timeout_s)

    def _start_turn(
        self,
        prompt: str | TurnRequest | None = None,
        *,
        owner: str | None = None,
        operator: bool = False,
        idempotency_key: str | None = None,
        **fields: Any,
    ) -> TurnHandle:
        """`start` for agentq's own commands and the gateway, owned by the key name `owner`.
        An `operator` (an admin key, or a tool holding Redis credentials that could read it
        anyway) may continue any conversation."""
        if isinstance(prompt, TurnRequest):
            if fields:  # they would be dropped without a word
                raise TypeError(f"fields given beside a TurnRequest: {', '.join(sorted(fields))}")
        else:
            prompt = TurnRequest(prompt=prompt, **fields)
        return start_turn(
            self._store,
            self.app,
            self.settings,
            prompt,
            owner=owner,
            any_owner=operator,
            traced=self.traced,
            idempotency_key=idempotency_key,
        )

    def retry(
        self,
        turn_id: str,
        *,
        token: str | None = None,
        rerun_lost: bool = False,
        agent: Agent | str | None = None,
        model: str | None = None,
        max_tokens: int | None = None,
        max_cost_usd: float | None = None,
    ) -> Turn:
        """A new turn going on where a turn that ended error or aborted stopped (docs/retry.md)."""
        name, output_type = _agent(agent)
        req = replay.RetryRequest(
            rerun_lost=rerun_lost,
            agent=name,
            model=model,
            max_tokens=max_tokens,
            max_cost_usd=max_cost_usd,
        )
        return Turn(self, self._replay(turn_id, req, token), output_type)

    def fork(
        self,
        turn_id: str,
        at_round: int,
        *,
        token: str | None = None,
        edit: replay.ForkEdit | dict[str, Any] | None = None,
        agent: Agent | str | None = None,
        max_tokens: int | None = None,
        max_cost_usd: float | None = None,
    ) -> Turn:
        """A new turn from the history before round `at_round` (1-based)."""
        name, output_type = _agent(agent)
        req = replay.ForkRequest(
            at_round=at_round,
            edit=replay.ForkEdit.model_validate(edit) if isinstance(edit, dict) else edit,
            agent=name,
            max_tokens=max_tokens,
            max_cost_usd=max_cost_usd,
        )
        return Turn(self, self._replay(turn_id, req, token), output_type)

    def _replay(
        self, turn_id: str, req: replay.RetryRequest | replay.ForkRequest, token: str | None = None
    ) -> TurnHandle:
        """The gateway's way in, once it checked the caller."""
        if token is not None:
            self.check_token(turn_id, token)
        return replay.start_replay(
            self._store, self.app, self.settings, turn_id, req, traced=self.traced
        )

    def retry_many(
        self, *, said: Callable[[replay.BulkOutcome], None] | None = None, **filters: Any
    ) -> list[replay.BulkOutcome]:
        """Retry each turn matching `filters` (BulkRetryRequest's fields) once, by anyone."""
        return self._retry_many(replay.BulkRetryRequest(**filters), said=said)

    def _retry_many(
        self,
        req: replay.BulkRetryRequest,
        *,
        said: Callable[[replay.BulkOutcome], None] | None = None,
        visible: Visible | None = None,
        limited: replay.Starter | None = None,
    ) -> list[replay.BulkOutcome]:
        """`retry_many` of a checked request (the gateway's way in, with its caller's view and
        start limits)."""
        from celery.local import Proxy

        # The app is built only once a retry is sent with it (a dry run sends none).
        app = cast("Celery", Proxy(lambda: self.app))
        return replay.bulk_retry(
            self._store,
            app,
            self.settings,
            req,
            traced=self.traced,
            said=said,
            visible=visible,
            limited=limited,
        )

    def check_token(self, turn_id: str, token: str | None, *, operator: bool = False) -> TurnState:
        """The turn's state if `token` is its token; an `operator` (holding Redis credentials,
        it could do anything to the turn anyway) needs none."""
        state = self._store.state(turn_id)
        if state is None:
            raise TurnNotFound(turn_id)
        if not operator and not token_matches(state, token):
            raise TokenInvalid(turn_id)
        return state

    def abort(
        self, turn_id: str, token: str | None, reason: str = "user", *, operator: bool = False
    ) -> None:
        """Abort a running turn and its sub-agents; unknown or finished turns raise TurnNotFound."""
        state = self.check_token(turn_id, token, operator=operator)
        if state.get("status") in TERMINAL_STATUSES:
            raise TurnNotFound(turn_id)
        request_abort(self._store, turn_id, reason)

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
        """Answer an interaction; raises if unknown (404) or closed already (409)."""
        self.check_token(turn_id, token, operator=operator)
        self._store.answer_interaction(
            turn_id,
            request_id,
            InteractionAnswer.model_validate({"decision": decision, "value": value}),
        )

    def complete_waitpoint(self, waitpoint_id: str, token: str, result: Any) -> ToolResult:
        """Settle a waitpoint's call with `result` (`{"error": ...}` settles it `error`); the
        settled result. Raises WaitpointRefused (404 unknown or a wrong token, 409 completed
        already, 410 closed) or PayloadTooLarge."""
        return self._store.complete_waitpoint(
            waitpoint_id, token, result, max_bytes=self.settings.max_result_bytes
        )

    def get(self, turn_id: str) -> TurnView:
        whole = self._store.snapshot(turn_id)
        if whole is None:
            raise TurnNotFound(turn_id)
        state = cast(TurnState, {f: v for f, v in whole.state.items() if f not in _HIDDEN})
        return {
            "turn_id": turn_id,
            "state": state,
            "history": public_history(whole.history),
            "invocations": [
                ToolResult.model_validate_json(r).record.model_dump()
                for r in whole.results.values()
            ],
            "spend": Spend(self._store.redis, self.settings).turn_totals(
                whole.state.get("owner"), turn_id
            ),
        }

    def _timeline(self, turn_id: str, state: TurnState) -> dict[str, Any]:
        """What `agentq show` and the console show of a turn the caller may read."""
        summary = TurnLister(self._store.redis).summaries([turn_id]).get(turn_id)
        if summary is None:
            raise TurnNotFound(turn_id)
        r, s = self._store.redis, self.settings
        return {
            **timeline(self._store, turn_id, state),
            "turn": summary,
            "webhook": Deliveries(r, s).of_turn(turn_id),
            "source": replay.replay_source(state),
            "waitpoints": self._store.waitpoint_rows(turn_id),
            "spend": Spend(r, s).turn_totals(state.get("owner"), turn_id),
        }

    def active(self, visible: Visible | None = None) -> list[dict[str, Any]]:
        """The open turns (only those `visible`, when given), oldest first, with the calls
        each has out (`current_tools`)."""
        rows = TurnLister(self._store.redis).active(visible)
        open_rows = [row for row in rows if row["status"] not in TERMINAL_STATUSES]
        return sorted(open_rows, key=lambda t: float(t["created_at"] or 0))

    def conversation(
        self,
        conversation_id: str,
        *,
        owner: str | None = None,
        token: str | None = None,
        operator: bool = False,
    ) -> dict[str, Any]:
        """A conversation, for its owner, its token's holder or an `operator`; anyone else,
        and an unknown id: ConversationNotFound."""
        convs = conversations(self._store)
        convs.check_access(conversation_id, owner=owner, token=token, any_owner=operator)
        view = shown(self._store, convs.view(conversation_id)).public()
        view["messages"] = public_history(view["messages"])
        return view

    def usage(
        self,
        *,
        since: float | str | None = None,
        until: float | str | None = None,
        key: str | None = None,
        group_by: str = "model",
        owner: str | None = None,
        admin: bool = True,
    ) -> dict[str, Any]:
        """Tokens and cost of the UTC days from `since` to `until` (default the last 30),
        grouped by model, agent or key (docs/spend.md); a caller not `admin` sees its own."""
        keep = self.settings.usage_retention_days
        start, end = usage_time(since, "since"), usage_time(until, "until", end=True)
        days = usage_days(group_by, start, end, time.time(), keep)
        spend = Spend(self._store.redis, self.settings)
        owners = [owner or NO_KEY] if not admin else [key] if key is not None else spend.owners()
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
                request_abort(self._store, turn_id, "user")
        return turns

    def events(
        self,
        turn_id: str,
        *,
        after_id: str = "0-0",
        heartbeat_s: float | None = None,
        depth: int = 1,
    ) -> Iterator[Event | None]:
        """The turn's events after `after_id` (an event's `cursor`), then live, up to its
        end; its sub-agents' relayed `depth` levels down; None every `heartbeat_s` of silence."""
        if self._store.state(turn_id) is None:
            raise TurnNotFound(turn_id)
        return follow(
            self._store.bus, turn_id, after=after_id, heartbeat_s=heartbeat_s, depth=depth
        )

    def wait(self, turn_id: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Event:
        """The turn's terminal event, or TurnTimeout; warns while no worker serves the turn."""
        from agentq.fleet.presence import Watch, advice

        deadline = time.monotonic() + timeout_s
        beat_s = min(1.0, max(timeout_s, 0.01))
        watch = Watch(turn_id, None, self._store.redis, log.warning).start()
        try:
            for ev in follow(self._store.bus, turn_id, heartbeat_s=beat_s, depth=0):
                if ev is not None and ev.ends_turn:
                    return ev
                if time.monotonic() > deadline:
                    break
        finally:
            watch.done.set()
        raise TurnTimeout(turn_id, timeout_s, advice(watch.said) if watch.said else "")
