"""An MCP server for tests and the demo fleet, made with the `mcp` SDK.

    python -m agentq.testing.mcp_server                      # stdio
    python -m agentq.testing.mcp_server --http 0 --token T   # Streamable HTTP on 127.0.0.1

Its tools show what agentq does with a server's calls: `slow` reports progress, `stubborn`
blocks its whole server (it cannot hear a cancel, nor answer a ping), `crash` kills the
server, `fail` answers `isError`, `add` answers `structuredContent`, `grow` adds a tool and
sends `notifications/tools/list_changed`, `whoami` tells the server's pid and environment.
With `--pid-file` the server writes its pid there at start, with `--log` it notes there when
`slow` starts and is cancelled, and with `--http` it prints `listening on URL` once it
listens.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations
from pydantic import BaseModel


class Sum(BaseModel):
    total: float


class Size(BaseModel):
    size: str


def build(name: str = "agentq-test", log: str | None = None) -> MCPServer:
    server = MCPServer(name, log_level="WARNING")

    def note(line: str) -> None:
        if log:
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {line}\n")

    @server.tool(description="Repeat the text.")
    def echo(text: str) -> str:
        return text

    @server.tool(description="Add two numbers.", annotations=ToolAnnotations(read_only_hint=True))
    def add(a: float, b: float) -> Sum:
        return Sum(total=a + b)

    @server.tool(description="Wait `seconds` in `steps` steps, reporting progress after each.")
    async def slow(seconds: float, ctx: Context, steps: int = 4) -> str:
        note("slow started")
        try:
            for i in range(steps):
                await asyncio.sleep(seconds / steps)
                await ctx.report_progress(i + 1, steps, f"step {i + 1} of {steps}")
        except BaseException:
            note("slow cancelled")
            raise
        return f"waited {seconds:g} s"

    @server.tool(
        description="Block the whole server for `seconds`: it hears no cancel and no ping.",
        annotations=ToolAnnotations(destructive_hint=True),
    )
    async def stubborn(seconds: float) -> str:
        time.sleep(seconds)
        return "done"

    @server.tool(description="Ask the user which size to ship (MCP elicitation), and say it.")
    async def pick_size(ctx: Context) -> str:
        got = await ctx.elicit("Which size should ship?", Size)
        return f"ship {got.data.size}" if got.action == "accept" else f"no size: {got.action}"

    @server.tool(description="Exit the server process at once.")
    def crash() -> str:
        os._exit(3)

    @server.tool(description="Fail with a message.")
    def fail(message: str) -> str:
        raise ToolError(message)

    @server.tool(description="Add a tool named `name` (it answers its own name), and say so.")
    async def grow(name: str, ctx: Context) -> str:
        def added() -> str:
            return name

        server.add_tool(added, name=name, description=f"Added by grow: answers {name!r}.")
        await ctx.request_context.session.send_tool_list_changed()
        return f"added {name}"

    @server.tool(description="This server's pid and environment variable names.")
    def whoami() -> dict[str, Any]:
        return {"pid": os.getpid(), "env": sorted(os.environ)}

    return server


def _http(server: MCPServer, port: int, token: str | None) -> None:
    import uvicorn
    from starlette.types import ASGIApp, Receive, Scope, Send

    app = server.streamable_http_app()

    class Bearer:
        def __init__(self, inner: ASGIApp) -> None:
            self.inner = inner

        async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and token is not None:
                headers = dict(scope.get("headers") or [])
                if headers.get(b"authorization", b"") != f"Bearer {token}".encode():
                    await send({"type": "http.response.start", "status": 401, "headers": []})
                    await send({"type": "http.response.body", "body": b"unauthorized"})
                    return
            await self.inner(scope, receive, send)

    config = uvicorn.Config(Bearer(app), host="127.0.0.1", port=port, log_level="warning")
    userver = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(userver.serve())
        while not userver.started:
            await asyncio.sleep(0.02)
        bound = userver.servers[0].sockets[0].getsockname()[1]
        print(f"listening on http://127.0.0.1:{bound}/mcp", flush=True)
        await task

    asyncio.run(serve())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--http", type=int, default=None, metavar="PORT")
    parser.add_argument("--token", default=None, help="the Bearer token --http requires")
    parser.add_argument("--pid-file", default=None)
    parser.add_argument("--log", default=None, help="a file to note starts and cancels in")
    args = parser.parse_args(argv)
    if args.pid_file:
        with open(args.pid_file, "w") as f:
            f.write(str(os.getpid()))
    if args.log:
        with open(args.log, "a") as f:
            f.write(f"{os.getpid()} started\n")
    server = build(log=args.log)
    if args.http is not None:
        _http(server, args.http, args.token)
    else:
        server.run("stdio")


if __name__ == "__main__":
    main(sys.argv[1:])
