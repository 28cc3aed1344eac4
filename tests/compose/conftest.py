"""The compose suite: the demo fleet on RabbitMQ in real containers, built once per run.

Skipped, saying why, only where no Docker engine can be started (`../shared/docker/engine`
or `AGENTQ_DOCKER_ENGINE` starts one here). Every container and volume is removed after.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.compose.fleet import ComposeFleet, since, start_engine


@pytest.fixture(scope="session")
def engine() -> None:
    why = start_engine()
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="session")
def fleet(engine: None) -> Iterator[ComposeFleet]:
    f = ComposeFleet()
    t0 = time.monotonic()
    try:
        # Built once here: `up --build` builds the one image again for every service.
        f.build()
        built_s = since(t0)
        f.up()
        print(f"\ncompose: image built in {built_s} s, fleet healthy {since(t0)} s after start")
        yield f
    finally:
        f.down()
