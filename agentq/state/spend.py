"""Spend in Redis: per key per UTC day and month, per turn (its sub-agents' included), and
the reservations that keep every budget (docs/spend.md). A key's spend, its turns' too, is
under one hash tag (``{spend:<key name>}``), so each script runs on one slot:

- ``d:<YYYYMMDD>``: ``tokens`` and ``usd`` (reservations included), and settled rounds'
  ``prompt``, ``completion``, ``cached``, ``usd`` and ``turns`` per model (``m|<model>|<f>``)
  and per agent (``a|<agent>|<f>``); kept `usage_retention_days`, past the turns it counts.
- ``mo:<YYYYMM>``: ``usd``.
- ``t:<turn id>``: ``max_tokens``, ``max_usd``, ``tokens`` and ``usd`` (its descendants' and
  reservations included), settled ``prompt``, ``completion``, ``cached``, its reservations
  ``r:<round>`` and the last round ``settled``.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import redis

from agentq import constants as k
from agentq.errors import BudgetExceeded

if TYPE_CHECKING:
    from agentq.config import ModelPrice, Settings
from agentq.events.lua_args import LuaScript, bind_lua
from agentq.models import Usage
from agentq.state.base import each, text
from agentq.state.budget import MIN_COMPLETION_TOKENS, day_of, per_token, resets_at

SPEND_OWNERS = f"{k.PREFIX}:spend:owners"
"""The key names that ever spent (the admin's usage reads them all)."""

NO_KEY = "-"
"""The owner of turns started without a key, in the spend keys."""


def _tag(owner: str | None) -> str:
    return f"{k.PREFIX}:spend:{{{owner or NO_KEY}}}"


def day_key(owner: str | None, day: str) -> str:
    return f"{_tag(owner)}:d:{day}"


def month_key(owner: str | None, month: str) -> str:
    return f"{_tag(owner)}:mo:{month}"


def turn_spend_key(owner: str | None, turn_id: str) -> str:
    return f"{_tag(owner)}:t:{turn_id}"


class SpendKeys(NamedTuple):
    """KEYS of RESERVE and SETTLE, the parents' spend keys after (`parents_at`). A round is
    settled in the day it was reserved in, not always the day it answers in."""

    day_key: str
    month_key: str
    own_key: str
    """Last: the loops over the turn and its parents start at it."""


_ADD_LUA = f"""local parents_at = {len(SpendKeys._fields) + 1}
-- Adds to the day's, the month's (usd only: its one budget), the turn's and its parents'
-- counts. `fresh`: a count may be a hash's first, which sets its retention (HINCRBY
-- answering the increment itself; a count back at zero sets it again, harmless).
local function add(key, ttl, dt, du, fresh)
  local total = nil
  if dt ~= 0 then total = redis.call('HINCRBY', key, 'tokens', dt) end
  if du ~= 0 then redis.call('HINCRBYFLOAT', key, 'usd', tostring(du)) end
  if fresh and (total == nil or total == dt) then redis.call('EXPIRE', key, ttl) end
end
local function add_all(dt, du, fresh)
  add(day_key, day_ttl_s, dt, du, fresh)
  add(month_key, day_ttl_s, 0, du, fresh and du ~= 0)
  for i = parents_at - 1, #KEYS do add(KEYS[i], turn_ttl_s, dt, du, fresh) end
end
"""


class SettleArgs(NamedTuple):
    settle_round: str
    used_prompt: int
    used_completion: int
    used_cached: int
    used_usd: float
    model: str
    agent: str
    day_ttl_s: int
    turn_ttl_s: int


class ReserveArgs(NamedTuple):
    reservation: str
    prompt_tokens: int
    want: int
    """The completion the round would produce unbounded."""
    input_per_token: float | str
    """The model's prices ("": it has none, so USD budgets do not count it: tokens only)."""
    output_per_token: float | str
    own_max_tokens: float | str
    """The turn's limits ("": none), stored for its children's rounds and its readers."""
    own_max_usd: float | str
    tokens_per_day: float | str
    usd_per_day: float | str
    usd_per_month: float | str
    min_completion: int
    day_ttl_s: int
    turn_ttl_s: int


SETTLE_LUA = (
    bind_lua(SpendKeys, SettleArgs)
    + _ADD_LUA
    + """-- The round's reservation (if any) becomes its usage in every count it was added to,
-- once: rounds settle in order, so a step that runs again finds its round settled (0).
local field = 'r:' .. settle_round
local got = redis.call('HMGET', own_key, 'settled', field)
local last = tonumber(got[1])
if last and last >= tonumber(settle_round) then return 0 end
redis.call('HSET', own_key, 'settled', settle_round)
local reserved = got[2] ~= false
local rt, ru = 0, 0
if reserved then
  local r = cjson.decode(got[2])
  rt, ru = r[1], r[2]
  redis.call('HDEL', own_key, field)
end
local p, c, h = tonumber(used_prompt), tonumber(used_completion), tonumber(used_cached)
local u = tonumber(used_usd)
-- Without a reservation a count may be a hash's first.
add_all(p + c - rt, u - ru, not reserved)
local function counts(key, g)
  local by = {p, c, h}
  for i, name in ipairs({'prompt', 'completion', 'cached'}) do
    if by[i] ~= 0 then redis.call('HINCRBY', key, g .. name, by[i]) end
  end
end
for i = parents_at - 1, #KEYS do counts(KEYS[i], '') end
-- By model and by agent; the key's totals are the sum of its models' (usage_report).
for _, g in ipairs({'m|' .. model .. '|', 'a|' .. agent .. '|'}) do
  counts(day_key, g)
  if u ~= 0 then redis.call('HINCRBYFLOAT', day_key, g .. 'usd', used_usd) end
  -- The turn's first round counts it as a turn.
  if settle_round == '0' then redis.call('HINCRBY', day_key, g .. 'turns', 1) end
end
return 1
"""
)
"""A round's usage, settled as its result is read (or at its turn's end, unanswered)."""

RESERVE_LUA = (
    bind_lua(SpendKeys, ReserveArgs)
    + _ADD_LUA
    + """-- A start's check (reservation ''): whether the key's budgets afford its least round,
-- a budget that refused a round this period refusing it too; it writes nothing.
local check = reservation == ''
local field = 'r:' .. reservation
local held = redis.call('HGET', own_key, field)
if held then
  local r = cjson.decode(held)
  return {r[3], r[4]}
end
if own_max_tokens ~= '' then redis.call('HSET', own_key, 'max_tokens', own_max_tokens) end
if own_max_usd ~= '' then redis.call('HSET', own_key, 'max_usd', own_max_usd) end
local prompt, cap, wanted = tonumber(prompt_tokens), tonumber(want), tonumber(want)
local priced = input_per_token ~= ''
local pin, pout = tonumber(input_per_token) or 0, tonumber(output_per_token) or 0
local tight, bounded = nil, 0
-- The completion: what it wants, lowered to what each budget has left past the prompt. A
-- USD budget does not count an unpriced model (its tokens count) but in a start's check.
local function consider(scope, name, unit, limit, spent, exhausted)
  if not limit or limit < 0 then return end
  if unit == 'usd' and not priced and not check then return end
  bounded = 1
  spent = spent or 0
  local room
  if check and exhausted then
    room = -math.huge
  elseif unit == 'tokens' then
    room = limit - spent - prompt
  else
    local room_usd = limit - spent - prompt * pin
    if room_usd < 0 then room = -1
    elseif pout <= 0 then room = wanted
    else room = room_usd / pout end
  end
  room = math.floor(room)
  if room < cap then cap = room; tight = {scope, name, tostring(spent), tostring(limit)} end
end
local n, x = {'tokens_per_day', 'usd_per_day', 'usd_per_month'}, 'exhausted:'
local day = redis.call('HMGET', day_key, 'tokens', 'usd', x .. n[1], x .. n[2])
local month = redis.call('HMGET', month_key, 'usd', x .. n[3])
consider('key', n[1], 'tokens', tonumber(tokens_per_day), tonumber(day[1]), day[3])
consider('key', n[2], 'usd', tonumber(usd_per_day), tonumber(day[2]), day[4])
consider('key', n[3], 'usd', tonumber(usd_per_month), tonumber(month[1]), month[2])
for i = parents_at - 1, #KEYS do
  local scope = (i == parents_at - 1) and 'turn' or 'parent_turn'
  local t = redis.call('HMGET', KEYS[i], 'max_tokens', 'max_usd', 'tokens', 'usd')
  consider(scope, 'max_tokens', 'tokens', tonumber(t[1]), tonumber(t[3]))
  consider(scope, 'max_cost_usd', 'usd', tonumber(t[2]), tonumber(t[4]))
end
-- Below min_completion (or its want, if less): refused by the budget that left the least.
if cap >= math.min(wanted, tonumber(min_completion)) then
  if not check then
    local tokens, usd = prompt + cap, 0
    if priced then usd = prompt * pin + cap * pout end
    add_all(tokens, usd, true)
    redis.call('HSET', own_key, field, cjson.encode({tokens, usd, cap, bounded}))
  end
  return {cap, bounded}
end
if tight[1] == 'key' and not check then
  -- Starts of the key are refused until the period resets (a start's check).
  local period = (tight[2] == n[3]) and month_key or day_key
  redis.call('HSET', period, x .. tight[2], 1)
end
-- A turn refused at its first round has a spend key (its limits) no count gave a TTL.
if redis.call('TTL', own_key) == -1 then redis.call('EXPIRE', own_key, turn_ttl_s) end
return tight
"""
)
"""A round's reservation, before it is sent."""


@dataclass(frozen=True)
class Settlement:
    """A round to settle: its usage, and the day its reservation (or its send) counts in."""

    round_no: int
    day: str
    usage: Usage
    model: str
    agent: str | None


def _limit(v: float | None) -> float | str:
    return "" if v is None else v


_TOKENS = {"prompt": "prompt_tokens", "completion": "completion_tokens", "cached": "cached_tokens"}
"""A spend hash's token fields, and the `Usage` fields (and report names) they count."""


class Spend:
    """Every read and write of spend."""

    _reserve = LuaScript(RESERVE_LUA)
    _settle = LuaScript(SETTLE_LUA)

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.redis = client
        self.settings = settings

    def _keys(self, owner: str | None, day: str, turn_id: str, parents: Iterable[str]) -> list[str]:
        turns = [turn_spend_key(owner, t) for t in (turn_id, *reversed(list(parents)))]
        own = SpendKeys(day_key(owner, day), month_key(owner, day[:6]), turns[0])
        return [*own, *turns[1:]]

    def _ttls(self) -> tuple[int, int]:
        return self.settings.usage_retention_days * 86400, self.settings.turn_retention_s

    def reserve(
        self,
        owner: str | None,
        day: str,
        prompt_tokens: int,
        price: ModelPrice | None,
        *,
        turn_id: str = "",
        parents: Sequence[str] = (),
        reservation: str = "",
        want: int = MIN_COMPLETION_TOKENS,
        max_tokens: int | None = None,
        max_usd: float | None = None,
    ) -> int | None:
        """Reserve a round against every budget it counts against: the completion it may
        produce (None: no budget bounds it), or BudgetExceeded naming one that cannot afford
        it. Without a reservation, a start's check that reserves nothing: a key budget that
        cannot afford its least round, or refused a round this period, refuses it."""
        kb = self.settings.key_budgets.get(owner or "")
        args = ReserveArgs(
            reservation,
            prompt_tokens,
            want,
            per_token(price.input) if price else "",
            per_token(price.output) if price else "",
            _limit(max_tokens),
            _limit(max_usd),
            _limit(kb.tokens_per_day if kb else None),
            _limit(kb.usd_per_day if kb else None),
            _limit(kb.usd_per_month if kb else None),
            MIN_COMPLETION_TOKENS,
            *self._ttls(),
        )
        answer = self._reserve(keys=self._keys(owner, day, turn_id, parents), args=list(args))
        if len(answer) == 2:
            return int(answer[0]) if int(answer[1]) else None
        scope, name, spent, limit = (text(a) for a in answer)
        when = resets_at(name, day) if scope == "key" else None
        raise BudgetExceeded(scope, name, float(spent), float(limit), when)

    def settle(
        self, *, owner: str | None, turn_id: str, parents: Sequence[str], settle: Settlement
    ) -> bool:
        """Settle a round to its usage (replacing its reservation); False if settled before."""
        u = settle.usage
        args = SettleArgs(
            str(settle.round_no),
            u.prompt_tokens,
            u.completion_tokens,
            u.cached_tokens,
            u.cost_usd or 0.0,
            settle.model,
            settle.agent or "",
            *self._ttls(),
        )
        keys = self._keys(owner, settle.day, turn_id, parents)
        done = int(self._settle(keys=keys, args=list(args))) == 1
        if done and settle.round_no == 0:
            # Its turns' first rounds name the key among those that spent (another slot).
            self.redis.sadd(SPEND_OWNERS, owner or NO_KEY)
        return done

    def carry(self, owner: str | None, turn_id: str, usage: Usage) -> None:
        """Start a new turn's spend at what it carries (a retry: its source's)."""
        key = turn_spend_key(owner, turn_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.hset(
            key,
            mapping={
                **{f: getattr(usage, name) for f, name in _TOKENS.items()},
                "tokens": usage.prompt_tokens + usage.completion_tokens,
                "usd": usage.cost_usd or 0.0,
            },
        )
        pipe.expire(key, self.settings.turn_retention_s)
        pipe.execute()

    def turn_totals(self, owner: str | None, turn_id: str) -> dict[str, Any]:
        """A turn's spend with its sub-agents' (reservations in flight included) and limits."""
        raw = self.redis.hgetall(turn_spend_key(owner, turn_id))
        f = {text(a): b for a, b in raw.items()}
        counts = {**_TOKENS, "tokens": "total_tokens"}
        out: dict[str, Any] = {name: int(f.get(n) or 0) for n, name in counts.items()}
        out["cost_usd"] = round(float(f.get("usd") or 0), 6)
        if "max_tokens" in f:
            out["max_tokens"] = int(float(f["max_tokens"]))
        if "max_usd" in f:
            out["max_cost_usd"] = float(f["max_usd"])
        return out

    def owners(self) -> list[str]:
        return sorted(text(o) for o in self.redis.smembers(SPEND_OWNERS))

    def days(self, owners: list[str], days: list[str]) -> dict[tuple[str, str], dict[str, str]]:
        """The per-day hashes of `owners` over `days`, by (owner, day), in one round trip."""
        pairs = [(o, d) for o in owners for d in days]
        got = each(self.redis, pairs, lambda p, od: p.hgetall(day_key(*od)))
        return {
            pair: {text(a): text(b) for a, b in raw.items()}
            for pair, raw in zip(pairs, got, strict=True)
            if raw
        }


GROUPS = {"model": "m|", "agent": "a|", "key": "m|"}
"""What `/v1/usage` may group by, and the prefix of its fields in a day's hash."""


def usage_days(
    group_by: str, since: float | None, until: float | None, now: float, keep_days: int
) -> list[str]:
    """The kept UTC days of a usage query's window (default: 30 days to `now`), or ValueError."""
    if group_by not in GROUPS:
        raise ValueError(f"group_by: one of {', '.join(GROUPS)}, not {group_by!r}")
    until = now if until is None else until
    since = until - 29 * 86400 if since is None else since
    if since > until:
        raise ValueError("since: after until")
    start = int(max(since, now - keep_days * 86400))
    days = [day_of(t) for t in range(start, int(until) + 1, 86400)]
    return days if day_of(until) in days else [*days, day_of(until)]


def _row(sums: defaultdict[str, float]) -> dict[str, Any]:
    row: dict[str, Any] = {n: int(sums[f]) for f, n in {**_TOKENS, "turns": "turns"}.items()}
    row["total_tokens"] = row["prompt_tokens"] + row["completion_tokens"]
    row["cost_usd"] = round(sums["usd"], 6)
    return row


def usage_report(hashes: dict[tuple[str, str], dict[str, str]], group_by: str) -> dict[str, Any]:
    """Totals and rows (by model, agent or key) of the per-day hashes `Spend.days` read.
    Settled rounds only: a reservation in flight is in a budget, not in usage yet."""
    prefix = GROUPS[group_by]
    totals: defaultdict[str, float] = defaultdict(float)
    rows: defaultdict[str, defaultdict[str, float]] = defaultdict(lambda: defaultdict(float))
    for (owner, _day), fields in hashes.items():
        for name, value in fields.items():
            if name.startswith("m|"):
                # Every settled round counts under its model: the totals are their sum.
                field = name.rpartition("|")[2]
                totals[field] += float(value)
                if group_by == "key":
                    rows[owner][field] += float(value)
            if group_by != "key" and name.startswith(prefix):
                group, _, field = name[len(prefix) :].rpartition("|")
                rows[group][field] += float(value)
    return {
        "totals": _row(totals),
        "rows": [
            {group_by: (None if name in ("", NO_KEY) else name), **_row(row)}
            for name, row in sorted(rows.items())
        ],
    }
