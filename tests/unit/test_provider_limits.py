"""The scripted provider's limits, with the time passed in."""

from __future__ import annotations

from agentq.llm.headers import parse_rate_headers
from tests.rigs.ratelimit import ProviderLimits


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


def test_a_continuously_refilled_bucket_takes_a_burst_then_one_per_interval() -> None:
    lim = ProviderLimits(requests_per_s=4, shape="bucket")
    # A full bucket: four at once, whatever the second they fall in.
    assert [lim.check(10.9, 1).status for _ in range(5)] == [200, 200, 200, 200, 429]
    refused = lim.check(10.95, 1)
    # One request's worth refills in 250 ms; the bucket is full again after 1 s.
    assert 195 <= int(refused.headers["retry-after-ms"]) <= 205
    assert refused.headers["x-ratelimit-reset-requests"] in ("950ms", "951ms")
    assert lim.check(11.0, 1).status == 429  # a new second is no new allowance
    assert lim.check(11.16, 1).status == 200
    assert lim.check(11.17, 1).status == 429


def test_header_modes_say_what_real_providers_say() -> None:
    bare = ProviderLimits(requests_per_s=1)
    bare.set_shape("window_bare")
    assert bare.check(1.2, 1).headers == {}
    assert bare.check(1.3, 1).headers == {"retry-after": "1"}
    quiet = ProviderLimits(requests_per_s=1)
    quiet.set_shape("bucket_refusals")
    assert quiet.check(1.2, 1).headers == {}
    refused = quiet.check(1.3, 1).headers
    assert refused["x-ratelimit-limit-requests"] == "60" and "retry-after-ms" in refused
