"""A worker's role follows from its queues: one role per worker, its pool rule with it."""

from __future__ import annotations

import pytest

from agentq.errors import ConfigError
from agentq.fleet.roles import pool_problem, role_of

TOOLS = ["agentq.tools", "gpu"]
IO = ["agentq.io", "agentq.io.recycle"]


@pytest.mark.parametrize(
    ("queues", "role"),
    [
        (["agentq.turns"], "turns"),
        (["agentq.llm"], "llm"),
        (["agentq.tools"], "tools"),
        (["gpu"], "tools"),
        (["agentq.tools", "gpu"], "tools"),
        (["agentq.io", "agentq.io.recycle"], "io"),
    ],
)
def test_the_queues_name_the_role(queues: list[str], role: str) -> None:
    assert role_of(queues, TOOLS, IO) == role


def test_queues_of_two_roles_are_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as info:
        role_of(["agentq.tools", "agentq.turns", "agentq.llm"], TOOLS, IO)
    msg = str(info.value)
    assert info.value.setting == "-Q"
    assert "tools: agentq.tools" in msg and "turns: agentq.turns" in msg and "llm" in msg


def test_a_queue_agentq_does_not_know_is_refused() -> None:
    with pytest.raises(ConfigError, match="not a queue of agentq: celery"):
        role_of(["agentq.tools", "celery"], TOOLS, IO)
    with pytest.raises(ConfigError, match="not a queue of agentq"):
        role_of([], TOOLS, IO)


def test_a_queue_two_roles_claim_is_refused() -> None:
    with pytest.raises(ConfigError, match="one role"):
        role_of(["shared"], ["agentq.tools", "shared"], ["agentq.io", "shared"])


@pytest.mark.parametrize(
    ("role", "pool", "ok"),
    [
        ("tools", "prefork", True),
        ("tools", "celery.concurrency.prefork", True),
        ("tools", "processes", True),
        ("tools", "threads", False),
        ("tools", "solo", False),
        ("tools", "gevent", False),
        ("io", "threads", True),
        ("io", "celery.concurrency.thread", True),
        ("io", "prefork", False),
        ("turns", "solo", True),
        ("llm", "threads", True),
    ],
)
def test_pool_rules(role: str, pool: str, ok: bool) -> None:
    assert (pool_problem(role, pool) is None) == ok
