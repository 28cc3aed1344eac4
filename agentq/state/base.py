"""What every part of the turn store shares: the client, durable writes, waking, decoding."""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple, Protocol, TypeVar, cast

import redis

from agentq import constants as k
from agentq.events.bus import SEQ_FIELD, EventBus, event_body, publish_lua, run_pipeline
from agentq.events.lua_args import LuaScript, bind_lua
from agentq.models import ToolResult
from agentq.state.turn_state import TurnState
from agentq.telemetry.fleetcounts import COUNTED_TYPES, fleet_counts

log = logging.getLogger("agentq.state")

T = TypeVar("T")

WAIT_WARN_EVERY_S = 10.0
"""A replica that does not acknowledge is logged at most this often per process."""
DURABLE_ATTEMPTS = 8
"""Runs of an unacknowledged idempotent write: with backoff, about 5 s, past a Sentinel failover."""

START_BACKSTOP_S = 30.0
"""A new turn whose first step message was lost is swept up this much later (a burst of
new turns waiting in the queue is not sent a second step each)."""
WAKE_BACKSTOP_S = 2.0
"""A wake whose step message was lost (its sender died) is swept up this much later."""

STATE_LOST_MESSAGE = (
    "Redis lost this turn's state (restarted without persistence?); it cannot go on: start it again"
)


class Settled(IntEnum):
    """What `settle` found (SETTLE_LUA answers it)."""

    TURN_GONE = -2
    """The turn is over, or Redis lost it: nothing written."""
    LOST = 0
    """A result was stored first: it is the one kept."""
    WON = 1
    """Stored; other calls of the batch in flight have no result yet (or no wake asked)."""
    READY = 3
    """Stored, completing the batch in flight: the turn is woken (or its step taken here)."""
    EXPIRED = -4
    """A waitpoint's completion past its deadline: nothing written (its step times it out)."""


class TurnKeys(NamedTuple):
    """KEYS of a script that writes a turn's state, publishes or wakes it: one slot, its shard's."""

    turn_key: str
    log_key: str
    channel: str
    wakeups_key: str

    @classmethod
    def of(cls, turn_id: str) -> list[str]:
        turn = [k.turn_key(turn_id, p) for p in ("", "log", "events")]
        return [*turn, k.shard_key(k.WAKEUPS, turn_id)]


class StateLostArgs(NamedTuple):
    error: str
    """The error message (JSON)."""
    event: str
    log_opts: str
    ttl_s: int


# STATE_LOST_LUA: a turn whose state Redis lost (a restart without persistence) cannot go
# on: it ends here with a clear error, once, and its record expires.
STATE_LOST_LUA = (
    bind_lua(TurnKeys, StateLostArgs)
    + f"""
if redis.call('EXISTS', turn_key) == 1 then return 0 end
local seq = 0
{publish_lua("log_key", "channel", "event", "log_opts", "1")}
redis.call('HSET', turn_key, 'status', '"error"', 'error_code', '"state_lost"', 'error', error,
  '{SEQ_FIELD}', seq)
for _, key in ipairs({{turn_key, log_key}}) do redis.call('EXPIRE', key, ttl_s) end
return 1
"""
)


@dataclass(frozen=True)
class RoundRead:
    """A round's calls' results, dispatch records and plans (raw), as `round_view`'s HMGET."""

    ids: tuple[str, ...]
    values: list[Any]

    @classmethod
    def unsent(cls, ids: tuple[str, ...], plans: list[Any] | None = None) -> RoundRead:
        """Calls neither sent nor settled, planned (`plans`) or not even that."""
        return cls(ids, [None] * (2 * len(ids)) + (plans or [None] * len(ids)))


@dataclass
class StepView:
    """What a step reads when it begins (`state` None: Redis lost the turn)."""

    state: TurnState | None
    cancel_reason: str | None
    history: list[dict[str, Any]]
    round: RoundRead | None = None


class InlineStepper(Protocol):
    """Sends a woken turn's step, or takes it in this process (see `steps.step_inline`)."""

    def wake(self, turn_id: str) -> None:
        """Send (or take here) the step of a turn a write woke without taking its lock."""

    def lock_ms(self) -> int | None:
        """The step lock's lifetime; None when steps are not taken here now."""

    def run(self, turn_id: str, token: str, lock_ms: int, view: StepView) -> None:
        """Go on with a step whose lock (`token`, for `lock_ms`) and view a write already took."""


def step_view(flat: list[Any], history: list[Any], rnd: list[Any] | None = None) -> StepView:
    """A step's view from what the begin script (or a write that took the lock) returned."""
    state = state_of(dict(zip(flat[::2], flat[1::2], strict=True)))
    ids = state.get("round_calls")
    cancel = state.pop(k.CANCEL_FIELD, None)
    return StepView(
        state=state or None,
        cancel_reason=None if cancel is None else str(cancel),
        history=[json.loads(m) for m in history],
        round=RoundRead(tuple(ids), rnd) if rnd and isinstance(ids, list) else None,
    )


def state_of(raw: Mapping[Any, Any]) -> TurnState:
    """A turn's state fields out of its state hash as read: its records left out."""
    fields = ((text(f), v) for f, v in raw.items())
    return cast(TurnState, {f: json.loads(v) for f, v in fields if not k.is_record(f)})


def call_fields(raw: Mapping[Any, Any], prefix: str) -> dict[str, Any]:
    """The records of one kind (`prefix`) in a turn's state hash as read, by call id."""
    fields = ((text(f), v) for f, v in raw.items())
    return {f[len(prefix) :]: v for f, v in fields if f.startswith(prefix)}


def history_of(raw: Mapping[Any, Any]) -> list[dict[str, Any]]:
    """A turn's messages, in order, out of its state hash as HGETALL read it."""
    found = {int(i): v for i, v in call_fields(raw, k.MESSAGE).items()}
    return [json.loads(found[i]) for i in sorted(found)]


def first_send(record: Mapping[str, Any]) -> bool:
    """A dispatch record of a call sent for the first time (a pickup sends it again)."""
    return int(record.get("sends", 1)) == 1


def dispatch_args(records: Mapping[str, dict[str, Any]]) -> list[str]:
    """Dispatch records as the (field, record JSON) pairs of a turn's state hash."""
    return [x for c, r in records.items() for x in (k.DISPATCHED + c, json.dumps(r))]


def each(client: Any, items: Iterable[T], command: Callable[[Any, T], Any]) -> list[Any]:
    """The answers of `command(pipe, item)` for each of `items`, in one round trip."""
    pipe = client.pipeline(transaction=False)
    for item in items:
        command(pipe, item)
    return list(pipe.execute())


def exist(client: Any, keys: list[str]) -> list[bool]:
    """Whether each of `keys` exists, in one round trip."""
    return [bool(v) for v in each(client, keys, lambda p, key: p.exists(key))]


def statuses(client: Any, turn_ids: list[str]) -> list[str | None]:
    """Each turn's status (None: Redis holds no such turn), in one round trip."""
    got = each(client, turn_ids, lambda p, t: p.hget(k.turn_key(t), "status"))
    return [None if raw is None else json.loads(raw) for raw in got]


def active_turns(client: Any) -> list[str]:
    """The open turns of every shard (the members of their wakeups), the soonest due first."""
    got = each(
        client, k.shards(), lambda p, s: p.zrange(k.shard_key(k.WAKEUPS, s), 0, -1, withscores=True)
    )
    return [text(t) for _, t in sorted((float(sc), t) for rows in got for t, sc in rows)]


SCAN_COUNT = 10_000
"""Fields an HSCAN of a turn's state looks at a call: mostly all of them, in one call."""


def records_of(client: Any, turn_ids: list[str], kinds: str) -> list[dict[Any, Any]]:
    """Each turn's records of these kinds (prefix letters: "sd"), matched in Redis, in one trip."""
    opts = {"match": f"[{kinds}]:*", "count": SCAN_COUNT}
    got = each(client, turn_ids, lambda p, t: p.hscan(k.turn_key(t), 0, **opts))
    return [
        dict(client.hscan_iter(k.turn_key(t), **opts)) if int(cursor) else dict(fields)
        for t, (cursor, fields) in zip(turn_ids, got, strict=True)
    ]


def now_ms() -> int:
    """This process's wall clock in ms, which the step lock's lifetime is counted on."""
    return int(time.time() * 1000)


def text(v: Any) -> str:
    """Redis answers bytes; callers want str."""
    return v.decode() if isinstance(v, bytes) else str(v)


def finished(result: ToolResult) -> dict[str, Any]:
    """The fields of a call's tool_finished event."""
    rec = result.record
    return {
        **result.model_dump(
            include={"call_id", "tool", "status", "error", "reason", "truncated_bytes"}
        ),
        **rec.model_dump(include={"duration_ms", "overran", "soft_limited", "partial", "worker"}),
        **rec.model_dump(include={"waitpoint_id"}, exclude_none=True),
    }


class StoreBase:
    """The client and the writes every part of the store makes."""

    _state_lost = LuaScript(STATE_LOST_LUA)

    def __init__(
        self,
        client: redis.Redis,
        *,
        log_maxlen: int = 10_000,
        ttl_s: int = 604800,
        stepper: InlineStepper | None = None,
        replicas_acked: int = 0,
        wait_timeout_ms: int = 500,
        metrics_flush_s: float = 5.0,
    ):
        self.redis = client
        self.replicas_acked = replicas_acked
        """Replicas that must acknowledge the writes a failover must not lose (`WAIT`)."""
        self.wait_timeout_ms = wait_timeout_ms
        self._wait_warned_at = 0.0
        self.bus = EventBus(
            client,
            log_maxlen=log_maxlen,
            count=lambda events: fleet_counts.events(events, client, metrics_flush_s),
            counted_types=COUNTED_TYPES,
        )
        self.ttl_s = ttl_s
        self.stepper = stepper
        """Sends (or takes here) the step of a turn this process woke."""

    def _durable(
        self,
        script: Any,
        keys: list[Any],
        args: list[Any],
        *,
        again: bool = True,
        claim: bool = False,
    ) -> Any:
        """Run a script whose write a failover must not lose (see `_durable_write`)."""
        if not self.replicas_acked:
            return script(keys=keys, args=args)
        return self._durable_write(
            lambda pipe: script(keys=keys, args=args, client=pipe), again, claim=claim
        )[0]

    def _durable_write(
        self, build: Callable[[Any], None], again: bool = True, *, claim: bool = False
    ) -> list[Any]:
        """Send the commands `build` puts in a pipeline and WAIT for `replicas_acked`
        replicas; the first run's answers. Too few acknowledgements: the write may sit on a
        master being replaced, so an idempotent one (`again`) is sent again, with backoff. A
        `claim` answers with its last run: its first may be lost with the old master and the
        broker's second copy claim the call since; the script knows its own claim's id."""
        if not self.replicas_acked:
            return run_pipeline(self.redis, build)

        def waited(pipe: Any) -> None:
            build(pipe)
            pipe.wait(self.replicas_acked, self.wait_timeout_ms)

        answer: list[Any] = []
        acked = 0
        for attempt in range(DURABLE_ATTEMPTS if again else 1):
            if attempt:
                time.sleep(min(0.1 * 2**attempt, 1.0))
                self._follow_master()
            # run_pipeline builds it again if a failover took it to a master without its scripts.
            *res, acked = run_pipeline(self.redis, waited)
            if attempt == 0 or claim:
                answer = res
            if int(acked) >= self.replicas_acked:
                return answer
        now = time.monotonic()
        if now - self._wait_warned_at > WAIT_WARN_EVERY_S:
            self._wait_warned_at = now
            log.warning(
                "%d of %d replicas acknowledged a settling write within %d ms: a failover "
                "now could lose it",
                int(acked),
                self.replicas_acked,
                self.wait_timeout_ms,
            )
        return answer

    def _follow_master(self) -> None:
        """Behind Sentinel, ask for the master now: if it moved, the pool drops the old one."""
        refresh = getattr(self.redis.connection_pool, "get_master_address", None)
        if refresh is not None:
            # No sentinel answers: the write is retried as it is.
            with contextlib.suppress(redis.RedisError):
                refresh()

    def _calls(self, turn_id: str, *kinds: str) -> list[dict[str, Any]]:
        """The turn's call records of each kind, by call id, from one read (results as JSON)."""
        raw = records_of(self.redis, [turn_id], "".join(p[0] for p in kinds))[0]
        load = {p: json.loads if p != k.SETTLED else text for p in kinds}
        return [{c: load[p](v) for c, v in call_fields(raw, p).items()} for p in kinds]

    def send_step(self, turn_id: str) -> None:
        """Send the step of a turn a write woke (its wakeup in Redis is the backstop)."""
        if self.stepper is not None:
            self.stepper.wake(turn_id)

    def _inline_lock(self) -> tuple[str, int]:
        """A step lock token for a write that may take the step it wakes here ("" if not)."""
        lock_ms = self.stepper.lock_ms() if self.stepper is not None else None
        return ("", 0) if lock_ms is None else (secrets.token_hex(8), lock_ms)

    def _woke(self, turn_id: str, answer: Any, token: str, lock_ms: int, *, wake: bool) -> int:
        """After a write that wakes a turn: take the step it locked here, else send one (not if
        a step held the lock: it steps again as it lets go); a lost turn ends `state_lost`."""
        if isinstance(answer, list):
            code, *raw = answer
            if self.stepper is not None:
                self.stepper.run(turn_id, token, lock_ms, step_view(*raw))
            return int(code)
        if wake and not token:
            self.send_step(turn_id)
        if int(answer) == Settled.TURN_GONE:
            self.end_lost_turn(turn_id)
        return int(answer)

    def end_lost_turn(self, turn_id: str) -> bool:
        """End a turn whose state Redis lost with turn_error `state_lost`; False if it exists."""
        fields = {"code": "state_lost", "error": STATE_LOST_MESSAGE}
        body = event_body(turn_id, "turn_error", fields)
        args = StateLostArgs(json.dumps(STATE_LOST_MESSAGE), body, self.bus.log_arg(), self.ttl_s)
        ended = bool(self._state_lost(keys=TurnKeys.of(turn_id), args=list(args)))
        if ended:
            self.bus.counted([("turn_error", fields)])
        return ended
