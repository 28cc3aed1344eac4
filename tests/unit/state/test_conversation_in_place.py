"""The scripts behind a retry in place (`IN_PLACE`, and `TAKE` and `RELEASE` for the turn
it admits), on fakeredis: the retry holds the conversation only while its source is the
last turn and nobody holds or waits, reads the history before the source's exchange, and
its exchange replaces the source's, in every order with the turns around it."""

from __future__ import annotations

import json
from typing import Any

import fakeredis

from agentq import constants as k
from agentq.models import MultitaskMode
from agentq.state.conversation_lua import Admit, InPlace, Release, ReleaseArgs, Take
from agentq.state.conversations import Admitted, Conversations, binding

CID = "c-1"
OWNER = binding("owner", "alice")


def convs() -> Conversations:
    return Conversations(fakeredis.FakeRedis(), ttl_s=600)


def msg(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def admit(c: Conversations, turn_id: str, mode: MultitaskMode = "enqueue") -> Admitted:
    return c.admit(CID, turn_id, mode, new_bytes=10, max_bytes=10**6, claim=OWNER, may=(OWNER,))


def take(c: Conversations, turn_id: str) -> list[dict[str, Any]]:
    outcome, history, _ = c.take(CID, turn_id)
    assert outcome is Take.HOLDS
    return history


def release(
    c: Conversations, turn_id: str, base: int, texts: list[str], *, rolled_back: bool = False
) -> tuple[Release, str | None]:
    messages = [json.dumps(msg(t)) for t in texts]
    args = ReleaseArgs(turn_id, base, 600, 1.0, CID, rolled_back, [], messages)
    return c.release(CID, args)


def run(c: Conversations, turn_id: str, texts: list[str]) -> None:
    """A turn that takes the conversation and appends its exchange."""
    assert admit(c, turn_id).outcome is Admit.RUN
    base = len(take(c, turn_id))
    assert release(c, turn_id, base, texts)[0] is Release.COMMITTED


def history(c: Conversations) -> list[str]:
    return [m["content"] for m in c.view(CID).messages]


def stored_bytes(c: Conversations) -> int:
    raw = c.redis.hget(k.conversation_key(CID, "meta"), "bytes")
    return int(raw or 0)


def all_bytes(c: Conversations) -> int:
    return sum(len(m) for m in c.redis.lrange(k.conversation_key(CID), 0, -1))


def test_a_retry_of_the_last_turn_replaces_its_exchange() -> None:
    c = convs()
    run(c, "a", ["a1", "a2"])
    run(c, "b", ["b1"])
    assert c.admit_in_place(CID, "r", "a") == (InPlace.MOVED_ON, None)  # b followed a
    assert c.admit_in_place(CID, "r", "b") == (InPlace.RUN, None)
    assert take(c, "r") == [msg("a1"), msg("a2")]  # before b's exchange
    assert release(c, "r", 2, ["b1", "r1", "r2"]) == (Release.COMMITTED, None)
    assert history(c) == ["a1", "a2", "b1", "r1", "r2"]
    assert stored_bytes(c) == all_bytes(c)
    # The retry is the last turn now: a second retry of b branches, one of r goes on.
    assert c.admit_in_place(CID, "r2", "b")[0] is InPlace.MOVED_ON
    assert c.admit_in_place(CID, "r2", "r")[0] is InPlace.RUN
    assert take(c, "r2") == [msg("a1"), msg("a2")]


def test_the_first_turn_replaced_reads_no_history() -> None:
    c = convs()
    run(c, "a", ["a1"])
    assert c.admit_in_place(CID, "r", "a")[0] is InPlace.RUN
    assert take(c, "r") == []
    release(c, "r", 0, ["a1", "r1"])
    assert history(c) == ["a1", "r1"]
    assert stored_bytes(c) == all_bytes(c)


def test_a_turn_that_holds_or_waits_keeps_the_retry_out() -> None:
    c = convs()
    run(c, "a", ["a1"])
    assert admit(c, "b").outcome is Admit.RUN
    assert c.admit_in_place(CID, "r", "a") == (InPlace.MOVED_ON, "b")
    release(c, "b", 1, [])  # b ended without an exchange: a is no longer the last turn
    assert c.admit_in_place(CID, "r", "a")[0] is InPlace.MOVED_ON
    c2 = convs()
    run(c2, "a", ["a1"])
    c2.redis.rpush(k.conversation_key(CID, "queue"), "q")  # one waits (as a hand-off in between)
    assert c2.admit_in_place(CID, "r", "a") == (InPlace.MOVED_ON, None)
    assert c.admit_in_place(CID, "r", "gone")[0] is InPlace.MOVED_ON
    assert convs().admit_in_place(CID, "r", "a")[0] is InPlace.GONE


def test_turns_that_come_while_the_retry_holds_it_wait_and_read_its_exchange() -> None:
    c = convs()
    run(c, "a", ["a1", "a2"])
    assert c.admit_in_place(CID, "r", "a")[0] is InPlace.RUN
    assert admit(c, "n").outcome is Admit.QUEUED
    assert take(c, "r") == []
    assert release(c, "r", 0, ["a1", "r1"]) == (Release.COMMITTED, "n")
    assert take(c, "n") == [msg("a1"), msg("r1")]
    release(c, "n", 2, ["n1"])
    assert history(c) == ["a1", "r1", "n1"]
    assert c.redis.hget(k.conversation_key(CID, "meta"), "conflicts") is None


def test_a_retry_that_never_read_the_history_changes_nothing_and_may_be_retried() -> None:
    c = convs()
    run(c, "a", ["a1"])
    run(c, "b", ["b1", "b2"])
    assert c.admit_in_place(CID, "r", "b")[0] is InPlace.RUN
    assert release(c, "r", -1, []) == (Release.COMMITTED, None)  # aborted before its step
    assert history(c) == ["a1", "b1", "b2"]
    # The slot it held is still b's exchange, which a retry of r replaces.
    assert c.admit_in_place(CID, "r2", "r")[0] is InPlace.RUN
    assert take(c, "r2") == [msg("a1")]
    release(c, "r2", 1, ["b1", "x"])
    assert history(c) == ["a1", "b1", "x"]
    assert stored_bytes(c) == all_bytes(c)


def test_a_rolled_back_retry_keeps_the_source_s_exchange() -> None:
    c = convs()
    run(c, "a", ["a1"])
    assert c.admit_in_place(CID, "r", "a")[0] is InPlace.RUN
    assert take(c, "r") == []
    assert admit(c, "n", "rollback").outcome is Admit.INTERRUPTED
    assert release(c, "r", 0, ["a1", "r1"], rolled_back=True) == (Release.DROPPED, "n")
    assert history(c) == ["a1"]
    assert take(c, "n") == [msg("a1")]


def test_a_rolled_back_source_is_followed_by_the_turn_that_rolled_it_back() -> None:
    c = convs()
    run(c, "a", ["a1"])
    assert admit(c, "b").outcome is Admit.RUN
    assert admit(c, "n", "rollback").outcome is Admit.INTERRUPTED
    assert release(c, "b", 1, ["b1"], rolled_back=True) == (Release.DROPPED, "n")
    assert c.admit_in_place(CID, "r", "b") == (InPlace.MOVED_ON, "n")
    release(c, "n", 1, ["n1"])
    assert c.admit_in_place(CID, "r", "b")[0] is InPlace.MOVED_ON
    assert history(c) == ["a1", "n1"]


def test_a_turn_that_held_it_but_never_read_is_replaced_in_place() -> None:
    c = convs()
    run(c, "a", ["a1"])
    assert admit(c, "w").outcome is Admit.RUN
    release(c, "w", -1, ["w1"])  # aborted as it was handed the conversation
    assert c.admit_in_place(CID, "r", "w")[0] is InPlace.RUN
    assert take(c, "r") == [msg("a1")]
    release(c, "r", 1, ["w1", "r1"])
    assert history(c) == ["a1", "w1", "r1"]


def test_a_listing_past_expired_conversations_skips_none_that_live() -> None:
    c = convs()
    r = c.redis
    for i in range(6):  # newest first: three expired, then three live
        cid = f"c-{i}"
        r.zadd(k.CONVERSATIONS_INDEX, {cid: 100.0 - i})
        if i >= 3:
            r.set(k.conversation_key(cid, "owner"), OWNER)
    # A page of limit * 2 = 2 entries: the first two pages meet the expired ones.
    rows = c.listing(owner="alice", any_owner=False, limit=1)
    assert [row["conversation_id"] for row in rows] == ["c-3"]
    rows = c.listing(owner="alice", any_owner=False, limit=3)
    assert [row["conversation_id"] for row in rows] == ["c-3", "c-4", "c-5"]
    assert r.zcard(k.CONVERSATIONS_INDEX) == 3  # the expired ones were pruned
