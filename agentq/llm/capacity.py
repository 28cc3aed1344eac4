"""Fleet-wide model capacity in Redis (docs/capacity.md): pacing, stream slots, a fair
queue, pauses and breakers, each decision one Lua script (`capacity_lua`). A model's keys
share the hash tag `{prefix}:{<model>}:`: one Redis Cluster slot."""

from __future__ import annotations

import collections
import json
import math
import secrets
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Literal

import redis
from pydantic import BaseModel, ConfigDict

from agentq.config import Settings
from agentq.events.lua_args import LuaScript
from agentq.llm import capacity_lua as lua
from agentq.llm.headers import BUSY_STATUSES, RateSignal
from agentq.llm.limits import DEFAULT_DEPLOYMENT, DeploymentLimits, ModelLimitsEntry, parse_limits

if TYPE_CHECKING:
    from agentq.state.store import TurnStore

BreakerVerdict = Literal["closed", "open"]

LIMITS_RESTORE_S = 30.0
"""Unchanged provider limits are told again after this long: the learned rate expires."""
ANSWERED_S = 1.0
"""The window of a process's recent successes: its guess of a rate nothing else told."""
ANSWERED_KEEP = 4096
RESERVE_AHEAD_MS = 200
"""A waiting round is given its slot once it is due this soon (docs/capacity.md)."""


class WakeAt(BaseModel):
    """A waiter whose turn should be woken at `at_ms` (epoch ms, Redis clock)."""

    model_config = ConfigDict(frozen=True)

    waiter: str
    at_ms: int


class Wakes(BaseModel):
    """Whose turns a capacity call asks its caller to wake."""

    model_config = ConfigDict(frozen=True)

    woken: tuple[str, ...] = ()
    """Other waiters granted by this call: wake their turns now."""
    later: tuple[WakeAt, ...] = ()
    """Other waiters given a slot that comes due soon, held for them: wake each then."""
    wake_next: WakeAt | None = None
    """The waiter now at the head of the queue (not the caller), woken when the next slot
    opens, however stale its own estimate."""


class Grant(Wakes):
    """Capacity for one request: a deployment to send it to and a lease to release."""

    model: str
    deployment: str
    lease_id: str
    """Empty for a model without limits that nothing held: nothing to renew or release."""
    granted_at_ms: int
    tokens: int
    """The estimate counted against tpm; `release` corrects it from the real usage."""


class Queued(Wakes):
    """No capacity yet: the round waits in the queue."""

    position: int
    """1: next to be served."""
    wait_ms: int
    """Estimated wait: until the next slot, plus one pacing interval per round ahead."""
    next_slot_ms: int
    """When capacity opens next for whoever is at the head of the queue."""
    retry_at_ms: int
    """When to call `acquire` again: the head at the next slot, a round further back at its
    estimated turn (not every slot: thousands would wake), within `waiter_ttl_ms` / 3."""
    held: bool = False
    """The slot at `next_slot_ms` is held for this waiter: not an estimate."""


def pacing_interval_ms(entry: ModelLimitsEntry, tokens: int) -> float:
    """Milliseconds between two requests of `tokens` each at the model's steady rate."""
    deps = entry.routes
    rpm = entry.rpm or (sum(d.rpm or 0 for d in deps) if all(d.rpm for d in deps) else 0)
    tpm = entry.tpm or (sum(d.tpm or 0 for d in deps) if all(d.tpm for d in deps) else 0)
    return max(60_000 / rpm if rpm else 0.0, tokens * 60_000 / tpm if tpm else 0.0)


_NO_LIMITS = ModelLimitsEntry.model_construct()


class Capacity:
    """Fleet-wide limits of the models in `limits`; other models pass unmetered."""

    _acquire = LuaScript(lua.ACQUIRE_LUA)
    _free = LuaScript(lua.FREE_LUA)
    _snapshot = LuaScript(lua.SNAPSHOT_LUA)
    _renew = LuaScript(lua.RENEW_LUA)
    _breaker = LuaScript(lua.BREAKER_LUA)
    _note = LuaScript(lua.NOTE_LUA)

    def __init__(
        self,
        redis_client: redis.Redis,
        limits: Mapping[str, ModelLimitsEntry],
        *,
        prefix: str = "agentq:cap",
        owner_weights: Mapping[str, float] | None = None,
        background_every: int = 0,
        burst_s: float = 1.0,
        lease_ttl_ms: int = 60_000,
        grant_ttl_ms: int = 30_000,
        waiter_ttl_ms: int = 300_000,
        breaker_failures: int = 5,
        breaker_cooldown_ms: int = 30_000,
    ) -> None:
        # Not only Settings': a ttl of 0 ms (seconds rounded down) would free every lease.
        if any(not w > 0 for w in (owner_weights or {}).values()):
            raise ValueError("owner weights must be > 0")
        if min(lease_ttl_ms, grant_ttl_ms, waiter_ttl_ms, breaker_cooldown_ms) <= 0:
            raise ValueError("ttls and the breaker cool-down must be > 0 ms")
        if breaker_failures < 1 or background_every < 0:
            raise ValueError("breaker_failures must be >= 1 and background_every >= 0")
        self.redis = redis_client
        self.limits = dict(limits)
        self.prefix = prefix
        self.owner_weights = dict(owner_weights or {})
        self.lease_ttl_ms = lease_ttl_ms
        """A lease not renewed or released this long is freed: its worker died."""
        self.waiter_ttl_ms = waiter_ttl_ms
        """A queued round whose turn has not called `acquire` this long is dropped."""
        self.breaker_failures = breaker_failures
        self.breaker_cooldown_ms = breaker_cooldown_ms
        self._tunables = {
            "burst_ms": burst_s * 1000,
            "lease_ttl_ms": lease_ttl_ms,
            "grant_ttl_ms": grant_ttl_ms,
            "waiter_ttl_ms": waiter_ttl_ms,
            "bg_every": background_every,
            "max_pump": 64,  # grants one call makes at most, however many are due
            "reserve_ms": RESERVE_AHEAD_MS,
            "rate_ttl_ms": 3_600_000,  # the learned rate outlives its last news an hour
        }
        self._config: dict[str, str] = {}
        self._stored_at: dict[str, float] = {}
        self._failed: set[tuple[str, str]] = set()
        """(model, deployment) this process counted a failure of and no success since."""
        self._answered: dict[str, collections.deque[float]] = {}
        self._told: dict[str, tuple[int, int, float]] = {}
        """The provider's limits this process last stored for a model, and when."""

    def entry(self, model: str) -> ModelLimitsEntry:
        """The model's limits (none for an unconfigured one)."""
        return self.limits.get(model) or _NO_LIMITS

    def _config_of(self, model: str) -> str:
        """The model's config as the scripts take it, asking them to store it once every
        CONFIG_STORE_S when configured."""
        config = self._config.get(model)
        if config is None:
            entry = self.entry(model)
            config = self._config[model] = json.dumps(
                {
                    **_counts(entry),
                    "strategy": entry.strategy,
                    "configured": model in self.limits,
                    "deps": [{"n": d.name, **_counts(d)} for d in entry.routes],
                    **self._tunables,
                }
            )
        if model in self.limits:
            now = time.monotonic()
            if now - self._stored_at.get(model, -lua.CONFIG_STORE_S) >= lua.CONFIG_STORE_S:
                self._stored_at[model] = now
                return config[:-1] + ', "store": true}'
        return config

    def keys(self, model: str) -> list[str]:
        """The model's Redis keys, in the order the scripts take them."""
        return [self._key(model, suffix) for suffix in lua.SUFFIX]

    def _key(self, model: str, suffix: str) -> str:
        return f"{self.prefix}:{{{model}}}:{suffix}"

    def _run(
        self, script: Any, model: str, now_ms: int | None, own: tuple[Any, ...] = ()
    ) -> dict[str, Any]:
        """A deciding script's JSON answer, run on the model's keys with its own arguments."""
        argv = lua.DecidingArgs(self._config_of(model), _clock(now_ms), model, secrets.token_hex(8))
        raw = script(keys=self.keys(model), args=[*argv, *own])
        out: dict[str, Any] = json.loads(raw)
        return out

    def acquire(
        self,
        model: str,
        *,
        waiter: str,
        owner: str,
        interactive: bool,
        tokens: int,
        now_ms: int | None = None,
    ) -> Grant | Queued:
        """Capacity for one request of `waiter` (unique per round) or its place in the
        queue; asking again keeps the place, or returns the same grant until released."""
        weight = self.owner_weights.get(owner, 1.0)
        cls = "i" if interactive else "b"
        own = lua.AcquireArgs(waiter, cls, owner, repr(weight), tokens)
        # The answer's other fields (`now`, `g`, ...) are no Grant's nor Queued's: ignored.
        out = self._run(self._acquire, model, now_ms, own)
        if "g" in out:
            g = out["g"]
            return Grant(
                **out,
                model=model,
                deployment=g["d"],
                lease_id=g["l"],
                # A round that went without reading Redis' clock has the caller's.
                granted_at_ms=int(g["at"]) if g["at"] else int(time.time() * 1000),
                tokens=int(g["t"]),
            )
        # `held`: a slot of its own (`ready`), held for it: nothing to estimate.
        now, held, position = int(out["now"]), out.get("held", False), int(out["position"])
        next_slot = max(math.ceil(out.get("ready") or now), now)
        ahead_ms = (position - 1) * pacing_interval_ms(self.entry(model), tokens)
        wait_ms = int(next_slot - now + ahead_ms)
        at_ms = next_slot if position <= 1 else now + wait_ms
        if not held:
            # Asked early enough to be given its slot, and often enough to look alive.
            at_ms = min(max(at_ms - RESERVE_AHEAD_MS, now), now + self.waiter_ttl_ms // 3)
        return Queued(**out, wait_ms=wait_ms, next_slot_ms=next_slot, retry_at_ms=at_ms)

    def release(
        self, lease_id: str, *, tokens_used: int | None = None, now_ms: int | None = None
    ) -> Wakes:
        """Free a lease's stream slot, correct tpm from the real usage, and grant waiters."""
        if not lease_id:
            return Wakes()
        used = "" if tokens_used is None else max(int(tokens_used), 0)
        own = lua.FreeArgs(lease_id, used, "")
        return Wakes(**self._run(self._free, _lease_model(lease_id), now_ms, own))

    def renew(self, lease_id: str, *, now_ms: int | None = None) -> bool:
        """Keep a lease for `lease_ttl_ms` more; False if it was lost."""
        if not lease_id:
            return True
        args = lua.RenewArgs(_clock(now_ms), lease_id, self.lease_ttl_ms)
        key = self._key(_lease_model(lease_id), lua.SUFFIX.LEASES)
        return bool(self._renew(keys=[key], args=list(args)))

    def withdraw(self, model: str, waiter: str, *, now_ms: int | None = None) -> Wakes:
        """Take an aborted round out of the queue and give back a grant it did not take."""
        # The model is an argument because it names the keys (and the Cluster slot).
        return Wakes(**self._run(self._free, model, now_ms, lua.FreeArgs("", "", waiter)))

    def note_answer(
        self,
        model: str,
        deployment: str,
        signal: RateSignal,
        *,
        status: int = 200,
        now_ms: int | None = None,
    ) -> int | None:
        """Tell the fleet what an answer says (NOTE_BODY_LUA); when the pause it caused ends
        (None: none). An answer that says nothing new sends nothing to Redis."""
        wait_s: float | None = None
        if status in BUSY_STATUSES:
            resets = [s for s in (signal.reset_requests_s, signal.reset_tokens_s) if s]
            wait_s = signal.pause_s or max(resets, default=1.0)
        else:
            if signal.remaining_requests is not None and signal.remaining_requests <= 0:
                wait_s = signal.reset_requests_s or 1.0
            if signal.remaining_tokens is not None and signal.remaining_tokens <= 0:
                wait_s = max(wait_s or 0.0, signal.reset_tokens_s or 1.0)
        limits = (signal.limit_requests or 0, signal.limit_tokens or 0)
        told, fresh = self._told.get(model, (0, 0, -math.inf)), time.monotonic()
        learn = any(limits) and (told[:2] != limits or fresh - told[2] >= LIMITS_RESTORE_S)
        if wait_s is None and not learn:
            return None
        if learn:
            self._told[model] = (*limits, fresh)
        field = "m" if deployment in ("", DEFAULT_DEPLOYMENT) else f"d:{deployment}"
        # The hint: rounds of `model` this process saw succeed in the last ANSWERED_S.
        seen = sum(1 for t in self._answered.get(model, ()) if t >= fresh - ANSWERED_S)
        own = lua.NoteArgs(
            1 if status == 429 else 0,
            field,
            "" if wait_s is None else math.ceil(wait_s * 1000),
            *limits,
            round(seen * 60 / ANSWERED_S),
        )
        out = self._run(self._note, model, now_ms, own)
        return int(out["until_at"]) or None

    def report_failure(
        self, model: str, deployment: str, kind: str, *, now_ms: int | None = None
    ) -> BreakerVerdict:
        """Count a failure (`5xx`, `stall`, `connection`...) of a deployment (BREAKER_LUA)."""
        args = lua.BreakerArgs(
            _clock(now_ms), deployment, kind, self.breaker_failures, self.breaker_cooldown_ms
        )
        self._failed.add((model, deployment))
        state = self._breaker(keys=[self._key(model, lua.SUFFIX.BRK)], args=list(args))
        return "open" if state in ("open", b"open") else "closed"

    def report_success(self, model: str, deployment: str, *, unleased: bool = False) -> None:
        """A request to the deployment worked: its breaker closes. An `unleased` round found no
        breaker hash: no command unless this process counted a failure since."""
        seen = self._answered.setdefault(model, collections.deque(maxlen=ANSWERED_KEEP))
        seen.append(time.monotonic())
        key = (model, deployment)
        if unleased and key not in self._failed:
            return
        self._failed.discard(key)
        # No script: forgetting decides nothing, and deleting absent fields writes nothing.
        fields = [f"{f}:{deployment}" for f in ("f", "o", "p", "k")]
        self.redis.hdel(self._key(model, lua.SUFFIX.BRK), *fields)

    def snapshot(self, model: str, *, now_ms: int | None = None) -> dict[str, Any]:
        """The model's capacity state now (SNAPSHOT_LUA's layout), for metrics and the console."""
        out = self._run(self._snapshot, model, now_ms)
        return {"model": model, "configured": model in self.limits, **out}


def _counts(limits: DeploymentLimits | ModelLimitsEntry) -> dict[str, int]:
    """A model's or deployment's limits as the scripts take them (0: none)."""
    return {"rpm": limits.rpm or 0, "tpm": limits.tpm or 0, "streams": limits.streams or 0}


def _clock(now_ms: int | None) -> str | int:
    """The `now_arg` of a script: the caller's clock, or "" for Redis TIME."""
    return "" if now_ms is None else now_ms


def _lease_model(lease_id: str) -> str:
    """The model a lease id names (`<nonce><n>:<model>`); '' for no lease."""
    return lease_id.partition(":")[2]


_fleet: dict[tuple[object, ...], Capacity] = {}
_fleet_lock = threading.Lock()


def capacity_for(redis_client: redis.Redis, settings: Settings) -> Capacity:
    """This process's capacity manager for `settings` on `redis_client` (one per pair)."""
    options: dict[str, Any] = {
        "owner_weights": settings.llm_owner_weights,
        "background_every": settings.llm_background_every,
        "lease_ttl_ms": int(settings.llm_lease_ttl_s * 1000),
        "burst_s": settings.llm_burst_s,
        "breaker_failures": settings.llm_breaker_failures,
        "breaker_cooldown_ms": int(settings.llm_breaker_cooldown_s * 1000),
    }
    key = (id(redis_client), settings.llm_limits or "", json.dumps(options, sort_keys=True))
    with _fleet_lock:
        cap = _fleet.get(key)
        if cap is None:
            limits = parse_limits(settings.llm_limits)
            cap = _fleet[key] = Capacity(redis_client, limits, **options)
        return cap


def waiter_of(turn_id: str, round_no: int) -> str:
    """The capacity queue's id of a turn's model round."""
    return f"{turn_id}:{round_no}"


def wake_granted(store: TurnStore, wakes: Wakes) -> None:
    """Wake the turns whose rounds were just granted; bring the wakeups of those given a later
    slot, and of the new head of the queue, forward to their slots."""
    for waiter in wakes.woken:
        store.wake(waiter.rsplit(":", 1)[0])
    for at in [*wakes.later, *([wakes.wake_next] if wakes.wake_next is not None else [])]:
        store.wake_by(at.waiter.rsplit(":", 1)[0], at.at_ms / 1000)
