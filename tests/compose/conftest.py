"""The compose suite: the demo fleet on RabbitMQ in real containers, built once per run.

Skipped, saying why, only where no Docker engine can be started (`../shared/docker/engine`
or `AGENTQ_DOCKER_ENGINE` starts one here). Every container and volume is removed after,
and an engine the suite started is stopped.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.compose.fleet import ComposeFleet, since, start_engine, stop_engine

LOGS = Path(__file__).resolve().parents[2] / "artifacts" / "compose-fleet.log"
"""Every container's log of the last compose run."""
REUSE_IMAGE = os.environ.get("AGENTQ_COMPOSE_REUSE_IMAGE") == "1"
"""Run the agentq:local image as built before (`docker build -f compose/Dockerfile -t
agentq:local .`), not built again: with the engine's vfs storage a build takes 20 min
or more on a busy 2-core machine, and any change to agentq/ starts it over."""


@pytest.fixture(scope="session")
def engine() -> Iterator[None]:
    why, started = start_engine()
    if why is not None:
        pytest.skip(why)
    yield
    if started:  # an engine that was running before stays running
        stop_engine()


@pytest.fixture(scope="session")
def fleet(engine: None) -> Iterator[ComposeFleet]:
    f = ComposeFleet()
    t0 = time.monotonic()
    try:
        # Built once here: `up --build` builds the one image again for every service.
        if not REUSE_IMAGE:
            f.build()
        built_s = since(t0)
        f.up()
        print(f"\ncompose: image built in {built_s} s, fleet healthy {since(t0)} s after start")
        yield f
    finally:
        # The containers go with `down`: their logs stay, for a failure to be read after.
        with contextlib.suppress(Exception):
            LOGS.parent.mkdir(parents=True, exist_ok=True)
            LOGS.write_text(f.logs(tail=-1))
        f.down()
