"""Helpers the integration and fault suites share: script a model, follow a turn, check its logs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agentq.api import Client
from agentq.events import TERMINAL_TYPES, Event
from agentq.testing.openai_server import Round, ScriptedCall


def script(llm_server: Any, *rounds: Round) -> str:
    """Give the scripted model server these rounds under a fresh key to put in a prompt."""
    key = f"s-{uuid.uuid4().hex[:10]}"
    llm_server.set_script(key, list(rounds))
    return key


def script_asking_echoer(llm_server: Any, *child_rounds: Round) -> str:
    """A parent's rounds that ask the `ask_echoer` sub-agent once (its child answering with
    `child_rounds`), then end with "done"."""
    child_key = script(llm_server, *child_rounds)
    return script(
        llm_server,
        Round(tool_calls=calls(("ask_echoer", {"prompt": f"{child_key} go"}))),
        Round(text="done"),
    )


def calls(*specs: tuple[str, Any]) -> list[ScriptedCall]:
    """Scripted tool calls from (name, arguments) pairs."""
    return [ScriptedCall(name=n, arguments=a) for n, a in specs]


def collect(
    client: Client,
    turn_id: str,
    timeout_s: float = 30,
    *,
    until: Callable[[Event], bool] | None = None,
    heartbeat_s: float = 0.5,
    depth: int = 1,
) -> list[Event]:
    """Every event of a turn up to and including its terminal one (or the first `until`),
    with its sub-agents' relayed `depth` levels down."""
    out: list[Event] = []
    deadline = time.monotonic() + timeout_s
    for ev in client.events(turn_id, heartbeat_s=heartbeat_s, depth=depth):
        if ev is not None:
            out.append(ev)
            if (ev.type in TERMINAL_TYPES and not ev.path) or (until is not None and until(ev)):
                return out
        assert time.monotonic() < deadline, [e.type for e in out]
    return out


def follow_until(client: Client, turn_id: str, *types: str, timeout_s: float = 30) -> Event:
    """The first event of one of these types on a turn's stream."""
    deadline = time.monotonic() + timeout_s
    for ev in client.events(turn_id, heartbeat_s=0.5):
        if ev is not None and ev.type in types:
            return ev
        assert time.monotonic() < deadline, f"no {types} on turn {turn_id}"
    raise AssertionError(f"stream of {turn_id} ended without {types}")


def wait_event(
    client: Client,
    turn_id: str,
    type_: str,
    timeout_s: float = 30,
    until: Callable[[Event], bool] | None = None,
    **fields: Any,
) -> Event:
    """The first event of this type on a turn's stream whose fields match (and `until`)."""
    deadline = time.monotonic() + timeout_s
    for ev in client.events(turn_id, heartbeat_s=0.5):
        if (
            ev is not None
            and ev.type == type_
            and all(ev.fields.get(k) == v for k, v in fields.items())
            and (until is None or until(ev))
        ):
            return ev
        assert time.monotonic() < deadline, f"no {type_} {fields} on {turn_id}"
    raise AssertionError(f"stream of {turn_id} ended without {type_}")


def assert_valid_history(history: list[dict[str, Any]]) -> None:
    """Every tool call of every assistant message has exactly one tool message, no orphans."""
    ids: list[str] = []
    for i, msg in enumerate(history):
        for call in msg.get("tool_calls") or []:
            ids.append(call["id"])
            answers = [m for m in history[i + 1 :] if m.get("tool_call_id") == call["id"]]
            assert len(answers) == 1, (call["id"], len(answers), history)
    answered = [m["tool_call_id"] for m in history if m.get("role") == "tool"]
    assert sorted(answered) == sorted(ids), "a tool message answers no call"


def assert_gapless(events: list[Event]) -> None:
    """seq runs 1, 2, 3 ... with no gap and no repeat: a client can tell nothing is missing."""
    seqs = [e.seq for e in events]
    assert seqs == list(range(1, len(seqs) + 1)), seqs


def starts(path: Path) -> int:
    """How many times a counting tool began (one line per start)."""
    return len(path.read_text().splitlines()) if path.exists() else 0


def dump_redis(client: Any) -> str:
    """Every key and value in Redis as text, to search for what must not be stored."""
    out = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key).decode()
        if kind == "string":
            val: Any = client.get(key)
        elif kind == "hash":
            val = client.hgetall(key)
        elif kind == "list":
            val = client.lrange(key, 0, -1)
        elif kind == "set":
            val = client.smembers(key)
        elif kind == "zset":
            val = client.zrange(key, 0, -1, withscores=True)
        elif kind == "stream":
            val = client.xrange(key)
        else:
            val = kind
        out.append(f"{key!r} {val!r}")
    return "\n".join(out)


def run_dev_once(*args: str, name: str) -> tuple[int, str]:
    """`agentq dev --once ARGS` as a new user runs it (no AGENTQ_ settings, a free Redis
    port, so it embeds its own): its exit code and its output."""
    import os
    import sys

    from agentq.local.processes import start_process
    from agentq.local.redis_server import find_free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("AGENTQ_", "FLOWER_"))}
    env.update(
        {
            "AGENTQ_REDIS_URL": f"redis://127.0.0.1:{find_free_port()}/0",
            "AGENTQ_GATEWAY_PORT": "0",
            "AGENTQ_FLOWER_PORT": "0",
            "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
        }
    )
    proc = start_process(
        [sys.executable, "-m", "agentq", "dev", "--once", *args],
        env=env,
        inherit_env=False,
        name=name,
    )
    try:
        rc = proc.wait(timeout_s=150)
    finally:
        proc.stop()
    return int(rc if rc is not None else -1), proc.log_text()


def exited(pid: int) -> bool:
    """The process has exited: gone, or a zombie its parent has not reaped yet (on a busy
    machine a pool's parent can take seconds to reap a child it killed)."""
    import psutil

    try:
        return bool(psutil.Process(pid).status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def agentq_cli(
    env: dict[str, str], *args: str, timeout_s: float = 60
) -> subprocess.CompletedProcess[str]:
    """`agentq ARGS` as a user runs it, with `env` over this process's environment."""
    from agentq.local.processes import run_process

    return run_process(
        [sys.executable, "-m", "agentq", *args], env={**os.environ, **env}, timeout_s=timeout_s
    )


def busy_factor() -> float:
    """How many times more work than cores the machine has now (1 when it has spare): a
    timing bound of a test that shares the machine with a four-process suite scales by it."""
    return max(1.0, os.getloadavg()[0] / (os.cpu_count() or 1))


@contextlib.contextmanager
def process_env(env: dict[str, str]) -> Iterator[None]:
    """Point this process (its Client) at `env`, then restore the session's settings."""
    from agentq.fleet import runtime

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    runtime.reset()
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        runtime.reset()


def call_scope(ran_s: float = 1.0, soft_timeout_s: float = 9.0) -> Any:
    """The scope of a call of a tool `slow` (hard limit 10 s) that has run `ran_s`."""
    from agentq.models import ToolTaskRequest
    from agentq.tools.calls import CallScope

    req = ToolTaskRequest(
        turn_id="t",
        call_id="c",
        tool="slow",
        arguments={},
        timeout_s=10.0,
        soft_timeout_s=soft_timeout_s,
        budget_s=5.0,
    )
    return CallScope(req=req, worker="w", task_id="x", started=time.time() - ran_s)
