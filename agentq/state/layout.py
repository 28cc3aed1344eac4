"""What an older agentq kept in Redis, moved to where this one keeps it: once per Redis,
by the first worker of a fleet that starts after an upgrade (docs/operations.md,
"Upgrading a fleet": the older workers are stopped first)."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from agentq import constants as k
from agentq.events.lua_args import bind_lua
from agentq.state.base import text
from agentq.state.lua import append_lua, hset_table_lua

log = logging.getLogger("agentq.state")

LAYOUT_KEY = f"{k.PREFIX}:layout"
"""The layout the turns in this Redis are kept in (absent: an older one)."""
LAYOUT = 9
"""A turn's calls (8) and its history (9) are fields of its state hash, not a
`{turn}:calls` hash and a `{turn}:history` list (issue #33's eighth and ninth passes)."""


class MoveKeys(NamedTuple):
    turn_key: str
    old_key: str
    """The older version's key (`{turn}:calls` or `{turn}:history`): same hash tag."""


# _MERGE_CALLS_LUA: one turn's call records into its state: a field the state holds
# already (written by a newer worker meanwhile) stays. Both keys carry the turn's hash
# tag: one slot.
_MERGE_CALLS_LUA = (
    bind_lua(MoveKeys)
    + """
local rec = redis.call('HGETALL', old_key)
if #rec == 0 then return 0 end
if redis.call('EXISTS', turn_key) == 1 then
  for i = 1, #rec, 2 do redis.call('HSETNX', turn_key, rec[i], rec[i + 1]) end
end
redis.call('DEL', old_key)
return 1
"""
)


# _MERGE_HISTORY_LUA: one turn's history list into its state, as its message fields and
# their count, unless the state has a history of its own already or is gone.
_MERGE_HISTORY_LUA = (
    bind_lua(MoveKeys)
    + """
local msgs = redis.call('LRANGE', old_key, 0, -1)
if #msgs == 0 then return 0 end
if redis.call('EXISTS', turn_key) == 1
    and redis.call('HEXISTS', turn_key, '"""
    + k.HISTORY_LEN_FIELD
    + """') == 0 then
  local hlen, w = 0, {}
"""
    + append_lua("w", "1", "#msgs", src="msgs")
    + hset_table_lua("turn_key", "w")
    + """
end
redis.call('DEL', old_key)
return 1
"""
)

_MOVES = (("calls", _MERGE_CALLS_LUA), ("history", _MERGE_HISTORY_LUA))


def upgrade_layout(client: Any) -> int:
    """Move the call records and the history of every turn an older version stored into
    the turn's state, unless this Redis is marked as moved already; how many keys moved."""
    if int(client.get(LAYOUT_KEY) or 0) >= LAYOUT:
        return 0
    moved = 0
    for suffix, lua in _MOVES:
        merge = client.register_script(lua)
        for raw in client.scan_iter(match=f"{k.PREFIX}:turn:*:{suffix}", count=1000):
            old = text(raw)
            moved += int(merge(keys=list(MoveKeys(old[: -len(suffix) - 1], old))))
    client.set(LAYOUT_KEY, LAYOUT)
    if moved:
        log.warning("moved %d keys of turns into their state hashes", moved)
    return moved
