from __future__ import annotations

import pytest

from agentq.state.store import TurnStore
from tests.unit.state.support import new_store


@pytest.fixture()
def store() -> TurnStore:
    return new_store()
