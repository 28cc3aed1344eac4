"""agentq.errors: every error survives a pickle round trip (Celery's pickle serializer,
multiprocessing), though its __init__ takes other arguments than the message it keeps."""

from __future__ import annotations

import inspect
import pickle
from typing import Any

import pytest

from agentq import errors
from agentq.orchestrator.conversation import ConversationMovedOn

SAMPLES: dict[str, Any] = {
    "str": "s-1",
    "int": 7,
    "float": 2.5,
    "bool": True,
    "list[str]": ["b", "a"],
    "float | None": 1.5,
    "dict[str, str]": {"retry-after": "3"},
    "dict[str, str] | None": {"status": "ok"},
}

CLASSES = [
    c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.AgentqError)
] + [ConversationMovedOn]


def sample(cls: type[errors.AgentqError]) -> errors.AgentqError:
    """`cls` made with a sample of each of its __init__'s parameters, by annotation."""
    params = inspect.signature(cls.__init__).parameters.values()
    args = {p.name: SAMPLES[str(p.annotation)] for p in params if p.name != "self"}
    return cls(**args)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_error_survives_a_pickle_round_trip(cls: type[errors.AgentqError]) -> None:
    error = sample(cls)
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is cls
    assert vars(again) == vars(error) and vars(error)
    assert again.args == error.args and str(again) == str(error)


def test_the_samples_cover_the_whole_tree() -> None:
    assert len(CLASSES) > 50
    assert {errors.TurnTimeout, errors.ModelBusy, errors.AmbiguousTurnId} <= set(CLASSES)
