"""Turn ids as a person sees and types them: 12 characters in a table, as git and Docker
show them, and any unambiguous prefix on the command line. `--json` keeps full ids."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentq.api import Client

TURN_ID_HELP = "the turn's id, or any prefix of it that names one turn (as `agentq turns` shows it)"


def short_id(turn_id: str) -> str:
    return turn_id[:12]


def clock(ts: Any, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    """A timestamp in local time, or `-` when there is none."""
    return time.strftime(fmt, time.localtime(ts)) if isinstance(ts, (int, float)) else "-"


def resolve_turn_id(client: Client, given: str) -> str:
    """The turn `given` names: a full id, or the one turn whose id starts with it. Several
    raise AmbiguousTurnId; none gives `given` back, for the command to report unknown."""
    # Imported here: tables import short_id at `--help`.
    from agentq.errors import AmbiguousTurnId
    from agentq.state.listing import TURN_ID_LEN, TurnLister, find_turn_ids

    if len(given) == TURN_ID_LEN:
        return given
    matches, more = find_turn_ids(client._store.redis, given, limit=10)
    if len(matches) == 1 and not more:
        return matches[0]
    if not matches:
        return given
    rows = TurnLister(client._store.redis).summaries(matches)
    candidates = []
    for turn_id in matches:
        row = rows.get(turn_id, {})
        when = clock(row.get("created_at"))
        status, agent = row.get("status") or "-", row.get("agent") or "-"
        candidates.append(f"{turn_id}  {status:<9} {when}  {agent}")
    raise AmbiguousTurnId(given, matches, candidates, more=more)
