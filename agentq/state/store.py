"""Durable turn state in Redis: one class put together from its parts."""

from __future__ import annotations

from agentq.state.calls import CallRecords
from agentq.state.interactions import InteractionRecords
from agentq.state.rounds import RoundRecords
from agentq.state.steplock import StepRecords
from agentq.state.turns import TurnRecords
from agentq.state.waitpoints import WaitpointRecords


class TurnStore(
    TurnRecords, StepRecords, CallRecords, WaitpointRecords, RoundRecords, InteractionRecords
):
    """Everything Redis holds for turns, and every write that changes it."""
