"""Retry and fork (docs/retry.md): a new turn built from a turn's history, read once and
stored in one write; the source never changes. Bulk retry holds an idempotency record per
source: it retries each once."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from itertools import islice
from typing import TYPE_CHECKING, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field

from agentq import constants as k
from agentq.agents import require_known
from agentq.errors import (
    AgentqError,
    ForkInvalid,
    NotRetryable,
    PayloadTooLarge,
    SourceGone,
    TurnNotFound,
)
from agentq.models import (
    MAX_TURN_COST_USD,
    MAX_TURN_TOKENS,
    ToolResult,
    TurnHandle,
)
from agentq.orchestrator import spend
from agentq.orchestrator.conversation import ConversationMovedOn
from agentq.orchestrator.plan import calls_of
from agentq.orchestrator.start import Launch, check_budgets, hash_token, launch
from agentq.state.idempotency import fingerprint, start_once
from agentq.state.listing import MAX_LIMIT, TurnLister, TurnQuery
from agentq.state.turn_state import TurnState, queued_state
from agentq.state.turns import TurnSnapshot

if TYPE_CHECKING:
    from celery import Celery

    from agentq.config import Settings
    from agentq.state.store import TurnStore

RETRYABLE = ("error", "aborted")

KEPT_FIELDS = ("headless", "detach", "agent", "owner", "webhook_url", "max_tokens", "max_cost_usd")
"""What a retry or fork keeps of its source as it is (overrides aside)."""
CARRIED_FIELDS = ("round", "call_count", "output_retries", "instructions", *spend.SPENT)
"""What a retry carries on from its source: counts, instructions and spend (no budget resets)."""

_MODEL = Field(default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:/@-]+$")


class _Closed(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Overrides(_Closed):
    """What a retry or fork may change of its source."""

    agent: str | None = Field(default=None, max_length=64)
    max_tokens: int | None = Field(default=None, gt=0, le=MAX_TURN_TOKENS)
    max_cost_usd: float | None = Field(
        default=None, gt=0, le=MAX_TURN_COST_USD, allow_inf_nan=False
    )


class RetryRequest(_Overrides):
    """`POST /v1/turns/{id}/retry`: all optional."""

    rerun_lost: bool = False
    """Run again the calls that ran without a result, even of tools not `idempotent`."""
    model: str | None = _MODEL


class ToolResultEdit(_Closed):
    call_id: str = Field(min_length=1, max_length=128)
    content: str
    """What the model reads as that call's result from then on (what-if)."""


class ForkEdit(_Closed):
    """A fork's changes to the history it starts from; each optional."""

    message: str | None = Field(default=None, min_length=1)
    """Replaces the last user message before the round."""
    instructions: str | None = Field(default=None, min_length=1)
    """Replaces the agent's instructions (the system message) for the fork's rounds."""
    model: str | None = _MODEL
    tool_result: ToolResultEdit | None = None
    """Replaces one settled call's result."""


class ForkRequest(_Overrides):
    """`POST /v1/turns/{id}/fork`."""

    at_round: int = Field(ge=1)
    """The first round the fork plays again (1-based, as `agentq show` counts)."""
    edit: ForkEdit | None = None


class Source(TurnSnapshot):
    """A turn as one read found it: what a retry or fork is built from."""

    def rounds(self) -> list[int]:
        """The index in the history of each of its own rounds' answers."""
        own = range(int(self.state.get("history_start") or 0), len(self.history))
        return [i for i in own if self.history[i]["role"] == "assistant"]


def read_source(store: TurnStore, turn_id: str) -> Source:
    """The source turn, read once; TurnNotFound, or SourceGone if its conversation is deleted."""
    snap = store.snapshot(turn_id)
    if snap is None:
        raise TurnNotFound(turn_id)
    cid = snap.state.get("conversation_id")
    if cid and not store.redis.exists(k.conversation_key(cid, "owner")):
        raise SourceGone(turn_id, f"its conversation {cid} was deleted, and its history with it")
    history = snap.history or list(snap.state.get("pending_messages") or [])
    return Source(**{**vars(snap), "history": history})


def _base_state(src: Source, over: _Overrides, token: str, model: str | None) -> TurnState:
    """A retry's or fork's start: the source's kept fields, the overrides, `model`, a token."""
    st = src.state
    state = queued_state(hash_token(token), history_start=int(st.get("history_start") or 0))
    overrides = over.model_dump(include=set(_Overrides.model_fields), exclude_none=True)
    kept = {f: st.get(f) for f in KEPT_FIELDS} | overrides
    kept["model"] = model or st.get("model") or None
    state.update(cast(TurnState, {f: v for f, v in kept.items() if v is not None}))
    return state


def _launch(
    token: str, state: TurnState, history: list[dict[str, Any]], results: dict[str, str]
) -> Launch:
    """The new turn, with the records of its settled calls (`results`)."""
    records = {k.SETTLED + c: r for c, r in results.items()}
    return Launch("", token, state, history, len(json.dumps(history).encode()), records)


def retry_launch(src: Source, req: RetryRequest, token: str) -> Launch:
    """A retry of `src`: its history up to its last settled step, its settled calls."""
    st = src.state
    status = str(st.get("status"))
    if status not in RETRYABLE:
        raise NotRetryable(src.turn_id, status)
    history = src.history
    rounds = src.rounds()
    calls = calls_of([history[rounds[-1]]]) if rounds else []
    open_ids = [c.id for c in calls if _unsettled(src, c.id)]
    state = _base_state(src, req, token, req.model)
    state.update(cast(TurnState, {f: st.get(f) for f in CARRIED_FIELDS if st.get(f) is not None}))
    state["retry_of"] = src.turn_id
    reused = {c: r for c, r in src.results.items() if c not in open_ids}
    if open_ids:
        # The round goes on: its tool messages go (rewritten in call order), its results stay.
        history = history[: rounds[-1] + 1]
        state.update(
            {
                "from_round": len(rounds),
                "round_calls": [c.id for c in calls],
                "phase": "tools",
                "replay_lost": [c for c in open_ids if c in src.started or _lost(src, c)] or None,
                "stop_after_round": st.get("stop_after_round"),
            }
        )
        if req.rerun_lost:
            state["rerun_lost"] = True
    else:
        state["from_round"] = len(rounds) + 1
    return _launch(token, state, history, reused)


def _unsettled(src: Source, call_id: str) -> bool:
    """A call of the last round without its own result: cancelled by the end, or lost."""
    ended = src.state.get("end_settled") or []
    return call_id in ended or call_id not in src.results or _lost(src, call_id)


def _lost(src: Source, call_id: str) -> bool:
    raw = src.results.get(call_id)
    return raw is not None and json.loads(raw).get("status") == "lost"


def fork_launch(src: Source, req: ForkRequest, token: str) -> Launch:
    """A fork of `src` at `req.at_round`: the history before it, edited."""
    rounds = src.rounds()
    top = len(rounds) + (1 if _settled_to_the_end(src, rounds) else 0)
    n = req.at_round
    if n > top:
        raise ForkInvalid(
            src.turn_id,
            "at_round",
            f"must be 1..{top} (turn {src.turn_id} answered {len(rounds)} round(s))",
        )
    history = [dict(m) for m in src.history[: rounds[n - 1] if n <= len(rounds) else None]]
    ids = {c.id for c in calls_of(history)}
    results = {c: r for c, r in src.results.items() if c in ids}
    edit = req.edit or ForkEdit()
    if edit.message is not None:
        users = [i for i, m in enumerate(history) if m["role"] == "user"]
        if not users:
            raise ForkInvalid(src.turn_id, "edit.message", f"no user message before round {n}")
        history[users[-1]] = {"role": "user", "content": edit.message}
    if edit.tool_result is not None:
        # The call's result is replaced (its record kept), and so is its tool message.
        cid, content = edit.tool_result.call_id, edit.tool_result.content
        at = [i for i, m in enumerate(history) if m["role"] == "tool" and m["tool_call_id"] == cid]
        if not at or cid not in results:
            why = f"no settled call {cid} before round {n}"
            raise ForkInvalid(src.turn_id, "edit.tool_result.call_id", why)
        history[at[0]] = {**history[at[0]], "content": content}
        result = ToolResult.model_validate_json(results[cid])
        results[cid] = result.model_copy(update={"content": content}).model_dump_json()
    state = _base_state(src, req, token, edit.model)
    state.update(
        {
            "fork_of": src.turn_id,
            "from_round": n,
            "round": n - 1,
            "call_count": len(calls_of(history, int(state.get("history_start") or 0))),
        }
    )
    instructions = edit.instructions or src.state.get("instructions")
    if instructions:
        state["instructions"] = instructions
    return _launch(token, state, history, results)


def _settled_to_the_end(src: Source, rounds: list[int]) -> bool:
    """Whether a round may follow the source's last: all its calls have their own results."""
    if not rounds:
        return True
    calls = calls_of([src.history[rounds[-1]]])
    answered = {m.get("tool_call_id") for m in src.history[rounds[-1] :] if m["role"] == "tool"}
    return bool(calls) and all(c.id in answered and not _unsettled(src, c.id) for c in calls)


def replay_source(state: TurnState) -> dict[str, Any] | None:
    """The turn a retry or fork was made from (`agentq show`): id, kind, and `from_round`."""
    for kind in ("retry", "fork"):
        source = state.get(f"{kind}_of")
        if source:
            return {"kind": kind, "turn_id": source, "from_round": state.get("from_round")}
    return None


def start_replay(
    store: TurnStore,
    app: Celery,
    settings: Settings,
    source_id: str,
    req: RetryRequest | ForkRequest,
    *,
    traced: bool = False,
    turn_id: str | None = None,
) -> TurnHandle:
    """Start a retry (RetryRequest) or fork (ForkRequest) of `source_id`: read once, stored in
    one write, its first step sent. The caller checked that it may."""
    src = read_source(store, source_id)
    token = secrets.token_urlsafe(32)
    retry = isinstance(req, RetryRequest)
    if isinstance(req, RetryRequest):
        new = retry_launch(src, req, token)
    else:
        message = req.edit.message if req.edit else None
        if message and len(message.encode()) > settings.max_prompt_bytes:
            raise PayloadTooLarge("edit.message", len(message.encode()), settings.max_prompt_bytes)
        new = fork_launch(src, req, token)
    new = replace(new, turn_id=turn_id or secrets.token_hex(16))
    require_known(store.redis, req.agent)  # an agent it names instead of its source's
    # As any start (the first round sends the whole history).
    check_budgets(store, settings, new.state, new.size)
    if retry:
        spend.carry_spent(store.redis, settings, new.turn_id, new.state)
    go = partial(launch, store, app, settings, any_owner=True, traced=traced)
    cid = src.state.get("conversation_id")
    if not cid:
        return go(new)
    if retry:
        try:
            handle = go(_in_place(src, new), in_place_of=src.turn_id)
            return handle.model_copy(update={"conversation_id": cid, "branched": False})
        except ConversationMovedOn:
            pass  # another turn followed the source, or holds or waits: a branch then
    # A branch: a new conversation holds the source's earlier messages.
    branch = f"{cid[:100]}.b{secrets.token_hex(6)}"
    handle = go(replace(new, state={**new.state, "conversation_id": branch}))
    return handle.model_copy(update={"conversation_id": branch, "branched": True})


def _in_place(src: Source, new: Launch) -> Launch:
    """A retry in its source's conversation: its own messages (the source's exchange) aside
    until its first step reads the history before that exchange, which it replaces."""
    st = src.state
    base = 0 if st.get("conversation_waiting") else int(st.get("conversation_base_len") or 0)
    state: TurnState = {
        **new.state,
        "conversation_id": st.get("conversation_id"),
        "history_start": int(new.state.get("history_start") or 0) - base,
        "conversation_replaces": src.turn_id,
    }
    return replace(new, state=state, history=new.history[base:])


BULK_CALLER = "bulk-retry"
"""The idempotency records' caller: one record per source turn, whoever asks."""


class BulkRetryRequest(_Closed):
    """`POST /v1/turns/retry`: which turns to retry, and how fast."""

    status: Literal["error", "aborted", "error,aborted"] = "error"
    agent: str | None = Field(default=None, max_length=64)
    since_s: float = Field(default=3600.0, gt=0, le=30 * 86400)
    """Turns created in the last this many seconds."""
    limit: int = Field(default=100, ge=1, le=1000)
    rate_per_s: float = Field(default=10.0, gt=0, le=1000)
    """At most this many retries started a second."""
    dry_run: bool = False
    rerun_lost: bool = False


class BulkOutcome(BaseModel):
    """What the bulk retry did with one source turn."""

    source: str
    outcome: Literal["started", "retried_already", "would_start", "refused"]
    turn_id: str | None = None
    """The retry (started now, or the one that retried it already)."""
    error: str | None = None


def _sources(
    lister: TurnLister, req: BulkRetryRequest, visible: Callable[[dict[str, Any]], bool] | None
) -> Iterator[str]:
    """The matching turns, newest first: not sub-agents (their parent is retried instead)."""
    since = time.time() - req.since_s
    query = TurnQuery.parse(status=req.status, agent=req.agent, limit=MAX_LIMIT)
    while True:
        page = lister.page(query, visible)
        for row in page.turns:
            if float(row.get("created_at") or 0) < since:
                return
            if row.get("parent_turn_id"):
                continue
            yield str(row["turn_id"])
        if page.next_before is None:
            return
        query = query.model_copy(update={"before": page.next_before})


Starter = Callable[[Callable[[], TurnHandle]], TurnHandle]
"""Runs one start under the caller's limits (the gateway's `limited`)."""


def bulk_retry(
    store: TurnStore,
    app: Celery,
    settings: Settings,
    req: BulkRetryRequest,
    *,
    visible: Callable[[dict[str, Any]], bool] | None = None,
    traced: bool = False,
    said: Callable[[BulkOutcome], None] | None = None,
    limited: Starter | None = None,
) -> list[BulkOutcome]:
    """Retry each matching turn once, at most `req.rate_per_s` a second; `visible` keeps a
    caller to its turns, `said` hears each outcome, `limited` runs each start (or refuses)."""
    out: list[BulkOutcome] = []
    gap_s = 1.0 / req.rate_per_s
    next_at = time.monotonic()
    one = RetryRequest(rerun_lost=req.rerun_lost)
    body = fingerprint(one.model_dump())
    run: Starter = limited or (lambda start: start())
    for source in islice(_sources(TurnLister(store.redis), req, visible), req.limit):
        # Under the source's idempotency record: started now, or by whoever came first.
        done = store.redis.get(k.idempotency_key(BULK_CALLER, source))
        if done is not None:
            turn_id = str(json.loads(done)["turn_id"])
            outcome = BulkOutcome(source=source, outcome="retried_already", turn_id=turn_id)
        elif req.dry_run:
            outcome = BulkOutcome(source=source, outcome="would_start")
        else:
            time.sleep(max(0.0, next_at - time.monotonic()))  # the rate cap
            next_at = time.monotonic() + gap_s
            new_id = secrets.token_hex(16)
            go = partial(
                start_replay, store, app, settings, source, one, traced=traced, turn_id=new_id
            )
            try:
                handle = start_once(
                    store.redis, BULK_CALLER, source, body, new_id, partial(run, go)
                )
            except AgentqError as exc:
                outcome = BulkOutcome(source=source, outcome="refused", error=exc.message)
            else:
                outcome = BulkOutcome(
                    source=source,
                    outcome="started" if handle.turn_id == new_id else "retried_already",
                    turn_id=handle.turn_id,
                )
        out.append(outcome)
        if said is not None:
            said(outcome)
    return out
