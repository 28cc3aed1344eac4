"""How a user's code calls agentq, checked by mypy --strict (tests/unit/test_user_typing.py)."""

from __future__ import annotations

from agentq import AsyncClient, Client, TurnFailed, TurnResult, TurnTimeout
from agentq.events import Event, InteractionRequested, ToolFinished, TurnFinished
from agentq.testing import ScriptedModel, call, local_fleet, reply
from tests.example.counter import WordCount, counter


def count(client: Client, text: str) -> int:
    try:
        result: TurnResult = client.run(counter, f"count: {text}", timeout_s=30)
    except TurnFailed as exc:
        raise ValueError(exc.error_code) from exc
    except TurnTimeout as exc:
        raise ValueError(exc.timeout_s) from exc
    output = result.output
    assert isinstance(output, WordCount)
    return output.words + result.usage.total_tokens * 0


def follow(client: Client) -> list[str]:
    turn = client.start("word_counter", "count: a b", headless=True)
    seen: list[str] = []
    for ev in turn.events():
        if isinstance(ev, ToolFinished):
            seen.append(f"{ev.tool} {ev.status} {ev.duration_ms}")
        elif isinstance(ev, InteractionRequested):
            turn.answer(ev.request_id, "deny")
        elif isinstance(ev, TurnFinished) and ev.ends_turn:
            seen.append(ev.content)
    return seen


async def count_many(texts: list[str]) -> list[int]:
    async with AsyncClient() as client:
        out: list[int] = []
        for text in texts:
            turn = await client.start(counter, text)
            events: list[Event] = [ev async for ev in turn.events()]
            result = await turn.result(timeout_s=10)
            out.append(len(events) + len(result.text))
        return out


def test_counter() -> None:
    model = ScriptedModel([[call("word_count", text="a b")], reply('{"words": 2}')])
    with local_fleet(tools=["tests.example.counter"], model=model) as client:
        assert count(client, "a b") == 2
