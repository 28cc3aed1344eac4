"""`agentq turns` (the console's list in a terminal) and `agentq show TURN_ID` (a timeline)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from agentq.api import Client
from agentq.cli.ids import clock, short_id
from agentq.cli.render import STATUS_STYLE, fmt_s
from agentq.state.listing import TurnLister, TurnQuery

WIDE_COLUMNS = 100
"""A terminal at least this wide shows `agentq turns`' `ended` column too."""


def turns_table(rows: list[dict[str, Any]], width: int | None = None) -> Table:
    """Short turn ids, no vertical rules; below WIDE_COLUMNS columns, no `ended` column (it
    is `started` plus `took`), so a row fits 80 columns with its calls unclipped."""
    wide = width is None or width >= WIDE_COLUMNS
    table = Table(
        title="turns, newest first",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    columns = ["turn", "status", "agent", "started", "ended", "took", "calls", "pending"]
    if not wide:
        columns.remove("ended")
    for col in columns:
        table.add_column(col, no_wrap=col != "calls", min_width=12 if col == "calls" else None)
    for t in rows:
        pending = len(t["pending_interactions"])
        calls = Text(" ").join(
            Text(f"{s} {n}", style=STATUS_STYLE.get(s, "cyan")) for s, n in t["calls"].items()
        )
        cells: dict[str, RenderableType] = {
            "turn": short_id(t["turn_id"]),
            "status": Text(str(t["status"]), style=STATUS_STYLE.get(str(t["status"]), "")),
            "agent": t.get("agent") or "-",
            "started": clock(t.get("started_at"), "%H:%M:%S"),
            "ended": clock(t.get("ended_at"), "%H:%M:%S"),
            "took": "-" if t.get("duration_s") is None else fmt_s(float(t["duration_s"])),
            "calls": calls or Text("-", style="dim"),
            "pending": Text(str(pending), style="bold yellow" if pending else "dim"),
        }
        table.add_row(*(cells[c] for c in columns))
    return table


def cmd_turns(client: Client, args: argparse.Namespace) -> int:
    """Print the list once (a table or JSON), or redraw it every `--watch` seconds until Ctrl-C."""
    lister = TurnLister(client._store.redis)
    try:
        query = TurnQuery.parse(status=args.status, agent=args.agent, limit=args.limit)
    except ValueError as exc:
        print(f"agentq turns: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(vars(lister.page(query))), flush=True)
        return 0
    console = Console()
    if args.watch is None:
        console.print(turns_table(lister.page(query).turns, console.width))
        return 0
    try:
        with Live(console=console, auto_refresh=False) as live:
            while True:
                live.update(turns_table(lister.page(query).turns, console.width), refresh=True)
                time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


def bar(
    start: float | None, end: float | None, t0: float, span: float, width: int
) -> tuple[int, int]:
    """The (offset, length) in cells of a bar from `start` to `end` on a `span`-second axis."""
    if start is None:
        return 0, 0
    a = max(0, min(int((start - t0) / span * width), width - 1))
    b = int(((start if end is None else end) - t0) / span * width)
    return a, max(1, min(b, width) - a)


def timeline_view(view: dict[str, Any], width: int = 60) -> RenderableType:
    turn = view["turn"]
    t0 = float(view.get("started_at") or view.get("created_at") or view["now"])
    end = float(view.get("ended_at") or view["now"])
    span = max(end - t0, 0.001)
    head = Text()
    head.append(f"turn {view['turn_id']}  ", style="bold")
    head.append(str(turn["status"]), style=STATUS_STYLE.get(str(turn["status"]), ""))
    head.append(f"  agent {turn.get('agent') or '-'}  {fmt_s(span)}")
    table = Table(box=None, pad_edge=False)
    for col in ("what", "status", f"0 … {fmt_s(span)}", "took", "limits b/s/H", "worker"):
        table.add_column(col, justify="right" if col == "took" else "left", no_wrap=True)
    for r in view["rounds"]:
        off, n = bar(r["started_at"], r["finished_at"], t0, span, width)
        line = Text(" " * off) + Text("█" * n, style="blue")
        took = "-" if r["finished_at"] is None else fmt_s(r["finished_at"] - r["started_at"])
        table.add_row(f"model round {r['round']}", r["status"], line, took, "", "")
    for c in view["calls"]:
        style = STATUS_STYLE.get(c["status"], "cyan")
        stop = c["finished_at"] if c["finished_at"] is not None else view["now"]
        off, n = bar(c["started_at"], stop, t0, span, width)
        cells = [" "] * off + ["█"] * n + [" "] * (width - off - n)
        limits = []
        for key, mark in (("budget_s", "b"), ("soft_timeout_s", "s"), ("timeout_s", "H")):
            v = c.get(key)
            limits.append("-" if v is None else f"{v:g}")
            if c["started_at"] is not None and isinstance(v, (int, float)) and v > 0:
                pos = int((c["started_at"] + v - t0) / span * width)
                if 0 <= pos < width:
                    cells[pos] = mark
        line = Text("".join(cells), style=style)
        took = "-" if c["duration_ms"] is None else fmt_s(c["duration_ms"] / 1000)
        what = f"{c['tool']} r{c['round'] or '?'}"
        status = Text(c["status"] + (" overran" if c["overran"] else ""), style=style)
        worker = f"{c['worker'] or '-'} pid {c['pid'] or '-'}"
        table.add_row(what, status, line, took, "/".join(limits), worker)
    legend = Text("b budget  s soft limit  H hard limit", style="dim")
    return Group(head, table, legend)


def spend_line(spend: dict[str, Any]) -> str:
    """A turn's spend, its sub-agents' included, and its limits, on one line."""
    line = (
        f"spend: {spend['total_tokens']} tokens ({spend['prompt_tokens']} prompt, "
        f"{spend['cached_tokens']} cached, {spend['completion_tokens']} completion)"
    )
    if spend.get("cost_usd"):
        line += f", ${spend['cost_usd']:.4f}"
    limits = []
    if "max_tokens" in spend:
        limits.append(f"{spend['max_tokens']} tokens")
    if "max_cost_usd" in spend:
        limits.append(f"${spend['max_cost_usd']:g}")
    return line + (f"; budget {', '.join(limits)}" if limits else "")


def cmd_show(client: Client, args: argparse.Namespace) -> int:
    turn_id = args.turn_id
    view = client._timeline(turn_id, client.check_token(turn_id, None, operator=True))
    if args.json:
        print(json.dumps(view), flush=True)
        return 0
    console = Console()

    def say(text: str, style: str) -> None:
        # Unwrapped: a command or id in it can be copied whole.
        console.print(Text(text, style=style), soft_wrap=True)

    console.print(timeline_view(view))
    source = view["source"]
    if source:
        line = f"{source['kind']} of {source['turn_id']}, from round {source['from_round']}"
        say(line + f"  (agentq show {source['turn_id']})", "cyan")
    say(spend_line(view["spend"]), "dim")
    hook = view["webhook"]
    if hook:
        line = f"webhook {hook['id']} -> {hook['url']}: {hook['status']}"
        style = "green" if hook["status"] == "delivered" else "yellow"
        say(f"{line}, {hook['attempts']} attempt(s)", style)
        for a in hook["tries"]:
            say(f"  #{a['n']} {a['error'] or a['status_code']} in {a['duration_ms']} ms", "dim")
    for w in view["waitpoints"]:
        left = f"{w['left_s']:.0f}s of {w['timeout_s']:g}s left"
        say(f"waiting: {w['tool']} on {w['id']}, open {w['age_s']:.0f}s, {left}", "yellow")
    for p in view["turn"].get("pending_interactions", []):
        left_s = max(0.0, float(p["expires_at"]) - time.time())
        say(f"? {p.get('prompt') or p.get('kind')}  ({left_s:.0f}s left)", "yellow")
        how = "approve --value ANSWER|deny" if p.get("kind") == "input" else "approve|deny"
        say(f"  agentq answer {turn_id} {p.get('request_id')} {how}", "dim")
    return 0
