"""`AGENTQ_MCP_SERVERS`: one frozen model per server, checked when a process starts."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agentq.errors import ConfigError, describe_invalid

SETTING = "AGENTQ_MCP_SERVERS"
NAME_PATTERN = r"^[A-Za-z0-9_-]{1,32}$"
_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class McpServer(BaseModel):
    """One MCP server: how to reach it and the policy every call of its tools runs under."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=NAME_PATTERN)
    command: tuple[str, ...] | None = None
    """argv of a stdio server, run as a child process of each `agentq worker io` process."""
    env: dict[str, str] = Field(default_factory=dict)
    """The whole environment of a stdio server: nothing of the worker's is passed on."""
    cwd: str | None = None
    url: str | None = None
    """The endpoint of a Streamable HTTP server."""
    headers: dict[str, str] = Field(default_factory=dict, repr=False)
    """HTTP headers; `${NAME}` in a value is the environment variable NAME of the worker."""
    timeout_s: float | None = Field(None, ge=0)
    budget_s: float | None = Field(None, ge=0)
    approval: Literal["auto", "ask", "deny", "annotations"] = "auto"
    """`annotations`: ask unless the tool declares `readOnlyHint` (and the server is trusted)."""
    trust_annotations: bool = False
    """Believe the tools' `readOnlyHint`; without it `annotations` asks for every call."""
    concurrency: Literal["parallel", "exclusive"] | int = "parallel"
    """`parallel`, `exclusive` (alone in its round), or N: the most calls at once, fleet-wide."""
    tools: tuple[str, ...] | None = None
    """An allowlist of the server's tool names; unset: all of them."""
    queue: str | None = None
    """The Celery queue of its calls; unset: `agentq.io`."""
    cancel_grace_s: float = Field(2.0, gt=0)
    """After a cancel, how long the server has to answer a ping before it is restarted."""
    start_timeout_s: float = Field(20.0, gt=0)
    """Longest wait for a server to start and answer `initialize`."""

    @field_validator("concurrency")
    @classmethod
    def _positive(cls, v: Any) -> Any:
        if isinstance(v, int) and v < 1:
            raise ValueError("a number of calls at once must be at least 1")
        return v

    @model_validator(mode="after")
    def _one_transport(self) -> McpServer:
        if (self.command is None) == (self.url is None):
            raise ValueError("give either `command` (stdio) or `url` (Streamable HTTP)")
        if self.command is not None and not self.command:
            raise ValueError("`command` must name a program")
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError("`url` must be http:// or https://")
        if self.url is None and self.headers:
            raise ValueError("`headers` are for a `url` server")
        return self

    @property
    def transport(self) -> Literal["stdio", "http"]:
        return "stdio" if self.command is not None else "http"

    def resolved_headers(self) -> dict[str, str]:
        """The headers with `${NAME}` read here, never stored nor logged (ConfigError if unset)."""
        out = {}
        for key, value in self.headers.items():
            unset = [name for name in _ENV_REF.findall(value) if name not in os.environ]
            if unset:
                why = f"server {self.name!r}: header {key!r} names ${unset[0]}, unset"
                raise ConfigError(SETTING, why)
            out[key] = _ENV_REF.sub(lambda m: os.environ[m.group(1)], value)
        return out

    def describe(self) -> str:
        """Where the server is, for messages: argv[0] or the URL without its query."""
        if self.command is not None:
            return f"stdio {self.command[0]}"
        return f"http {str(self.url).split('?', 1)[0]}"


def parse_servers(raw: str | None) -> dict[str, McpServer]:
    """The servers of `AGENTQ_MCP_SERVERS`; ConfigError naming the setting and the server."""
    if not raw or not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ConfigError(SETTING, f"not JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(data, dict):
        raise ConfigError(SETTING, "must be a JSON object keyed by server name")
    out = {}
    for name, spec in data.items():
        if not isinstance(spec, dict):
            raise ConfigError(SETTING, f"server {name!r}: must be an object")
        try:
            out[name] = McpServer(name=name, **spec)
        except ValidationError as exc:
            why = describe_invalid(exc, "server")
            raise ConfigError(SETTING, f"server {name!r}: {why}") from None
        except TypeError as exc:
            raise ConfigError(SETTING, f"server {name!r}: {exc}") from None
    return out
