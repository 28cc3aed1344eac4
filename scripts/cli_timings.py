#!/usr/bin/env python3
"""How long the `agentq` command takes to start, measured from outside, against its goals.

    python scripts/cli_timings.py               # --version, --help, abort: 7 runs each
    python scripts/cli_timings.py --dev 3       # and `agentq dev --once` three times
    python scripts/cli_timings.py --json        # one JSON object on stdout, the table on stderr
    python scripts/cli_timings.py --as-is       # with this environment's bytecode setting

Each run is a new process of the installed console script (`agentq`, beside this Python),
timed from its start. `abort` is timed from the start of `agentq abort ID` to the
`turn_aborted` event's timestamp: the turn is queued on a Redis of the script's own with
no worker, so no process holds it and the command takes the abort step itself, as it does
for any waiting turn. `dev` is the `ready in X s` that `agentq dev --once` prints, with
its own embedded Redis and free ports; the demo turn it then runs is not counted.
The commands run with their bytecode cached, as an installed agentq has it (pip compiles
it at install): in a private PYTHONPYCACHEPREFIX, written by a warm-up, even where
PYTHONDONTWRITEBYTECODE is set (a checkout then compiles every agentq module it imports,
each time; `--as-is` measures that). A goal is met when the median meets it; the worst
run is shown beside it, and the CPU time the command's process used (user + system),
which a busy machine changes less than the wall clock.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOALS_S = {"version": 0.25, "help": 0.25, "abort": 0.6, "dev_ready": 8.0}
"""Issue 52's goals, in seconds, for the median run."""
DEV_TIMEOUT_S = 180.0
DEV_MODULES = (
    "agentq.worker",
    "agentq.gateway.server",
    "agentq.schedules.beat",
    "agentq.testing.openai_server",
    "flower.command",
)
"""What the processes of `agentq dev` import: the warm-up before its runs imports them."""
BYTECODE: dict[str, str] = {}
"""The environment that gives the commands a bytecode cache of their own (see --as-is)."""


def agentq_argv() -> list[str]:
    """The console script users run; `python -m agentq` where it is not installed."""
    script = Path(sys.executable).with_name("agentq")
    return [str(script)] if script.exists() else [sys.executable, "-m", "agentq"]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTQ_")}
    if BYTECODE:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    return {**env, **BYTECODE, **extra}


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's children that have ended."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def time_command(args: list[str], runs: int) -> tuple[list[float], list[float]]:
    """Wall-clock and CPU seconds of `agentq ARGS`, once per run; the first is a warm-up."""
    # Nothing answers at this URL: a command that only prints must not need Redis.
    env = clean_env(AGENTQ_REDIS_URL="redis://127.0.0.1:1/0")
    wall, cpu = [], []
    for i in range(runs + 1):
        cpu0, t0 = children_cpu_s(), time.perf_counter()
        done = subprocess.run(
            [*agentq_argv(), *args], env=env, capture_output=True, stdin=subprocess.DEVNULL
        )
        took, used = time.perf_counter() - t0, children_cpu_s() - cpu0
        if done.returncode != 0:
            raise RuntimeError(f"agentq {' '.join(args)}: exit {done.returncode}: {done.stderr!r}")
        if i:
            wall.append(took)
            cpu.append(used)
    return wall, cpu


def time_abort(runs: int) -> tuple[list[float], list[float]]:
    """Seconds from starting `agentq abort ID` to the turn's `turn_aborted` event, and the
    CPU seconds of the command's process."""
    from agentq.fleet import runtime
    from agentq.local.redis_server import RedisServer

    server = RedisServer().start()
    saved = os.environ.get("AGENTQ_REDIS_URL")
    os.environ["AGENTQ_REDIS_URL"] = server.url
    runtime.reset()
    try:
        from agentq.api import Client

        client = Client()
        env = clean_env(AGENTQ_REDIS_URL=server.url)
        wall, cpu = [], []
        for i in range(runs + 1):
            handle = client._start_turn("wait here", headless=True)
            cpu0, t0 = children_cpu_s(), time.time()
            done = subprocess.run(
                [*agentq_argv(), "abort", handle.turn_id],
                env=env,
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
            )
            used = children_cpu_s() - cpu0
            if done.returncode != 0:
                raise RuntimeError(f"agentq abort: exit {done.returncode}: {done.stderr}")
            aborted = next(
                ev
                for ev in client.events(handle.turn_id)
                if ev is not None and ev.type == "turn_aborted"
            )
            if i:
                wall.append(aborted.ts - t0)
                cpu.append(used)
        return wall, cpu
    finally:
        if saved is None:
            os.environ.pop("AGENTQ_REDIS_URL", None)
        else:
            os.environ["AGENTQ_REDIS_URL"] = saved
        runtime.reset()
        server.stop()


def time_dev(runs: int) -> list[float]:
    """The `ready in X s` of `agentq dev --once`, each run with its own embedded Redis."""
    from agentq.local.redis_server import find_free_port

    warm = "import " + ", ".join(DEV_MODULES)
    subprocess.run([sys.executable, "-c", warm], env=clean_env(), check=True, capture_output=True)
    out = []
    for _ in range(runs):
        env = clean_env(
            AGENTQ_REDIS_URL=f"redis://127.0.0.1:{find_free_port()}/0",
            AGENTQ_GATEWAY_PORT="0",
            AGENTQ_FLOWER_PORT="0",
        )
        proc = subprocess.Popen(
            [*agentq_argv(), "dev", "--once"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        try:
            text, _ = proc.communicate(timeout=DEV_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            # It stops what it started on SIGTERM; its group is ours to end if it does not.
            os.killpg(proc.pid, signal.SIGTERM)
            text, _ = proc.communicate(timeout=30)
        found = re.search(r"ready in ([0-9.]+) s", text)
        if proc.returncode != 0 or found is None:
            raise RuntimeError(f"agentq dev --once: exit {proc.returncode}:\n{text[-3000:]}")
        out.append(float(found.group(1)))
    return out


def summarise(samples: dict[str, list[float]], cpu: dict[str, list[float]]) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name, xs in samples.items():
        median = statistics.median(xs)
        report[name] = {
            "median_s": round(median, 3),
            "max_s": round(max(xs), 3),
            "cpu_median_s": round(statistics.median(cpu[name]), 3) if name in cpu else None,
            "runs": len(xs),
            "goal_s": GOALS_S[name],
            "met": median <= GOALS_S[name],
        }
    return report


def render(report: dict[str, Any]) -> str:
    lines = [f"{'command':<22}{'median':>9}{'worst':>9}{'cpu':>8}{'goal':>8}  met"]
    names = {
        "version": "agentq --version",
        "help": "agentq --help",
        "abort": "agentq abort ID",
        "dev_ready": "agentq dev --once",
    }
    for key, r in report.items():
        cpu = "-" if r["cpu_median_s"] is None else f"{r['cpu_median_s']:.3f}s"
        lines.append(
            f"{names[key]:<22}{r['median_s']:>8.3f}s{r['max_s']:>8.3f}s{cpu:>8}"
            f"{r['goal_s']:>7.2f}s  {'yes' if r['met'] else 'NO'}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--runs", type=int, default=7, help="runs of each quick command (7)")
    p.add_argument("--dev", type=int, default=0, metavar="N", help="runs of agentq dev --once")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument(
        "--as-is",
        action="store_true",
        help="keep this environment's bytecode setting (no cache of the script's own)",
    )
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="agentq-pyc-") as pyc:
        if not args.as_is:
            BYTECODE["PYTHONPYCACHEPREFIX"] = pyc
        return measure(args)


def measure(args: argparse.Namespace) -> int:
    samples: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}
    samples["version"], cpu["version"] = time_command(["--version"], args.runs)
    samples["help"], cpu["help"] = time_command(["--help"], args.runs)
    samples["abort"], cpu["abort"] = time_abort(args.runs)
    if args.dev:
        samples["dev_ready"] = time_dev(args.dev)
    report = summarise(samples, cpu)
    report["load_1m"] = os.getloadavg()[0]
    report["bytecode_cached"] = bool(BYTECODE)
    table = render({k: v for k, v in report.items() if isinstance(v, dict)})
    cached = "bytecode cached" if BYTECODE else "bytecode as the environment has it"
    table += f"\n(load average {report['load_1m']:.2f} on {os.cpu_count()} CPUs; {cached})"
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(report))
    else:
        print(table)
    return 0 if all(r["met"] for r in report.values() if isinstance(r, dict)) else 1


if __name__ == "__main__":
    raise SystemExit(main())
