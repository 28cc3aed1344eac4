"""A fleet beyond one worker per kind: tool calls spread over two tool workers, and
RabbitMQ as the Celery broker with Redis kept for events and state.

Each test builds its own stack (a fresh Redis, its own turn, stream and tool workers)
so the session workers cannot take its tasks; only the scripted model is shared.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import psutil
import pytest

from agentq.api import Client
from agentq.events import Event
from agentq.fleet import runtime
from agentq.fleet.connections import probe
from agentq.local.processes import (
    ManagedProcess,
    WaitTimeout,
    start_process,
    start_worker,
    wait_for,
)
from agentq.local.redis_server import RedisServer
from agentq.models import ToolCall
from agentq.testing.openai_server import Round, ScriptedCall
from tests.helpers import collect, process_env, run_dev_once, script
from tests.rigs.rounds import start_round, wait_round

pytestmark = pytest.mark.integration

AMQP_URL = os.environ.get("AGENTQ_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672//")
RABBITMQ_START_TIMEOUT_S = 60


@contextlib.contextmanager
def stack(
    base: dict[str, str], *, broker_url: str | None, tool_workers: list[str], tool_concurrency: int
) -> Iterator[tuple[Client, dict[str, ManagedProcess]]]:
    """A fresh Redis, one turn and one stream worker, and one tool worker per name."""
    with RedisServer() as redis_server:
        env = {
            **base,
            "AGENTQ_REDIS_URL": redis_server.url,
            "AGENTQ_BROKER_URL": broker_url or redis_server.url,
        }
        tag = uuid.uuid4().hex[:6]
        specs: dict[str, tuple[str, int]] = {"turns": ("turns", 8), "llm": ("llm", 4)}
        specs.update({name: ("tools", tool_concurrency) for name in tool_workers})
        procs: dict[str, ManagedProcess] = {}
        # Started side by side: each worker spends its start-up importing, not waiting.
        with ThreadPoolExecutor(len(specs)) as pool:
            futures = {
                name: pool.submit(
                    start_worker,
                    kind,
                    env=env,
                    hostname=f"{name}-{tag}@%h",
                    concurrency=conc,
                    ready_timeout_s=60,
                )
                for name, (kind, conc) in specs.items()
            }
            errors = []
            for name, fut in futures.items():
                try:
                    procs[name] = fut.result()
                except Exception as exc:
                    errors.append(exc)
        try:
            if errors:
                raise errors[0]
            with process_env(env):
                yield Client(), procs
        finally:
            for proc in procs.values():
                proc.stop()


def test_one_round_spreads_over_two_tool_workers(agentq_env, llm_server) -> None:
    # Three processes each: neither worker can take all six calls, so both must run some.
    with stack(
        agentq_env, broker_url=None, tool_workers=["tools-a", "tools-b"], tool_concurrency=3
    ) as (client, procs):
        # Different arguments: six identical calls would trip the loop detector.
        sleeps = [
            ScriptedCall(name="sleep", arguments={"seconds": 0.5 + i / 100}) for i in range(6)
        ]
        key = script(llm_server, Round(text="Six at once.", tool_calls=sleeps), Round(text="Done."))
        handle = client._start_turn(f"{key} go")
        events = collect(client, handle.turn_id, timeout_s=60)
        assert events[-1].type == "turn_finished", events[-1]
        finished = [e for e in events if e.type == "tool_finished"]
        assert len(finished) == 6
        assert {e.fields["status"] for e in finished} == {"ok"}
        nodes = {str(e.fields["worker"]).split("@", 1)[0].rsplit("-", 1)[0] for e in finished}
        assert nodes == {"tools-a", "tools-b"}, [e.fields["worker"] for e in finished]
        records = client.get(handle.turn_id)["invocations"]
        assert {r["worker"] for r in records} == {e.fields["worker"] for e in finished}
        # All six ran at once: far less than the 3 s they would take one after another.
        started = min(e.ts for e in events if e.type == "tool_started")
        span_s = max(e.ts for e in finished) - started
        assert span_s < 2.9, span_s
        assert procs["tools-a"].is_running() and procs["tools-b"].is_running()


def test_a_stream_worker_of_two_processes_streams_on_both(agentq_env, llm_server) -> None:
    """`agentq worker llm --processes 2`: two Celery nodes, one event loop each, both take
    rounds; the supervisor killed outright takes its workers along."""
    with RedisServer() as redis_server:
        url = redis_server.url
        env = {**agentq_env, "AGENTQ_REDIS_URL": url, "AGENTQ_BROKER_URL": url}
        tag = uuid.uuid4().hex[:6]
        turns = start_worker("turns", env=env, hostname=f"turns-{tag}@%h", concurrency=8)
        llm = start_worker(
            "llm", env=env, hostname=f"llm-{tag}@%h", extra_args=("--processes", "2")
        )
        try:
            workers = wait_for(
                lambda: pids if len(pids := llm.children_pids()) == 2 else None,
                30,
                message="two stream worker processes",
            )
            wait_for(lambda: llm.log_text().count(" ready.") == 2, 60, message="both ready")
            with process_env(env):
                client = Client()
                # Sixteen rounds of a second each at once: more than one process prefetches.
                slow = Round(text="x" * 20, chunk_size=2, chunk_delay_ms=100)
                keys = [script(llm_server, slow) for _ in range(16)]
                handles = [client._start_turn(f"{key} go") for key in keys]
                for h in handles:
                    events = collect(client, h.turn_id, timeout_s=60)
                    assert events[-1].type == "turn_finished", events[-1]
                    assert events[-1].fields["content"] == "x" * 20
                stats = client.app.control.inspect(timeout=5).stats() or {}
            served = {
                node.split("@", 1)[0]: s.get("total", {}).get("agentq.llm.round", 0)
                for node, s in stats.items()
                if node.startswith(f"llm-{tag}-")
            }
            assert set(served) == {f"llm-{tag}-1", f"llm-{tag}-2"}, stats.keys()
            assert min(served.values()) > 0, served
            # Each round streamed once. (A round a loaded machine left unclaimed for four
            # leases is delivered again, and the second delivery finds it claimed: counted
            # by Celery, never streamed.)
            streamed = [
                r for r in list(llm_server.requests) if any(key in json.dumps(r) for key in keys)
            ]
            assert len(streamed) == 16, len(streamed)
            # SIGKILL to the supervisor alone: its workers get SIGTERM from the kernel.
            os.kill(llm.pid, 9)
            for pid in workers:
                wait_for(
                    lambda pid=pid: (
                        not psutil.pid_exists(pid)
                        or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                    ),
                    30,
                    message=f"stream worker {pid} to go with its supervisor",
                )
        finally:
            llm.stop()
            turns.stop()


# --------------------------------------------------------------------------- RabbitMQ


@pytest.fixture(scope="module")
def amqp_broker() -> Iterator[str]:
    """The RabbitMQ to use. Skips when none answers, except on CI with RabbitMQ
    installed: there it is started (and stopped again by PID), and failing to is a failure."""
    if probe(AMQP_URL) is None:
        yield AMQP_URL
        return
    server = shutil.which("rabbitmq-server")
    if os.environ.get("CI") != "true" or server is None:
        pytest.skip(
            f"no RabbitMQ answers at {AMQP_URL} (set AGENTQ_TEST_AMQP_URL, or run "
            "with CI=true where rabbitmq-server is installed to start one)"
        )
    port = urlsplit(AMQP_URL).port or 5672
    # In the foreground, in its own process group, so it is stopped by PID afterwards.
    proc = start_process([server], env={"RABBITMQ_NODE_PORT": str(port)}, name="rabbitmq")
    try:
        try:
            wait_for(
                lambda: probe(AMQP_URL, timeout_s=2.0) is None or proc.poll() is not None,
                RABBITMQ_START_TIMEOUT_S,
                interval_s=1.0,
                message=f"RabbitMQ to answer at {AMQP_URL}",
            )
        except WaitTimeout:
            pytest.fail(
                f"started {server} but no broker answered in "
                f"{RABBITMQ_START_TIMEOUT_S} s:\n{proc.log_tail()}"
            )
        if proc.poll() is not None and probe(AMQP_URL) is not None:
            pytest.fail(f"{server} exited with code {proc.returncode}:\n{proc.log_tail()}")
        yield AMQP_URL
    finally:
        # The server runs under `su`, which moves it to a session of its own: SIGTERM each
        # descendant by PID (beam shuts down cleanly on it), then stop the group.
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(proc.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    child.terminate()
        proc.stop(timeout_s=30)


def _task_totals(client: Client, prefix: str) -> dict[str, int]:
    """Tasks run so far by the Celery nodes named `prefix...`, by task name."""
    out: dict[str, int] = {}
    for node, s in (client.app.control.inspect(timeout=5).stats() or {}).items():
        if node.startswith(prefix):
            for name, n in s.get("total", {}).items():
                out[name] = out.get(name, 0) + n
    return out


def test_a_round_the_caller_sends_needs_no_turn_worker(agentq_env) -> None:
    """The bench's `cost_per_call` sends its call as a model turn sends its calls: the
    process that learned of them takes the step (`start_round(step_here=True)`). A tool
    worker alone runs the call, and its child takes the step that ends the turn."""
    with RedisServer() as redis_server:
        url = redis_server.url
        env = {**agentq_env, "AGENTQ_REDIS_URL": url, "AGENTQ_BROKER_URL": url}
        tag = uuid.uuid4().hex[:6]
        tools = start_worker("tools", env=env, hostname=f"tools-{tag}@%h", concurrency=2)
        try:
            with process_env(env):
                calls = [ToolCall(id="c_here", name="echo", arguments='{"text": "here"}')]
                turn_id = start_round(calls, step_here=True)
                (res,) = wait_round(turn_id, calls, timeout_s=60)
                assert (res.status, res.content) == ("ok", "here")
                assert runtime.get_store().status(turn_id) == "finished"
                totals = _task_totals(Client(), f"tools-{tag}")
                assert totals == {"agentq.tool.echo": 1}, totals
        finally:
            tools.stop()


def test_rabbitmq_broker_runs_and_aborts_turns(agentq_env, llm_server, amqp_broker) -> None:
    with stack(
        agentq_env, broker_url=amqp_broker, tool_workers=["tools-amqp"], tool_concurrency=2
    ) as (client, procs):
        assert client.app.conf.broker_url.startswith("amqp://")
        key = script(
            llm_server,
            Round(
                text="Two tools.",
                tool_calls=[
                    ScriptedCall(name="echo", arguments={"text": "via rabbit"}),
                    ScriptedCall(name="sleep", arguments={"seconds": 0.3}),
                ],
            ),
            Round(text="Done over AMQP."),
        )
        handle = client._start_turn(f"{key} go")
        events = collect(client, handle.turn_id, timeout_s=60)
        assert events[-1].type == "turn_finished", events[-1]
        assert events[-1].fields["content"] == "Done over AMQP."
        turn = client.get(handle.turn_id)
        assert {r["status"] for r in turn["invocations"]} == {"ok"}
        assert all(r["worker"].startswith("tools-amqp-") for r in turn["invocations"])
        assert turn["history"][2]["content"] == "via rabbit"

        # Abort revokes over the broker's broadcast exchange: the stuck tool's process dies.
        key = script(
            llm_server, Round(tool_calls=[ScriptedCall(name="hang", arguments={"seconds": 60})])
        )
        handle = client._start_turn(f"{key} hang")
        started: list[Event] = []
        for ev in client.events(handle.turn_id, heartbeat_s=0.5):
            if ev is not None and ev.type == "tool_started":
                started.append(ev)
                break
        pid = int(started[0].fields["pid"])
        client.abort(handle.turn_id, handle.token)
        events = collect(client, handle.turn_id, timeout_s=60)
        assert events[-1].type == "turn_aborted"
        (res,) = [e for e in events if e.type == "tool_finished"]
        assert res.fields["status"] == "cancelled"
        wait_for(
            lambda: (
                not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            ),
            10,
            message=f"tool process {pid} killed",
            ignore=(psutil.NoSuchProcess,),
        )
        assert procs["tools-amqp"].is_running()


# --------------------------------------------------------------------------- agentq dev


def test_agentq_dev_once_runs_a_turn_and_leaves_nothing_behind() -> None:
    """The README's first command: embedded Redis, scripted model, all processes, one turn."""
    rc, out = run_dev_once(name="agentq-dev")
    assert rc == 0, out
    assert "no model configured (AGENTQ_LLM_BASE_URL unset): using the scripted demo model" in out
    assert "started an embedded redis-server" in out
    assert "turn finished" in out and "2 ok" in out, out
    # Flower got generated basic-auth credentials, shown once at start.
    assert re.search(r"Flower\s+\S+\s+\(basic auth, user agentq password \S{12,}\)", out), out
    listed = re.search(r"^\s+pids\s+(.*)$", out, re.MULTILINE)
    redis_pid = re.search(r"embedded redis-server \(pid (\d+)\)", out)
    assert listed is not None and redis_pid is not None, out
    pids = {int(p) for p in re.findall(r"\b(\d+)\b", listed.group(1))}
    pids.add(int(redis_pid.group(1)))
    assert len(pids) == 9, out  # model, 4 workers, beat, gateway, Flower, Redis
    assert re.search(r"webhooks\s+signed with whsec_\S+ \(generated\)", out), out
    # Each was the leader of its own process group: no member of those groups is left.
    left = [
        p.info
        for p in psutil.process_iter(["pid", "name", "status"])
        if _pgid(p.pid) in pids and p.info["status"] != psutil.STATUS_ZOMBIE
    ]
    assert not left, (left, out)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None
