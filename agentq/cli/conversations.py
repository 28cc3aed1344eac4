"""`agentq conversations`: list conversations, show one, delete one (its turns aborted)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from agentq.cli.ids import clock, short_id

if TYPE_CHECKING:
    from agentq.api import Client

CONVERSATION_ID_HELP = "a conversation id (as given with --conversation)"


def add_parsers(sub: Any) -> None:
    c = sub.add_parser(
        "conversations", help="list conversations, show one, or delete one and its turns"
    )
    c.add_argument("action", nargs="?", choices=("list", "show", "delete"), default="list")
    c.add_argument("conversation_id", nargs="?", help=CONVERSATION_ID_HELP)
    c.add_argument("--limit", type=int, default=20, help="at most this many (list)")
    c.add_argument("--json", action="store_true", help="print JSON")


def cmd_conversations(client: Client, args: argparse.Namespace) -> int:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if args.action != "list" and not args.conversation_id:
        print(f"agentq conversations {args.action}: needs a conversation id", file=sys.stderr)
        return 2
    # The command holds Redis credentials: it may read any conversation, as the console.
    if args.action == "delete":
        aborted = client.delete_conversation(args.conversation_id, operator=True)
        data: Any = {"conversation_id": args.conversation_id, "aborted_turns": aborted}
    elif args.action == "show":
        data = client.conversation(args.conversation_id, operator=True)
    else:
        data = client.conversations(operator=True, limit=max(1, min(args.limit, 200)))
    if args.json:
        print(json.dumps(data))
    elif args.action == "delete":
        also = f" (aborted {len(aborted)} turns)" if aborted else ""
        console.print(f"deleted {args.conversation_id}{also}")
    elif args.action == "show":
        running = data["running_turn_id"]
        console.print(
            f"[bold]{data['conversation_id']}[/]  {data['status']}"
            + (f", running {short_id(running)}" if running else "")
            + (f", {len(data['queued'])} queued" if data["queued"] else "")
            + f", updated {clock(data['updated_at'])}"
        )
        for m in data["messages"]:
            role = m.get("role", "?")
            text = m.get("content") or ""
            if m.get("tool_calls"):
                text = ", ".join(c["function"]["name"] for c in m["tool_calls"])
                role += " (calls)"
            console.print(f"  [dim]{role:>16}[/]  {str(text)[:200]}", highlight=False)
    else:
        table = Table(box=box.SIMPLE_HEAD)
        for col in ("conversation", "status", "running", "queued", "messages", "updated"):
            table.add_column(col, no_wrap=col != "conversation", overflow="fold")
        for r in data:
            running = short_id(r["running_turn_id"]) if r["running_turn_id"] else "-"
            row = (r["conversation_id"], r["status"], running, str(r["queued"]), str(r["messages"]))
            table.add_row(*row, clock(r["updated_at"]))
        console.print(table)
    return 0
