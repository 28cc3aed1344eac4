"""A worker's role (turns, llm, tools, io), decided once from the queues it consumes, so
`agentq worker KIND` and a bare `celery -A agentq worker -Q ...` get the same heartbeat,
checks and pool rules."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from agentq.constants import QUEUE_LLM, QUEUE_TURNS, QUEUE_WEBHOOKS
from agentq.errors import ConfigError

Role = Literal["turns", "llm", "tools", "io"]
HEARTBEAT_ROLES: tuple[Role, ...] = ("tools", "io")
"""Roles that run tool calls: they beat, so a turn settles the calls of a dead one as lost."""
PREFORK_POOLS = ("prefork", "processes")

role: Role | None = None
"""This worker's role, set before the prefork pool forks (so its children know it); None
outside a worker (a client, the gateway, a test)."""


def role_of(queues: Iterable[str], tool_queues: Iterable[str], io_queues: Iterable[str]) -> Role:
    """The one role a worker consuming `queues` has; ConfigError for a mix or a stranger."""
    owners: dict[str, set[Role]] = {QUEUE_TURNS: {"turns"}, QUEUE_LLM: {"llm"}}
    # Webhook attempts wait on the network, as async tools do: the I/O worker takes them,
    # or a worker started for that queue alone (`-Q agentq.webhooks -P threads`).
    served: dict[Role, Iterable[str]] = {"tools": tool_queues, "io": [*io_queues, QUEUE_WEBHOOKS]}
    for r, qs in served.items():
        for q in qs:
            owners.setdefault(q, set()).add(r)
    names = sorted(set(queues))
    unknown = [q for q in names if q not in owners]
    if not names or unknown:
        raise ConfigError(
            "-Q",
            f"not a queue of agentq: {', '.join(unknown) or '(none)'}; "
            f"known: {', '.join(sorted(owners))}",
        )
    roles = sorted({r for q in names for r in owners[q]})
    if len(roles) != 1:
        by_role = {r: [q for q in names if r in owners[q]] for r in roles}
        listed = "; ".join(f"{r}: {', '.join(qs)}" for r, qs in by_role.items())
        raise ConfigError(
            "-Q",
            f"a worker consumes the queues of one role, and these are of {len(roles)} "
            f"({listed}): start one worker per role, e.g. `celery -A agentq worker "
            f"-Q agentq.tools` or `agentq worker tools`",
        )
    return roles[0]


def pool_problem(role: str, pool: str) -> str | None:
    """Why `pool` (a Celery pool name or class path) cannot serve `role`, or None."""
    name = pool.lower()
    if role == "tools" and not any(p in name for p in PREFORK_POOLS):
        return (
            f"the tool worker needs the prefork pool (hard time limits are only "
            f"enforced there), not {pool!r}"
        )
    if role == "io" and "thread" not in name:
        return (
            f"the I/O worker runs its calls on one event loop fed by the threads pool, not {pool!r}"
        )
    return None
