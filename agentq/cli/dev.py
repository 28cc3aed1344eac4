"""`agentq dev`: the whole fleet on one machine, Redis and a demo model where none is set,
each process logging to a file; Ctrl-C, SIGTERM, any death or a failed start stops all."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentq.config import Settings, get_settings, is_sentinel, redact
from agentq.errors import ConfigError
from agentq.fleet.connections import probe
from agentq.local.fleet import LocalFleet
from agentq.local.processes import (
    CELERY_READY_PATTERN,
    ManagedProcess,
    ProcessStartError,
    WaitTimeout,
    last_error,
    wait_for,
)
from agentq.local.redis_server import ensure_redis, find_free_port, port_is_free

DEMO_PROMPT = "Say hello: call echo with 'hello' and sleep for 2 seconds, both at once."
DEMO_TOOLS = "agentq.testing.tools,agentq.testing.agents"
READY_TIMEOUT_S = 90.0
"""Generous: five Python processes import Celery at once, on a laptop or a small CI box."""
STOP_TIMEOUT_S = 10.0
"""Per process, between SIGTERM and SIGKILL: a warm shutdown lets running tasks end."""
FLOWER_AUTH_VARIABLES = ("FLOWER_BASIC_AUTH", "FLOWER_AUTH")
"""Flower's own: either keeps `agentq dev` from generating credentials."""


def say(message: str) -> None:
    # A closed terminal or pipe must not keep the finally blocks from stopping everything.
    with contextlib.suppress(OSError):
        print(f"agentq dev: {message}", flush=True)


def _python(*args: str) -> list[str]:
    return [sys.executable, "-m", *args]


def wait_ready(ready: dict[ManagedProcess, str], timeout_s: float = READY_TIMEOUT_S) -> None:
    """Wait until each process logged its ready line; ProcessStartError otherwise."""
    pending = dict(ready)

    def all_ready() -> bool:
        for proc, line in list(pending.items()):
            if re.search(line, proc.log_text(), re.MULTILINE):
                del pending[proc]
            elif proc.poll() is not None:
                raise ProcessStartError(
                    f"{proc.name} (pid {proc.pid}) exited with code {proc.returncode} while "
                    f"starting{_because(proc)}; its log: {proc.log_path}",
                    proc.log_tail(),
                )
        return not pending

    try:
        wait_for(all_ready, timeout_s, 0.05)
    except WaitTimeout:
        proc = next(iter(pending))
        raise ProcessStartError(
            f"{', '.join(p.name for p in pending)} not ready within {timeout_s:g} s; "
            f"log: {proc.log_path}",
            proc.log_tail(),
        ) from None


def _because(proc: ManagedProcess) -> str:
    why = last_error(proc.log_text())
    return f" ({why})" if why else ""


def _port(preferred: int, env_name: str, what: str) -> int:
    """`preferred` (0: any) if free; else a free one, unless the user asked for that one."""
    if preferred == 0:
        return find_free_port()
    if port_is_free(preferred):
        return preferred
    if env_name in os.environ:
        raise ConfigError(env_name, f"port {preferred} for {what} is in use")
    port = find_free_port()
    say(f"port {preferred} is in use: {what} listens on {port} instead")
    return port


SHOWN = ("web page", "Flower", "webhooks", "Redis", "model", "pids", "logs")
Started = tuple[dict[str, str], dict[str, str]]
"""The fleet's environment, and the summary's lines by SHOWN label (generated credentials too)."""


def start_all(fleet: LocalFleet, opts: argparse.Namespace, settings: Settings) -> Started:
    # Ports first: a taken port the user asked for fails before anything starts.
    gateway_port = (
        0 if opts.no_gateway else _port(settings.gateway_port, "AGENTQ_GATEWAY_PORT", "the gateway")
    )
    flower_port = (
        0 if opts.no_flower else _port(settings.flower_port, "AGENTQ_FLOWER_PORT", "Flower")
    )
    fleet_env, shown = _environment(fleet, opts, settings)
    ready: dict[ManagedProcess, str] = {}

    def launch(name: str, argv: list[str], ready_line: str, **env: str) -> None:
        ready[fleet.start(name, argv, env={**fleet_env, **env})] = ready_line

    if not settings.llm_base_url:
        say("no model configured (AGENTQ_LLM_BASE_URL unset): using the scripted demo model")
        # Its port is picked here, so the workers start beside it rather than after it.
        port = str(find_free_port())
        argv = _python("agentq.testing.openai_server", "--port", port, "--script", "demo")
        launch("model", argv, r"listening on \S+")
        url = fleet_env["AGENTQ_LLM_BASE_URL"] = f"http://127.0.0.1:{port}/v1"
        shown["model"] = f"{url}  (scripted demo model)"
    for kind in ("turns", "llm", "tools", "io"):
        argv = _python("agentq", "worker", kind, "--hostname", f"{kind}-dev@%h")
        if kind == "tools":
            argv += ["--concurrency", "4"]
        if kind == "llm" and not settings.llm_processes:
            # One event loop holds the streams of a machine's worth of turns; a process a
            # CPU would start two more Pythons beside the rest of the fleet for nothing.
            argv += ["--processes", "1"]
        launch(f"worker-{kind}", argv, CELERY_READY_PATTERN)
    if not opts.no_beat:
        # A beat already running elsewhere holds the lock: this one waits for its turn.
        launch("beat", _python("agentq", "beat"), r"beat: Starting")
    if not opts.no_gateway:
        host = settings.gateway_host
        at = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        url = shown["web page"] = f"http://{at}:{gateway_port}/"
        argv = _python("agentq", "serve", "--host", host, "--port", str(gateway_port))
        launch("gateway", argv, r"Uvicorn running on")
    if not opts.no_flower:
        url = f"http://127.0.0.1:{flower_port}/"
        env = {"AGENTQ_FLOWER_PORT": str(flower_port)}
        auth = " from AGENTQ_FLOWER_BASIC_AUTH"
        # Flower can revoke and kill tasks: even on loopback, not for any local process.
        if not settings.flower_basic_auth and not any(map(os.getenv, FLOWER_AUTH_VARIABLES)):
            password = secrets.token_urlsafe(12)
            env["AGENTQ_FLOWER_BASIC_AUTH"] = f"agentq:{password}"
            auth = f", user agentq password {password}"
        shown["Flower"] = f"{url}  (basic auth{auth})"
        # Logged once its socket listens.
        launch("flower", _python("agentq", "flower"), r"Visit me at", **env)
    wait_ready(ready)
    return fleet_env, shown


def _environment(fleet: LocalFleet, opts: argparse.Namespace, settings: Settings) -> Started:
    """The Redis the fleet uses (embedded if none answers), and its environment."""
    separate_broker = bool(settings.broker_url) and settings.broker_url != settings.redis_url
    if separate_broker and (problem := probe(settings.broker, settings.redis_sentinel_master)):
        where = redact(settings.broker)
        raise ConfigError("AGENTQ_BROKER_URL", f"no broker answers at {where}: {problem}")
    # A Sentinel's master is used as it is; anything else, `ensure_redis`.
    url, embedded = settings.redis_url, None
    if not is_sentinel(url):
        url, embedded = ensure_redis(url)
    elif (problem := probe(url, settings.redis_sentinel_master)) is not None:
        raise ConfigError("AGENTQ_REDIS_URL", f"no master answers behind {redact(url)}: {problem}")
    fleet.redis = embedded
    if embedded is None:
        say(f"Redis: using the one answering at {redact(url)}")
    else:
        say(
            f"no Redis answered at {redact(settings.redis_url)}: started an embedded "
            f"redis-server (pid {embedded.pid}) at {redact(url)}; it stops with agentq dev"
        )
    env = {"AGENTQ_REDIS_URL": url}
    if separate_broker:
        say(f"broker: {redact(settings.broker)} (Redis kept for events and state)")
    elif settings.broker_url:
        env["AGENTQ_BROKER_URL"] = url  # it named the Redis we may have moved
    if not settings.tools:
        say(f"AGENTQ_TOOLS unset: loading the demo tools from {DEMO_TOOLS}")
        env["AGENTQ_TOOLS"] = DEMO_TOOLS
    if not opts.no_flower and "AGENTQ_TASK_EVENTS" not in os.environ:
        # Flower runs here: task events from the first task on, not after its 5 s timer.
        env["AGENTQ_TASK_EVENTS"] = "true"
    where = "embedded, stops with agentq dev" if embedded else "already running"
    shown = {"Redis": f"{redact(url)}  ({where})"}
    if settings.webhook_secret is None:
        import base64

        token = base64.b64encode(secrets.token_bytes(32)).decode()
        secret = env["AGENTQ_WEBHOOK_SECRET"] = f"whsec_{token}"
        shown["webhooks"] = f"signed with {secret} (generated)"
    return env, shown


def summary(env: dict[str, str], shown: dict[str, str], fleet: LocalFleet, took_s: float) -> str:
    pids = ", ".join(f"{name} {p.pid}" for name, p in fleet.procs.items())
    shown = {**shown, "pids": pids, "logs": str(fleet.log_dir)}
    lines = [f"ready in {took_s:.1f} s"]
    lines += [f"  {label:<9} {shown[label]}" for label in SHOWN if label in shown]
    # The variables another terminal needs that its environment does not already hold.
    prefix = "".join(
        f"{k}={redact(v)} "
        for k, v in env.items()
        if k in ("AGENTQ_REDIS_URL", "AGENTQ_BROKER_URL")
        and v != os.environ.get(k, Settings.model_fields["redis_url"].default)
    )
    lines.append(f'try it from another terminal:  {prefix}agentq run "hello"')
    return "\n".join(lines)


def _print_events(events: Iterator[Any]) -> None:
    for ev in events:
        if ev is not None:
            fields = json.dumps(ev.fields, default=str, ensure_ascii=False)
            # A sub-agent's events, relayed, are indented under the call that started them.
            indent = "  " * len(ev.path)
            print(f"  {indent}{ev.seq:>3} {ev.type:<22} {fields[:150]}", flush=True)


def _watch(fleet: LocalFleet) -> int:
    """Block until a process dies (1) or we are told to stop."""
    # wait_for returns only what is truthy: a death, never None.
    name, rc = wait_for(fleet.first_dead, float("inf"), 0.5)  # type: ignore[misc]
    proc = fleet.procs.get(name)  # None for Redis
    why, tail = (_because(proc), proc.log_tail()) if proc else ("", "")
    say(f"{name} exited with code {rc}{why}; stopping everything\n{tail}")
    return 1


def _stop_quietly(fleet: LocalFleet) -> None:
    """Stop everything, signals ignored from here on so no child is left behind."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    n = len(fleet.procs) + (fleet.redis is not None)
    t0 = time.monotonic()
    fleet.stop()
    if n:
        what = "process" if n == 1 else "processes"
        say(f"stopped {n} {what} in {time.monotonic() - t0:.1f} s")


def main(opts: argparse.Namespace) -> int:
    log_dir = Path(tempfile.mkdtemp(prefix="agentq-dev-"))
    fleet = LocalFleet({}, log_dir=log_dir, stop_timeout_s=STOP_TIMEOUT_S)
    code = 1
    try:
        for signum in (signal.SIGTERM, signal.SIGHUP):  # they stop everything as Ctrl-C does
            signal.signal(signum, signal.default_int_handler)
        code = _serve(fleet, opts)
    except ProcessStartError as exc:
        say(f"could not start: {exc}")
    except KeyboardInterrupt:
        code = 0
    finally:
        _stop_quietly(fleet)
        if code == 0 or not any(log_dir.iterdir()):
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            say(f"logs kept in {log_dir}")
    return code


def _serve(fleet: LocalFleet, opts: argparse.Namespace) -> int:
    """Start everything; then the demo turn (--once: its exit code), or watch till a death."""
    t0 = time.monotonic()
    env, shown = start_all(fleet, opts, get_settings())
    say(summary(env, shown, fleet, time.monotonic() - t0))
    from agentq.fleet import runtime

    os.environ.update(env)  # this process's Client uses what was started
    runtime.reset()
    from agentq.api import Client

    prompt = opts.prompt or DEMO_PROMPT
    if opts.once:
        from agentq.cli.run import run

        return run(Client(), prompt, as_json=False, headless=True, agent=opts.agent)
    if opts.demo:
        client = Client()
        handle = client._start_turn(prompt, headless=True, agent=opts.agent)
        say(f"demo turn {handle.turn_id}:")
        _print_events(client.events(handle.turn_id, heartbeat_s=1.0))
    say("running; Ctrl-C stops everything")
    return _watch(fleet)
