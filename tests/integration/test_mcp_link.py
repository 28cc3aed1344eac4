"""One MCP server's session (agentq.mcp.link) against real servers, without a fleet: the
backoff of a server that cannot start, an HTTP session made again after its server
ignored a cancel, and an I/O worker's listings (agentq.mcp.catalog) made on its sessions."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from agentq import constants as k
from agentq.errors import McpServerUnavailable
from agentq.local.processes import ManagedProcess, start_process
from agentq.local.redis_server import RedisServer
from agentq.mcp import catalog
from agentq.mcp.catalog import McpTools
from agentq.mcp.link import ServerLink
from agentq.mcp.listing import Listing
from agentq.mcp.servers import McpServer, parse_servers
from agentq.tools import registry

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


def test_a_server_that_cannot_start_is_not_retried_in_a_tight_loop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "agentq.mcp")
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
    assert "MCP server s started" not in caplog.text and link.failures == 2


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
    caplog.set_level(logging.INFO, "agentq.mcp")
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
    assert caplog.text.count("MCP server s started") == 2
    assert "MCP server s ignored a cancel (ping: no answer within 0.5 s)" in caplog.text


def test_an_io_worker_lists_on_its_sessions_and_again_when_a_listing_is_due(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "t.log"
    spec = {
        "t": {
            "command": [sys.executable, "-m", "agentq.testing.mcp_server", "--log", str(log)],
            "env": {"PYTHONPATH": str(ROOT)},
        },
        "gone": {"command": [sys.executable, "-c", "import sys; sys.exit(3)"]},
    }
    client = redis.Redis.from_url(redis_server.url)
    monkeypatch.setattr(catalog, "RETRY_FAILED_S", 0.5)
    tools = McpTools(parse_servers(json.dumps(spec)), 3.0, lambda: client)

    def shared(name: str) -> Listing:
        return Listing.model_validate_json(client.hget(k.MCP_TOOLS, name))

    async def changed(name: str, since: Listing) -> Listing:
        deadline = time.monotonic() + 15
        while shared(name).listed_at == since.listed_at:
            assert time.monotonic() < deadline, f"{name} not listed again"
            await asyncio.sleep(0.05)
        return shared(name)

    async def go() -> tuple[Listing, Listing, Listing, Listing]:
        await tools.list_all()
        first, failed = shared("t"), shared("gone")
        keeper = asyncio.create_task(tools.keep_listed())
        try:
            failed_again = await changed("gone", failed)
            again = await changed("t", first)
        finally:
            keeper.cancel()
            await tools.close()
        return first, failed, again, failed_again

    try:
        first, failed, again, failed_again = asyncio.run(go())
        assert "echo" in {t.name for t in first.tools} and not first.error
        assert "t__echo" in registry.all_tools()
        assert failed.error and failed.tools == []
        # Listed again on the same session: the server started once.
        assert again.listed_at > first.listed_at and not again.error
        starts = [ln for ln in log.read_text().splitlines() if ln.endswith("started")]
        assert len(starts) == 1, starts
        # A server that could not be listed is tried again sooner than the TTL.
        assert failed_again.listed_at < first.listed_at + 3.0 <= again.listed_at
    finally:
        for n in tools.registered:
            registry.unregister(n)
        client.close()
