"""`agentq retry ID` and `agentq fork ID --at-round N`: a new turn from a turn's history
(docs/retry.md). The command holds Redis credentials, so it may retry any turn, as
`agentq abort` may abort any."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from agentq.cli.ids import TURN_ID_HELP
from agentq.cli.options import positive

if TYPE_CHECKING:
    from agentq.api import Client, Turn


def add_parsers(sub: Any) -> None:
    r = sub.add_parser(
        "retry",
        help="retry a turn that ended error or aborted, paying once; or many: --status, --since",
    )
    one = r.add_mutually_exclusive_group(required=True)
    one.add_argument("turn_id", nargs="?", help=TURN_ID_HELP)
    one.add_argument(
        "--status",
        choices=("error", "aborted", "error,aborted"),
        help="retry every turn that ended so (each once), newest first",
    )
    r.add_argument(
        "--since",
        metavar="AGE",
        help="with --status: turns created in the last AGE (30m, 1h, 2d; default 1h)",
    )
    r.add_argument(
        "--limit", type=positive(int), default=100, help="with --status: at most this many"
    )
    r.add_argument(
        "--rate",
        dest="rate_per_s",
        type=positive(float),
        default=10.0,
        help="with --status: starts a second",
    )
    r.add_argument("--dry-run", action="store_true", help="with --status: say, start nothing")
    r.add_argument(
        "--rerun-lost",
        action="store_true",
        help="run again the calls that ran without a result, even of non-idempotent tools",
    )
    r.add_argument("--model", help="the model of its rounds from now on")
    _common(r)
    f = sub.add_parser("fork", help="a new turn from a turn's history before one round")
    f.add_argument("turn_id", help=TURN_ID_HELP)
    f.add_argument("--at-round", type=int, required=True, metavar="N", help="1-based round")
    f.add_argument("--message", help="replace the last user message")
    f.add_argument("--instructions", help="replace the agent's instructions")
    f.add_argument("--model", help="another model for its rounds")
    f.add_argument(
        "--tool-result",
        nargs=2,
        metavar=("CALL_ID", "CONTENT"),
        help="replace one settled call's result (what-if)",
    )
    _common(f)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--agent", help="run it as this agent instead")
    p.add_argument("--max-tokens", type=positive(int), help="its token budget")
    p.add_argument("--max-cost-usd", type=positive(float), help="its USD budget")
    p.add_argument("--json", action="store_true", help="print the new turn's handle as JSON")


BULK = ("status", "agent", "limit", "rate_per_s", "dry_run", "rerun_lost")
"""`agentq retry --status`'s options, each a BulkRetryRequest field."""
MISPLACED = {False: ("since", "dry_run"), True: ("model", "max_tokens", "max_cost_usd")}
"""The options a single retry (False) or a bulk one (True) would ignore: refused instead (a
dry run that retried the one turn would start what it said it would not)."""


def cmd_replay(client: Client, args: argparse.Namespace) -> int:
    bulk = args.cmd == "retry" and args.status is not None
    misplaced = MISPLACED[bulk] if args.cmd == "retry" else ()
    if wrong := [o for o in misplaced if getattr(args, o) not in (None, False)]:
        with_ = "a TURN_ID" if bulk else "--status"
        said = " and ".join("--" + o.replace("_", "-") for o in wrong)
        print(f"agentq retry: {said} go with {with_}", file=sys.stderr)
        return 2
    if bulk:
        return _bulk(client, args)
    given = {"agent": args.agent, "max_tokens": args.max_tokens, "max_cost_usd": args.max_cost_usd}
    if args.cmd == "retry":
        turn = client.retry(args.turn_id, rerun_lost=args.rerun_lost, model=args.model, **given)
    else:
        turn = client.fork(args.turn_id, args.at_round, edit=_edit(args), **given)
    return _said(turn, args)


def _bulk(client: Client, args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from agentq.errors import describe_invalid
    from agentq.orchestrator.replay import BulkOutcome
    from agentq.schedules.spec import to_seconds

    since_s = to_seconds(args.since or "1h")
    if since_s is None:
        print(f"agentq retry: --since {args.since!r}: a number with s, m, h or d", file=sys.stderr)
        return 2

    def said(o: BulkOutcome) -> None:
        if args.json:
            print(o.model_dump_json(exclude_none=True), flush=True)
        else:
            print(f"{o.source}  {o.outcome.replace('_', ' ')}  {o.turn_id or o.error or ''}")

    try:
        done = client.retry_many(since_s=since_s, said=said, **{f: getattr(args, f) for f in BULK})
    except ValidationError as exc:
        print(f"agentq retry: {describe_invalid(exc)}", file=sys.stderr)
        return 2
    if not args.json:
        started = sum(o.outcome == "started" for o in done)
        print(f"{len(done)} turn(s) matched, {started} retried now", file=sys.stderr)
    return 0


def _edit(args: argparse.Namespace) -> dict[str, Any] | None:
    edit = {n: getattr(args, n) for n in ("message", "instructions", "model", "tool_result")}
    if args.tool_result:
        edit["tool_result"] = dict(zip(("call_id", "content"), args.tool_result, strict=True))
    return {n: v for n, v in edit.items() if v is not None} or None


def _said(turn: Turn, args: argparse.Namespace) -> int:
    handle = turn.handle.model_dump(exclude_none=True)
    if args.json:
        print(json.dumps(handle), flush=True)
        return 0
    what = "retry" if args.cmd == "retry" else f"fork at round {args.at_round}"
    print(f"{turn.turn_id}  ({what} of {args.turn_id})")
    if handle.get("branched"):
        print(f"in the new conversation {handle['conversation_id']}")
    elif handle.get("conversation_id"):
        print(f"in its conversation {handle['conversation_id']}, replacing its exchange")
    print(f"follow it: agentq events {turn.turn_id}", file=sys.stderr)
    return 0
