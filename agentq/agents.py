"""Agents: named configurations of a turn (instructions, model, tools, limits), also
offered to other agents as tools.

An `Agent(...)` made in an `AGENTQ_TOOLS` module is registered, as `@tool` registers a tool.
Turn workers publish their agents to Redis, so the gateway and the CLI, which import no tool
module, refuse an unknown agent before a turn starts.
"""

from __future__ import annotations

import importlib
import json
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from agentq import constants as k
from agentq.config import Settings, get_settings
from agentq.errors import AgentDefinitionError, ConfigError, UnknownAgent, field_errors
from agentq.tools.policy import Approval
from agentq.tools.registry import ASK_USER, ASK_USER_SPEC, all_tools

if TYPE_CHECKING:
    from agentq.tools.registry import ToolSpec

NAME_PATTERN = r"^[A-Za-z0-9_-]{1,64}$"
"""Names usable as OpenAI function names, since an agent may be offered as a tool."""
PUBLISHED_FRESH_S = 600.0
"""An agent a turn worker published longer ago than this is no longer known."""

SETTINGS_FIELDS = {
    "max_calls_per_turn",
    "stream_idle_timeout_ms",
    "stream_duration_s",
    "approval_timeout_s",
}
"""The fields of an Agent that override the settings of its turns."""

_AGENTS: dict[str, Agent] = {}


class AgentTool(BaseModel):
    """An agent offered to another agent's model as a tool: a call starts a child turn."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    agent: str
    name: str = Field(pattern=NAME_PATTERN)
    description: str
    timeout_s: float = Field(300.0, ge=0)
    """Hard limit of the child turn, aborted at it (the call settles `timeout`); 0: none."""

    def openai_schema(self) -> dict[str, Any]:
        params = {
            "type": "object",
            "properties": {"prompt": {"type": "string", "description": "The task for the agent."}},
            "required": ["prompt"],
            "additionalProperties": False,
        }
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": params},
        }


class Agent(BaseModel):
    """A named configuration a turn runs as; registered when made (in an AGENTQ_TOOLS module)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    instructions: str = ""
    """The system message, sent first in every model round of the agent's turns."""
    model: str | None = None
    """The model name sent to the server; unset: AGENTQ_LLM_MODEL."""
    description: str = ""
    """What the agent does: the description its `as_tool()` gives other models by default."""
    tools: tuple[str | AgentTool, ...] = ()
    """Names, @tool functions, or other agents' `as_tool()`: none unless listed, so what an
    agent may do is read where it is defined, never grown by a module loaded elsewhere."""
    mcp_servers: tuple[str, ...] = ()
    """MCP servers whose tools are offered too (a `SERVER__TOOL` in `tools` offers just one)."""
    max_calls_per_turn: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, gt=0)
    """Token budget of this agent's turns (a request may lower it, not raise it)."""
    max_cost_usd: float | None = Field(None, gt=0, allow_inf_nan=False)
    """USD budget of this agent's turns (its model needs a price); a request may lower it."""
    stream_idle_timeout_ms: int | None = None
    stream_duration_s: float | None = Field(None, gt=0)
    approval_timeout_s: float | None = Field(None, gt=0)
    """How long an approval request of this agent's turns waits; unset: the setting."""
    approval: dict[str, Approval] = Field(default_factory=dict)
    """Per-tool approval for this agent (`{"delete_file": "ask"}`), over the tool's own."""
    approval_default: Literal["approve", "deny"] | None = None
    """What a headless turn of this agent does with an `ask` whose tool declares no default."""
    ask_user: bool = False
    """Offer the model `ask_user`: a typed question for the user, asked as an `input`."""
    output_type: type[BaseModel] | None = None
    """The pydantic model the final JSON answer must match (asked once more), the `output`."""

    @field_validator("tools", mode="before")
    @classmethod
    def _tool_names(cls, v: Any) -> Any:
        if isinstance(v, (str, bytes)) or not hasattr(v, "__iter__"):
            raise ValueError("must be a list of tools (names, @tool functions or as_tool())")
        out: list[Any] = []
        for item in v:
            spec = getattr(item, "agentq_tool", None)
            if spec is not None:
                out.append(spec.name)
            elif isinstance(item, (str, AgentTool)):
                out.append(item)
            else:
                raise ValueError(
                    f"{item!r} is not a tool: pass a name, a @tool function or as_tool()"
                )
        return tuple(out)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            field, msg = field_errors(exc, "agent")[0]
            raise AgentDefinitionError(str(data.get("name", "?")), field, msg) from None
        same = _AGENTS.get(self.name)
        if same is not None and same != self:
            # One name, two definitions: which one a turn runs would depend on import order.
            raise AgentDefinitionError(
                self.name, "name", "another Agent already has this name (names are fleet-wide)"
            )
        _AGENTS[self.name] = self

    def system_message(self) -> str:
        """The instructions, and with an output type, its JSON schema."""
        if self.output_type is None:
            return self.instructions
        schema = json.dumps(self.output_type.model_json_schema(), separators=(",", ":"))
        ask = f"Answer with only one JSON object that matches this JSON schema: {schema}"
        return f"{self.instructions}\n\n{ask}" if self.instructions else ask

    def output_format(self) -> dict[str, Any] | None:
        """The Responses API's `text.format` for an `output_type`, else None."""
        if self.output_type is None:
            return None
        from agentq.llm.responses import output_format

        return output_format(self.output_type.__name__, self.output_type.model_json_schema())

    def as_tool(
        self, *, timeout_s: float = 300.0, description: str | None = None, name: str | None = None
    ) -> AgentTool:
        """This agent as a tool of another agent: its call runs a child turn of this agent."""
        try:
            return AgentTool(
                agent=self.name,
                name=name or self.name,
                description=description or self.description or f"Ask the {self.name} agent.",
                timeout_s=timeout_s,
            )
        except ValidationError as exc:
            field, msg = field_errors(exc)[0]
            raise AgentDefinitionError(self.name, f"as_tool.{field}", msg) from None

    @property
    def agent_tools(self) -> dict[str, AgentTool]:
        return {t.name: t for t in self.tools if isinstance(t, AgentTool)}

    def tool_names(self) -> list[str]:
        names = [t if isinstance(t, str) else t.name for t in self.tools]
        servers = set(self.mcp_servers)
        names += sorted(
            n for n, s in all_tools().items() if s.mcp_server in servers and n not in names
        )
        if self.ask_user and ASK_USER not in names:
            names.append(ASK_USER)
        return names

    def offered_tools(self) -> list[ToolSpec | AgentTool]:
        """What the model is offered (tools, and agents as tools), in the agent's order."""
        asks = {ASK_USER: ASK_USER_SPEC} if self.ask_user else {}
        tools: dict[str, ToolSpec | AgentTool] = {**all_tools(), **asks, **self.agent_tools}
        return [tools[n] for n in self.tool_names() if n in tools]

    def settings_for(self, base: Settings) -> Settings:
        update = self.model_dump(include=SETTINGS_FIELDS, exclude_none=True)
        return base.model_copy(update=update) if update else base


def all_agents() -> dict[str, Agent]:
    return dict(_AGENTS)


def unregister_agent(name: str) -> None:
    _AGENTS.pop(name, None)


def check_agents(mcp_servers: str | None = None) -> None:
    """Check that every tool and MCP server an agent names exists, once all are loaded."""
    tools = all_tools()
    try:
        servers = set(json.loads(mcp_servers or "{}"))
    except (ValueError, TypeError):
        servers = set()
    for agent in _AGENTS.values():
        for field, detail in _problems(agent, tools, servers):
            raise AgentDefinitionError(agent.name, field, detail)


def _problems(
    agent: Agent, tools: dict[str, ToolSpec], servers: set[str]
) -> Iterator[tuple[str, str]]:
    unknown_servers = sorted(set(agent.mcp_servers) - servers)
    if unknown_servers:
        yield (
            "mcp_servers",
            f"not in AGENTQ_MCP_SERVERS: {', '.join(unknown_servers)} "
            f"(configured: {', '.join(sorted(servers)) or 'none'})",
        )
    names = agent.tool_names()
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        yield "tools", f"named twice: {', '.join(dup)}"
    for t in agent.agent_tools.values():
        if t.agent not in _AGENTS:
            yield "tools", f"as_tool of unknown agent {t.agent!r}"
        if t.name in tools:
            yield "tools", f"agent tool {t.name!r} has the name of a @tool tool"
    for n in names:
        # A configured server's tool (`SERVER__TOOL`) is missing while the server is down.
        if n.split("__", 1)[0] in servers and "__" in n:
            continue
        if n == ASK_USER:
            # Listed without the flag, it was accepted and offered to nobody.
            if not agent.ask_user:
                yield "tools", f"{n!r} is offered with ask_user=True, not by its name in tools"
        elif n not in tools and n not in agent.agent_tools:
            yield "tools", f"unknown tool {n!r} (known: {', '.join(sorted(tools)) or 'none'})"
    for n in agent.approval:
        if n not in names:
            yield "approval", f"{n!r} is not one of the agent's tools"


def publish_agents(client: redis.Redis, now: float | None = None) -> int:
    """Tell the gateway and the CLI which agents this worker runs; returns how many."""
    now = time.time() if now is None else now
    records: dict[Any, str] = {}
    for a in _AGENTS.values():
        schema = a.output_type.model_json_schema() if a.output_type is not None else None
        rec = {"model": a.model, "tools": a.tool_names(), "description": a.description}
        records[a.name] = json.dumps({**rec, "output_schema": schema, "seen_at": now})
    if records:
        client.hset(k.AGENTS, mapping=records)
    return len(records)


def published_agent_details(client: redis.Redis, now: float | None = None) -> list[dict[str, Any]]:
    """The agents some turn worker published lately (before `now`), sorted by name."""
    now = time.time() if now is None else now
    out = []
    for name, raw in client.hgetall(k.AGENTS).items():
        try:
            rec = json.loads(raw)
            seen = float(rec.pop("seen_at"))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if now - seen <= PUBLISHED_FRESH_S:
            out.append({"name": name.decode() if isinstance(name, bytes) else str(name), **rec})
    return sorted(out, key=lambda a: str(a["name"]))


def require_known(client: redis.Redis, agent: str | None) -> None:
    """Refuse a turn that names an agent no turn worker runs (UnknownAgent)."""
    if agent is None:
        return
    known = [a["name"] for a in published_agent_details(client)]
    if agent not in known:
        raise UnknownAgent(agent, known)


def load_tool_modules(modules: list[str]) -> None:
    """Import the modules named in AGENTQ_TOOLS (tools and agents), then check the agents."""
    for mod in modules:
        try:
            importlib.import_module(mod)
        except ImportError as exc:
            raise ConfigError("AGENTQ_TOOLS", f"cannot import {mod!r}: {exc}") from None
    check_agents(get_settings().mcp_servers)
