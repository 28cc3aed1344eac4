"""Entry point of the `agentq` command.

A command imports what it needs when it runs: `agentq --version` and `agentq --help` load
neither Celery nor redis (tests/unit/test_startup.py), and `agentq abort` not the gateway."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from agentq.cli.ids import TURN_ID_HELP
from agentq.cli.options import has_option, positive, take_option
from agentq.constants import RELAY_DEPTH_MAX, VERSION

if TYPE_CHECKING:
    from agentq.api import Client
    from agentq.config import Settings

WORKER_KINDS: dict[str, tuple[str, str | None, str]] = {
    "turns": ("threads", "16", "agentq.turns"),
    # The threads claim each round and hand it to the event loop, which streams it.
    "llm": ("threads", "4", "agentq.llm"),
    "tools": ("prefork", None, "agentq.tools"),
    # The threads only hand calls to the event loop, which holds thousands of them.
    "io": ("threads", "8", "agentq.io"),
}
"""Each kind of worker: its default pool, concurrency and queue."""


def worker_argv(
    kind: str, opts: list[str], tool_queues: list[str], io_queues: list[str] | None = None
) -> list[str]:
    """The celery worker command line for one kind of agentq worker."""
    from agentq.errors import ConfigError
    from agentq.fleet.roles import pool_problem

    default_pool, concurrency, queue = WORKER_KINDS[kind]
    pool = take_option(opts, "-P", "--pool")[0]
    if pool and (problem := pool_problem(kind, pool)):
        raise ConfigError("--pool", problem)
    queues = {"tools": tool_queues, "io": io_queues or [queue]}.get(kind, [queue])
    argv = ["worker"]
    for names, value in (
        (("-Q", "--queues"), ",".join(queues)),
        (("-P", "--pool"), default_pool),
        (("-c", "--concurrency"), concurrency),
        (("-n", "--hostname"), f"{kind}@%h"),
        (("-l", "--loglevel"), "INFO"),
    ):
        if value and not has_option(opts, *names):
            argv += [names[0], value]
    # Mingle (a second's wait at every start and reconnect) and gossip serve nothing agentq
    # uses: a cancelled turn's call is refused at its start in Redis, and liveness is
    # agentq's own heartbeat. Mingle at a reconnect also took a broker connection from the
    # publishers' pool without waiting: kombu's LimitExceeded stopped a stream worker.
    argv += [flag for flag in ("--without-mingle", "--without-gossip") if flag not in opts]
    return [*argv, *opts]


def require_reachable(settings: Settings, *, broker: bool) -> None:
    """Fail at start, naming the setting, when Redis (or the broker) does not answer:
    Celery would retry an unreachable broker for many minutes, hiding a wrong URL."""
    import time

    from agentq.config import redact
    from agentq.errors import ConfigError
    from agentq.fleet.connections import probe, probe_cluster

    master = settings.redis_sentinel_master
    checks: list[tuple[str, str, Callable[[str], str | None]]] = [
        ("AGENTQ_REDIS_URL", settings.redis_url, lambda url: probe(url, master))
    ]
    if broker and settings.broker != settings.redis_url:
        checks.insert(0, ("AGENTQ_BROKER_URL", settings.broker, lambda url: probe(url, master)))
    if settings.redis_cluster_nodes:
        checks.append(("AGENTQ_REDIS_CLUSTER_NODES", settings.redis_cluster_nodes, probe_cluster))
    for setting, url, check in checks:
        for attempt in range(3):
            if (problem := check(url)) is None:
                break
            if attempt == 2:
                raise ConfigError(setting, f"cannot reach {redact(url)}: {problem}")
            time.sleep(1.0)


def cmd_worker(kind: str, opts: list[str]) -> int:
    from agentq.cli.supervise import SUPERVISED_ENV, default_processes, supervise, take_processes
    from agentq.config import get_settings
    from agentq.errors import MissingExtra

    settings = get_settings()
    if settings.mcp_servers:  # before a supervisor starts children that could not load them
        MissingExtra.check("mcp", "AGENTQ_MCP_SERVERS")
    processes = 1
    if kind in ("llm", "io"):
        setting = settings.llm_processes if kind == "llm" else settings.io_processes
        opts, asked = take_processes(opts, setting)
        processes = asked or default_processes(kind)
    if not has_option(opts, "-h", "--help"):
        require_reachable(settings, broker=True)
        # An I/O worker is always supervised: it recycles itself when a tool blocks its loop.
        if os.environ.get(SUPERVISED_ENV) != "1" and (processes > 1 or kind == "io"):
            return supervise(kind, opts, processes)
    from agentq.worker import app, io_queues, tool_queues

    argv = worker_argv(kind, opts, tool_queues, io_queues)
    app.worker_main(argv=argv)
    return 0


def flower_argv(settings: Settings, opts: list[str], environ: Mapping[str, str]) -> list[str]:
    """Flower's command line, bound to loopback by default: options given win, then Flower's
    own ``FLOWER_*`` variables (``FLOWER_ADDRESS=0.0.0.0`` in a container), then agentq's."""
    from agentq.errors import ConfigError

    argv = ["flower"]
    if not has_option(opts, "--port") and (
        "AGENTQ_FLOWER_PORT" in environ or "FLOWER_PORT" not in environ
    ):
        argv.append(f"--port={settings.flower_port}")
    # An empty --address is Flower's default: every address.
    address = take_option(opts, "--address")[0]
    if address is None:
        address = environ.get("FLOWER_ADDRESS") or "127.0.0.1"
        argv.append(f"--address={address}")
    if settings.flower_basic_auth and not has_option(opts, "--basic_auth", "--basic-auth"):
        argv.append(f"--basic_auth={settings.flower_basic_auth.get_secret_value()}")
    authenticated = bool(
        settings.flower_basic_auth
        or environ.get("FLOWER_BASIC_AUTH")
        or environ.get("FLOWER_AUTH")
        or has_option(opts, "--basic_auth", "--basic-auth", "--auth")
    )
    # Flower can revoke and kill tasks: it never listens beyond this machine unguarded.
    if address not in ("127.0.0.1", "localhost", "::1") and not authenticated:
        raise ConfigError(
            "AGENTQ_FLOWER_BASIC_AUTH",
            f"Flower would listen on {address or 'every address'} without authentication; "
            "set it to user:password (or bind Flower to 127.0.0.1)",
        )
    return argv + opts


CLIENT_COMMANDS = {
    "run": "run.cmd_run",
    "turns": "show.cmd_turns",
    "show": "show.cmd_show",
    "abort": "main._cmd_abort",
    "answer": "main._cmd_answer",
    "events": "main._cmd_events",
    "retry": "replay.cmd_replay",
    "fork": "replay.cmd_replay",
    "conversations": "conversations.cmd_conversations",
    "usage": "usage.cmd_usage",
    "waitpoint": "waitpoints.cmd_waitpoint",
    "schedule": "schedule.cmd_schedule",
}
"""The commands that run on a Client: their function in agentq.cli, imported to run."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agentq", description="LLM agent turns on a Celery fleet.")
    p.add_argument("--version", action="version", version=f"agentq {VERSION}")
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_run(sub)
    _add_turn_commands(sub)
    _add_process_commands(sub)
    for module in ("conversations", "replay", "usage", "waitpoints", "schedule"):
        importlib.import_module(f"agentq.cli.{module}").add_parsers(sub)
    return p


def _add_run(sub: Any) -> None:
    r = sub.add_parser("run", help="run one turn and show it live")
    r.add_argument("prompt")
    r.add_argument("--json", action="store_true", help="print each event as a JSON line")
    r.add_argument(
        "--headless",
        action="store_true",
        help="no interactor: interactions use their declared default or fail (exit 4)",
    )
    r.add_argument("--conversation", dest="conversation_id", help="continue this conversation id")
    r.add_argument(
        "--multitask",
        choices=("enqueue", "reject", "interrupt", "rollback", "inject"),
        help="with --conversation, when another of its turns runs: wait for it (enqueue, "
        "the default), refuse (reject), abort it (interrupt), drop it (rollback), or join it "
        "(inject)",
    )
    r.add_argument(
        "--idempotency-key",
        metavar="KEY",
        help="run again with the same KEY within 24 h: follow the first run's turn instead",
    )
    r.add_argument("--agent", help="run the turn as this agent (unknown: exit 2)")
    r.add_argument(
        "--webhook", dest="webhook_url", metavar="URL", help="POST the turn's end to URL (signed)"
    )
    r.add_argument(
        "--max-tokens",
        type=positive(int),
        metavar="N",
        help="the turn's token budget, its sub-agents' included (exit 1 past it)",
    )
    r.add_argument(
        "--max-cost-usd",
        type=positive(float),
        metavar="USD",
        help="the turn's budget in USD (its model needs a price in AGENTQ_LLM_PRICES)",
    )


def _add_turn_commands(sub: Any) -> None:
    a = sub.add_parser("abort", help="abort a running turn")
    a.add_argument("turn_id", help=TURN_ID_HELP)
    t = sub.add_parser("turns", help="list recent and running turns, newest first")
    t.add_argument("--status", help="e.g. running, finished, active, ended")
    t.add_argument("--agent", help="only turns of this agent")
    t.add_argument("--limit", type=int, default=50)
    t.add_argument("--json", action="store_true", help="one JSON document, for machines")
    t.add_argument(
        "--watch",
        nargs="?",
        type=positive(float),
        const=1.0,
        metavar="SECONDS",
        help="redraw every SECONDS (1 by default) until Ctrl-C",
    )
    sh = sub.add_parser("show", help="a turn's timeline: model rounds and calls")
    sh.add_argument("turn_id", help=TURN_ID_HELP)
    sh.add_argument("--json", action="store_true", help="the timeline as JSON")
    an = sub.add_parser("answer", help="approve or deny a turn's pending interaction")
    an.add_argument("turn_id", help=TURN_ID_HELP)
    an.add_argument("request_id", help="from its interaction_requested event, or `agentq show`")
    an.add_argument("decision", choices=["approve", "deny"])
    an.add_argument(
        "--value",
        help="the answer's value; `-` reads it from the terminal without echo (a password)",
    )
    token = "the turn's token (or AGENTQ_TURN_TOKEN)"
    for parser, help_ in ((a, token), (an, f"{token}; without it, as an operator")):
        parser.add_argument("--token", default=os.environ.get("AGENTQ_TURN_TOKEN"), help=help_)
    e = sub.add_parser("events", help="follow a turn's events, from the start, then live")
    e.add_argument("turn_id", help=TURN_ID_HELP)
    e.add_argument(
        "--after", default="0-0", help="resume after this stream id (or an event's cursor)"
    )
    e.add_argument(
        "--depth",
        type=int,
        default=1,
        choices=range(RELAY_DEPTH_MAX + 1),
        metavar="N",
        help="levels of sub-agents whose events are relayed, each with `path` (default 1)",
    )


def _add_process_commands(sub: Any) -> None:
    # No -h of their own: `--help` shows Celery's worker options, or Flower's.
    w = sub.add_parser("worker", help="start a worker: turns, llm, tools or io", add_help=False)
    w.add_argument("kind", choices=sorted(WORKER_KINDS))
    sub.add_parser("flower", help="Flower, the Celery monitor, on agentq's app", add_help=False)
    sv = sub.add_parser("serve", help="the HTTP gateway and web page")
    sv.add_argument("--host")
    sv.add_argument("--port", type=int)
    sv.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help="serve beyond loopback with no key (AGENTQ_API_KEYS unset): anyone who "
        "reaches the port can read and start turns",
    )
    d = sub.add_parser("dev", help="everything on one machine, Redis included")
    for flag, help_ in (
        ("--no-flower", "don't start Flower"),
        ("--no-gateway", "don't start the gateway (HTTP API and web page)"),
        ("--no-beat", "don't start a beat (schedules)"),
        ("--demo", "run one demo turn once started, print its events, keep running"),
        ("--once", "start, run one demo turn live, stop everything; exit with its code"),
    ):
        d.add_argument(flag, action="store_true", help=help_)
    d.add_argument("--prompt", help="the prompt of the demo turn")
    d.add_argument("--agent", help="the agent of the demo turn (e.g. lead)")


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    from agentq.cli.helptext import WORKER_HELP

    if args_in[:1] == ["worker"] and args_in[1:2] in ([], ["-h"], ["--help"]):
        # `agentq worker` alone is a usage error; `agentq worker --help` is not.
        print(WORKER_HELP, end="", file=sys.stdout if len(args_in) > 1 else sys.stderr)
        return 0 if len(args_in) > 1 else 2
    parser = build_parser()
    args, rest = parser.parse_known_args(_glued(args_in))
    if rest and args.cmd not in ("worker", "flower"):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    from agentq import errors as e

    try:
        return _dispatch(args, rest)
    except e.ConfigError as exc:
        print(f"agentq: configuration error: {exc}", file=sys.stderr)
        return 2
    except e.AgentqError as exc:
        print(f"agentq: {exc}", file=sys.stderr)
        # The caller's words are wrong, as in argparse's errors: exit 2 as it does.
        usage = (
            e.UnknownAgent,
            e.MissingExtra,
            e.ScheduleInvalid,
            e.AmbiguousTurnId,
            e.ForkInvalid,
        )
        return 2 if isinstance(exc, usage) else 1


def _glued(argv: list[str]) -> list[str]:
    """`--token -x` as `--token=-x`: argparse reads a word beginning with "-" as an option."""
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--":
            out += [word, *words]
            break
        out.append(word)
        if word == "--token":
            value = next(words, None)
            if value is not None:
                out[-1] = f"{word}={value}"
    return out


def _dispatch(args: argparse.Namespace, rest: list[str]) -> int:
    from agentq.config import get_settings

    get_settings()  # bad configuration fails here, naming the setting
    if args.cmd not in CLIENT_COMMANDS:
        return _process_command(args, rest)
    from agentq.api import Client

    require_reachable(get_settings(), broker=args.cmd == "run")
    client = Client()
    if getattr(args, "turn_id", None) is not None:
        from agentq.cli.ids import resolve_turn_id

        args.turn_id = resolve_turn_id(client, args.turn_id)
    module, _, name = CLIENT_COMMANDS[args.cmd].rpartition(".")
    cmd: Callable[[Client, argparse.Namespace], int]
    cmd = getattr(importlib.import_module(f"agentq.cli.{module}"), name)
    return cmd(client, args)


def _process_command(args: argparse.Namespace, rest: list[str]) -> int:
    from agentq.config import get_settings
    from agentq.errors import MissingExtra

    if args.cmd == "worker":
        return cmd_worker(args.kind, rest)
    if args.cmd == "flower":
        MissingExtra.check("flower", "agentq flower")
        if has_option(rest, "-h", "--help"):
            from agentq.cli.helptext import flower_help

            print(flower_help(), end="")
            return 0
        from agentq.worker import app

        app.start(argv=flower_argv(get_settings(), rest, os.environ))
        return 0
    if args.cmd == "serve":
        MissingExtra.check("gateway", "agentq serve")
        from agentq.gateway.server import serve

        return serve(host=args.host, port=args.port, insecure_no_auth=args.insecure_no_auth)
    if args.cmd == "dev":
        MissingExtra.check("local", "agentq dev")
        if not args.no_gateway:
            MissingExtra.check("gateway", "agentq dev (or --no-gateway)")
        if not args.no_flower:
            MissingExtra.check("flower", "agentq dev (or --no-flower)")
        from agentq.cli.dev import main as dev_main

        return dev_main(args)
    require_reachable(get_settings(), broker=True)
    from agentq.fleet.runtime import get_app
    from agentq.schedules.beat import run_beat

    run_beat(get_app(), get_settings())
    return 0


def _cmd_events(client: Client, args: argparse.Namespace) -> int:
    for ev in client.events(args.turn_id, after_id=args.after, depth=args.depth):
        if ev is not None:
            print(ev.model_dump_json(), flush=True)
    return 0


def _cmd_abort(client: Client, args: argparse.Namespace) -> int:
    # Durable once written; said once a turn worker's step ended the turn.
    client.abort(args.turn_id, args.token, operator=args.token is None)
    try:
        client.wait(args.turn_id, timeout_s=10.0)
        print(f"aborted {args.turn_id}")
    except TimeoutError as exc:
        print(
            f"agentq: abort of {args.turn_id} is recorded; the turn has not ended yet ({exc})",
            file=sys.stderr,
        )
    return 0


def _cmd_answer(client: Client, args: argparse.Namespace) -> int:
    value = args.value
    if value == "-":
        import getpass

        value = getpass.getpass("value: ")
    client.answer(
        args.turn_id, args.request_id, args.token, args.decision, value, operator=args.token is None
    )
    done = {"approve": "approved", "deny": "denied"}[args.decision]
    print(f"{done} {args.request_id} of {args.turn_id}")
    return 0
