"""The conversations stage: what one turn at a time per conversation costs; and beside it,
what a turn's budget costs (`max_tokens`: its RESERVE checks a limit, caps the round).

- A model turn on an idle conversation against the same turn without one, interleaved in
  blocks: wall time from the start to its end, and the Redis commands clients send for
  each (MONITOR), per turn.
- The hand-off: turns queued behind one another on one conversation, from one turn's end
  (its terminal event) to the next one's `turn_started`, both stamped by the fleet.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

from agentq.api import Client
from agentq.events import TERMINAL_TYPES
from agentq.fleet import runtime
from agentq.testing.openai_server import Round, ScriptedCall
from scripts.bench_stages import BenchRig, Sizes, _r, _ratio, ms_stats, pct, redis_monitor

BLOCK = 10
MONITORED_TURNS = 20


class BenchError(RuntimeError):
    pass


def _turn_s(
    client: Client, prompt: str, conversation_id: str | None, max_tokens: int | None = None
) -> float:
    t0 = time.time()
    handle = client._start_turn(
        prompt, conversation_id=conversation_id, operator=True, max_tokens=max_tokens
    )
    end = client.wait(handle.turn_id, timeout_s=60)
    if end.type != "turn_finished":
        raise BenchError(f"turn {handle.turn_id} ended {end.type}: {end.fields}")
    return float(end.ts - t0)


def _client_commands(fx: BenchRig, run: Any) -> int:

    assert fx.redis is not None
    return sum(1 for port, _ in redis_monitor(fx.redis.url, run) if port != "lua")


def bench_conversations(fx: BenchRig, sz: Sizes) -> dict[str, Any]:
    client = Client()
    assert fx.llm is not None
    key = f"bench-conv-{uuid.uuid4().hex[:6]}"
    fx.llm.set_script(key, [Round(text="ok.")] * 1000)
    n = sz.conversation_turns
    conversation = f"{key}-warm"
    for _ in range(3):  # warm up both paths
        _turn_s(client, key, None)
        _turn_s(client, key, conversation)
    # A fresh conversation every block, so the history sent does not grow with n.
    plain, conv = _interleaved(
        n,
        lambda _block: _turn_s(client, key, None),
        lambda block: _turn_s(client, key, f"{key}-{block}"),
    )
    out: dict[str, Any] = {
        **ms_stats("plain_turn_ms", plain),
        **ms_stats("conversation_turn_ms", conv),
    }
    out["conversation_turn_ratio_p50"] = _ratio(
        out["conversation_turn_ms_p50"], out["plain_turn_ms_p50"]
    )
    if fx.redis is not None:
        m = MONITORED_TURNS
        plain_cmds = _client_commands(fx, lambda: [_turn_s(client, key, None) for _ in range(m)])
        fresh = f"{key}-monitored"
        conv_cmds = _client_commands(fx, lambda: [_turn_s(client, key, fresh) for _ in range(m)])
        out["plain_turn_redis_commands"] = _r(plain_cmds / m, 1)
        out["conversation_turn_redis_commands"] = _r(conv_cmds / m, 1)
        out["conversation_extra_redis_commands"] = _r((conv_cmds - plain_cmds) / m, 1)
    out.update(_handoffs(client, fx, sz.conversation_handoffs))
    out.update(_budgeted(client, key, n))
    return out


def _interleaved(
    n: int, a: Callable[[int], float], b: Callable[[int], float]
) -> tuple[list[float], list[float]]:
    """n samples of each side (`a(block)`, `b(block)`), in blocks of BLOCK, the side that
    goes first alternating so machine noise hits both."""
    xs: list[float] = []
    ys: list[float] = []
    block = 0
    while len(xs) < n:
        sides = [(xs, a), (ys, b)]
        if block % 2:
            sides.reverse()
        for samples, once in sides:
            samples.extend(once(block) for _ in range(BLOCK))
        block += 1
    return xs, ys


def _budgeted(client: Client, key: str, n: int) -> dict[str, Any]:
    """A turn under a budget (one it never reaches) against the same turn without one."""
    free, bounded = _interleaved(
        n,
        lambda _block: _turn_s(client, key, None),
        lambda _block: _turn_s(client, key, None, max_tokens=10**9),
    )
    out: dict[str, Any] = {
        **ms_stats("unbudgeted_turn_ms", free),
        **ms_stats("budgeted_turn_ms", bounded),
    }
    out["budgeted_turn_ratio_p50"] = _ratio(
        out["budgeted_turn_ms_p50"], out["unbudgeted_turn_ms_p50"]
    )
    return out


def _handoffs(client: Client, fx: BenchRig, n: int) -> dict[str, Any]:
    assert fx.llm is not None
    key = f"bench-handoff-{uuid.uuid4().hex[:6]}"
    # The first turn naps so the others queue behind it; each of them answers at once.
    nap = Round(tool_calls=[ScriptedCall(name="sleep", arguments={"seconds": 0.5})])
    fx.llm.set_script(key, [nap, *[Round(text="ok.")] * (n + 2)])
    conversation = f"{key}-c"
    handles = [client._start_turn(key, conversation_id=conversation, operator=True)]
    handles += [
        client._start_turn(f"next {i}", conversation_id=conversation, operator=True)
        for i in range(n)
    ]
    end = client.wait(handles[-1].turn_id, timeout_s=120 + n)
    if end.type != "turn_finished":
        raise BenchError(f"the last queued turn ended {end.type}")
    gaps: list[float] = []
    ended_at: float | None = None
    for h in handles:
        events = runtime.get_store().bus.replay(h.turn_id)
        started = next((e.ts for e in events if e.type == "turn_started"), None)
        terminal = next((e for e in events if e.type in TERMINAL_TYPES), None)
        if started is None or terminal is None:
            raise BenchError(f"turn {h.turn_id} did not run to its end")
        if ended_at is not None:
            gaps.append(started - ended_at)
        ended_at = terminal.ts
    if min(gaps) < 0:
        raise BenchError("two turns of one conversation overlapped")
    return {
        **ms_stats("conversation_handoff_ms", gaps),
        "conversation_handoffs": len(gaps),
        "conversation_handoff_ms_max": _r(max(gaps) * 1000),
        "conversation_handoff_ms_p90": _r(pct([g * 1000 for g in gaps], 90) or 0),
    }


__all__ = ["bench_conversations"]
