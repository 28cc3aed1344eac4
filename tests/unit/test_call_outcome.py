"""How a call's end becomes its result, as both tool workers decide it (`outcome`): one
precedence, an abort, then the hard limit, the soft limit, the tool's error, its value."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from celery.exceptions import SoftTimeLimitExceeded

from agentq.config import Settings
from agentq.tools.calls import outcome
from agentq.tools.registry import spec_of
from tests.helpers import call_scope

HARD = "Tool 'slow' was cancelled at its hard time limit of 10s; it is not running any more."


def slow(seconds: float = 1) -> str:
    return "done"


SPEC = spec_of(slow, "slow", None, {})


def _outcome(soft_fired: bool = False, **how: Any) -> Any:
    scope = call_scope()
    scope.soft_fired = soft_fired  # as the worker's soft limit sets it
    return outcome(scope, SPEC, Settings(), **how)


def test_an_abort_the_tool_saw_wins_over_everything() -> None:
    everything = {"hard_limit": HARD, "soft_fired": True, "raised": ValueError("x"), "value": 1}
    res = _outcome(aborted=True, **everything)
    assert res.status == "cancelled"
    assert json.loads(res.content)["reason"] == "user"
    # The sync worker once settled this case `error`, the I/O worker `cancelled`.
    assert _outcome(aborted=True, raised=RuntimeError("saw the abort")).status == "cancelled"
    assert _outcome(aborted=True, value="partial").status == "cancelled"


def test_the_hard_limit_wins_over_the_soft_limit_and_the_tool() -> None:
    res = _outcome(hard_limit=HARD, soft_fired=True, raised=asyncio.CancelledError())
    assert res.status == "timeout" and res.error == HARD
    assert _outcome(hard_limit=HARD, value="late").status == "timeout"


def test_the_soft_limit_wins_over_what_the_tool_raised() -> None:
    for raised in (SoftTimeLimitExceeded(), asyncio.CancelledError("soft"), KeyError("k")):
        res = _outcome(soft_fired=True, raised=raised)
        assert res.status == "timeout" and "soft time limit" in (res.error or ""), raised
        assert res.record.soft_limited is True


def test_what_the_tool_raised_wins_over_a_value() -> None:
    res = _outcome(raised=ValueError("bad page"), value="ignored")
    assert res.status == "error"
    assert res.error == "slow raised ValueError: bad page"


def test_a_value_is_the_result_also_after_the_soft_limit() -> None:
    res = _outcome(value={"n": 1})
    assert res.status == "ok" and json.loads(res.content) == {"n": 1}
    assert res.record.soft_limited is False
    late = _outcome(soft_fired=True, value="caught the limit, returned what it had")
    assert late.status == "ok" and late.record.soft_limited and late.record.partial


def test_a_value_no_tool_may_return_is_an_error() -> None:
    res = _outcome(value=(i for i in range(3)))
    assert res.status == "error" and "returned a generator" in (res.error or "")
