"""Turn ids by prefix: a person types `agentq show 3f2a9c01b7e4`, not 32 hex digits.

A prefix is looked up in the turns' index (agentq.state.listing): four hex digits or more
name its shard, Redis matches the prefix as it scans (ZSCAN MATCH), and a lookup stops at
`limit` live turns or SCAN_MAX entries read, so it is a bounded number of round trips
whatever the index holds. An index entry whose turn has expired is not a match.
"""

from __future__ import annotations

import re
from typing import Any

from agentq import constants as k
from agentq.state.base import exist, text

TURN_ID_LEN = 32
SCAN_COUNT = 1000
"""Index entries a ZSCAN call reads."""
SCAN_MAX = 200_000
"""Index entries a lookup reads at most, over every shard it reads."""
_PREFIX = re.compile(r"[0-9a-f]{1,32}")


def find_turn_ids(client: Any, prefix: str, *, limit: int = 10) -> tuple[list[str], bool]:
    """The stored turns whose id starts with `prefix` (hex, any case), newest first, at most
    `limit` of them, and whether the lookup stopped before it knew them all (more matches,
    or SCAN_MAX entries read). Something that cannot begin a turn id matches nothing."""
    prefix = prefix.lower()
    if not _PREFIX.fullmatch(prefix):
        return [], False
    shards = [k.shard_of(prefix)] if len(prefix) >= 4 else list(k.shards())
    found: dict[str, float] = {}
    scanned = 0
    for shard in shards:
        cursor = 0
        while True:
            cursor, rows = client.zscan(
                k.index_key(shard), cursor, match=prefix + "*", count=SCAN_COUNT
            )
            scanned += SCAN_COUNT
            fresh = {text(m): float(sc) for m, sc in rows if text(m) not in found}
            found.update({t: fresh[t] for t in live(client, list(fresh))})
            if int(cursor) == 0 and len(found) <= limit:
                break
            if len(found) > limit or scanned >= SCAN_MAX:
                return _newest(found, limit), True
    return _newest(found, limit), False


def live(client: Any, turn_ids: list[str]) -> list[str]:
    """The turns of `turn_ids` whose state Redis still holds, in one round trip."""
    alive = exist(client, [k.turn_key(t) for t in turn_ids])
    return [t for t, up in zip(turn_ids, alive, strict=True) if up]


def _newest(found: dict[str, float], limit: int) -> list[str]:
    return sorted(found, key=lambda t: found[t], reverse=True)[:limit]
