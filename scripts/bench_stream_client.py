"""CPU per model stream of the stream worker's OpenAI client, by HTTP transport.

    python scripts/bench_stream_client.py [--streams 1000] [--pairs 3]
    python scripts/bench_stream_client.py --decoders   # agentq.llm.sse against the SDK's

Runs `--streams` concurrent 2-second rounds (20 chunks, as in the bench's io stage) from
the scripted server, run in a process of its own, through the stream worker's round
(`agentq.llm.aclient.astream_round`) on the SDK's client with its aiohttp transport (as
`make_client` builds it) and with its httpx2 one, in alternating pairs, and prints the
CPU milliseconds per stream. With `--decoders`, both on aiohttp: the stream worker's
round, which reads the body itself (`agentq.llm.sse`), against the same round read
through the SDK's own stream (its SSE decoder, as the stream worker did before). On a
loaded 2-core machine both numbers move by a tenth from one minute to the next: compare
within a pair.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx2
import openai

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentq.llm import aclient  # noqa: E402
from agentq.llm import client as chat  # noqa: E402

ROUND = {"text": "x" * 80, "chunk_size": 4, "chunk_delay_ms": 100}
CLIENTS = 8
"""As many clients as the stream worker keeps for 1,000 streams (STREAMS_PER_CLIENT)."""


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def _sdk_round(client: openai.AsyncOpenAI, on_delta: Any) -> None:
    """The round as the stream worker read it before agentq.llm.sse: through the SDK's
    stream, its chunks assembled as the worker's own are."""
    stream: openai.AsyncStream[object] = await client.post(  # type: ignore[assignment]
        chat.CHAT_COMPLETIONS_PATH,
        content=chat.chat_request("m", [{"role": "user", "content": "k"}], "[]"),
        cast_to=object,
        stream=True,
        stream_cls=openai.AsyncStream[object],
    )
    async with stream:
        assembler = chat.ChatAssembler(on_delta)
        index = 0
        async for chunk in stream:
            assembler.add(chunk, index)
            index += 1
        assembler.message(index - 1)


async def _streams(url: str, transport: str, n: int) -> float:
    limits = httpx2.Limits(max_connections=n + 100, max_keepalive_connections=200)
    timeout = httpx2.Timeout(60)
    factory: Any = (
        openai.DefaultAsyncHttpxClient if transport == "httpx2" else openai.DefaultAioHttpClient
    )
    clients = [
        openai.AsyncOpenAI(
            base_url=url,
            api_key="unused",
            max_retries=0,
            http_client=factory(timeout=timeout, limits=limits),
        )
        for _ in range(CLIENTS)
    ]

    never = asyncio.Event()

    async def one(i: int) -> int:
        # The stream worker's own round: agentq.llm.aclient.astream_round on this client.
        deltas: list[str] = []
        if transport == "sdk-sse":
            await _sdk_round(clients[i % CLIENTS], lambda kind, text: deltas.append(text))
            return len(deltas)
        attempt = aclient.Attempt(
            client=clients[i % CLIENTS],
            model="m",
            idle_timeout_ms=30_000,
            duration_left_s=60,
            max_retries=0,
            timeout=timeout,
            on_delta=lambda kind, text: deltas.append(text),
            on_retry=lambda *_: None,
            abort=never,
        )
        await aclient.astream_round(attempt, [{"role": "user", "content": "k"}], "[]")
        return len(deltas)

    try:
        await asyncio.gather(*[one(i) for i in range(50)])  # connections and imports warm
        before = _cpu_s()
        chunks = await asyncio.gather(*[one(i) for i in range(n)])
        used = _cpu_s() - before
    finally:
        for c in clients:
            await c.close()
    if min(chunks) < 20:
        raise SystemExit(f"a stream ended early: {min(chunks)} deltas")
    return used * 1000 / n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument(
        "--decoders",
        action="store_true",
        help="agentq.llm.sse against the SDK's SSE decoder, both on aiohttp",
    )
    args = p.parse_args()
    sides = ("aiohttp", "sdk-sse") if args.decoders else ("aiohttp", "httpx2")
    if not 1 <= args.streams <= 5000:
        raise SystemExit("--streams: 1 to 5000")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"k": [ROUND] * 4}, f)
    server = subprocess.Popen(
        [sys.executable, "-m", "agentq.testing.openai_server", "--script-file", f.name],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        url = line.rsplit(" ", 1)[-1].strip()
        if not url.startswith("http"):
            raise SystemExit(f"the scripted server did not start: {line!r}")
        got: dict[str, list[float]] = {side: [] for side in sides}
        for pair in range(args.pairs):
            for transport in sides[::-1] if pair % 2 else sides:
                t0 = time.perf_counter()
                ms = asyncio.run(_streams(url, transport, args.streams))
                got[transport].append(ms)
                print(
                    f"{transport:8s} {args.streams} streams: {ms:.2f} CPU ms a stream "
                    f"({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
        a, h = statistics.median(got[sides[0]]), statistics.median(got[sides[1]])
        print(f"median: {sides[0]} {a:.2f} ms, {sides[1]} {h:.2f} ms, ratio {a / h:.2f}")
    finally:
        server.terminate()
        server.wait(10)
        Path(f.name).unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
