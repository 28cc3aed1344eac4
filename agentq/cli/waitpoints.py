"""`agentq waitpoint complete ID --token T --json VALUE`: complete a tool's waitpoint, as
`POST /v1/waitpoints/{id}` does (docs/waitpoints.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentq.api import Client


def add_parsers(sub: Any) -> None:
    w = sub.add_parser("waitpoint", help="complete a tool's waitpoint")
    wsub = w.add_subparsers(dest="waitpoint_cmd", required=True)
    c = wsub.add_parser("complete", help="complete a waitpoint: its call settles with VALUE")
    c.add_argument("waitpoint_id", help="from its tool_waiting event (wp_...)")
    c.add_argument(
        "--token",
        default=os.environ.get("AGENTQ_WAITPOINT_TOKEN"),
        help="the waitpoint's token, from its callback URL (or AGENTQ_WAITPOINT_TOKEN)",
    )
    what = c.add_mutually_exclusive_group(required=True)
    what.add_argument("--json", dest="value", help="the result, as JSON (`-`: read stdin)")
    what.add_argument("--error", help="settle the call `error` with this message")


def cmd_waitpoint(client: Client, args: argparse.Namespace) -> int:
    """Exit 0 completed; 1 closed or unknown; 2 bad input."""
    if not args.token:
        print("agentq waitpoint complete: --token is required", file=sys.stderr)
        return 2
    if args.error is not None:
        value: Any = {"error": args.error}
    else:
        raw = sys.stdin.read() if args.value == "-" else args.value
        try:
            value = json.loads(raw)
        except ValueError as exc:
            print(f"agentq waitpoint complete: --json is not JSON ({exc})", file=sys.stderr)
            return 2
    result = client.complete_waitpoint(args.waitpoint_id, args.token, value)
    print(f"completed {args.waitpoint_id}: call {result.call_id} settled {result.status}")
    return 0
