"""Typed final outputs: an agent that declares `output_type` has its final answer checked.

The answer must be a JSON object the output type (a pydantic model) validates; one that is
not goes back to the model once, with the validation errors as a user message, and a
second invalid answer fails the turn (`turn_error`, code `invalid_output`). The typed value,
as JSON, is stored with the turn (`output`), carried by `turn_finished`, and is the result
of the agent call that started the turn.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

if TYPE_CHECKING:
    from agentq.orchestrator.context import StepContext

OUTPUT_RETRIES = 1
"""How many times an invalid final answer goes back to the model."""
ERRORS_SHOWN = 10
"""Validation errors quoted to the model and in the turn's error, at most."""
_FENCE = re.compile(r"^```[A-Za-z0-9_-]*\s*\n(.*)\n```$", re.DOTALL)


@dataclass(frozen=True)
class Checked:
    """What the final answer is: a typed value (JSON), a request to answer again, or an
    error; all None for an agent without an output type."""

    value: Any = None
    retry: dict[str, Any] | None = None
    error: str | None = None


def check_output(ctx: StepContext, message: dict[str, Any]) -> Checked:
    agent = ctx.agent
    if agent is None or agent.output_type is None:
        return Checked()
    name = agent.output_type.__name__
    content = str(message.get("content") or "").strip()
    # Models often fence JSON as a code block: the fence is not part of the answer.
    fenced = _FENCE.match(content)
    try:
        value = agent.output_type.model_validate_json(fenced.group(1) if fenced else content)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'answer'}: {e['msg']}"
            for e in exc.errors()[:ERRORS_SHOWN]
        )
        if int(ctx.state.get("output_retries") or 0) >= OUTPUT_RETRIES:
            return Checked(error=f"the final answer is not a valid {name}: {problems}")
        return Checked(
            retry={
                "role": "user",
                "content": f"Your answer is not a valid {name}: {problems}. Answer again "
                "with only one JSON object that matches the schema.",
            }
        )
    return Checked(value=value.model_dump(mode="json"))
