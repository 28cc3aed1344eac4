"""`agentq usage`: tokens and cost per model, agent or key over UTC days (docs/spend.md)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentq.api import Client


def add_parsers(sub: Any) -> None:
    u = sub.add_parser("usage", help="tokens and cost per model, agent or key")
    u.add_argument("--since", help="first UTC day, YYYY-MM-DD (default: 29 days ago)")
    u.add_argument("--until", help="last UTC day, YYYY-MM-DD (default: today)")
    u.add_argument("--key", help="only this key's usage")
    u.add_argument("--group-by", default="model", choices=("model", "agent", "key"))
    u.add_argument("--json", action="store_true", help="print JSON")


def cmd_usage(client: Client, args: argparse.Namespace) -> int:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    # The command holds Redis credentials: it reads every key's usage, as an admin.
    try:
        report = client.usage(
            since=args.since, until=args.until, key=args.key, group_by=args.group_by
        )
    except ValueError as exc:
        print(f"agentq usage: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report))
        return 0
    group = args.group_by
    table = Table(title=f"usage {report['since']} to {report['until']} (UTC)", box=box.SIMPLE_HEAD)
    for name in (group, "turns", "prompt", "cached", "completion", "total", "cost"):
        table.add_column(name, justify="left" if name == group else "right")
    counts = ("turns", "prompt_tokens", "cached_tokens", "completion_tokens", "total_tokens")
    for row in [*report["rows"], {group: "total", **report["totals"]}]:
        name = "(none)" if row[group] is None else str(row[group])
        cost = f"${row['cost_usd']:.4f}" if row["cost_usd"] else "-"
        table.add_row(name, *(str(row[c]) for c in counts), cost)
    Console().print(table)
    return 0
