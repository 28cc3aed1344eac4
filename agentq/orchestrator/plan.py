"""Each call of a round is planned once (checked, limited, gated) before anything runs, and
stored: the gate, the dispatcher and a step that takes over read the same decisions."""

from __future__ import annotations

import json
from collections import Counter
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from agentq.errors import AgentqError, ToolArgumentsInvalid
from agentq.llm.client import REASONING_ITEMS
from agentq.models import CALL_ID, AssistantMessage, InteractionKind, ToolCall
from agentq.tools.policy import ToolPolicy, effective_limits, split_meta
from agentq.tools.registry import ASK_USER, ASK_USER_SPEC, get_tool, parse_arguments

if TYPE_CHECKING:
    from agentq.agents import Agent, AgentTool


class CallPlan(BaseModel):
    """What the turn decided about one call; `refusal` set means it never runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    call: ToolCall
    refusal: str | None = None
    task_name: str = ""
    queue: str = ""
    exclusive: bool = False
    arguments: dict[str, Any] = {}
    timeout_s: float = 0.0
    soft_timeout_s: float = 0.0
    budget_s: float = 0.0
    approval: Literal["auto", "ask", "deny"] = "auto"
    approval_kind: InteractionKind = "approval"
    approval_timeout_s: float | None = None
    approval_default: Literal["approve", "deny"] | None = None
    subturn_agent: str = ""
    """Set for an agent called as a tool: the call runs a child turn of this agent."""


def plan_call(call: ToolCall, refusal: str | None = None, agent: Agent | None = None) -> CallPlan:
    """Validate a call the model made; a problem becomes a refusal the model can act on."""
    if refusal is not None:
        return CallPlan(call=call, refusal=refusal)
    if agent is not None:
        names = agent.tool_names()
        if call.name not in names:
            return CallPlan(
                call=call,
                refusal=f"tool {call.name!r} is not available to agent {agent.name!r}; "
                f"its tools: {', '.join(names) or 'none'}",
            )
        if call.name in agent.agent_tools:
            return _plan_subturn(call, agent.agent_tools[call.name], agent)
    try:
        asks = agent is not None and agent.ask_user and call.name == ASK_USER
        spec = ASK_USER_SPEC if asks else get_tool(call.name)
        args, hint_s = _arguments(call)
        validated = spec.validate(args)
    except AgentqError as exc:
        return CallPlan(call=call, refusal=exc.message)
    pol = spec.policy
    if asks:
        # A question is always asked, whatever the agent says: no worker runs `ask_user`.
        agent = None
    return CallPlan(
        call=call,
        task_name=spec.task_name,
        queue=pol.queue,
        exclusive=pol.concurrency == "exclusive",
        arguments=validated.model_dump(mode="json"),
        **vars(effective_limits(pol, hint_s)),
        approval=pol.approval if agent is None else agent.approval.get(call.name, pol.approval),
        approval_kind=pol.approval_kind,
        approval_timeout_s=pol.approval_timeout_s,
        approval_default=pol.approval_default or (agent.approval_default if agent else None),
    )


def _arguments(call: ToolCall) -> tuple[dict[str, Any], float | None]:
    """The call's arguments without `_meta`, and its `_meta.timeout_s` hint."""
    args, hint_s, problem = split_meta(parse_arguments(call.name, call.arguments))
    if problem:
        raise ToolArgumentsInvalid(call.name, problem)
    return args, hint_s


def _plan_subturn(call: ToolCall, tool: AgentTool, agent: Agent) -> CallPlan:
    try:
        args, hint_s = _arguments(call)
        prompt = args.get("prompt")
        if set(args) != {"prompt"} or not isinstance(prompt, str) or not prompt.strip():
            raise ToolArgumentsInvalid(call.name, 'expected {"prompt": "<a non-empty string>"}')
    except AgentqError as exc:
        return CallPlan(call=call, refusal=exc.message)
    limits = effective_limits(ToolPolicy.model_validate({"timeout_s": tool.timeout_s}), hint_s)
    return CallPlan(
        call=call,
        arguments={"prompt": prompt},
        timeout_s=limits.timeout_s,
        approval=agent.approval.get(call.name, "auto"),
        approval_default=agent.approval_default,
        subturn_agent=tool.agent,
    )


def batches(plans: list[CallPlan]) -> list[list[CallPlan]]:
    """Consecutive parallel calls share a batch; an exclusive call is a batch of its own."""
    out: list[list[CallPlan]] = []
    for p in plans:
        if p.exclusive or not out or out[-1][0].exclusive:
            out.append([p])
        else:
            out[-1].append(p)
    return out


def canonical_call(call: ToolCall) -> str:
    """The identity the loop detector compares: tool plus normalised arguments."""
    try:
        norm = json.dumps(json.loads(call.arguments or "{}"), sort_keys=True, separators=(",", ":"))
    except json.JSONDecodeError:
        norm = call.arguments
    return f"{call.name}:{norm}"


def limit_checks(
    earlier: list[ToolCall], new: list[ToolCall], *, max_calls: int, loop_threshold: int
) -> tuple[dict[str, str], str | None]:
    """Which new calls must not run (call id -> why), and why the turn stops after this round."""
    refused: dict[str, str] = {}
    stop: str | None = None
    seen = Counter(canonical_call(c) for c in earlier)
    budget = max_calls - len(earlier)
    for call in new:
        key = canonical_call(call)
        seen[key] += 1
        if budget <= 0:
            refused[call.id] = (
                f"not run: this turn reached max_calls_per_turn={max_calls}. "
                "Answer the user with what you have."
            )
            stop = "max_calls_per_turn"
            continue
        budget -= 1
        if seen[key] >= loop_threshold:
            refused[call.id] = (
                f"not run: the same call ({call.name} with the same arguments) was made "
                f"{seen[key]} times this turn; the loop detector stopped it."
            )
            stop = stop or "loop_detected"
    return refused, stop


def history_form(
    msg: AssistantMessage, max_arguments_bytes: int
) -> tuple[dict[str, Any], dict[str, str]]:
    """The assistant message as kept in history (with its reasoning items), and the calls
    refused for their size, whose arguments it drops (else resent with every round)."""
    out = msg.to_openai()
    if msg.reasoning_items:
        out[REASONING_ITEMS] = list(msg.reasoning_items)
    refused: dict[str, str] = {}
    for call, kept in zip(msg.tool_calls, out.get("tool_calls") or [], strict=True):
        why = oversize_refusal(call, max_arguments_bytes)
        if why is not None:
            size = len(call.arguments.encode("utf-8"))
            kept["function"]["arguments"] = json.dumps(
                {"_removed_by_agentq": f"{size} bytes of arguments, over the limit"}
            )
            refused[call.id] = why
    return out, refused


def oversize_refusal(call: ToolCall, max_arguments_bytes: int) -> str | None:
    """Why a call's arguments are too large to run, or None."""
    size = len(call.arguments.encode("utf-8"))
    if size <= max_arguments_bytes:
        return None
    return (
        f"invalid arguments for tool {call.name!r}: arguments are {size} bytes, over the "
        f"limit of {max_arguments_bytes} bytes; pass a reference (a path, an id) instead of "
        "the data"
    )


def with_safe_call_ids(
    message: AssistantMessage, taken: set[str], round_no: int
) -> AssistantMessage:
    """The message with every call id usable in a URL (to answer its approval) and unique in
    the turn (a model saying "call_0" every round would find the first result settled)."""
    seen = set(taken)
    calls: list[ToolCall] = []
    for i, call in enumerate(message.tool_calls):
        new_id = call.id
        if not CALL_ID.fullmatch(new_id) or new_id in seen:
            new_id = f"aq_r{round_no}_{i}"
            while new_id in seen:
                new_id += "_"
        seen.add(new_id)
        calls.append(call if new_id == call.id else call.model_copy(update={"id": new_id}))
    return message.model_copy(update={"tool_calls": tuple(calls)})


def calls_of(history: list[dict[str, Any]], start: int = 0) -> list[ToolCall]:
    """Every tool call the model made in `history[start:]`."""
    return [
        ToolCall(
            id=c["id"], name=c["function"]["name"], arguments=c["function"].get("arguments") or "{}"
        )
        for msg in history[start:]
        for c in msg.get("tool_calls") or []
    ]


def pending_calls(history: list[dict[str, Any]]) -> list[ToolCall]:
    """The tool calls of the last assistant message that have no tool message yet."""
    for i in range(len(history) - 1, -1, -1):
        msg = history[i]
        if msg.get("role") == "assistant":
            answered = {m.get("tool_call_id") for m in history[i + 1 :] if m.get("role") == "tool"}
            return [c for c in calls_of([msg]) if c.id not in answered]
        if msg.get("role") == "user":
            return []
    return []
