"""What an older agentq kept in Redis, moved to where this one keeps it: once per Redis,
by the first worker of a fleet that starts after an upgrade (docs/operations.md,
"Upgrading a fleet": the older workers are stopped first)."""

from __future__ import annotations

import logging
from typing import Any

from agentq import constants as k
from agentq.state.base import text

log = logging.getLogger("agentq.state")

LAYOUT_KEY = f"{k.PREFIX}:layout"
"""The layout the turns in this Redis are kept in (absent: an older one)."""
LAYOUT = 8
"""A turn's calls are fields of its state hash, not of a `{turn}:calls` hash (issue #33's
eighth pass)."""

# One turn's call records into its state: a field the state holds already (written by a
# newer worker meanwhile) stays. Both keys carry the turn's hash tag: one slot.
_MERGE_CALLS_LUA = """
local rec = redis.call('HGETALL', KEYS[2])
if #rec == 0 then return 0 end
if redis.call('EXISTS', KEYS[1]) == 1 then
  for i = 1, #rec, 2 do redis.call('HSETNX', KEYS[1], rec[i], rec[i + 1]) end
end
redis.call('DEL', KEYS[2])
return 1
"""


def upgrade_layout(client: Any) -> int:
    """Move the call records of every turn an older version stored into the turn's state,
    unless this Redis is marked as moved already; how many turns' records moved."""
    if int(client.get(LAYOUT_KEY) or 0) >= LAYOUT:
        return 0
    merge = client.register_script(_MERGE_CALLS_LUA)
    moved = 0
    for raw in client.scan_iter(match=f"{k.PREFIX}:turn:*:calls", count=1000):
        calls = text(raw)
        moved += int(merge(keys=[calls[: -len(":calls")], calls]))
    client.set(LAYOUT_KEY, LAYOUT)
    if moved:
        log.warning("moved the call records of %d turns into their state hashes", moved)
    return moved
