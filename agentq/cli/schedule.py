"""`agentq schedule add|list|remove` and `agentq beat`."""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentq.api import Client


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sub.add_parser("beat", help="fire the schedules (Celery beat; one of many beats fires)")
    s = sub.add_parser("schedule", help="scheduled agent runs: add, list, remove")
    ss = s.add_subparsers(dest="schedule_cmd", required=True)
    a = ss.add_parser("add", help="run PROMPT as a turn every period or at cron times (UTC)")
    a.add_argument("name")
    when = a.add_mutually_exclusive_group(required=True)
    when.add_argument("--every", help="a period: 30s, 5m, 2h, 1d")
    when.add_argument("--cron", help='five fields, in UTC: "0 7 * * *"')
    a.add_argument("--agent", help="run the turns as this agent")
    a.add_argument(
        "--webhook", dest="webhook_url", metavar="URL", help="POST each turn's end to this URL"
    )
    a.add_argument(
        "--overlap",
        action="store_true",
        help="start a tick's turn even while the previous one still runs (default: skip it)",
    )
    a.add_argument("prompt")
    ls = ss.add_parser("list", help="every schedule, its last turn and its next tick")
    ls.add_argument("--json", action="store_true", help="one JSON document, for machines")
    rm = ss.add_parser("remove", help="remove a schedule")
    rm.add_argument("name")


def cmd_schedule(client: Client, args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from agentq.cli.ids import short_id
    from agentq.schedules.spec import build_spec
    from agentq.schedules.store import Schedules

    schedules = Schedules(client.app, client._store.redis, client.settings)
    if args.schedule_cmd == "add":
        # Every option is a field of the spec as it is given, as the gateway's body is.
        fields = ("name", "every", "cron", "prompt", "agent", "webhook_url", "overlap")
        spec = build_spec({f: getattr(args, f) for f in fields})
        if spec.webhook_url:
            from agentq.webhooks.target import check_for_turn

            check_for_turn(spec.webhook_url, client.settings)
        schedules.add(spec)
        print(f"added {spec.name}: {spec.when}")
        return 0
    if args.schedule_cmd == "remove":
        schedules.remove(args.name)
        print(f"removed {args.name}")
        return 0
    rows = schedules.list()
    if args.json:
        print(json.dumps({"schedules": rows}))
        return 0
    table = Table("name", "when", "agent", "fired", "skipped", "last turn", "next in")
    for r in rows:
        next_in = "" if r["next_at"] is None else f"{max(0.0, r['next_at'] - time.time()):.0f}s"
        last = short_id(r["last_turn_id"]) if r["last_turn_id"] else ""
        cells = (r["name"], r["when"], r["agent"] or "", r["fired"], r["skipped"], last, next_in)
        table.add_row(*map(str, cells))
    Console().print(table)
    return 0
