"""The list of turns for the operator console: recent and running turns, newest first.

Every turn is in its shard's ``agentq:turns:index`` (by ``created_at``) until the sweeper
(`prune`) or a listing drops it expired. One Lua call a shard summarises a page in Redis: no
result content crosses the network. A turn id prefix is looked up there too (ZSCAN MATCH),
bounded by `limit` live turns or ID_SCAN_MAX entries read.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import groupby
from typing import Any

import redis
from pydantic import BaseModel, Field, ValidationError, field_validator

from agentq import constants as k
from agentq.errors import describe_invalid
from agentq.events.lua_args import LuaScript, bind_lua
from agentq.models import TERMINAL_STATUSES, TurnStatus
from agentq.state.base import active_turns, each, exist, text

MAX_LIMIT = 200
DEFAULT_LIMIT = 50
SCAN_BATCH = 100
SCAN_MAX = 5000
"""Index entries a filtered page reads at most, then it hands back a cursor."""
TURN_STATUSES = frozenset(s.value for s in TurnStatus)
TURN_ID_LEN = 32
ID_SCAN_COUNT = 1000
"""Index entries a ZSCAN call of `find_turn_ids` reads."""
ID_SCAN_MAX = 200_000
"""Index entries a lookup reads at most, over every shard it reads."""
_PREFIX = re.compile(r"[0-9a-f]{1,32}")
Visible = Callable[[dict[str, Any]], bool]
"""Whether the asker may see a turn, given its state (the gateway's rule)."""


# _SUMMARY_LUA: the summaries of a shard's turns (turn id, state key: pairs; the index key
# routes it to its slot). Results are matched, not decoded: the first "status" of a
# ToolResult's JSON is its own (call_id and tool come before it, their quotes escaped).
_SUMMARY_LUA = (
    bind_lua(("index_key",), ("approval_suffix",), rest="turns")
    + f"""
local out = {{}}
for i = turns_at, #ARGV, 2 do
  local id, base = ARGV[i], ARGV[i + 1]
  local all = redis.call('HGETALL', base)
  if #all == 0 then
    out[#out + 1] = {{id, false}}
  else
    local st, counts, settled, started, sent, planned = {{}}, {{}}, {{}}, {{}}, {{}}, {{}}
    -- The calls' records (counted here) and the history are fields of the state: not sent back.
    for j = 1, #all, 2 do
      local kind, call = string.sub(all[j], 1, 2), string.sub(all[j], 3)
      if kind == '{k.SETTLED}' then
        local s = string.match(all[j + 1], '"status":"(%a+)"') or 'unknown'
        counts[s] = (counts[s] or 0) + 1
        settled[call] = true
      elseif kind == '{k.STARTED}' then
        started[call] = true
      elseif kind == '{k.DISPATCHED}' then
        sent[#sent + 1] = {{call, all[j + 1]}}
      elseif kind == '{k.PLANNED}' then
        planned[#planned + 1] = call
      elseif not ({" or ".join(f"kind == '{r}'" for r in k.RECORDS)}) then
        st[all[j]] = all[j + 1]
      end
    end
    local open = {{}}
    for _, d in ipairs(sent) do
      if not settled[d[1]] then
        local state = started[d[1]] and 'running' or 'queued'
        counts[state] = (counts[state] or 0) + 1
        local tool = string.match(d[2], '"tool":%s*"([^"]*)"') or '?'
        open[#open + 1] = {{d[1], tool, state}}
      end
    end
    local pending = {{}}
    for j = 1, #planned do
      local ik = base .. ':interaction:' .. planned[j] .. approval_suffix
      local v = redis.call('HMGET', ik, 'state', 'request')
      if v[1] == 'pending' and v[2] then pending[#pending + 1] = v[2] end
    end
    out[#out + 1] = {{id, st, counts, open, pending}}
  end
end
return cjson.encode(out)
"""
)


class TurnQuery(BaseModel, frozen=True):
    """Filters and paging of a listing; `before` is a `created_at` (exclusive)."""

    status: frozenset[str] = frozenset()
    agent: str | None = None
    limit: int = Field(DEFAULT_LIMIT, ge=1, le=MAX_LIMIT)
    before: float | None = Field(None, allow_inf_nan=False)

    @field_validator("status", mode="before")
    @classmethod
    def _known(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = {s.strip() for s in value.split(",") if s.strip()}
        unknown = sorted(set(value) - TURN_STATUSES - {"active", "ended"})
        if unknown:
            known = ", ".join(sorted(TURN_STATUSES))
            raise ValueError(f"unknown {', '.join(unknown)}; one or more of {known}, active, ended")
        return value

    @classmethod
    def parse(cls, **raw: str | int | None) -> TurnQuery:
        """From query-string values (blank: absent); ValueError naming a malformed one."""
        try:
            return cls.model_validate({f: v for f, v in raw.items() if v not in (None, "")})
        except ValidationError as exc:
            raise ValueError(describe_invalid(exc)) from None

    def matches(self, summary: dict[str, Any]) -> bool:
        status = summary.get("status")
        groups = {str(status), "ended" if status in TERMINAL_STATUSES else "active"}
        if self.status and not groups & self.status:
            return False
        return self.agent is None or summary.get("agent") == self.agent


@dataclass
class TurnPage:
    turns: list[dict[str, Any]] = field(default_factory=list)
    next_before: float | None = None
    """Pass as `before` for the next page; None when there is none."""


def summarise(
    turn_id: str,
    state: dict[str, Any],
    counts: dict[str, int],
    open_calls: list[list[str]],
    pending: list[dict[str, Any]],
    now: float,
) -> dict[str, Any]:
    """One row of the list, from the turn's state and what the summary script found."""
    shown = ("status", "phase", "agent", "owner", "parent_turn_id", "conversation_id")
    started = state.get("started_at")
    wait = None
    if state.get("llm_wait_round") is not None and state.get("status") not in TERMINAL_STATUSES:
        wait = {n: state.get(f"llm_wait_{n}") for n in ("round", "since", "position")}
    ended = state.get("ended_at")
    duration_s = None
    if isinstance(started, (int, float)):
        end = ended if isinstance(ended, (int, float)) else now
        duration_s = round(max(0.0, end - started), 3)
    for p in pending:
        created = float(p.get("created_at") or now)
        p["expires_at"] = created + float(p.get("timeout_ms") or 0) / 1000
        p["turn_id"] = turn_id
    return {
        "turn_id": turn_id,
        **{f: state.get(f) for f in shown},
        "conversation_waiting": bool(state.get("conversation_waiting"))
        and state.get("status") == "queued",
        "round": state.get("round", 0),
        "created_at": state.get("created_at"),
        "started_at": started,
        "ended_at": ended,
        "duration_s": duration_s,
        "call_count": state.get("call_count", 0),
        "calls": {s: int(n) for s, n in sorted(counts.items())},
        "current_tools": [{"call_id": c, "tool": t, "state": s} for c, t, s in open_calls],
        "pending_interactions": pending,
        "model_wait": wait,
        "error": state.get("error"),
        "abort_reason": state.get("abort_reason"),
    }


class TurnLister:
    """Reads pages of turn summaries; `visible` filters by who asks (the gateway's rule)."""

    _summary = LuaScript(_SUMMARY_LUA)

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client

    def summaries(
        self, turn_ids: list[str], now: float | None = None, visible: Visible | None = None
    ) -> dict[str, dict[str, Any]]:
        """Summaries of these turns whose state is `visible`; vanished ones leave the index."""
        now = time.time() if now is None else now
        raw: list[Any] = []
        for shard, ids in groupby(sorted(turn_ids, key=k.shard_of), k.shard_of):
            args = [k.approval_request_id(""), *(a for t in ids for a in (t, k.turn_key(t)))]
            raw += json.loads(self._summary(keys=[k.shard_key(k.TURNS_INDEX, shard)], args=args))
        out: dict[str, dict[str, Any]] = {}
        # An empty table comes as {} (cjson) or [] (fakeredis): iterated, either is empty.
        for row in raw:
            if row[1] is False:
                continue
            state = {f: json.loads(v) for f, v in row[1].items()}
            if visible is not None and not visible(state):
                continue
            pending = [json.loads(p) for p in row[4]]
            out[row[0]] = summarise(row[0], state, row[2] or {}, row[3], pending, now)
        self._drop([row[0] for row in raw if row[1] is False])
        return out

    def _drop(self, gone: list[str]) -> None:
        """Remove these turns' index entries, each from its shard's index."""
        each(self.redis, gone, lambda p, t: p.zrem(k.shard_key(k.TURNS_INDEX, t), t))

    def _entries(self, low: str, high: str, num: int, newest: bool) -> list[tuple[float, str]]:
        """At most `num` index entries (score, turn id) from `low` to `high` over every shard."""

        def read(p: Any, shard: int) -> Any:
            key = k.shard_key(k.TURNS_INDEX, shard)
            if newest:
                return p.zrevrangebyscore(key, high, low, start=0, num=num, withscores=True)
            return p.zrangebyscore(key, low, high, start=0, num=num, withscores=True)

        got = each(self.redis, k.shards(), read)
        rows = sorted(((float(sc), text(m)) for found in got for m, sc in found), reverse=newest)
        return rows[:num]

    def page(self, query: TurnQuery, visible: Visible | None = None) -> TurnPage:
        """Up to `query.limit` turns, newest first from `query.before`, of SCAN_MAX entries read."""
        now, page = time.time(), TurnPage()
        top = "+inf" if query.before is None else f"({query.before!r}"
        for _ in range(SCAN_MAX // SCAN_BATCH):
            rows = self._entries("-inf", top, SCAN_BATCH, newest=True)
            found = self.summaries([m for _, m in rows], now, visible)
            for score, member in rows:
                row = found.get(member)
                if row is not None and query.matches(row):
                    page.turns.append(row)
                    if len(page.turns) >= query.limit:
                        page.next_before = score
                        return page
            if len(rows) < SCAN_BATCH:
                return page
            top = f"({rows[-1][0]!r}"
        page.next_before = rows[-1][0]
        return page

    def prune(self, older_than: float, batch: int, rounds: int) -> int:
        """Drop expired turns' entries before `older_than` (`rounds` pages of `batch`); how many."""
        top, low, tied, dropped = f"({older_than!r}", -math.inf, set[str](), 0

        for _ in range(rounds):
            # A page starts at the last one's score, past its live entries of that score:
            # entries sharing a score are never skipped.
            rows = self._entries(repr(low), top, batch + len(tied), newest=False)
            page = [(sc, m) for sc, m in rows if m not in tied][:batch]
            if not page:
                break
            ids = [m for _, m in page]
            alive = set(live(self.redis, ids))
            self._drop([t for t in ids if t not in alive])
            dropped += len(ids) - len(alive)
            if page[-1][0] > low:
                low, tied = page[-1][0], set()
            tied |= {m for sc, m in page if sc == low and m in alive}
        return dropped

    def active(self, visible: Visible | None = None) -> list[dict[str, Any]]:
        """The open turns' summaries, a page at a time so no script holds Redis long."""
        ids = active_turns(self.redis)
        at = range(0, len(ids), SCAN_BATCH)
        return [
            r for i in at for r in self.summaries(ids[i : i + SCAN_BATCH], None, visible).values()
        ]

    def pending_interactions(self, visible: Visible | None = None) -> list[dict[str, Any]]:
        """Every pending interaction of the running turns, the soonest to expire first."""
        # A sub-agent's request: the console shows whose agent call asked.
        asks = ("agent", "owner", "parent_turn_id")
        rows = self.active(visible)
        out = [{**p, **{f: r[f] for f in asks}} for r in rows for p in r["pending_interactions"]]
        return sorted(out, key=lambda p: float(p["expires_at"]))


def find_turn_ids(client: Any, prefix: str, *, limit: int = 10) -> tuple[list[str], bool]:
    """Up to `limit` stored turns whose id starts with `prefix` (hex, any case), newest first,
    and whether the lookup stopped before it knew them all."""
    prefix = prefix.lower()
    if not _PREFIX.fullmatch(prefix):
        return [], False
    shards = [k.shard_of(prefix)] if len(prefix) >= 4 else list(k.shards())
    found: dict[str, float] = {}
    scanned = 0
    more = False
    for shard in shards:
        cursor = 0
        while not more:
            cursor, rows = client.zscan(
                k.shard_key(k.TURNS_INDEX, shard), cursor, match=prefix + "*", count=ID_SCAN_COUNT
            )
            scanned += ID_SCAN_COUNT
            fresh = {text(m): float(sc) for m, sc in rows if text(m) not in found}
            found.update({t: fresh[t] for t in live(client, list(fresh))})
            if int(cursor) == 0 and len(found) <= limit:
                break
            more = len(found) > limit or scanned >= ID_SCAN_MAX
    return sorted(found, key=found.__getitem__, reverse=True)[:limit], more


def live(client: Any, turn_ids: list[str]) -> list[str]:
    """The turns of `turn_ids` whose state Redis still holds, in one round trip."""
    alive = exist(client, [k.turn_key(t) for t in turn_ids])
    return [t for t, up in zip(turn_ids, alive, strict=True) if up]
