"""The @tool decorator and the registry: arguments validated by pydantic from the signature."""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, get_type_hints, overload

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from agentq.config import get_settings
from agentq.constants import TOOL_TASK_PREFIX
from agentq.errors import (
    ToolArgumentsInvalid,
    ToolDefinitionError,
    ToolMisuse,
    UnknownTool,
    describe_invalid,
)
from agentq.models import InteractionKind
from agentq.tools.context import ToolContext
from agentq.tools.policy import Approval, Concurrency, ResolvedPolicy, ToolPolicy

F = TypeVar("F", bound=Callable[..., Any])

_REGISTRY: dict[str, ToolSpec] = {}


ToolKind = Literal["sync", "async", "thread"]
"""sync: a prefork process of `agentq worker tools`; async: the event loop of `agentq
worker io`; thread: a sync tool on a thread of `agentq worker io` (`thread=True`)."""


@dataclass(frozen=True)
class ToolSpec:
    name: str
    fn: Callable[..., Any]
    description: str
    declared: ToolPolicy
    """The policy as declared; `policy` fills in the defaults."""
    args_model: type[BaseModel]
    wants_ctx: bool
    schema: dict[str, Any] = field(default_factory=dict)
    kind: ToolKind = "sync"
    mcp_server: str = ""
    """The MCP server the tool belongs to (agentq.mcp); empty for a @tool function."""

    @property
    def task_name(self) -> str:
        return TOOL_TASK_PREFIX + self.name

    @property
    def on_io_worker(self) -> bool:
        return self.kind != "sync"

    @property
    def policy(self) -> ResolvedPolicy:
        """The policy with its unset fields taken from this process's settings."""
        s = get_settings()
        return self.declared.resolved(
            timeout_s=s.tool_timeout_s, budget_s=s.tool_budget_s, on_io=self.on_io_worker
        )

    def openai_schema(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.schema}
        return {"type": "function", "function": function}

    def validate(self, arguments: dict[str, Any]) -> BaseModel:
        try:
            return self.args_model.model_validate(arguments)
        except ValidationError as exc:
            why = describe_invalid(exc, "(arguments)", 10)
            raise ToolArgumentsInvalid(self.name, why) from None


def _kind(name: str, f: Callable[..., Any], pol: ToolPolicy) -> ToolKind:
    """How the tool runs; the shapes that cannot be a tool are refused here."""
    target = inspect.unwrap(f)

    def shaped(test: Callable[[Any], bool]) -> bool:
        return test(f) or test(target)

    if shaped(inspect.isasyncgenfunction) or shaped(inspect.isgeneratorfunction):
        what = "an async generator" if shaped(inspect.isasyncgenfunction) else "a generator"
        raise ToolDefinitionError(
            name,
            f"{what} cannot be a tool: return a list instead of yielding, "
            "or report each item with ctx.progress(...)",
        )
    if shaped(inspect.iscoroutinefunction) and pol.thread:
        raise ToolDefinitionError(
            name, "thread=True is for sync tools; an async def tool runs on the event loop"
        )
    if shaped(inspect.iscoroutinefunction):
        return "async"
    return "thread" if pol.thread else "sync"


@overload
def tool(fn: F, /) -> F: ...
@overload
def tool(
    fn: None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    soft_timeout_s: float | None = None,
    budget_s: float | None = None,
    max_timeout_s: float | None = None,
    concurrency: Concurrency = "parallel",
    approval: Approval = "auto",
    approval_kind: InteractionKind = "approval",
    approval_timeout_s: float | None = None,
    approval_default: Literal["approve", "deny"] | None = None,
    queue: str | None = None,
    thread: bool = False,
    idempotent: bool = False,
    max_retries: int = 1,
) -> Callable[[F], F]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    **policy: Any,
) -> Any:
    """Declare a tool; the keyword arguments after `description` are its ToolPolicy."""
    unknown = sorted(set(policy) - set(ToolPolicy.model_fields))
    if unknown:
        # As a signature would refuse it: a misspelt knob is a mistake in the code.
        raise TypeError(f"tool() got unexpected keyword arguments: {', '.join(unknown)}")

    def register(f: F) -> F:
        spec = spec_of(f, name or f.__name__, description, policy)
        _REGISTRY[spec.name] = spec
        f.agentq_tool = spec  # type: ignore[attr-defined]
        return f

    return register if fn is None else register(fn)


def spec_of(
    f: Callable[..., Any], tool_name: str, description: str | None, policy: dict[str, Any]
) -> ToolSpec:
    """The ToolSpec of `f` under `policy` (ToolPolicy's fields), registered nowhere."""
    try:
        pol = ToolPolicy.model_validate(policy)
    except ValidationError as exc:
        raise ToolDefinitionError(tool_name, describe_invalid(exc, "(arguments)", 10)) from None
    kind = _kind(tool_name, f, pol)
    sig = inspect.signature(f)
    try:
        hints = get_type_hints(f)
    except Exception as exc:
        raise ToolDefinitionError(tool_name, f"cannot resolve annotations: {exc}") from None
    fields: dict[str, Any] = {}
    wants_ctx = False
    for i, (pname, param) in enumerate(sig.parameters.items()):
        ann = hints.get(pname, Any)
        if i == 0 and (ann is ToolContext or pname == "ctx"):
            wants_ctx = True
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ToolDefinitionError(
                tool_name, f"*args/**kwargs ({pname}) cannot be described to a model"
            )
        if pname.startswith("_"):
            raise ToolDefinitionError(tool_name, f"argument {pname!r} may not start with '_'")
        default = ... if param.default is inspect.Parameter.empty else param.default
        fields[pname] = (ann, default)
    model = create_model(  # type: ignore[call-overload]
        f"{tool_name}_arguments", __config__=ConfigDict(extra="forbid"), **fields
    )
    schema = model.model_json_schema()
    schema.pop("title", None)
    for prop in schema.get("properties", {}).values():
        prop.pop("title", None)
    doc = description or inspect.getdoc(f) or ""
    return ToolSpec(
        name=tool_name,
        fn=f,
        description=doc.strip(),
        declared=pol,
        args_model=model,
        wants_ctx=wants_ctx,
        schema=schema,
        kind=kind,
    )


ASK_USER = "ask_user"


def _ask_user(
    question: str, answer_schema: dict[str, Any] | None = None, default: Any = None
) -> str:
    """Ask the user a question and wait for the answer. Free text unless `answer_schema`
    (a JSON Schema) says otherwise: a choice is {"enum": [...]}, a small form an object
    with properties. `default`: the answer taken when nobody can be asked."""
    raise ToolMisuse(ASK_USER, "it is answered by the user, never run by a worker")


ASK_USER_SPEC = spec_of(
    _ask_user, ASK_USER, None, {"approval": "ask", "approval_kind": "input", "timeout_s": 0}
)
"""The tool of `Agent(..., ask_user=True)`, registered nowhere: the turn's approval gate asks
it as an `input` interaction, and the (checked) answer is the call's result."""


refresher: Callable[[], None] | None = None
"""Run before the registry is read (cheap, never raising): MCP servers' tools change."""


def register(spec: ToolSpec) -> None:
    """Add (or replace) a tool made without @tool, e.g. an MCP server's."""
    _REGISTRY[spec.name] = spec


def get_tool(name: str) -> ToolSpec:
    try:
        return all_tools()[name]
    except KeyError:
        raise UnknownTool(name, list(_REGISTRY)) from None


def all_tools() -> dict[str, ToolSpec]:
    if refresher is not None:
        refresher()
    return dict(_REGISTRY)


def unregister(name: str) -> None:
    _REGISTRY.pop(name, None)


def parse_arguments(tool_name: str, raw: str) -> dict[str, Any]:
    """Parse a call's raw JSON arguments into an object, with an error the model can act on."""
    text = raw.strip() or "{}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ToolArgumentsInvalid(
            tool_name, f"arguments are not valid JSON ({exc.msg} at position {exc.pos})"
        ) from None
    if not isinstance(value, dict):
        raise ToolArgumentsInvalid(
            tool_name, f"arguments must be a JSON object, got {type(value).__name__}"
        )
    return value


class _Offered(Protocol):
    def openai_schema(self) -> dict[str, Any]: ...


_schemas_json: dict[tuple[int, ...], tuple[tuple[_Offered, ...], str]] = {}


def schemas_json(offered: Sequence[_Offered]) -> str:
    """These tools' schemas as a JSON array, encoded once per tool set, not once per round."""
    key = tuple(map(id, offered))
    hit = _schemas_json.get(key)
    # The entry holds the tools, so no id in its key is reused while it lives.
    if hit is not None:
        return hit[1]
    text = json.dumps([t.openai_schema() for t in offered], separators=(",", ":"))
    if len(_schemas_json) >= 64:
        _schemas_json.clear()
    _schemas_json[key] = (tuple(offered), text)
    return text
