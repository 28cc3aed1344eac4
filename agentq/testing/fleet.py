"""Test your agents the way agentq tests its own: a scripted model and a real fleet that
starts and stops inside the test.

    model = ScriptedModel([[call("word_count", text="a b")], reply('{"words": 2}')])
    with local_fleet(tools=["myapp.tools"], model=model) as client:
        result = client.run(counter, "count: a b")
    assert result.output.words == 2

`local_fleet` starts what `agentq dev` starts for a turn (an embedded Redis, the turn,
stream, tool and I/O workers, and the scripted model server in this process), points
this process's settings at them, and stops everything by PID on the way out. A test that
fails inside it shows the events of the turns it started.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

from agentq.api import Client
from agentq.errors import AgentqError
from agentq.events import Event
from agentq.models import TurnHandle, TurnRequest
from agentq.testing.openai_server import DEFAULT_KEY, Round, ScriptedCall, ScriptedOpenAIServer

__all__ = ["FleetClient", "ScriptedModel", "call", "local_fleet", "reply"]

WORKER_KINDS = ("turns", "llm", "tools")
"""Always started; the I/O worker too when a module defines an async (or thread) tool."""
SHOWN_EVENTS = 60
"""Events of a turn a failure message shows at most (its last ones)."""


def call(name: str, /, **arguments: Any) -> ScriptedCall:
    """A tool call the scripted model makes: `call("word_count", text="a b")`."""
    return ScriptedCall(name=name, arguments=arguments)


def reply(text: str) -> Round:
    """A round in which the scripted model answers `text` and calls no tool."""
    return Round(text=text)


class ScriptedModel:
    """A model that plays its rounds in order, for every turn it serves.

    A round is a list of `call(...)`s (the model calls those tools at once) or a
    `reply(text)`. Past its last round the model answers "done."."""

    def __init__(self, rounds: Sequence[Sequence[ScriptedCall] | Round]) -> None:
        self.rounds: list[Round] = []
        for i, rnd in enumerate(rounds):
            if isinstance(rnd, Round):
                self.rounds.append(rnd)
            elif all(isinstance(c, ScriptedCall) for c in rnd) and rnd:
                self.rounds.append(Round(tool_calls=list(rnd)))
            else:
                raise TypeError(f"round {i}: a list of call(...) or a reply(...), not {rnd!r}")
        self.server: ScriptedOpenAIServer | None = None

    @property
    def requests(self) -> list[dict[str, Any]]:
        """The chat completion requests the model received (their JSON bodies), in order."""
        return [] if self.server is None else list(self.server.requests)


class FleetClient(Client):
    """The `Client` of a `local_fleet`: it keeps the turns it started, to show their events
    when the test fails."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[str] = []

    def _start_turn(self, prompt: str | TurnRequest | None = None, **options: Any) -> TurnHandle:
        handle = super()._start_turn(prompt, **options)
        self.started.append(handle.turn_id)
        return handle

    def describe(self, turn_id: str) -> str:
        """The turn's events, one line each, for a failure message."""
        events: list[Event] = []
        try:
            # What the log holds now: a turn still running stops at its first silence.
            for ev in self.events(turn_id, depth=1, heartbeat_s=0.2):
                if ev is None:
                    break
                events.append(ev)
        except AgentqError as exc:
            return f"turn {turn_id}: {exc}"
        lines = [f"events of turn {turn_id}:"]
        for ev in events[-SHOWN_EVENTS:]:
            fields = json.dumps(ev.fields, default=str, ensure_ascii=False)
            lines.append(f"  {ev.seq:>3} {ev.type} {fields[:300]}")
        return "\n".join(lines)


def _module_names(tools: Sequence[str | ModuleType | Any]) -> list[str]:
    names: list[str] = []
    for t in tools:
        if isinstance(t, str):
            names.append(t)
        elif isinstance(t, ModuleType):
            names.append(t.__name__)
        elif getattr(t, "agentq_tool", None) is not None:
            names.append(t.__module__)
        else:
            raise TypeError(f"tools: module names, modules or @tool functions, not {t!r}")
    return list(dict.fromkeys(names))


def _needs_io(modules: list[str]) -> bool:
    """Whether a tool of these modules runs on the I/O worker (async, or a thread)."""
    import importlib

    from agentq.tools.registry import all_tools

    for mod in modules:
        importlib.import_module(mod)
    return any(
        spec.kind != "sync" for spec in all_tools().values() if spec.fn.__module__ in modules
    )


@contextmanager
def local_fleet(
    tools: Sequence[str | ModuleType | Any],
    model: ScriptedModel,
    *,
    env: dict[str, str] | None = None,
    log_dir: Path | None = None,
    ready_timeout_s: float = 60.0,
) -> Iterator[FleetClient]:
    """An embedded Redis, the workers and `model`, for the `with` block; yields a client.

    `tools`: the modules (names, modules, or @tool functions of them) that define your
    tools and agents, imported by every worker as AGENTQ_TOOLS is. `env`: more AGENTQ_*
    settings for the workers and this process. This process's environment points at the
    fleet inside the block and is restored after it.
    """
    from agentq.fleet import runtime
    from agentq.local.fleet import LocalFleet
    from agentq.local.redis_server import RedisServer

    modules = _module_names(tools)
    kinds = list(WORKER_KINDS)
    if _needs_io(modules):
        kinds.append("io")
    server = ScriptedOpenAIServer()
    server.set_script(DEFAULT_KEY, model.rounds)
    redis = RedisServer()
    fleet = LocalFleet({}, log_dir=log_dir, redis=redis, name="test")
    saved = dict(os.environ)
    try:
        redis.start()
        server.start()
        model.server = server
        paths = [p for p in sys.path if p and Path(p).is_dir()]
        fleet.env = {
            "AGENTQ_REDIS_URL": redis.url,
            "AGENTQ_LLM_BASE_URL": server.url,
            "AGENTQ_LLM_API_KEY": "scripted",
            "AGENTQ_TOOLS": ",".join(modules),
            "AGENTQ_LLM_PROCESSES": "1",
            "AGENTQ_IO_PROCESSES": "1",
            "PYTHONPATH": os.pathsep.join([os.getcwd(), *paths]),
            **(env or {}),
        }
        os.environ.update(fleet.env)
        runtime.reset()
        fleet.start_workers(
            kinds, concurrency={"tools": 2, "turns": 4}, ready_timeout_s=ready_timeout_s
        )
        client = FleetClient()
        try:
            yield client
        except BaseException as exc:
            add_note: Any = getattr(exc, "add_note", None)  # Python 3.11 on
            if add_note is not None:
                for turn_id in client.started[-3:]:
                    add_note(client.describe(turn_id))
            raise
    finally:
        fleet.stop()
        server.stop()
        os.environ.clear()
        os.environ.update(saved)
        runtime.reset()
