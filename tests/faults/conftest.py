"""Fixtures of the fault suite: each module (or test) builds its own rig of processes.

Nothing here is shared with the session `fleet` of tests/conftest.py: a fault test
SIGKILLs workers and restarts Redis, so every module gets its own processes (and a
test that breaks something for good builds a fresh rig of its own).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.faults.rig import Rig


@pytest.fixture(scope="module")
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    """A module's rig with all three kinds of workers; `RIG_ENV`, `RIG_CONCURRENCY` and
    `RIG_WORKERS` in the test module tune it."""
    env: dict[str, str] = getattr(request.module, "RIG_ENV", {})
    conc: dict[str, int] = getattr(request.module, "RIG_CONCURRENCY", {})
    kinds: tuple[str, ...] = getattr(request.module, "RIG_WORKERS", ("tools", "llm", "turns"))
    name = request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
    r = Rig(name, **env)
    try:
        r.start(*kinds, concurrency=conc)
        yield r
    finally:
        r.close()


@pytest.fixture()
def make_rig(request: pytest.FixtureRequest) -> Iterator[Callable[..., Rig]]:
    """Build a rig for one test (only one rig may be live at a time: it owns os.environ)."""
    made: list[Rig] = []

    def make(**kwargs: Any) -> Rig:
        r = Rig(request.node.name[:24], **kwargs)
        made.append(r)
        return r

    yield make
    for r in reversed(made):
        r.close()
