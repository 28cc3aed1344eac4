"""The scripted provider's limits, with the time passed in."""

from __future__ import annotations

from agentq.llm.headers import parse_rate_headers
from agentq.testing.ratelimit import ProviderLimits


def test_requests_per_second_refuse_past_the_window_with_openai_headers() -> None:
    lim = ProviderLimits(requests_per_s=3)
    verdicts = [lim.check(100.0 + i * 0.1, 10) for i in range(5)]
    assert [v.status for v in verdicts] == [200, 200, 200, 429, 429]
    assert verdicts[2].headers["x-ratelimit-remaining-requests"] == "0"
    refused = verdicts[3]
    assert refused.headers["retry-after"] == "1"
    assert 690 <= int(refused.headers["retry-after-ms"]) <= 701
    signal = parse_rate_headers(refused.headers, now_s=100.3)
    assert signal.remaining_requests == 0 and signal.limit_requests == 180
    assert signal.reset_requests_s is not None and 0.69 <= signal.reset_requests_s <= 0.702
    # A new second is a new window.
    assert lim.check(101.0, 10).status == 200
    assert lim.refused[429] == 2 and len(lim.admitted_at) == 4
    assert lim.most_in_one_second() == 3


def test_tokens_per_second_and_overloaded_answers() -> None:
    lim = ProviderLimits(tokens_per_s=100)
    assert lim.check(5.0, 80).status == 200
    refused = lim.check(5.5, 30)
    assert refused.status == 429 and refused.kind == "tokens"
    assert refused.headers["x-ratelimit-remaining-tokens"] == "20"
    # One request larger than a window still goes into an empty window.
    assert lim.check(6.0, 500).status == 200
    busy = ProviderLimits(overloaded_every=2, overloaded_status=529)
    assert [busy.check(1.0, 1).status for _ in range(4)] == [200, 529, 200, 529]
    busy.reset()
    assert not busy.refused and not busy.admitted_at
