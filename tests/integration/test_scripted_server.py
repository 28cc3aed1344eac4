"""The scripted OpenAI server's serving: one thread for any number of streams, keep-alive
connections or a close after each answer, a prompt stop, and refusals of requests it does
not parse."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from agentq.testing.openai_server import Round, ScriptedOpenAIServer

pytestmark = pytest.mark.integration

SLOW = Round(text="x" * 30, chunk_size=1, chunk_delay_ms=100)
"""About three seconds of stream: long enough for every stream to be open at once."""


@pytest.fixture
def server() -> Iterator[ScriptedOpenAIServer]:
    with ScriptedOpenAIServer({"slow": [SLOW], "quick": [Round(text="hello there")]}) as srv:
        yield srv


def wait_until(predicate: Callable[[], bool], *, timeout_s: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.01)


def _address(server: ScriptedOpenAIServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").removesuffix("/v1").split(":")
    return host, int(port)


def _post(prompt: str, *, stream: bool = True) -> bytes:
    body = json.dumps(
        {"model": "m", "stream": stream, "messages": [{"role": "user", "content": prompt}]}
    ).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _raw(server: ScriptedOpenAIServer, data: bytes) -> bytes:
    """What the server answers to `data` on a fresh connection, up to its close."""
    with socket.create_connection(_address(server), timeout=5) as sock:
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


def test_two_hundred_streams_share_the_server_thread(server: ScriptedOpenAIServer) -> None:
    threads_before = threading.active_count()
    host, port = _address(server)

    async def one(all_open: asyncio.Event) -> bytes:
        reader, writer = await asyncio.open_connection(host, port)
        try:
            writer.write(_post("slow"))
            first = await reader.readuntil(b"data: ")
            await all_open.wait()
            return first + await reader.readuntil(b"0\r\n\r\n")
        finally:
            writer.close()
            await writer.wait_closed()

    async def go() -> tuple[list[bytes], int, int]:
        all_open = asyncio.Event()
        tasks = [asyncio.create_task(one(all_open)) for _ in range(200)]
        deadline = time.monotonic() + 20
        while server.open_streams < 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        streams, threads = server.open_streams, threading.active_count()
        all_open.set()
        return await asyncio.gather(*tasks), streams, threads

    bodies, streams, threads = asyncio.run(go())
    assert streams == 200
    assert threads <= threads_before + 2, [t.name for t in threading.enumerate()]
    for body in bodies:
        assert b"transfer-encoding: chunked" in body.lower()
        assert body.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert body.count(b'"content": "x"') == 30
    wait_until(lambda: server.open_streams == 0, what="every stream to close")
    assert server.connections_accepted == 200


def test_sequential_requests_reuse_one_connection(server: ScriptedOpenAIServer) -> None:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "quick"}]}
    before = server.connections_accepted
    with httpx.Client(base_url=server.url, timeout=5) as client:
        for _ in range(2):
            with client.stream("POST", "/chat/completions", json=body) as response:
                assert response.headers["transfer-encoding"] == "chunked"
                text = "".join(response.iter_text())
            assert text.rstrip().endswith("data: [DONE]")
        plain = client.post("/chat/completions", json={**body, "stream": False}).json()
        assert plain["choices"][0]["message"]["content"] == "hello there"
        assert client.get("/models").status_code == 200
        assert client.get("/nowhere").status_code == 404
        assert client.delete("/models").status_code == 405
    assert server.connections_accepted - before == 1


def test_a_paced_round_streams_its_chunk_count_on_schedule() -> None:
    from agentq.testing.openai_server import ScriptedCall

    rnd = Round(
        text="x" * 12,
        chunk_size=4,
        chunk_delay_ms=60,
        tool_calls=[ScriptedCall(name="echo", arguments={"text": "hi"})],
    )
    # 3 text chunks, the call's header, its 16 characters of arguments in 4, the finish.
    assert rnd.chunk_count() == 9
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "paced"}]}
    with ScriptedOpenAIServer({"paced": [rnd]}) as srv, httpx.Client(timeout=5) as client:
        t0 = time.monotonic()
        with client.stream("POST", f"{srv.url}/chat/completions", json=body) as response:
            text = "".join(response.iter_text())
        took_s = time.monotonic() - t0
    data = [line for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and len(data) - 1 == rnd.chunk_count()
    # (9 - 1) * 60 ms: paced from the first chunk, whatever the machine's load adds.
    assert 0.48 <= took_s < 3.0, took_s


def test_the_openai_sdk_reuses_its_connection(server: ScriptedOpenAIServer) -> None:
    from openai import AsyncOpenAI, BadRequestError, OpenAI

    server.set_script("refused", [Round(fault="http_400")])
    quick: Any = [{"role": "user", "content": "quick"}]
    refused: Any = [{"role": "user", "content": "refused"}]
    before = server.connections_accepted
    with OpenAI(base_url=server.url, api_key="k", max_retries=0) as client:
        for _ in range(3):
            answer = client.chat.completions.create(model="m", messages=quick)
            assert answer.choices[0].message.content == "hello there"
            with pytest.raises(BadRequestError):
                client.chat.completions.create(model="m", messages=refused)
    assert server.connections_accepted - before == 1

    async def streams() -> list[str]:
        # The stream worker's client: it reads a stream to its end, so it can reuse it.
        async with AsyncOpenAI(base_url=server.url, api_key="k", max_retries=0) as aclient:
            texts = []
            for _ in range(3):
                chunks = await aclient.chat.completions.create(
                    model="m", messages=quick, stream=True
                )
                texts.append("".join([c.choices[0].delta.content or "" async for c in chunks]))
            return texts

    before = server.connections_accepted
    assert asyncio.run(streams()) == ["hello there"] * 3
    assert server.connections_accepted - before == 1


def test_a_broken_stream_cuts_the_connection(server: ScriptedOpenAIServer) -> None:
    server.set_script("cut", [Round(text="abcdef", chunk_size=2, fault="disconnect")])
    # The connection closes with the body unfinished: no terminating chunk.
    answer = _raw(server, _post("cut"))
    assert answer.startswith(b"HTTP/1.1 200 ")
    assert not answer.endswith(b"0\r\n\r\n")


def test_stop_with_streams_open_returns_at_once() -> None:
    scripts = {
        "silent": [Round(fault="silent_after_200")],
        "keepalive": [Round(fault="keepalive_only")],
        "slow": [SLOW],
        "mute": [Round(fault="silent_after_chunks")],
    }
    before = set(threading.enumerate())
    server = ScriptedOpenAIServer(scripts).start()
    # Its own thread: other tests of the session may run servers of their own.
    (own,) = [
        t for t in threading.enumerate() if t not in before and t.name == "scripted-openai-server"
    ]
    address = _address(server)
    socks = [socket.create_connection(address, timeout=5) for _ in range(40)]
    try:
        for i, sock in enumerate(socks):
            sock.sendall(_post(list(scripts)[i % 4], stream=i % 8 != 3))
        idle = socket.create_connection(address, timeout=5)
        socks.append(idle)
        wait_until(lambda: server.open_streams == 35, what="the streams to open")
        started = time.monotonic()
        server.stop()
        assert time.monotonic() - started < 2.0
        assert server.open_streams == 0
        assert not own.is_alive()
        for sock in socks:
            assert _ends(sock)
        with pytest.raises(OSError), socket.create_connection(address, timeout=1):
            pass
    finally:
        for sock in socks:
            sock.close()


def _ends(sock: socket.socket) -> bool:
    """Read to the end of a connection: an EOF or a reset both end it."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def test_a_request_it_does_not_parse_is_refused_and_the_connection_closed(
    server: ScriptedOpenAIServer,
) -> None:
    answer = _raw(server, b"NOT A REQUEST\r\n\r\nGET /v1/models HTTP/1.1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 "), answer
    # The request queued behind it is not served.
    assert b'"object": "list"' not in answer


def _stream_text(client: httpx.Client, prompt: str) -> tuple[str, httpx.Headers]:
    body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": prompt}]}
    with client.stream("POST", "/chat/completions", json=body) as response:
        return "".join(response.iter_text()), response.headers


def test_a_round_closes_the_connection_after_its_stream(server: ScriptedOpenAIServer) -> None:
    server.set_script("closing", [Round(text="bye", close_connection=True)])
    before = server.connections_accepted
    with httpx.Client(base_url=server.url, timeout=5) as client:
        for prompt in ("closing", "quick", "closing", "quick"):
            text, headers = _stream_text(client, prompt)
            assert text.rstrip().endswith("data: [DONE]")
            assert (headers.get("connection") == "close") == (prompt == "closing")
    # [closing] [quick, closing] [quick]: a fresh connection after each closing stream.
    assert server.connections_accepted - before == 3


def test_a_server_that_closes_every_connection_serves_the_sdk() -> None:
    from openai import AsyncOpenAI

    rounds = [Round(text="hello there", chunk_size=2)]
    with ScriptedOpenAIServer({"quick": rounds}, close_connections=True) as srv:
        with httpx.Client(base_url=srv.url, timeout=5) as client:
            text, headers = _stream_text(client, "quick")
            assert headers["connection"] == "close" and text.rstrip().endswith("[DONE]")
            assert client.get("/models").headers["connection"] == "close"
        assert srv.connections_accepted == 2

        async def streams() -> list[str]:
            quick: Any = [{"role": "user", "content": "quick"}]
            async with AsyncOpenAI(base_url=srv.url, api_key="k", max_retries=0) as aclient:
                texts = []
                for _ in range(3):
                    chunks = await aclient.chat.completions.create(
                        model="m", messages=quick, stream=True
                    )
                    texts.append("".join([c.choices[0].delta.content or "" async for c in chunks]))
                return texts

        assert asyncio.run(streams()) == ["hello there"] * 3
        assert srv.connections_accepted == 5


def test_a_server_told_to_keep_no_request_bodies_keeps_none() -> None:
    # The command line's server (agentq dev, the bench): nothing can read them there.
    with ScriptedOpenAIServer({"quick": [Round(text="hi")]}, keep_requests=False) as srv:
        with httpx.Client(base_url=srv.url, timeout=5) as client:
            text, _ = _stream_text(client, "quick")
        assert text.rstrip().endswith("[DONE]") and srv.requests == []
    with ScriptedOpenAIServer({"quick": [Round(text="hi")]}) as srv:
        with httpx.Client(base_url=srv.url, timeout=5) as client:
            _stream_text(client, "quick")
        assert [m["content"] for m in srv.requests[0]["messages"]] == ["quick"]


def test_a_client_that_leaves_mid_burst_is_no_app_error(caplog: pytest.LogCaptureFixture) -> None:
    """A client that reads one chunk of a burst and closes (as a turn aborted at its first
    delta does) is counted as gone, and uvicorn sees an answer that ended with its client,
    not an app that returned with its response unfinished."""
    # 8 MB of SSE: more than the sender's buffer (4 MB at most here) and the receive window
    # of a client that stops reading at its first delta, so the answer cannot be written
    # whole before its client leaves (4,000 words, 0.5 MB, sometimes could).
    burst = Round(text="word " * 60000, chunk_delay_ms=0)
    caplog.set_level("INFO", logger="uvicorn.error")
    with ScriptedOpenAIServer({"burst": [burst]}) as srv:

        async def leave_early() -> None:
            messages = [{"role": "user", "content": "burst"}]
            body = {"model": "m", "stream": True, "messages": messages}
            async with httpx.AsyncClient() as client:
                url = f"{srv.url}/chat/completions"
                async with client.stream("POST", url, json=body) as response:
                    async for line in response.aiter_lines():
                        if "content" in line:
                            break

        async def main() -> None:
            for _ in range(10):
                await leave_early()

        asyncio.run(main())
        wait_until(lambda: srv.closed_by_client == 10, what="ten clients counted as gone")
    unfinished = [r for r in caplog.records if "without completing response" in r.getMessage()]
    assert not unfinished, [r.getMessage() for r in unfinished]
