#!/usr/bin/env python3
"""The io stage's reference: the same turns as one asyncio loop with the raw OpenAI SDK.

    python scripts/bench_raw_sdk.py --base-url URL --prompt-key KEY --turns 1000

Each turn streams round 1 from the model, waits out its one tool call (`asyncio.sleep`,
as the `aio_sleep` tool does), sends the tool's result and streams round 2: the model and
tool waits of the io stage with nothing around them (no queue, no state, no events, no
Redis). It prints one JSON object: turns finished, seconds, and the CPU seconds this
process used (user + system), which the bench sets against the agentq fleet's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any


def add_chunk(chunk: Any, text: list[str], calls: dict[int, dict[str, Any]]) -> None:
    """Fold one streamed chunk into the round's text and tool calls."""
    if not chunk.choices:
        return
    delta = chunk.choices[0].delta
    if delta.content:
        text.append(delta.content)
    for tc in delta.tool_calls or []:
        call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
        call["id"] = tc.id or call["id"]
        if tc.function is not None:
            call["name"] += tc.function.name or ""
            call["arguments"] += tc.function.arguments or ""


def assistant_message(text: list[str], calls: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The round's answer as the next request's history has it."""
    return {
        "role": "assistant",
        "content": "".join(text) or None,
        "tool_calls": [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["name"], "arguments": c["arguments"]},
            }
            for c in calls.values()
        ],
    }


def tool_seconds(call: dict[str, Any]) -> float:
    """How long the shapes' tools (`aio_sleep`, `stamp`) wait."""
    return float(json.loads(call["arguments"] or "{}").get("seconds", 0))


async def one_turn(client: Any, model: str, prompt: str, pool: Executor | None = None) -> bool:
    messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
    for _ in range(MAX_ROUNDS):
        text: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        stream = await client.chat.completions.create(model=model, messages=messages, stream=True)
        async for chunk in stream:
            add_chunk(chunk, text, calls)
        if not calls:
            return True
        messages.append(assistant_message(text, calls))
        for c in calls.values():
            if pool is None:
                await asyncio.sleep(tool_seconds(c))  # the aio_sleep tool
            else:
                await asyncio.get_running_loop().run_in_executor(pool, time.sleep, tool_seconds(c))
            messages.append({"role": "tool", "tool_call_id": c["id"], "content": "null"})
    return False


MAX_ROUNDS = 12
"""A bound on a turn's rounds, which keeps a broken script finite."""

TURNS_PER_CLIENT = 50
"""Turns sharing one SDK client: httpx2's pool looks at each of its connections for every
request, so one pool of a thousand made the reference loop spend most of its CPU there
(1,000 turns: 72 s with one client on the test VM); a client per 50 turns is what a tuned
loop would do."""


async def run(
    base_url: str, model: str, key: str, turns: int, sync_tool_threads: int = 0
) -> dict[str, Any]:
    import httpx2
    from openai import AsyncOpenAI

    limits = httpx2.Limits(max_connections=TURNS_PER_CLIENT)
    clients = [
        AsyncOpenAI(
            base_url=base_url,
            api_key="bench",
            max_retries=0,
            http_client=httpx2.AsyncClient(limits=limits, timeout=120),
        )
        for _ in range(-(-turns // TURNS_PER_CLIENT))
    ]
    # A sync tool (the `sleep` tool) runs on threads, as many as the fleet's tool processes.
    pool = ThreadPoolExecutor(sync_tool_threads) if sync_tool_threads else None
    t0 = time.perf_counter()
    done = await asyncio.gather(
        *(
            one_turn(clients[i // TURNS_PER_CLIENT], model, f"{key} #{i}", pool)
            for i in range(turns)
        ),
        return_exceptions=True,
    )
    if pool is not None:
        pool.shutdown()
    took = time.perf_counter() - t0
    for client in clients:
        await client.close()
    return {
        "turns": turns,
        "finished": sum(1 for d in done if d is True),
        "errors": sorted({type(d).__name__ for d in done if isinstance(d, BaseException)}),
        "seconds": round(took, 2),
    }


def warm_up() -> None:
    """What a long-running process pays once, paid before the clock starts, as the fleet's
    warm workers have: the SDK's imports, its chat resources (loaded on first use) and the
    chunk model's first validation (about 0.19 CPU-s on the 2-core VM)."""
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletionChunk

    AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="warm-up").chat.completions  # noqa: B018
    delta = {"content": "a", "tool_calls": [{"index": 0, "id": "c", "function": {"name": "f"}}]}
    chunk = {"id": "w", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    ChatCompletionChunk.model_validate({**chunk, "choices": [{"index": 0, "delta": delta}]})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", default="gpt-4o-mini")
    p.add_argument("--prompt-key", required=True)
    p.add_argument("--turns", type=int, default=1000)
    p.add_argument("--sync-tool-threads", type=int, default=0, help="the tool is sync: threads")
    args = p.parse_args(argv)
    warm_up()
    before = resource.getrusage(resource.RUSAGE_SELF)
    out = asyncio.run(
        run(args.base_url, args.model, args.prompt_key, args.turns, args.sync_tool_threads)
    )
    after = resource.getrusage(resource.RUSAGE_SELF)
    out["cpu_s"] = round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 2)
    print(json.dumps(out))
    return 0 if out["finished"] == out["turns"] else 1


if __name__ == "__main__":
    sys.exit(main())
