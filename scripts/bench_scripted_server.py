"""CPU per streamed round of the scripted model server, and its rounds per second.

    python scripts/bench_scripted_server.py [--rounds 3000] [--concurrency 50] [--close]

Runs the server (`python -m agentq.testing.openai_server`) in a process of its own and
streams `--rounds` chat completions from it over aiohttp, `--concurrency` at a time, each a
round of 50 chunks sent as fast as the server can (a burst: the server's own cost, not a
pace), with the usage chunk. Prints the server process's CPU milliseconds per round and the
rounds per second. `--close` closes the connection after each stream (a `Connection: close`
request), as some proxies do. On a shared 2-core machine, compare runs of the same minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

ROUND = {"text": "x" * 400, "chunk_size": 8}
BODY = {
    "model": "m",
    "stream": True,
    "stream_options": {"include_usage": True},
    "messages": [{"role": "user", "content": "bench"}],
}


async def drive(url: str, rounds: int, concurrency: int, close: bool) -> float:
    """Stream `rounds` rounds; the seconds it took."""
    headers = {"Connection": "close"} if close else {}
    todo = iter(range(rounds))
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=close)
    ) as session:

        async def worker() -> None:
            for _ in todo:
                async with session.post(url, json=BODY, headers=headers) as resp:
                    body = await resp.read()
                    assert resp.status == 200 and body.endswith(b"data: [DONE]\n\n"), body[-200:]

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--close", action="store_true", help="a connection per stream")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "script.json"
        script.write_text(json.dumps({"bench": [ROUND]}))
        argv = [sys.executable, "-m", "agentq.testing.openai_server", "--script", "none"]
        proc = subprocess.Popen(
            [*argv, "--script-file", str(script)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert proc.stdout is not None
            url = proc.stdout.readline().split()[-1] + "/chat/completions"
            server = psutil.Process(proc.pid)
            asyncio.run(drive(url, 100, args.concurrency, args.close))  # warm up
            before = server.cpu_times()
            wall_s = asyncio.run(drive(url, args.rounds, args.concurrency, args.close))
            after = server.cpu_times()
        finally:
            proc.terminate()
            proc.wait(10)
    cpu_s = (after.user - before.user) + (after.system - before.system)
    print(
        f"rounds={args.rounds} concurrency={args.concurrency} close={args.close}: "
        f"server CPU {cpu_s / args.rounds * 1000:.3f} ms/round, "
        f"{args.rounds / wall_s:.0f} rounds/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
