"""One MCP server's session (agentq.mcp.link) against real servers, without a fleet: the
backoff of a server that cannot start, and an HTTP session made again after its server
ignored a cancel."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentq.errors import McpServerUnavailable
from agentq.local.processes import ManagedProcess, start_process
from agentq.mcp.link import ServerLink
from agentq.mcp.servers import McpServer, parse_servers

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "link-token-0123456789"


def server(**spec: object) -> McpServer:
    return parse_servers(json.dumps({"s": spec}))["s"]


async def no_progress(progress: float, total: float | None, message: str | None) -> None:
    return None


@pytest.fixture(scope="module")
def http_server() -> Iterator[tuple[ManagedProcess, str]]:
    proc = start_process(
        [sys.executable, "-m", "agentq.testing.mcp_server", "--http", "0", "--token", TOKEN],
        env={"PYTHONPATH": str(ROOT)},
        ready_pattern=r"listening on http://127\.0\.0\.1:\d+/mcp",
        name="mcp-http-link",
    )
    try:
        found = re.search(r"listening on (\S+)", proc.log_text())
        assert found is not None
        yield proc, found.group(1)
    finally:
        proc.stop()


def test_a_server_that_cannot_start_is_not_retried_in_a_tight_loop() -> None:
    link = ServerLink(server(command=[sys.executable, "-c", "import sys; sys.exit(3)"]))

    async def go() -> list[str]:
        errors = []
        for _ in range(3):
            with pytest.raises(McpServerUnavailable) as caught:
                await link.call("echo", {"text": "x"}, no_progress)
            errors.append(caught.value.message)
        return errors

    first, second, third = asyncio.run(go())
    assert "MCP server 's'" in first and "cannot start" in first
    # The second failure in a row waits a second before the next start: the third call
    # is refused at once, saying when.
    assert "cannot start" in second
    assert "next start in" in third and "2 time(s) in a row" in third
    assert link.starts == 0 and link.failures == 2


def test_a_wrong_bearer_token_is_an_error_naming_the_server(
    http_server: tuple[ManagedProcess, str],
) -> None:
    _, url = http_server
    link = ServerLink(server(url=url, headers={"Authorization": "Bearer wrong"}))

    async def go() -> str:
        with pytest.raises(McpServerUnavailable) as caught:
            await link.call("echo", {"text": "x"}, no_progress)
        return caught.value.message

    assert "MCP server 's'" in asyncio.run(go())


def test_an_http_session_is_made_again_after_its_server_ignored_a_cancel(
    http_server: tuple[ManagedProcess, str],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    _, url = http_server
    monkeypatch.setenv("LINK_TOKEN", TOKEN)
    link = ServerLink(
        server(url=url, headers={"Authorization": "Bearer ${LINK_TOKEN}"}, cancel_grace_s=0.5)
    )

    async def go() -> str:
        first = await link.call("echo", {"text": "one"}, no_progress)
        assert first.structured_content == {"result": "one"}
        stuck = asyncio.ensure_future(link.call("stubborn", {"seconds": 3}, no_progress))
        await asyncio.sleep(0.5)
        stuck.cancel()
        with pytest.raises(asyncio.CancelledError):
            await stuck
        began = time.monotonic()
        # Waits for the ping check, which fails (the server is blocked): a new session,
        # made once the server answers again.
        again = await link.call("echo", {"text": "two"}, no_progress)
        assert time.monotonic() - began >= 0.4
        await link.stop()
        return str(again.structured_content["result"])

    assert asyncio.run(go()) == "two"
    assert link.starts == 2
    assert "MCP server s ignored a cancel (ping: no answer within 0.5 s)" in caplog.text
