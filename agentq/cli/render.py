"""Live rendering of a turn's events in a terminal: model text, a line per tool, a summary."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rich.console import Group, RenderableType
from rich.spinner import Spinner
from rich.table import Table
from rich.text import Text

from agentq.events import Event

STATUS_STYLE = {
    "queued": "dim",
    "running": "cyan",
    "finished": "green",
    "aborted": "yellow",
    "ok": "green",
    "error": "red",
    "timeout": "red",
    "lost": "magenta",
    "cancelled": "yellow",
    "denied": "yellow",
}
OUTCOMES = {"turn_finished": "finished", "turn_aborted": "aborted", "turn_error": "failed"}
"""A turn's end, as the summary line says it."""


def fmt_s(seconds: float) -> str:
    return f"{seconds:.1f}s" if seconds < 60 else f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


def progress_text(message: Any, pct: Any) -> str:
    """`searching 40%`: a tool's own progress report, as a line of the live view shows it."""
    parts = [str(message)] if message else []
    if isinstance(pct, (int, float)) and pct == pct and abs(pct) != float("inf"):
        parts.append(f"{max(0, min(100, round(pct)))}%")
    return " ".join(parts)


@dataclass
class ToolLine:
    tool: str
    started: float
    finished: float | None = None
    status: str | None = None
    detail: str = ""
    progress: str = ""
    """What the tool last reported with `ctx.progress(message, pct)`, while it runs."""
    spinner: Spinner = field(default_factory=lambda: Spinner("dots"))
    child_turn_id: str | None = None
    """For an agent call: the child turn, whose relayed events `sub` folds."""
    sub: TurnView | None = None


@dataclass
class TurnView:
    """Folds events into what the screen shows."""

    text: str = ""
    tools: dict[str, ToolLine] = field(default_factory=dict)
    pending: dict[str, dict[str, Any]] = field(default_factory=dict)
    outcome: str | None = None
    detail: str = ""
    started: float = field(default_factory=time.time)
    round_start: int = 0
    waiting: str = ""
    """Set while a model round waits for model capacity (`llm_queued`)."""

    def apply(self, ev: Event, depth: int = 0) -> None:
        """Fold one event in; a relayed one into the view of the agent call that started it."""
        if len(ev.path) > depth:
            child = ev.path[depth]
            line = next((t for t in self.tools.values() if t.child_turn_id == child), None)
            if line is not None:
                line.sub = line.sub or TurnView()
                line.sub.apply(ev, depth + 1)
            return
        f = ev.fields
        if ev.type == "llm_queued":
            # Its place and the estimated wait, each when known.
            bits = [f"position {f['position']}"] if isinstance(f.get("position"), int) else []
            if isinstance(f.get("wait_s"), (int, float)):
                bits.append(f"about {fmt_s(float(f['wait_s']))}")
            self.waiting = "waiting for model capacity" + (f" ({', '.join(bits)})" if bits else "")
        elif ev.type == "llm_started":
            self.waiting = ""
            if self.text and not self.text.endswith("\n"):
                self.text += "\n"
            self.round_start = len(self.text)
        elif ev.type == "llm_delta" and f.get("kind") == "text":
            self.text += str(f.get("text", ""))
        elif ev.type == "llm_retry" and f.get("restart"):
            # The round starts over on another stream worker: drop the dead attempt's text.
            self.text = self.text[: self.round_start]
        elif ev.type == "tool_started":
            line = ToolLine(str(f.get("tool")), ev.ts, child_turn_id=f.get("child_turn_id") or None)
            self.tools[str(f["call_id"])] = line
        elif ev.type == "tool_progress" and f.get("source") in ("tool", "agent"):
            self._line(ev).progress = progress_text(f.get("message"), f.get("pct"))
        elif ev.type == "tool_waiting":
            self._line(ev).progress = f"waiting on {f.get('waitpoint_id')} ({f.get('timeout_s')}s)"
        elif ev.type == "tool_finished":
            line = self._line(ev)
            line.finished = ev.ts
            line.status = str(f.get("status"))
            if f.get("duration_ms") is not None:
                line.started = ev.ts - int(f["duration_ms"]) / 1000
            line.detail = str(f.get("error") or f.get("reason") or "")
            if f.get("overran"):
                line.detail = (line.detail + " (over budget)").strip()
        elif ev.type == "interaction_requested":
            self.pending[str(f["request_id"])] = {**f, "ts": ev.ts, "path": ev.path}
        elif ev.type in ("interaction_answered", "interaction_timed_out"):
            self.pending.pop(str(f.get("request_id")), None)
        elif ev.type in OUTCOMES:
            self.waiting = ""
            self.outcome = ev.type
            self.detail = str(f.get("reason") or f.get("error") or "")
            if ev.type == "turn_finished" and f.get("content") and not self.text:
                self.text = str(f["content"])

    def _line(self, ev: Event) -> ToolLine:
        """The line of the call `ev` is about, made if its `tool_started` was missed."""
        cid = str(ev.fields["call_id"])
        return self.tools.setdefault(cid, ToolLine(str(ev.fields.get("tool")), ev.ts))

    def render(self) -> RenderableType:
        now = time.time()
        parts: list[RenderableType] = []
        if self.text:
            parts.append(Text(self.text))
        if self.waiting:
            parts.append(Text(self.waiting, style="yellow"))
        table = Table.grid(padding=(0, 1))
        self._rows(table, now, 0)
        if self.tools:
            parts.append(table)
        for rid, req in self.all_pending():
            left = max(0.0, req["ts"] + int(req.get("timeout_ms", 0)) / 1000 - now)
            who = f"[{req['agent']}] " if req.get("path") and req.get("agent") else ""
            parts.append(
                Text(f"? {who}{req.get('prompt')}  [{rid}] {left:.0f}s left", style="yellow")
            )
        return Group(*parts)

    def _rows(self, table: Table, now: float, level: int) -> None:
        """A row per tool; a sub-agent's tools nested under the agent call's row."""
        for line in self.tools.values():
            elapsed = (line.finished or now) - line.started
            # The web page's bands: green under 10 s, yellow to 30 s, red beyond.
            band = "green" if elapsed < 10 else "yellow" if elapsed < 30 else "red"
            head: RenderableType = (
                line.spinner
                if line.status is None
                else Text("●", style=STATUS_STYLE.get(line.status, "white"))
            )
            table.add_row(
                head,
                Text(("  " * level + "└ " if level else "") + line.tool, style="bold"),
                Text(fmt_s(elapsed), style=band),
                Text(line.status or "running", style=STATUS_STYLE.get(line.status or "", "cyan")),
                Text((line.detail if line.status else line.progress)[:80], style="dim"),
            )
            if line.sub is not None:
                line.sub._rows(table, now, level + 1)

    def all_pending(self) -> list[tuple[str, dict[str, Any]]]:
        """Open interaction requests, the sub-agents' too: each is answered from here."""
        out = list(self.pending.items())
        for line in self.tools.values():
            if line.sub is not None:
                out += line.sub.all_pending()
        return out

    def summary(self) -> str:
        counts = Counter(line.status or "running" for line in self.tools.values())
        tools = ", ".join(f"{n} {s}" for s, n in sorted(counts.items())) or "no tools"
        took = fmt_s(time.time() - self.started)
        outcome = OUTCOMES.get(self.outcome or "", "ended")
        extra = f" ({self.detail})" if self.detail and outcome != "finished" else ""
        return f"turn {outcome}{extra} in {took}: {tools}"
