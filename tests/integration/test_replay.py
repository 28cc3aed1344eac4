"""Retry and fork through real turn, stream and tool workers and the scripted model server:
what a retry reuses (no tool runs again, no answered round is sent again), what a fork plays
again, and that the source never changes."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from agentq import AsyncClient
from agentq import constants as k
from agentq.api import Client
from agentq.config import load_settings
from agentq.errors import ForkInvalid, NotRetryable
from agentq.events import Event
from agentq.local.processes import ManagedProcess, start_worker, wait_for
from agentq.local.redis_server import RedisServer
from agentq.models import Usage
from agentq.testing.openai_server import Round
from tests.helpers import (
    assert_valid_history,
    busy_factor,
    calls,
    collect,
    follow_until,
    process_env,
    script,
)

pytestmark = pytest.mark.integration

ROUNDS_WITH_CALLS = 4


def _requests(llm_server: Any, key: str) -> int:
    """Model requests the scripted server received for the script `key`."""
    return sum(
        1
        for body in list(llm_server.requests)
        if any(key in str(m.get("content") or "") for m in body.get("messages", []))
    )


def _runs(path: Path) -> list[str]:
    return path.read_text().split() if path.exists() else []


def _source_view(client: Client, turn_id: str) -> dict[str, Any]:
    """What must not change of a source: its state, history and invocation records."""
    view = client.get(turn_id)
    return {k: view[k] for k in ("state", "history", "invocations")}  # type: ignore[literal-required]


def _own_env(
    agentq_env: dict[str, str],
    redis_url: str,
    tools: str = "agentq.testing.tools,tests.replay_tools",
) -> dict[str, str]:
    """The suite's settings on a Redis (and broker) of the test's own, with `tools` loaded."""
    return {
        **agentq_env,
        "AGENTQ_REDIS_URL": redis_url,
        "AGENTQ_BROKER_URL": redis_url,
        "AGENTQ_TOOLS": tools,
    }


def _fleet(env: dict[str, str], tag: str, **kinds: int) -> list[ManagedProcess]:
    """Workers of `kinds` (kind: concurrency) on `env`, started at once."""
    with ThreadPoolExecutor(len(kinds)) as pool:
        futures = [
            pool.submit(
                start_worker,
                kind,
                env=env,
                hostname=f"{tag}-{kind}@%h",
                concurrency=n,
                ready_timeout_s=90,
            )
            for kind, n in kinds.items()
        ]
        return [f.result() for f in futures]


@pytest.fixture(scope="module")
def stack(agentq_env: dict[str, str]) -> Iterator[Client]:
    """Workers of their own (their own Redis and broker) that load the counting tools,
    which no other test's fleet offers its model."""
    with RedisServer() as redis_server:
        env = _own_env(agentq_env, redis_server.url)
        procs = _fleet(env, "replay", turns=16, llm=4, tools=4)
        try:
            with process_env(env):
                yield Client(load_settings())
        finally:
            for proc in procs:
                proc.stop()


@pytest.fixture()
def client(stack: Client) -> Client:
    return stack


@pytest.fixture()
def failed_turn(llm_server: Any, client: Client, tmp_path: Path) -> dict[str, Any]:
    """A turn of 4 rounds of 2 tool calls each whose 5th round fails (the model answers
    HTTP 400 once): its id, its script key, its tally file."""
    tally = tmp_path / "tally"
    rounds = [
        Round(
            tool_calls=calls(
                ("tally", {"path": str(tally), "label": f"r{n}a"}),
                ("tally", {"path": str(tally), "label": f"r{n}b"}),
            )
        )
        for n in range(1, ROUNDS_WITH_CALLS + 1)
    ]
    rounds.append(Round(text="All five.", fault="http_400", fault_times=1))
    key = script(llm_server, *rounds)
    handle = client._start_turn(f"{key} tally please")
    events = collect(client, handle.turn_id)
    assert events[-1].type == "turn_error", events[-1].fields
    assert len(_runs(tally)) == 2 * ROUNDS_WITH_CALLS
    assert _requests(llm_server, key) == ROUNDS_WITH_CALLS + 1
    return {"turn_id": handle.turn_id, "key": key, "tally": tally}


def test_retry_sends_only_the_failed_round_and_runs_no_tool_again(
    failed_turn: dict[str, Any], llm_server: Any, client: Client
) -> None:
    source, key, tally = failed_turn["turn_id"], failed_turn["key"], failed_turn["tally"]
    before = _source_view(client, source)
    retry = client.retry(source)
    events = collect(client, retry.turn_id)
    started = events[0]
    assert started.type == "turn_started"
    assert started.fields["retry_of"] == source and started.fields["from_round"] == 5
    assert events[-1].type == "turn_finished" and events[-1].fields["content"] == "All five."
    assert _requests(llm_server, key) == ROUNDS_WITH_CALLS + 2  # exactly one round more
    assert len(_runs(tally)) == 2 * ROUNDS_WITH_CALLS  # no tool ran again
    assert not [e for e in events if e.type == "tool_started"]
    view = client.get(retry.turn_id)
    assert view["history"][:-1] == before["history"]
    assert view["history"][-1]["content"] == "All five."
    assert_valid_history(view["history"])
    assert view["state"]["retry_of"] == source
    assert view["state"]["spent_prompt_tokens"] > before["state"]["spent_prompt_tokens"]
    assert _source_view(client, source) == before
    # Finished: nothing left to retry; a fork may still play it again.
    with pytest.raises(NotRetryable) as refused:
        client.retry(retry.turn_id)
    assert refused.value.status == "finished"


def test_async_client_retries_and_forks(
    failed_turn: dict[str, Any], agentq_env: dict[str, str]
) -> None:
    source = failed_turn["turn_id"]

    async def main() -> tuple[str, str]:
        async with AsyncClient() as aclient:
            retried = await (await aclient.retry(source)).result(30)
            forked = await aclient.fork(source, 5, edit={"model": "model-forked"})
            async for ev in forked.events():
                if ev.type == "llm_started":
                    assert ev.fields["model"] == "model-forked"
            return retried.text, (await forked.result(30)).text

    assert asyncio.run(main()) == ("All five.", "All five.")


def test_fork_at_round_3_plays_rounds_3_to_5_and_their_tools_only(
    failed_turn: dict[str, Any], llm_server: Any, client: Client
) -> None:
    source, key, tally = failed_turn["turn_id"], failed_turn["key"], failed_turn["tally"]
    before = _source_view(client, source)
    sent = _requests(llm_server, key)
    fork = client.fork(source, 3)
    events = collect(client, fork.turn_id)
    assert events[0].fields["fork_of"] == source and events[0].fields["from_round"] == 3
    assert events[-1].type == "turn_finished", events[-1].fields
    assert _requests(llm_server, key) == sent + 3
    assert sorted(_runs(tally)[2 * ROUNDS_WITH_CALLS :]) == ["r3a", "r3b", "r4a", "r4b"]
    history = client.get(fork.turn_id)["history"]
    assert_valid_history(history)
    assert history[:5] == before["history"][:5]  # the prompt and rounds 1 and 2
    assert _source_view(client, source) == before
    with pytest.raises(ForkInvalid) as bad:
        client.fork(source, 9)
    assert bad.value.field == "at_round" and "1..5" in bad.value.message


def test_fork_edits_a_tool_result_and_the_prompt(
    failed_turn: dict[str, Any], llm_server: Any, client: Client
) -> None:
    source, key = failed_turn["turn_id"], failed_turn["key"]
    history = client.get(source)["history"]
    call_id = history[1]["tool_calls"][0]["id"]
    fork = client.fork(
        source,
        2,
        edit={
            "message": f"{key} tally, but differently",
            "tool_result": {"call_id": call_id, "content": "what if"},
            "instructions": "You are a forked agent.",
        },
    )
    collect(client, fork.turn_id)
    forked = client.get(fork.turn_id)["history"]
    assert forked[0]["content"] == f"{key} tally, but differently"
    assert forked[2]["content"] == "what if"
    sent = [b for b in list(llm_server.requests) if "differently" in json.dumps(b["messages"])]
    assert sent, "the fork sent no round"
    assert sent[0]["messages"][0] == {"role": "system", "content": "You are a forked agent."}
    assert sent[0]["messages"][3]["content"] == "what if"
    with pytest.raises(ForkInvalid) as bad:
        client.fork(source, 2, edit={"tool_result": {"call_id": "call_nope", "content": "x"}})
    assert bad.value.field == "edit.tool_result.call_id"


def _abort_mid_round(
    client: Client,
    llm_server: Any,
    tmp_path: Path,
    round_calls: list[tuple[str, Any]],
    **start: Any,
) -> tuple[str, Path, Path, str]:
    """A turn (started with `start`'s fields) aborted while its first round's held calls
    run and its `fast` call settled: (its id, its tally file, its hold file, its key)."""
    tally, hold = tmp_path / "tally", tmp_path / "hold"
    hold.touch()
    key = script(llm_server, Round(tool_calls=calls(*round_calls)), Round(text="Round two."))
    handle = client._start_turn(key, **start)
    held = sum(1 for _, a in round_calls if a.get("hold"))
    seen: set[str] = set()

    def ready(ev: Event) -> bool:
        if ev.type == "tool_finished" and ev.fields["tool"] == "tally":
            seen.add("fast")
        if ev.type == "tool_started" and ev.fields["call_id"]:
            seen.add(ev.fields["call_id"])
        return "fast" in seen and len(seen) >= held + 2

    collect(client, handle.turn_id, until=ready)
    # tool_started comes before the tool's body runs: abort once every call has tallied.
    labels = sorted(a["label"] for _, a in round_calls)
    wait_for(lambda: sorted(_runs(tally)) == labels, 30, message="every call tallied")
    client.abort(handle.turn_id, handle.token)
    follow_until(client, handle.turn_id, "turn_aborted")
    return handle.turn_id, tally, hold, key


def test_retry_of_a_round_cut_short_runs_only_its_unsettled_calls(
    llm_server: Any, client: Client, tmp_path: Path
) -> None:
    tally, hold = tmp_path / "tally", tmp_path / "hold"
    source, tally, hold, _ = _abort_mid_round(
        client,
        llm_server,
        tmp_path,
        [
            ("tally", {"path": str(tally), "label": "fast"}),
            ("tally", {"path": str(tally), "label": "held", "hold": str(hold)}),
            ("tally_again", {"path": str(tally), "label": "again", "hold": str(hold)}),
        ],
    )
    hold.unlink()
    before = _source_view(client, source)
    assert sorted(_runs(tally)) == ["again", "fast", "held"]
    retry = client.retry(source)
    events = collect(client, retry.turn_id)
    assert events[-1].type == "turn_finished", events[-1].fields
    assert events[0].fields["from_round"] == 1
    finished = {e.fields["tool"]: e.fields["status"] for e in events if e.type == "tool_finished"}
    # The idempotent call ran again; the other one that ran settles lost, unrun.
    assert finished == {"tally": "lost", "tally_again": "ok"}
    assert sorted(_runs(tally)) == ["again", "again", "fast", "held"]
    view = client.get(retry.turn_id)
    assert_valid_history(view["history"])
    results = [
        json.loads(m["content"]) if m["content"].startswith("{") else m["content"]
        for m in view["history"]
        if m["role"] == "tool"
    ]
    assert results[0] == "tallied fast" and results[1]["status"] == "lost"
    assert _source_view(client, source) == before
    # rerun_lost: every call that ran without a result runs again.
    again = client.retry(source, rerun_lost=True)
    events = collect(client, again.turn_id)
    assert events[-1].type == "turn_finished", events[-1].fields
    assert sorted(_runs(tally)) == ["again", "again", "again", "fast", "held", "held"]
    assert _source_view(client, source) == before


PROBE_TOOLS = '''
import os
import time

from agentq import tool


@tool(timeout_s=60)
def probe(path: str, hold: str = "") -> str:
    """Say which version of this module ran."""
    with open(path, "a") as f:
        f.write("{version}\\n")
    while hold and os.path.exists(hold):
        time.sleep(0.02)
    return "probe {version}"
'''


def test_retry_after_the_fleet_died_mid_round_runs_the_fixed_tool(
    llm_server: Any, agentq_env: dict[str, str], tmp_path: Path
) -> None:
    """The turn worker and the tool worker are killed while a round's call runs, the fleet
    comes back with that tool's module changed: the aborted turn's retry reuses the call
    that settled and runs the other with the new code."""
    (tmp_path / "probe_tools.py").write_text(PROBE_TOOLS.replace("{version}", "v1"))
    runs, hold = tmp_path / "runs", tmp_path / "hold"
    hold.touch()
    key = script(
        llm_server,
        Round(
            tool_calls=calls(
                ("probe", {"path": str(runs), "hold": str(hold)}), ("echo", {"text": "kept"})
            )
        ),
        Round(text="Probed."),
    )
    with RedisServer() as redis_server:
        env = {
            **_own_env(agentq_env, redis_server.url, "agentq.testing.tools,probe_tools"),
            "PYTHONPATH": os.pathsep.join([str(tmp_path), agentq_env.get("PYTHONPATH", "")]),
        }
        procs = _fleet(env, "first", turns=4, llm=2, tools=2)
        try:
            with process_env(env):
                client = Client(load_settings())
                handle = client._start_turn(key)
                tid = handle.turn_id
                seen: set[str] = set()

                def mid_round(ev: Event) -> bool:
                    if ev.type in ("tool_started", "tool_finished"):
                        seen.add(f"{ev.type}:{ev.fields['tool']}")
                    return {"tool_started:probe", "tool_finished:echo"} <= seen

                collect(client, tid, until=mid_round)
                for proc in procs:
                    proc.kill()
                client.abort(tid, handle.token)  # recorded: no turn worker takes it yet
                (tmp_path / "probe_tools.py").write_text(PROBE_TOOLS.replace("{version}", "v2"))
                hold.unlink()
                procs = _fleet(env, "second", turns=4, llm=2, tools=2)
                follow_until(client, tid, "turn_aborted")
                assert _runs(runs) == ["v1"]
                retry = client.retry(tid, rerun_lost=True)
                events = collect(client, retry.turn_id)
                assert events[-1].type == "turn_finished", events[-1].fields
                started = [e.fields["tool"] for e in events if e.type == "tool_started"]
                assert started == ["probe"]  # echo's result is reused
                assert _runs(runs) == ["v1", "v2"]
                tools = [
                    m["content"]
                    for m in client.get(retry.turn_id)["history"]
                    if m["role"] == "tool"
                ]
                assert tools == ["probe v2", "kept"]
        finally:
            for proc in procs:
                proc.stop()


def _command_calls(r: Any) -> dict[str, int]:
    return {name: int(v["calls"]) for name, v in r.info("commandstats").items()}


def _spent(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Commands run between two reads of INFO commandstats (the second read's INFO aside)."""
    spent = {c: n - before.get(c, 0) for c, n in after.items() if n != before.get(c, 0)}
    spent["cmdstat_info"] = spent.get("cmdstat_info", 1) - 1
    return {c: n for c, n in spent.items() if n}


def test_retry_and_fork_start_fast_and_read_the_source_once(
    failed_turn: dict[str, Any], llm_server: Any, client: Client, agentq_env: dict[str, str]
) -> None:
    source = failed_turn["turn_id"]
    client.retry(source)  # the scripts and the broker's connection, once
    took: dict[str, list[float]] = {"retry": [], "fork": []}
    started: list[str] = []
    for _ in range(100):
        for kind in took:
            t0 = time.perf_counter()
            turn = client.retry(source) if kind == "retry" else client.fork(source, 5)
            took[kind].append(time.perf_counter() - t0)
            started.append(turn.turn_id)
    for tid in started:
        assert collect(client, tid)[-1].type == "turn_finished"
    # The goal is 50 ms p99 (printed above, for docs/retry.md); the suite's bound is four
    # times it, scaled by the load, so a hiccup of a loaded machine fails nothing.
    bound_s = 0.2 * busy_factor()
    for kind, times in took.items():
        times.sort()
        p50, p99 = times[49], times[98]
        print(f"{kind} start: p50 {p50 * 1000:.1f} ms, p99 {p99 * 1000:.1f} ms over 100")
        assert p99 <= bound_s, (kind, p99)
    # The same commands whatever the history's length: one read, one write.
    small_key = script(llm_server, Round(text="small", fault="http_400"))
    small = client._start_turn(small_key).turn_id
    assert collect(client, small)[-1].type == "turn_error"
    session = client._store.redis
    with RedisServer() as quiet:
        env = {"AGENTQ_REDIS_URL": quiet.url, "AGENTQ_BROKER_URL": quiet.url}
        with process_env(env):
            alone = Client(load_settings())
            r = alone._store.redis
            for tid in (source, small):
                r.restore(k.turn_key(tid), 0, session.dump(k.turn_key(tid)))
            alone.retry(small)
            spent = {}
            for name, tid in (("small", small), ("big", source)):
                before = _command_calls(r)
                alone.retry(tid)
                spent[name] = _spent(before, _command_calls(r))
            assert spent["small"] == spent["big"], spent
            assert spent["big"]["cmdstat_hgetall"] == 1


def test_a_retry_never_resets_a_budget(llm_server: Any, client: Client) -> None:
    used = Usage(prompt_tokens=500, completion_tokens=10, total_tokens=510)
    key = script(
        llm_server,
        Round(tool_calls=calls(("echo", {"text": "paid"})), usage=used),
        Round(text="Within budget.", usage=used),
    )
    source = client._start_turn(key, max_tokens=600).turn_id
    ended = collect(client, source)[-1]
    assert ended.type == "turn_error" and ended.fields["code"] == "budget_exceeded"
    again = collect(client, client.retry(source).turn_id)
    assert again[-1].type == "turn_error" and again[-1].fields["code"] == "budget_exceeded"
    assert not [e for e in again if e.type == "llm_started"]
    raised = client.retry(source, max_tokens=5000)
    events = collect(client, raised.turn_id)
    assert events[-1].fields["content"] == "Within budget."
    assert client.get(raised.turn_id)["state"]["spent_prompt_tokens"] == 1000


def _settled(client: Client, conv: str) -> list[dict[str, Any]]:
    """The conversation's messages once no turn holds it."""
    wait_for(lambda: client.conversation(conv, operator=True)["status"] == "idle", 15)
    return list(client.conversation(conv, operator=True)["messages"])


def test_a_retry_of_a_conversations_last_turn_replaces_its_exchange(
    llm_server: Any, client: Client
) -> None:
    key = script(
        llm_server,
        Round(text="First answer."),
        Round(text="Second answer.", fault="http_400", fault_times=1),
    )
    conv = f"c-{os.urandom(6).hex()}"
    first = client._start_turn(f"{key} one", conversation_id=conv, operator=True)
    assert collect(client, first.turn_id)[-1].type == "turn_finished"
    second = client._start_turn("two", conversation_id=conv, operator=True)
    assert collect(client, second.turn_id)[-1].type == "turn_error"
    before = _settled(client, conv)
    assert [m["role"] for m in before] == ["user", "assistant", "user"]
    sent = _requests(llm_server, key)
    retry = client.retry(second.turn_id)
    assert retry.handle.conversation_id == conv and retry.handle.branched is False
    assert collect(client, retry.turn_id)[-1].fields["content"] == "Second answer."
    history = _settled(client, conv)
    # Turn 1's exchange, then the retry's, which replaced the source's: "two" once.
    assert history == [*before, {"role": "assistant", "content": "Second answer."}]
    assert_valid_history(history)
    assert _requests(llm_server, key) == sent + 1
    assert client.get(retry.turn_id)["history"] == history
    # The conversation goes on after the retry.
    third = client._start_turn("three", conversation_id=conv, operator=True)
    collect(client, third.turn_id)
    assert [m["content"] for m in _settled(client, conv) if m["role"] == "user"] == [
        f"{key} one",
        "two",
        "three",
    ]


def test_a_retry_in_place_of_a_turn_aborted_mid_call_runs_the_call_again(
    llm_server: Any, client: Client, tmp_path: Path
) -> None:
    tally, hold = tmp_path / "tally", tmp_path / "hold"
    conv = f"c-{os.urandom(6).hex()}"
    source, tally, hold, _ = _abort_mid_round(
        client,
        llm_server,
        tmp_path,
        [
            ("tally", {"path": str(tally), "label": "fast"}),
            ("tally_again", {"path": str(tally), "label": "again", "hold": str(hold)}),
        ],
        conversation_id=conv,
        operator=True,
    )
    hold.unlink()
    aborted = _settled(client, conv)
    assert [m["role"] for m in aborted] == ["user", "assistant", "tool", "tool"]
    assert "cancelled" in aborted[3]["content"]
    retry = client.retry(source)
    assert retry.handle.conversation_id == conv and retry.handle.branched is False
    events = collect(client, retry.turn_id)
    assert events[-1].fields["content"] == "Round two."
    assert [e.fields["status"] for e in events if e.type == "tool_finished"] == ["ok"]
    assert sorted(_runs(tally)) == ["again", "again", "fast"]  # the cancelled call ran again
    history = _settled(client, conv)
    assert [m["role"] for m in history] == ["user", "assistant", "tool", "tool", "assistant"]
    ids = [m["tool_call_id"] for m in history if m["role"] == "tool"]
    assert sorted(ids) == sorted(c["id"] for c in history[1]["tool_calls"])  # one each
    assert history[3]["content"] == "tallied again"
    assert_valid_history(history)


def test_a_retry_of_a_turn_another_followed_branches(llm_server: Any, client: Client) -> None:
    key = script(llm_server, Round(text="An answer.", fault="http_400", fault_times=1))
    conv = f"c-{os.urandom(6).hex()}"
    source = client._start_turn(f"{key} one", conversation_id=conv, operator=True)
    assert collect(client, source.turn_id)[-1].type == "turn_error"
    after = client._start_turn("two", conversation_id=conv, operator=True)
    assert collect(client, after.turn_id)[-1].type == "turn_finished"
    original = _settled(client, conv)
    retry = client.retry(source.turn_id)
    branch = retry.handle.conversation_id
    assert retry.handle.branched is True and branch and branch.startswith(f"{conv}.b")
    assert collect(client, retry.turn_id)[-1].type == "turn_finished"
    assert _settled(client, conv) == original
    branched = _settled(client, branch)
    assert [m["role"] for m in branched] == ["user", "assistant"]
    assert branched[0]["content"] == f"{key} one"


def test_a_branch_retry_aborted_before_its_first_step_leaves_a_valid_history(
    llm_server: Any, agentq_env: dict[str, str], tmp_path: Path
) -> None:
    """A retry that branches holds its source's messages aside until its first step; an
    abort that comes first settles the calls they leave open, so the branch's history
    gives every call a result."""
    with RedisServer() as redis_server:
        env = _own_env(agentq_env, redis_server.url)
        procs = _fleet(env, "branch", turns=1, llm=1, tools=2)
        try:
            with process_env(env):
                client = Client(load_settings())
                conv = f"c-{os.urandom(6).hex()}"
                source, _, hold, _ = _abort_mid_round(
                    client,
                    llm_server,
                    tmp_path,
                    [
                        ("tally", {"path": str(tmp_path / "tally"), "label": "fast"}),
                        (
                            "tally_again",
                            {
                                "path": str(tmp_path / "tally"),
                                "label": "again",
                                "hold": str(tmp_path / "hold"),
                            },
                        ),
                    ],
                    conversation_id=conv,
                    operator=True,
                )
                hold.unlink()
                after = client._start_turn("two", conversation_id=conv, operator=True)
                assert collect(client, after.turn_id)[-1].type == "turn_finished"
                turns = next(p for p in procs if "turns" in " ".join(p.argv))
                turns.kill()  # the retry's first step waits in the broker
                retry = client.retry(source)
                assert retry.handle.branched is True and retry.handle.conversation_id
                client.abort(retry.turn_id, retry.token)  # recorded before any step
                procs.append(_fleet(env, "branch-again", turns=1)[0])
                follow_until(client, retry.turn_id, "turn_aborted")
                branch = _settled(client, retry.handle.conversation_id)
        finally:
            for proc in procs:
                proc.stop()
    assert [m["role"] for m in branch] == ["user", "assistant", "tool", "tool"]
    assert "cancelled" in branch[3]["content"]
    assert_valid_history(branch)
