"""`agentq run`: start one turn and show it live; Ctrl-C aborts it for real."""

from __future__ import annotations

import argparse
import contextlib
import getpass
import json
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from rich.console import Console
from rich.live import Live

from agentq.api import Client
from agentq.cli.render import TurnView
from agentq.constants import RELAY_DEPTH_MAX
from agentq.errors import AgentqError, AnswerInvalid
from agentq.events import Event
from agentq.fleet import presence
from agentq.models import TurnHandle

EXIT_OK, EXIT_FAILED, EXIT_HEADLESS, EXIT_ABORTED = 0, 1, 4, 130


def exit_code_for(ev: Event) -> int:
    if ev.fields.get("code") == "headless_interaction":  # only a turn_error has a code
        return EXIT_HEADLESS
    return {"turn_finished": EXIT_OK, "turn_aborted": EXIT_ABORTED}.get(ev.type, EXIT_FAILED)


def _answerer(client: Client, turn_id: str, token: str) -> Callable[[Event], None]:
    """Asks the person at the terminal, one request at a time, each on a background thread."""
    busy = threading.Lock()

    def ask(ev: Event) -> None:
        f = ev.fields
        # A relayed sub-agent's request is answered on its own turn, with the root's token.
        on = ev.turn_id if ev.path else turn_id
        prompt = (f"[{f['agent']}] " if ev.path and f.get("agent") else "") + str(f.get("prompt"))
        rid = str(f["request_id"])
        with busy, contextlib.suppress(EOFError, AgentqError):
            deadline = float(f.get("created_at") or time.time()) + int(f["timeout_ms"]) / 1000
            if f.get("kind") == "password":
                secs = max(0, int(deadline - time.time()))
                value: str | None = getpass.getpass(f"{prompt} password ({secs}s): ")
                client.answer(on, rid, token, "approve" if value else "deny", value)
                return
            # A question is asked until an answer fits its schema (the line is JSON, or
            # plain text; an empty line declines); an approval takes y or yes.
            question = f.get("kind") == "input"
            schema = f.get("answer_schema")
            hint = (f" {json.dumps(schema)}" if schema else "") if question else " [y/N]"
            while (line := countdown_input(prompt + hint, deadline)) is not None:
                value = line.strip() if question else None
                yes = bool(value) if question else line.strip().lower() in ("y", "yes")
                try:
                    client.answer(on, rid, token, "approve" if yes else "deny", value)
                    return
                except AnswerInvalid as exc:
                    print(exc.message, flush=True)
            print("\nno answer in time" + ("" if question else ": denied"), flush=True)

    return lambda ev: threading.Thread(target=ask, args=(ev,), daemon=True).start()


def countdown_input(prompt: str, deadline: float) -> str | None:
    """Read a line from the terminal, redrawing the seconds left; None when time runs out."""
    while True:
        left = deadline - time.time()
        if left <= 0:
            return None
        print(f"\r{prompt} ({int(left)}s left, silence denies): ", end="", flush=True)
        if select.select([sys.stdin], [], [], min(1.0, left))[0]:
            line = sys.stdin.readline()
            if not line:
                raise EOFError
            return line


def _say_admission(console: Console, handle: TurnHandle) -> None:
    """A line on how a turn of a conversation was admitted, when it does not run at once."""
    if handle.injected:
        # The message joins a running turn: follow that turn, whose next round holds it.
        console.print(
            f"[dim]joined running turn {handle.turn_id} (if it has no further round, the "
            f"message runs as turn {handle.message_turn_id})[/]"
        )
    elif handle.queued:
        console.print(
            f"[dim]queued behind turn {handle.behind} (position {handle.position}); it starts "
            "when the conversation's turns before it have ended[/]"
        )


def _follow(
    client: Client, turn_id: str, asker: Callable[[Event], None] | None, console: Console | None
) -> int:
    """The turn's live view and summary (no console: its events as JSON lines); its exit code."""
    code = EXIT_FAILED
    view = TurnView()
    live = None
    if console is not None:
        console.print(f"[dim]turn {turn_id}[/dim]")
        live = Live(view.render(), console=console, refresh_per_second=8, transient=False)
    asked = False
    heartbeat_s = None if live is None else 0.25
    with live or contextlib.nullcontext():
        # Every level of sub-agents: an approval they ask for is answered here.
        for ev in client.events(turn_id, heartbeat_s=heartbeat_s, depth=RELAY_DEPTH_MAX):
            if ev is not None:
                view.apply(ev)
                if live is None:
                    print(ev.model_dump_json(), flush=True)
                if ev.type == "interaction_requested" and asker is not None:
                    if live is not None:
                        live.stop()
                    asked = True
                    asker(ev)
                if ev.ends_turn:
                    code = exit_code_for(ev)
            if live is not None:
                live.update(view.render())
    if console is not None:
        if asked:
            # The live view stopped for a prompt: show how the turn ended below the answer.
            console.print(view.render())
        console.print(view.summary(), style="bold")
    return code


def cmd_run(client: Client, args: argparse.Namespace) -> int:
    """Every option of `agentq run` but these is a field of its turn's request."""
    turn = {k: v for k, v in vars(args).items() if k not in ("cmd", "prompt", "json", "headless")}
    return run(client, args.prompt, as_json=args.json, headless=args.headless, **turn)


def run(client: Client, prompt: str, *, as_json: bool, headless: bool, **turn: Any) -> int:
    """`turn`: the fields of its TurnRequest (conversation_id, agent, ...), idempotency_key."""
    console = Console(stderr=as_json)
    # The command holds Redis credentials: it may continue any conversation, as it could read it.
    handle = client._start_turn(prompt, headless=headless, operator=True, **turn)
    _say_admission(console, handle)

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second one stops waiting
        with contextlib.suppress(AgentqError):
            # An injected message's token is its own turn's, not the joined one's.
            client.abort(handle.turn_id, handle.token, operator=bool(handle.injected))

    previous = signal.signal(signal.SIGINT, on_sigint)
    # A fleet with no live worker for the turn: a line on stderr says what to start.
    watch = presence.Watch(
        handle.turn_id,
        lambda: presence.waiting_on(client._store, handle.turn_id),
        client._store.redis,
        lambda line: print(f"agentq: {line}", file=sys.stderr, flush=True),
    ).start()
    # Prompted only where someone can answer: a terminal, and not a headless run.
    tty = not headless and sys.stdin.isatty()
    asker = _answerer(client, handle.turn_id, handle.token) if tty else None
    try:
        return _follow(client, handle.turn_id, asker, None if as_json else console)
    except KeyboardInterrupt:
        return EXIT_ABORTED
    finally:
        watch.done.set()
        signal.signal(signal.SIGINT, previous)
