"""Durable turn state in Redis: state, history, results by call id, wakeups, the step lock.

Nothing here waits. Whatever changes a turn's situation (a settled call, a finished model
round, an answer, an abort) writes its fact and *wakes* the turn in one atomic step: it
sets the turn's dirty flag and a near wakeup in ``agentq:turns:wakeups`` (the backstop,
swept by every turn worker), then asks for a step at once through ``waker``. A process
that takes woken turns' steps itself (``stepper``) has the same script take the step
lock too, and goes on with the step from what the script read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from agentq import constants as k
from agentq import store_lua as lua
from agentq.events.bus import EventBus, event_body
from agentq.models import ToolResult, TurnStatus

log = logging.getLogger("agentq.store")

WAIT_WARN_EVERY_S = 10.0
"""A replica that does not acknowledge is logged at most this often per process."""
DURABLE_ATTEMPTS = 8
"""Runs of an idempotent settling write that replicas did not acknowledge: with the
backoff, about 5 s, longer than Sentinel takes to demote the old master."""

START_BACKSTOP_S = 30.0
"""A new turn whose first step message was lost is swept up this much later: long enough
that a burst of new turns waiting in the queue is not sent a second step each."""
WAKE_BACKSTOP_S = 2.0
"""A wake whose step message was lost (its sender died) is swept up this much later."""

STATE_LOST_MESSAGE = (
    "Redis lost this turn's state (restarted without persistence?); it cannot go on: start it again"
)


@dataclass(frozen=True)
class RoundRead:
    """The stored results, dispatch records and plans (raw, in call order) of a round's
    calls, read with the step's view or known by the step that planned them."""

    ids: tuple[str, ...]
    results: list[Any]
    calls: list[Any]
    plans: list[Any]

    @classmethod
    def planned(cls, plans: dict[str, str]) -> RoundRead:
        """A round just planned: nothing sent or settled yet."""
        none: list[Any] = [None] * len(plans)
        return cls(tuple(plans), none, list(none), list(plans.values()))


@dataclass
class StepView:
    """What a step reads when it begins: the turn's state (None: Redis lost it), its cancel
    reason, its history and, when the state names them, its round's calls as stored."""

    state: dict[str, Any] | None
    cancel_reason: str | None
    history: list[dict[str, Any]]
    round: RoundRead | None = None
    llm_result: tuple[int, str] | None = None
    """(round, LlmRoundResult JSON): a model round's result its writer took this step with."""


class InlineStepper(Protocol):
    """Takes a woken turn's step in this process (see `runtime.step_inline`)."""

    def lock_ms(self) -> int | None:
        """The step lock's lifetime; None when steps are not taken here now."""

    def run(self, turn_id: str, token: str, lock_ms: int, view: StepView) -> None:
        """Go on with a step whose lock (`token`, for `lock_ms`) and view a write already took."""


def step_view(
    flat: list[Any], cancel: Any, history: list[Any], rnd: list[Any] | None = None
) -> StepView:
    """A step's view from what the begin script (or a write that took the lock) returned."""
    state = {text(flat[i]): json.loads(flat[i + 1]) for i in range(0, len(flat), 2)}
    ids = state.get("round_calls")
    return StepView(
        state=state or None,
        cancel_reason=text(cancel) or None,
        history=[json.loads(m) for m in history],
        round=RoundRead(tuple(ids), *rnd) if rnd and isinstance(ids, list) else None,
    )


def _dispatch_args(records: Mapping[str, dict[str, Any]]) -> list[str]:
    """Dispatch records as the (call id, record JSON) pairs `store_lua.record_lua` reads."""
    return [x for c, r in records.items() for x in (c, json.dumps(r))]


def text(v: Any) -> str:
    """Redis answers bytes; callers want str."""
    return v.decode() if isinstance(v, bytes) else str(v)


def _finished(result: ToolResult) -> dict[str, Any]:
    """The fields of a call's tool_finished event."""
    rec = result.record
    return {
        "call_id": result.call_id,
        "tool": result.tool,
        "status": result.status,
        "duration_ms": rec.duration_ms,
        "overran": rec.overran,
        "soft_limited": rec.soft_limited,
        "partial": rec.partial,
        "worker": rec.worker,
        "error": result.error,
        "reason": result.reason,
        "truncated_bytes": result.truncated_bytes,
    }


def _loads(v: bytes | str | None) -> Any:
    return None if v is None else json.loads(v)


@dataclass(frozen=True)
class LlmRoundStart:
    """What a stream worker found when it took a round: a result already stored, a turn
    that is over, another delivery streaming it, or the round claimed with its history."""

    done: str | None = None
    gone: bool = False
    elsewhere: bool = False
    claimed: bool = False
    cancelled: bool = False
    history: list[dict[str, Any]] = field(default_factory=list)


class TurnStore:
    def __init__(
        self,
        client: redis.Redis,
        *,
        log_maxlen: int = 10_000,
        ttl_s: int = 604800,
        waker: Callable[[str], None] | None = None,
        stepper: InlineStepper | None = None,
        replicas_acked: int = 0,
        wait_timeout_ms: int = 500,
    ):
        self.redis = client
        self.replicas_acked = replicas_acked
        """Replicas that must acknowledge the writes a failover must not lose (`WAIT`)."""
        self.wait_timeout_ms = wait_timeout_ms
        self._wait_warned_at = 0.0
        self.bus = EventBus(client, log_maxlen=log_maxlen)
        self.ttl_s = ttl_s
        self.waker = waker
        """Sends a step of a turn at once (a Celery task); the wakeup sweep is the backstop."""
        self.stepper = stepper
        """Takes the step of a turn this process woke, when this process steps turns itself."""
        self._settle = client.register_script(lua.SETTLE_LUA)
        self._start = client.register_script(lua.START_LUA)
        self._wake = client.register_script(lua.WAKE_ONLY_LUA)
        self._finish_llm = client.register_script(lua.FINISH_LLM_LUA)
        self._begin_llm = client.register_script(lua.BEGIN_LLM_LUA)
        self._close = client.register_script(lua.CLOSE_LUA)
        self._commit = client.register_script(lua.COMMIT_LUA)
        self._release = client.register_script(lua.RELEASE_LUA)
        self._claim = client.register_script(lua.CLAIM_LUA)
        self._begin = client.register_script(lua.BEGIN_LUA)
        self._reread = client.register_script(lua.REREAD_LUA)
        self._state_lost = client.register_script(lua.STATE_LOST_LUA)
        self._record_dispatch = client.register_script(lua.RECORD_DISPATCH_LUA)

    def _durable(self, script: Any, keys: list[Any], args: list[Any], *, again: bool = True) -> Any:
        """Run a script whose write a failover must not lose (see `_durable_write`)."""
        if not self.replicas_acked:
            return script(keys=keys, args=args)
        return self._durable_write(lambda p: script(keys=keys, args=args, client=p), again)[0]

    def _durable_write(self, build: Callable[[Any], None], again: bool = True) -> list[Any]:
        """Send the commands `build` puts in a pipeline, then WAIT for `replicas_acked`
        replicas on the same connection; the answers of the first run, WAIT's cut off.

        Too few acknowledgements mean the write may sit on a master being replaced, so
        idempotent writes (`again`) are sent again, with backoff, until replicas
        acknowledge them: after a failover the client has moved to the new master and
        the write lands there.
        """
        first: list[Any] = []
        acked = 0
        for attempt in range(DURABLE_ATTEMPTS if again else 1):
            if attempt:
                time.sleep(min(0.1 * 2**attempt, 1.0))
                self._follow_master()
            *res, acked = self._pipelined(build, wait=True)
            if attempt == 0:
                first = res
            if not self.replicas_acked or int(acked) >= self.replicas_acked:
                return first
        self._under_acked(int(acked))
        return first

    def _pipelined(self, build: Callable[[Any], None], *, wait: bool = False) -> list[Any]:
        """Run the commands `build` puts in a pipeline (with a WAIT last, `wait`).

        A pipeline loads its scripts once, before it is sent: when a retry took it to
        a new master (a failover, a restart) that lacks them, it is built and sent again.
        """
        for attempt in range(2):
            pipe = self.redis.pipeline(transaction=False)
            build(pipe)
            if wait:
                pipe.wait(self.replicas_acked, self.wait_timeout_ms)
            try:
                return list(pipe.execute())
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _follow_master(self) -> None:
        """Behind Sentinel, ask for the master now: if it moved, the pool drops its
        connections to the old one instead of writing there until it is demoted."""
        refresh = getattr(self.redis.connection_pool, "get_master_address", None)
        if refresh is not None:
            # No sentinel answers: the write is retried as it is.
            with contextlib.suppress(redis.RedisError):
                refresh()

    def _under_acked(self, acked: int) -> None:
        now = time.monotonic()
        if now - self._wait_warned_at > WAIT_WARN_EVERY_S:
            self._wait_warned_at = now
            log.warning(
                "%d of %d replicas acknowledged a settling write within %d ms: a failover "
                "now could lose it",
                acked,
                self.replicas_acked,
                self.wait_timeout_ms,
            )

    # -- state ---------------------------------------------------------------

    def create(self, turn_id: str, state: dict[str, Any], history: list[dict[str, Any]]) -> None:
        """Store a new turn, woken: if the message of its first step is lost (a failover
        took it with the old master, its sender died), the wakeup sweep starts it."""

        def build(pipe: Any) -> None:
            pipe.hset(k.turn_key(turn_id), mapping={f: json.dumps(v) for f, v in state.items()})
            # Written whole each time, so sending it again (see _durable_write) is harmless.
            pipe.delete(k.history_key(turn_id))
            if history:
                pipe.rpush(k.history_key(turn_id), *[json.dumps(m) for m in history])
            pipe.zadd(k.ACTIVE_TURNS, {turn_id: time.time()})
            pipe.zadd(k.TURNS_INDEX, {turn_id: float(state.get("created_at") or time.time())})
            pipe.set(k.dirty_key(turn_id), "1", ex=self.ttl_s)
            pipe.zadd(k.WAKEUPS, {turn_id: time.time() + START_BACKSTOP_S})
            parent = state.get("parent_turn_id")
            if parent:
                pipe.sadd(k.children_key(parent), turn_id)

        if self.replicas_acked:
            self._durable_write(build)
        else:
            pipe = self.redis.pipeline()
            build(pipe)
            pipe.execute()

    def state(self, turn_id: str) -> dict[str, Any] | None:
        raw = self.redis.hgetall(k.turn_key(turn_id))
        if not raw:
            return None
        return {text(f): json.loads(v) for f, v in raw.items()}

    def update(self, turn_id: str, **fields: Any) -> None:
        self.redis.hset(k.turn_key(turn_id), mapping={f: json.dumps(v) for f, v in fields.items()})

    def status(self, turn_id: str) -> str | None:
        return _loads(self.redis.hget(k.turn_key(turn_id), "status"))  # type: ignore[no-any-return]

    def active(self) -> list[str]:
        return [text(t) for t in self.redis.zrange(k.ACTIVE_TURNS, 0, -1)]

    def close(
        self,
        turn_id: str,
        status: TurnStatus,
        event: str,
        event_fields: dict[str, Any],
        *,
        settle_parent: tuple[str, ToolResult] | None = None,
        token: str = "",
        append: list[dict[str, Any]] | None = None,
        **fields: Any,
    ) -> int:
        """End the turn (status, terminal event, retention TTL) atomically: 1 (or 2: it
        settled its parent's call), 0 if it had ended, -1 if `token` no longer holds the
        step lock (nothing written).

        `settle_parent` (parent turn id, result) settles the parent's call that started
        this turn in the same step, and wakes the parent; `append` adds history messages
        first, in the same write.
        """
        messages = [json.dumps(m) for m in append or []]
        flat: list[Any] = []
        for f, v in {"status": status.value, "ended_at": time.time(), **fields}.items():
            flat += [f, json.dumps(v)]
        parent, result = settle_parent or ("", None)
        pid = parent or turn_id  # placeholders the script leaves alone without a parent
        won = self._durable(
            self._close,
            keys=[
                k.turn_key(turn_id),
                k.ACTIVE_TURNS,
                k.WAKEUPS,
                k.seq_key(turn_id),
                k.log_key(turn_id),
                k.events_channel(turn_id),
                k.turn_key(pid),
                k.results_key(pid),
                k.dirty_key(pid),
                k.seq_key(pid),
                k.log_key(pid),
                k.events_channel(pid),
                k.outstanding_key(pid),
                k.step_lock_key(turn_id),
                k.history_key(turn_id),
                *k.turn_keys(turn_id),
            ],
            args=[
                turn_id,
                self.ttl_s,
                event_body(turn_id, event, event_fields),
                self.bus.log_maxlen,
                parent,
                "" if result is None else result.call_id,
                "" if result is None else result.model_dump_json(),
                "" if result is None else event_body(pid, "tool_finished", _finished(result)),
                time.time() + WAKE_BACKSTOP_S,
                token,
                len(messages),
                *messages,
                *flat,
            ],
        )
        if won == 2:
            self._send_step(parent)
        return int(won)

    # -- history ---------------------------------------------------------------

    def history(self, turn_id: str) -> list[dict[str, Any]]:
        return [json.loads(m) for m in self.redis.lrange(k.history_key(turn_id), 0, -1)]

    # -- the step: lock, fenced commit, wakeups --------------------------------------

    def lock_step(self, turn_id: str, token: str, ttl_ms: int) -> bool:
        return bool(self.redis.set(k.step_lock_key(turn_id), token, nx=True, px=ttl_ms))

    def begin_step(
        self, turn_id: str, token: str, ttl_ms: int, *, again: bool = False
    ) -> StepView | None:
        """Lock the turn for a step (or keep the lock, `again`) and read it, in one round
        trip; None if another step holds it (or, `again`, this step lost it)."""
        script = self._reread if again else self._begin
        raw = script(
            keys=[
                k.step_lock_key(turn_id),
                k.dirty_key(turn_id),
                k.turn_key(turn_id),
                k.cancel_key(turn_id),
                k.history_key(turn_id),
                k.results_key(turn_id),
                k.calls_key(turn_id),
                k.plan_key(turn_id),
            ],
            args=[token, ttl_ms],
        )
        if not raw:
            return None
        return step_view(*raw)

    def commit(
        self,
        turn_id: str,
        token: str,
        fields: dict[str, Any],
        append: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Write state fields and append history messages, if this step still holds the lock."""
        args: list[Any] = [token, len(fields)]
        for f, v in fields.items():
            args += [f, json.dumps(v)]
        args += [json.dumps(m) for m in append or []]
        # Not run again: a second run would append the messages twice.
        ok = self._durable(
            self._commit,
            keys=[k.step_lock_key(turn_id), k.turn_key(turn_id), k.history_key(turn_id)],
            args=args,
            again=False,
        )
        return bool(ok)

    def release_step(
        self,
        turn_id: str,
        token: str,
        next_wake_at: float | None,
        ttl_ms: int,
        dispatched: dict[str, dict[str, Any]] | None = None,
    ) -> int:
        """Let go of the step's lock, recording the calls it sent (`dispatched`, see
        `record_dispatch`) while it still holds it: 1 released; 0 woken meanwhile, lock
        kept: step again; -1 the lock was lost (nothing recorded)."""
        args: list[Any] = [token, turn_id, "" if next_wake_at is None else repr(next_wake_at)]
        args += [ttl_ms, *_dispatch_args(dispatched or {})]
        keys = [k.step_lock_key(turn_id), k.dirty_key(turn_id), k.WAKEUPS]
        keys += [k.calls_key(turn_id), k.outstanding_key(turn_id), k.results_key(turn_id)]
        if not dispatched:
            return int(self._release(keys=keys, args=args))
        # Not sent again: a second run finds the lock gone. Records a failover loses are
        # of calls a later step sends again, which their start claims run once.
        return int(self._durable(self._release, keys=keys, args=args, again=False))

    def wake(self, turn_id: str) -> bool:
        """Wake an open turn: mark it and send it a step; False if it has ended."""
        ok = self.wake_here(turn_id)
        if ok:
            self._send_step(turn_id)
        return ok

    def wake_here(self, turn_id: str) -> bool:
        """Mark an open turn woken, for a caller that steps it itself; False if it has ended."""
        return bool(
            self._wake(
                keys=[k.dirty_key(turn_id), k.WAKEUPS, k.turn_key(turn_id)],
                args=[turn_id, time.time() + WAKE_BACKSTOP_S, self.ttl_s],
            )
        )

    def _send_step(self, turn_id: str) -> None:
        if self.waker is not None:
            self.waker(turn_id)

    def due_wakeups(self, now: float, limit: int = 500) -> list[str]:
        raw = self.redis.zrangebyscore(k.WAKEUPS, "-inf", now, start=0, num=limit)
        return [text(t) for t in raw]

    def claim_wakeup(self, turn_id: str, now: float, retry_s: float) -> bool:
        """Claim a due wakeup (one sweeper wins) and push it `retry_s` later as its retry."""
        return bool(
            self._claim(
                keys=[k.WAKEUPS, k.dirty_key(turn_id)],
                args=[turn_id, now, now + retry_s, self.ttl_s],
            )
        )

    # -- calls and results -------------------------------------------------------

    def record_dispatch(self, turn_id: str, records: dict[str, dict[str, Any]]) -> None:
        """Record calls as sent, and those not settled yet as the batch in flight whose last
        settle wakes the turn."""
        if not records:
            return
        self._durable(
            self._record_dispatch,
            keys=[k.calls_key(turn_id), k.outstanding_key(turn_id), k.results_key(turn_id)],
            args=_dispatch_args(records),
        )

    def dispatches(self, turn_id: str) -> dict[str, dict[str, Any]]:
        raw = self.redis.hgetall(k.calls_key(turn_id))
        return {text(c): json.loads(v) for c, v in raw.items()}

    def starts(self, turn_id: str) -> dict[str, dict[str, Any]]:
        raw = self.redis.hgetall(k.started_key(turn_id))
        return {text(c): json.loads(v) for c, v in raw.items()}

    def running_tasks(self, turn_id: str) -> dict[str, str | None]:
        """Task id -> worker of each call that started and has no result yet, in one read."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hkeys(k.results_key(turn_id))
        pipe.hgetall(k.started_key(turn_id))
        pipe.hgetall(k.calls_key(turn_id))
        done_raw, starts_raw, calls_raw = pipe.execute()
        done = {text(c) for c in done_raw}
        starts = {text(c): json.loads(v) for c, v in starts_raw.items()}
        records = {text(c): json.loads(v) for c, v in calls_raw.items()}
        # Agent calls have no task: their child turns are aborted instead.
        return {
            d["task_id"]: starts[cid].get("worker")
            for cid, d in records.items()
            if cid not in done and cid in starts and d.get("task_id")
        }

    def mark_started(
        self, turn_id: str, call_id: str, start: dict[str, Any], event: dict[str, Any]
    ) -> int:
        """Record a task's start; 1 started, 0 already settled, -1 turn cancelled,
        -2 turn over or gone, 2 this delivery (`start["delivery"]`) started already."""
        worker = str(start.get("worker") or "")
        watched = bool(start.get("heartbeat")) and bool(worker)
        return int(
            self._durable(
                self._start,
                keys=[
                    k.results_key(turn_id),
                    k.started_key(turn_id),
                    k.cancel_key(turn_id),
                    k.seq_key(turn_id),
                    k.log_key(turn_id),
                    k.events_channel(turn_id),
                    k.turn_key(turn_id),
                    k.worker_calls_key(worker or "-"),
                ],
                args=[
                    call_id,
                    json.dumps(start),
                    event_body(turn_id, "tool_started", event),
                    self.bus.log_maxlen,
                    str(start.get("delivery") or ""),
                    f"{turn_id}/{call_id}" if watched else "",
                ],
            )
        )

    def workers_alive(self, hostnames: list[str]) -> dict[str, bool]:
        """Which workers sent a heartbeat lately."""
        if not hostnames:
            return {}
        pipe = self.redis.pipeline(transaction=False)
        for h in hostnames:
            pipe.exists(k.worker_alive_key(h))
        return {h: bool(v) for h, v in zip(hostnames, pipe.execute(), strict=True)}

    def settle(self, turn_id: str, result: ToolResult, *, wake: bool = True) -> bool:
        """Store a call's result unless one is stored already; True if this one won.

        `wake=False` is for the turn's own step, which goes on by itself.
        """
        result_json = result.model_dump_json()
        event = _finished(result)
        token, lock_ms = self._inline_lock() if wake else ("", 0)
        won = self._durable(
            self._settle,
            keys=[
                k.results_key(turn_id),
                k.dirty_key(turn_id),
                k.seq_key(turn_id),
                k.log_key(turn_id),
                k.events_channel(turn_id),
                k.turn_key(turn_id),
                k.WAKEUPS,
                k.started_key(turn_id),
                k.outstanding_key(turn_id),
                k.step_lock_key(turn_id),
                k.cancel_key(turn_id),
                k.history_key(turn_id),
                k.calls_key(turn_id),
                k.plan_key(turn_id),
            ],
            args=[
                result.call_id,
                result_json,
                event_body(turn_id, "tool_finished", event),
                self.bus.log_maxlen,
                "",
                time.time() + WAKE_BACKSTOP_S,
                self.ttl_s,
                turn_id,
                "1" if wake else "0",
                token,
                lock_ms,
            ],
        )
        won = self._woke(turn_id, won, token, lock_ms, wake=won == 3 and wake)
        if won == -2:
            self.end_lost_turn(turn_id)
        return won in (1, 3)

    def _inline_lock(self) -> tuple[str, int]:
        """A step lock token for a write that may take the step it wakes here ("" if not)."""
        lock_ms = self.stepper.lock_ms() if self.stepper is not None else None
        return ("", 0) if lock_ms is None else (secrets.token_hex(8), lock_ms)

    def _woke(
        self,
        turn_id: str,
        answer: Any,
        token: str,
        lock_ms: int,
        *,
        wake: bool,
        llm_result: tuple[int, str] | None = None,
    ) -> int:
        """After a write that wakes a turn: take the step it locked for this process, else
        send one (unless another step holds the lock: it steps again when it lets go)."""
        if isinstance(answer, list):
            code, *raw = answer
            if self.stepper is not None:
                view = step_view(*raw)
                view.llm_result = llm_result
                self.stepper.run(turn_id, token, lock_ms, view)
            return int(code)
        if wake and not token:
            self._send_step(turn_id)
        return int(answer)

    def end_lost_turn(self, turn_id: str) -> bool:
        """End a turn whose state Redis lost with turn_error `state_lost`; False if it exists."""
        event = event_body(
            turn_id, "turn_error", {"code": "state_lost", "error": STATE_LOST_MESSAGE}
        )
        return bool(
            self._state_lost(
                keys=[
                    k.turn_key(turn_id),
                    k.seq_key(turn_id),
                    k.log_key(turn_id),
                    k.events_channel(turn_id),
                ],
                args=[json.dumps(STATE_LOST_MESSAGE), event, self.bus.log_maxlen, self.ttl_s],
            )
        )

    def round_view(
        self, turn_id: str, call_ids: list[str]
    ) -> tuple[dict[str, ToolResult], dict[str, dict[str, Any]]]:
        """Settled results and dispatch records of these calls, in one round trip."""
        _, settled, dispatched = self.round_plans_view(turn_id, call_ids, plans=False)
        return settled, dispatched

    def round_plans_view(
        self,
        turn_id: str,
        call_ids: list[str],
        *,
        plans: bool = True,
        read: RoundRead | None = None,
    ) -> tuple[list[bytes | None], dict[str, ToolResult], dict[str, dict[str, Any]]]:
        """The stored plans (raw, in order), settled results and dispatch records of these
        calls: from `read` when it is of these calls, else in one round trip."""
        if not call_ids:
            return [], {}, {}
        if read is not None and list(read.ids) == call_ids:
            results, calls, raw_plans = read.results, read.calls, [read.plans]
        else:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hmget(k.results_key(turn_id), call_ids)
            pipe.hmget(k.calls_key(turn_id), call_ids)
            if plans:
                pipe.hmget(k.plan_key(turn_id), call_ids)
            results, calls, *raw_plans = pipe.execute()
        return (
            raw_plans[0] if plans else [],
            {
                c: ToolResult.model_validate_json(r)
                for c, r in zip(call_ids, results, strict=True)
                if r
            },
            {c: json.loads(d) for c, d in zip(call_ids, calls, strict=True) if d},
        )

    def result(self, turn_id: str, call_id: str) -> ToolResult | None:
        raw = self.redis.hget(k.results_key(turn_id), call_id)
        return None if raw is None else ToolResult.model_validate_json(raw)

    def results(self, turn_id: str) -> dict[str, ToolResult]:
        raw = self.redis.hgetall(k.results_key(turn_id))
        return {text(c): ToolResult.model_validate_json(v) for c, v in raw.items()}

    # -- model rounds ------------------------------------------------------------------

    def begin_llm_round(
        self, turn_id: str, round_no: int, worker: str, lease_ms: int
    ) -> LlmRoundStart:
        """Claim a model round for this stream worker and read its history, in one step."""
        res = self._begin_llm(
            keys=[
                k.llm_result_key(turn_id, round_no),
                k.turn_key(turn_id),
                k.llm_alive_key(turn_id, round_no),
                k.llm_taken_key(turn_id, round_no),
                k.cancel_key(turn_id),
                k.history_key(turn_id),
            ],
            args=[worker, lease_ms, self.ttl_s],
        )
        outcome = int(res[0])
        if outcome == 1:
            return LlmRoundStart(done=text(res[1]))
        if outcome == 2:
            return LlmRoundStart(gone=True)
        if outcome == 3:
            return LlmRoundStart(elsewhere=True)
        return LlmRoundStart(
            claimed=True,
            cancelled=bool(res[1]),
            history=[json.loads(m) for m in res[2]],
        )

    def llm_round_alive(self, turn_id: str, round_no: int, worker: str, lease_ms: int) -> None:
        """Renew the claim of a round while it streams."""
        self.redis.set(k.llm_alive_key(turn_id, round_no), worker, px=lease_ms, xx=True)

    def finish_llm_round(self, turn_id: str, round_no: int, result_json: str) -> None:
        """Store a model round's result (LlmRoundResult JSON) and wake its turn."""
        token, lock_ms = self._inline_lock()
        ok = self._finish_llm(
            keys=[
                k.dirty_key(turn_id),
                k.WAKEUPS,
                k.turn_key(turn_id),
                k.llm_result_key(turn_id, round_no),
                k.llm_alive_key(turn_id, round_no),
                k.step_lock_key(turn_id),
                k.cancel_key(turn_id),
                k.history_key(turn_id),
            ],
            args=[turn_id, time.time() + WAKE_BACKSTOP_S, self.ttl_s, result_json, token, lock_ms],
        )
        woke = self._woke(
            turn_id, ok, token, lock_ms, wake=ok == 1, llm_result=(round_no, result_json)
        )
        if woke == -2:
            self.end_lost_turn(turn_id)

    def llm_result(self, turn_id: str, round_no: int) -> str | None:
        raw = self.redis.get(k.llm_result_key(turn_id, round_no))
        return None if raw is None else text(raw)

    # -- cancel ---------------------------------------------------------------------------

    def cancel_reason(self, turn_id: str) -> str | None:
        v = self.redis.get(k.cancel_key(turn_id))
        return None if v is None else text(v)  # type: ignore[union-attr]

    def children(self, turn_id: str) -> list[str]:
        return [text(c) for c in self.redis.smembers(k.children_key(turn_id))]

    def llm_rounds_alive(self, rounds: dict[tuple[str, int], str], lease_ms: int) -> None:
        """Renew many rounds' claims in one round trip: (turn id, round) -> worker."""
        if not rounds:
            return
        pipe = self.redis.pipeline(transaction=False)
        for (turn_id, round_no), worker in rounds.items():
            pipe.set(k.llm_alive_key(turn_id, round_no), worker, px=lease_ms, xx=True)
        pipe.execute()

    def publish_many(self, batches: Mapping[str, list[tuple[str, dict[str, Any]]]]) -> None:
        """Publish the events of several turns, each turn's in order, in one round trip."""
        if not any(batches.values()):
            return
        bodies = {
            turn_id: [event_body(turn_id, type_, fields) for type_, fields in events]
            for turn_id, events in batches.items()
        }
        self._pipelined(lambda pipe: self.bus.publish_many(bodies, client=pipe))
