"""The gateway's /mcp: the fleet's agents called by the `mcp` SDK's own client, over a real
gateway (with keys) and the session's real workers and scripted model."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import httpx2
import pytest
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client

from agentq import constants as k
from agentq.api import Client
from agentq.config import load_settings
from agentq.gateway import create_app
from agentq.gateway.mcp_endpoint import TURN_META_KEY
from agentq.testing.gateway import BackgroundServer
from agentq.testing.openai_server import Round, ScriptedCall
from tests.helpers import script

pytestmark = pytest.mark.integration

ALICE, BOB, ADMIN = "alice-key-0123456789", "bob-key-0123456789", "admin-key-0123456789"


@pytest.fixture(scope="module")
def gateway(fleet: Any, agentq_env: dict[str, str]) -> Iterator[BackgroundServer]:
    settings = load_settings(api_keys=f"alice={ALICE},bob={BOB}", admin_keys=f"root={ADMIN}")
    with BackgroundServer(create_app(Client(settings))) as server:
        yield server


class Session:
    """One MCP client session with the gateway, as `key`."""

    def __init__(self, url: str, key: str) -> None:
        self.url, self.key = url, key
        self.progress: list[str] = []

    async def __aenter__(self) -> ClientSession:
        self._http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {self.key}"})
        self._transport = streamable_http_client(self.url + "/mcp", http_client=self._http)
        read, write = await self._transport.__aenter__()
        self._session = ClientSession(read, write)
        session = await self._session.__aenter__()
        await session.initialize()
        return session

    async def __aexit__(self, *exc: object) -> None:
        await self._session.__aexit__(None, None, None)
        await self._transport.__aexit__(None, None, None)
        await self._http.aclose()

    async def on_progress(self, progress: float, total: float | None, message: str | None) -> None:
        self.progress.append(message or "")


def test_agents_are_tools_and_a_call_is_a_turn_of_the_caller(
    gateway: BackgroundServer, llm_server: Any
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=[ScriptedCall(name="sleep", arguments={"seconds": 0.3})]),
        Round(text="The answer is 42."),
    )
    alice = Session(gateway.url, ALICE)

    async def go() -> Any:
        async with alice as session:
            tools = {t.name: t for t in (await session.list_tools()).tools}
            assert "researcher" in tools
            assert tools["researcher"].input_schema["required"] == ["input"]
            assert "Researches a question" in (tools["researcher"].description or "")
            return await session.call_tool(
                "researcher", {"input": f"{key} go"}, progress_callback=alice.on_progress
            )

    result = asyncio.run(go())
    assert not result.is_error, result
    assert result.content[0].text == "The answer is 42."
    turn_id = result.meta[TURN_META_KEY]
    assert any(f"turn {turn_id} started" in m for m in alice.progress), alice.progress
    assert any(m.endswith("calling sleep") for m in alice.progress), alice.progress
    assert any(m.endswith("sleep: ok") for m in alice.progress), alice.progress
    # The turn is alice's: she reads it, bob does not even learn it exists.
    with httpx.Client(base_url=gateway.url) as http:
        mine = http.get(f"/v1/turns/{turn_id}", headers={"Authorization": f"Bearer {ALICE}"})
        assert mine.status_code == 200 and mine.json()["state"]["owner"] == "alice"
        theirs = http.get(f"/v1/turns/{turn_id}", headers={"Authorization": f"Bearer {BOB}"})
        assert theirs.status_code == 404


def test_a_typed_agent_declares_its_output_schema_and_answers_structured_content(
    gateway: BackgroundServer, llm_server: Any
) -> None:
    key = script(llm_server, Round(text='{"answer": "yes", "confidence": 0.9}'))

    async def go() -> tuple[Any, Any]:
        async with Session(gateway.url, ALICE) as session:
            tools = {t.name: t for t in (await session.list_tools()).tools}
            # The SDK's client checks the answer against this schema.
            result = await session.call_tool("t_judge", {"input": f"{key} judge"})
            return tools["t_judge"], result

    tool, result = asyncio.run(go())
    assert tool.output_schema is not None
    assert set(tool.output_schema["properties"]) == {"answer", "confidence"}
    assert not result.is_error, result
    assert result.structured_content == {"answer": "yes", "confidence": 0.9}


def test_a_cancel_aborts_the_turn(gateway: BackgroundServer, llm_server: Any) -> None:
    key = script(
        llm_server,
        Round(tool_calls=[ScriptedCall(name="sleep", arguments={"seconds": 60})]),
        Round(text="never"),
    )
    alice = Session(gateway.url, ALICE)
    client = Client()

    async def go() -> str:
        async with alice as session:
            call = asyncio.ensure_future(
                session.call_tool(
                    "researcher", {"input": f"{key} go"}, progress_callback=alice.on_progress
                )
            )
            while not any(m.endswith("calling sleep") for m in alice.progress):
                assert not call.done(), call.result()
                await asyncio.sleep(0.05)
            call.cancel()  # the SDK sends notifications/cancelled
            with pytest.raises(asyncio.CancelledError):
                await call
        found = re.search(r"turn (\S+) started", " ".join(alice.progress))
        assert found is not None
        return found.group(1)

    turn_id = asyncio.run(go())
    terminal = client.wait(turn_id, timeout_s=30)
    assert terminal.type == "turn_aborted", terminal
    calls = client.get(turn_id)["invocations"]
    assert [c["status"] for c in calls] == ["cancelled"], calls


def test_failures_are_is_error_results(gateway: BackgroundServer, llm_server: Any) -> None:
    key = script(llm_server, Round(fault="http_400"))

    async def go() -> tuple[Any, Any]:
        async with Session(gateway.url, ALICE) as session:
            unknown = await session.call_tool("no_such_agent", {"input": "hi"})
            failed = await session.call_tool("researcher", {"input": f"{key} go"})
            return unknown, failed

    unknown, failed = asyncio.run(go())
    assert unknown.is_error and "unknown agent" in unknown.content[0].text
    assert failed.is_error and "failed" in failed.content[0].text, failed


def test_healthz_shows_mcp_servers_without_their_errors(gateway: BackgroundServer) -> None:
    redis = Client()._store.redis
    entry = {"ok": False, "failures": 3, "error": "secret detail", "worker": "w", "at": 1.0}
    redis.hset(k.MCP_HEALTH, "broken", json.dumps(entry))
    try:
        body = httpx.get(gateway.url + "/healthz").json()
        admin = httpx.get(
            gateway.url + "/v1/capacity", headers={"Authorization": f"Bearer {ADMIN}"}
        ).json()
    finally:
        redis.hdel(k.MCP_HEALTH, "broken")
    assert body["ok"] is True
    assert body["mcp"]["broken"] == {"ok": False, "failures": 3, "at": 1.0}
    assert "secret detail" not in json.dumps(body)
    # The console's panel (admins only) shows the error too.
    assert admin["mcp_servers"]["broken"]["error"] == "secret detail"


def test_mcp_needs_a_key_and_a_session_is_its_maker_s(gateway: BackgroundServer) -> None:
    init = {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "initialize",
        "params": {
            "protocolVersion": "2025-06-18",
            "capabilities": {},
            "clientInfo": {"name": "t", "version": "0"},
        },
    }
    accept = {"Accept": "application/json, text/event-stream"}
    with httpx.Client(base_url=gateway.url) as http:
        assert http.post("/mcp", json=init, headers=accept).status_code == 401
        wrong = {**accept, "Authorization": "Bearer nope"}
        assert http.post("/mcp", json=init, headers=wrong).status_code == 401
        made = http.post("/mcp", json=init, headers={**accept, "Authorization": f"Bearer {ALICE}"})
        assert made.status_code == 200, made.text
        session_id = made.headers["mcp-session-id"]
        ping = {"jsonrpc": "2.0", "id": 2, "method": "ping"}
        as_bob = {**accept, "Authorization": f"Bearer {BOB}", "mcp-session-id": session_id}
        assert http.post("/mcp", json=ping, headers=as_bob).status_code == 404
