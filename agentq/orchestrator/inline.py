"""Inline steps: a process that wakes a turn takes the turn's step itself.

Worker processes that settle calls or finish model rounds switch it on: the step that
follows the last result of a batch then costs no broker round trip. Only for processes
whose own work it may delay by a few milliseconds (not a prefork parent).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from agentq.config import get_settings
from agentq.fleet import runtime
from agentq.orchestrator.steps import run_step, take_step
from agentq.state.base import StepView

log = logging.getLogger("agentq.turn")


def step_inline() -> None:
    """Take a woken turn's step in this process instead of sending it to a turn worker."""
    runtime.set_inline_steps(_InlineSteps())


class _InlineSteps:
    def wake(self, turn_id: str) -> None:
        _step(run_step, turn_id)

    def lock_ms(self) -> int | None:
        return int(get_settings().step_lock_s * 1000)

    def run(self, turn_id: str, token: str, lock_ms: int, view: StepView) -> None:
        _step(take_step, turn_id, view, token, lock_ms)


def _step(step: Callable[..., object], turn_id: str, *args: Any) -> None:
    try:
        store, app = runtime.get_store(), runtime.get_app()
        step(turn_id, *args, store=store, app=app, settings=get_settings())
    except Exception:
        # The fact is recorded and the turn marked: a turn worker takes the step (once the
        # failed step's lock, if it held one, lapses; the wakeup sweep is the backstop).
        log.warning("turn %s: inline step failed; sending it", turn_id, exc_info=True)
        runtime.send_woken_step(turn_id)
