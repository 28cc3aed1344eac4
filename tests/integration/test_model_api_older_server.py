"""`auto` against an older compatible server: a reasoning model's 400 names
`/v1/responses`, but the server answers that route 404. The model stays on Chat
Completions, said once, and its rounds fail with the server's own 400 (through real
workers and the scripted server)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from agentq.llm.apis import read_learned
from agentq.testing.openai_server import Round
from agentq.testing.responses_answer import chat_tools_refusal
from tests.faults.rig import Rig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def rig() -> Iterator[Rig]:
    made = Rig("apis-older", AGENTQ_LLM_MAX_RETRIES="1")
    try:
        made.llm.refuse_chat_tools = True
        made.llm.responses_api = False
        made.start("tools", "llm", "turns")
        yield made
    finally:
        made.close()


def test_a_404_on_responses_keeps_the_model_on_chat_and_says_so_once(rig: Rig) -> None:
    for _ in range(2):
        key = rig.script(Round(text="never sent"))
        events = rig.collect(rig.client._start_turn(key).turn_id)
        assert events[-1].type == "turn_error", events[-1]
        assert chat_tools_refusal("gpt-4o-mini") in events[-1].fields["error"]
        assert "ETIMEDOUT" not in str(events[-1].fields)
    learned = read_learned(rig.client._store.redis)
    assert learned["gpt-4o-mini"]["api"] == "chat"
    assert "404" in learned["gpt-4o-mini"]["reason"]
    assert rig.logs().count("model gpt-4o-mini stays on Chat Completions") == 1
    # Every request that reached a route went to chat completions.
    assert rig.llm.requests and all("messages" in b for b in rig.llm.requests)
