"""Turn ids by prefix (agentq.state.listing) and how the CLI shows and resolves them, on
fakeredis: the index of the turn's shard only, live turns only, newest first, bounded."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import fakeredis
import pytest
from rich.console import Console

from agentq import constants as k
from agentq.cli.ids import resolve_turn_id, short_id
from agentq.cli.show import turns_table
from agentq.errors import AmbiguousTurnId
from agentq.state import listing
from agentq.state.listing import ID_SCAN_COUNT, find_turn_ids


class Counting:
    """A Redis client that records the keys its ZSCANs read."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self.scanned: list[str] = []

    def zscan(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self.scanned.append(key)
        return self.client.zscan(key, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def store_turn(r: Any, turn_id: str, created_at: float, *, alive: bool = True) -> None:
    r.zadd(k.shard_key(k.TURNS_INDEX, turn_id), {turn_id: created_at})
    if alive:
        r.hset(k.turn_key(turn_id), "status", '"running"')


@pytest.fixture()
def four_shards() -> Iterator[None]:
    k.set_shard_count(4)
    yield
    k.set_shard_count(None)


def test_a_prefix_finds_its_live_turns_newest_first() -> None:
    r = fakeredis.FakeRedis()
    stem = secrets.token_hex(4)
    a, b = stem + "a" + secrets.token_hex(12)[:23], stem + "b" + secrets.token_hex(12)[:23]
    gone = stem + "c" + secrets.token_hex(12)[:23]
    store_turn(r, a, 100.0)
    store_turn(r, b, 200.0)
    store_turn(r, gone, 300.0, alive=False)  # expired: its index entry is not pruned yet
    for other in range(50):
        store_turn(r, secrets.token_hex(16), float(other))
    assert find_turn_ids(r, stem) == ([b, a], False)
    assert find_turn_ids(r, stem.upper() + "A") == ([a], False)
    assert find_turn_ids(r, a) == ([a], False)
    assert find_turn_ids(r, gone) == ([], False)
    assert find_turn_ids(r, gone[:12]) == ([], False)
    for nothing in ("", "xyz", stem + "*", "0" * 33):
        assert find_turn_ids(r, nothing) == ([], False)


def test_four_hex_digits_read_one_shard_and_fewer_read_them_all(four_shards: None) -> None:
    r = Counting(fakeredis.FakeRedis())
    turn_id = secrets.token_hex(16)
    store_turn(r, turn_id, time.time())
    assert find_turn_ids(r, turn_id[:6]) == ([turn_id], False)
    assert r.scanned == [k.shard_key(k.TURNS_INDEX, turn_id)]
    r.scanned.clear()
    assert find_turn_ids(r, turn_id[:2])[0][:1] == [turn_id]
    assert sorted(r.scanned) == sorted(k.shard_key(k.TURNS_INDEX, s) for s in range(4))


def test_the_scan_stops_at_the_limit_and_at_scan_max(monkeypatch: pytest.MonkeyPatch) -> None:
    r = Counting(fakeredis.FakeRedis())
    # Enough entries that the index is a skiplist, read ID_SCAN_COUNT at a time.
    for i in range(3 * ID_SCAN_COUNT):
        store_turn(r, "ab" + secrets.token_hex(15), float(i))
    found, more = find_turn_ids(r, "ab", limit=3)
    assert len(found) == 3 and more
    assert len(r.scanned) == 1
    r.scanned.clear()
    monkeypatch.setattr(listing, "ID_SCAN_MAX", ID_SCAN_COUNT)
    found, more = find_turn_ids(r, "abffffffff", limit=3)
    assert more and len(r.scanned) == 1


class FakeClient:
    """What resolve_turn_id reads of a Client: its store's Redis."""

    def __init__(self, r: Any) -> None:
        self._store = type("Store", (), {"redis": r})()


def test_the_cli_resolves_a_unique_prefix_refuses_an_ambiguous_one_keeps_an_unknown() -> None:
    r = fakeredis.FakeRedis()
    client: Any = FakeClient(r)
    a, b = "1234abcd" + "0" * 24, "1234abce" + "0" * 24
    store_turn(r, a, 1.0)
    store_turn(r, b, 2.0)
    assert resolve_turn_id(client, "1234abcd") == a
    with pytest.raises(AmbiguousTurnId) as exc:
        resolve_turn_id(client, "1234ab")
    assert exc.value.matches == [b, a] and not exc.value.more
    assert resolve_turn_id(client, "99") == "99"
    assert resolve_turn_id(client, "f" * 32) == "f" * 32  # a full id is not looked up


def test_the_turns_table_fits_80_columns_with_short_ids() -> None:
    now = time.time()
    rows: list[dict[str, Any]] = [
        {
            "turn_id": secrets.token_hex(16),
            "status": status,
            "agent": "researcher",
            "started_at": now - 75,
            "ended_at": now,
            "duration_s": 75.2,
            "calls": {"ok": 12, "error": 3, "timeout": 1},
            "pending_interactions": [{}],
        }
        for status in ("finished", "running", "aborted")
    ]
    console = Console(width=80, record=True, color_system=None)
    console.print(turns_table(rows, console.width))
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text, text
    for col in ("turn", "status", "agent", "started", "took", "calls", "pending"):
        assert col in text
    for row in rows:
        assert short_id(row["turn_id"]) in text and row["turn_id"] not in text
    wide = Console(width=120, record=True, color_system=None)
    wide.print(turns_table(rows, wide.width))
    assert "ended" in wide.export_text() and "ended" not in text
