"""What a user is told when the fleet lacks a worker: which queues none consumes, what to
start, and why one died."""

from __future__ import annotations

import json
import time

import fakeredis

from agentq import constants as k
from agentq.fleet import presence


def seen(redis: fakeredis.FakeRedis, host: str, queues: list[str], age_s: float) -> None:
    at = time.time() - age_s
    redis.hset(k.PRESENCE, host, json.dumps({"role": "x", "queues": queues, "pid": 1, "at": at}))


def test_only_workers_heard_from_lately_count_and_long_silent_ones_are_forgotten() -> None:
    redis = fakeredis.FakeRedis()
    seen(redis, "t1", [k.QUEUE_TURNS], 0.5)
    seen(redis, "l1", [k.QUEUE_LLM], k.WORKER_ALIVE_TTL_S + 1)
    seen(redis, "old", [k.QUEUE_IO], presence.PRUNE_AFTER_S + 1)
    redis.hset(k.PRESENCE, "junk", "not json")
    assert presence.live_queues(redis) == {k.QUEUE_TURNS: ["t1"]}
    assert presence.missing(redis) == [k.QUEUE_LLM]
    assert presence.missing(redis, [k.QUEUE_IO, "mine", k.QUEUE_IO]) == [k.QUEUE_IO, "mine"]
    assert not redis.hexists(k.PRESENCE, "old") and redis.hexists(k.PRESENCE, "l1")


def test_the_advice_names_the_command_for_each_queue() -> None:
    assert presence.advice([k.QUEUE_TURNS, "gpu"]) == (
        "no live worker consumes agentq.turns (start `agentq worker turns`), gpu (start the "
        "tool or I/O worker whose tools use it)"
    )
    assert presence.kinds([k.QUEUE_LLM, k.QUEUE_WEBHOOKS, k.QUEUE_IO, "gpu"]) == [
        "llm",
        "io",
        "gpu",
    ]
    view = presence.workers_view({k.QUEUE_LLM: ["a", "b"]})
    assert view["missing_workers"] == ["turns"] and view["workers"][k.QUEUE_LLM] == 2


def test_agentq_dev_names_why_a_worker_died_in_one_line() -> None:
    from agentq.local.processes import last_error

    log = (
        "[12:00:00: INFO/MainProcess] Connected\n"
        "Traceback (most recent call last):\n"
        '  File "celery/utils/functional.py", line 436, in head_from_fun\n'
        "    def tool_everything__get-annotated-message(self, **kwargs):\n"
        "SyntaxError: expected '('\n"
    )
    assert last_error(log) == "SyntaxError: expected '('"
    assert last_error("agentq.errors.ConfigError: AGENTQ_X: bad") == (
        "agentq.errors.ConfigError: AGENTQ_X: bad"
    )
    assert last_error("ready.\nall fine") == ""


def test_the_watch_speaks_only_when_what_is_missing_changes() -> None:
    needs: list[str] | None = [k.QUEUE_TURNS, k.QUEUE_LLM, k.QUEUE_IO]
    redis = fakeredis.FakeRedis()
    seen(redis, "t", [k.QUEUE_TURNS, k.QUEUE_LLM], 0)
    said: list[str] = []
    watch = presence.Watch("t1", lambda: needs, redis, said.append)
    watch.look()
    watch.look()
    assert said == ["turn t1 waits: no live worker consumes agentq.io (start `agentq worker io`)"]
    seen(redis, "i", [k.QUEUE_IO], 0)
    watch.look()
    assert said[-1] == "turn t1: the workers it needs are alive now"
    needs = None
    watch.look()
    assert watch.done.is_set() and len(said) == 2
