"""A stdio MCP server that speaks raw JSON-RPC, to send what the SDK's servers never would.

    python -m tests.mcp_hostile_server listing   # a listing full of bad tools, and good ones
    python -m tests.mcp_hostile_server mute      # reads `initialize`, never answers
    python -m tests.mcp_hostile_server die       # exits while it is asked to `initialize`
    python -m tests.mcp_hostile_server garbage   # a listing the SDK refuses as a whole
    python -m tests.mcp_hostile_server endless   # a listing whose next page is itself

In `listing` mode, `churn` sends `notifications/tools/list_changed` while it runs (its next
listing adds `late-tool`) and answers after `seconds`; every other kept tool echoes its
arguments.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

OBJECT = {"type": "object", "properties": {"text": {"type": "string"}}}
BAD_TOOLS: list[dict[str, Any]] = [
    {"name": "", "inputSchema": OBJECT},
    {"name": "twice", "inputSchema": OBJECT},
    {"name": "twice", "inputSchema": OBJECT},
    {"name": "not-schema", "inputSchema": {"type": "object", "properties": {"a": {"type": 5}}}},
    {"name": "n" * 300, "inputSchema": OBJECT},
    {"name": "huge-schema", "inputSchema": {**OBJECT, "description": "s" * 100_000}},
]
GOOD_TOOLS: list[dict[str, Any]] = [
    {"name": "get-sum", "description": "Echo, with a hyphen.", "inputSchema": OBJECT},
    {"name": "dotted.name", "description": "Echo, with a dot.", "inputSchema": OBJECT},
    {"name": "wordy", "description": "w" * 10_000_000, "inputSchema": OBJECT},
    {
        "name": "churn",
        "description": "Say the tools changed, then answer after `seconds`.",
        "inputSchema": {"type": "object", "properties": {"seconds": {"type": "number"}}},
    },
]
LATE_TOOL = {"name": "late-tool", "description": "Listed after churn.", "inputSchema": OBJECT}

_write = threading.Lock()
_churned = threading.Event()


def send(message: dict[str, Any]) -> None:
    with _write:
        sys.stdout.write(json.dumps({"jsonrpc": "2.0", **message}) + "\n")
        sys.stdout.flush()


def answer(request: dict[str, Any], result: dict[str, Any]) -> None:
    send({"id": request["id"], "result": result})


def initialized(request: dict[str, Any]) -> None:
    version = request.get("params", {}).get("protocolVersion", "2025-06-18")
    answer(
        request,
        {
            "protocolVersion": version,
            "capabilities": {"tools": {"listChanged": True}},
            "serverInfo": {"name": "hostile", "version": "0"},
        },
    )


def tools_of(mode: str) -> dict[str, Any]:
    if mode == "garbage":
        # The SDK refuses the whole listing: MCP says an input schema is an object.
        return {"tools": [*GOOD_TOOLS, {"name": "a-string", "inputSchema": {"type": "string"}}]}
    if mode == "endless":
        return {"tools": [GOOD_TOOLS[0]], "nextCursor": "again"}
    late = [LATE_TOOL] if _churned.is_set() else []
    return {"tools": [*BAD_TOOLS, *GOOD_TOOLS, *late]}


def call(request: dict[str, Any]) -> None:
    params = request.get("params") or {}
    args = params.get("arguments") or {}
    if params.get("name") == "churn":
        _churned.set()
        send({"method": "notifications/tools/list_changed"})
        time.sleep(float(args.get("seconds", 1)))
    text = json.dumps({"tool": params.get("name"), "arguments": args})
    answer(request, {"content": [{"type": "text", "text": text}]})


def main(mode: str) -> None:
    for line in sys.stdin:
        try:
            request = json.loads(line)
        except ValueError:
            continue
        method = request.get("method")
        if method == "initialize":
            if mode == "mute":
                continue
            if mode == "die":
                sys.stderr.write("hostile: dying during initialize\n")
                sys.exit(4)
            initialized(request)
        elif method == "tools/list":
            answer(request, tools_of(mode))
        elif method == "tools/call":
            threading.Thread(target=call, args=(request,), daemon=True).start()
        elif method == "ping":
            answer(request, {})
        elif "id" in request and method is not None:
            send({"id": request["id"], "error": {"code": -32601, "message": "not here"}})


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "listing")
