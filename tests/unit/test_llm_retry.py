"""The retry rules of a model round, tested without any I/O or waiting."""

from __future__ import annotations

import pytest

from agentq.errors import (
    Aborted,
    AgentqError,
    MalformedStreamChunk,
    ModelHTTPError,
    StreamDurationExceeded,
    StreamIdleTimeout,
)
from agentq.llm.headers import parse_retry_after
from agentq.llm.retry import (
    BASE_BACKOFF_S,
    MAX_BACKOFF_S,
    backoff_s,
    retryable_status,
    should_retry,
)


def idle(chunks: int = 0) -> StreamIdleTimeout:
    return StreamIdleTimeout(idle_ms=300, chunks_received=chunks, stream_lifetime_ms=300)


def http(status: int) -> ModelHTTPError:
    return ModelHTTPError(status, "boom", retryable_status(status))


@pytest.mark.parametrize(
    ("exc", "again"),
    [
        (Aborted("t1"), False),
        (idle(), True),
        (http(500), True),
        (http(429), True),
        (ModelHTTPError(0, "connection refused", True), True),
        (http(400), False),
        (MalformedStreamChunk(3, "not valid JSON"), False),
        (StreamDurationExceeded(60, 61), False),
        (AgentqError("something else"), False),
        (RuntimeError("bug"), False),
    ],
)
def test_retryable(exc: BaseException, again: bool) -> None:
    assert should_retry(exc, chunks_received=0, attempt=1, max_retries=1) is again


def test_idle_timeout_code_is_etimedout() -> None:
    assert idle().code == "ETIMEDOUT"


@pytest.mark.parametrize(
    ("status", "retryable"),
    [(s, False) for s in (400, 401, 403, 404, 408, 409, 422)]
    + [(s, True) for s in (429, 500, 502, 503, 504)],
)
def test_retryable_status(status: int, retryable: bool) -> None:
    assert retryable_status(status) is retryable


def test_zero_chunk_idle_timeout_retries_at_most_max_retries_times() -> None:
    decisions = [
        should_retry(idle(0), chunks_received=0, attempt=a, max_retries=2) for a in (1, 2, 3, 4)
    ]
    assert decisions == [True, True, False, False]


def test_idle_timeout_after_chunks_never_retries() -> None:
    assert not should_retry(idle(1), chunks_received=1, attempt=1, max_retries=5)


def test_max_retries_zero_means_no_retry() -> None:
    assert not should_retry(idle(0), chunks_received=0, attempt=1, max_retries=0)


@pytest.mark.parametrize("status", [429, 500, 503])
def test_rate_limits_and_server_errors_retry(status: int) -> None:
    assert should_retry(http(status), chunks_received=0, attempt=1, max_retries=2)
    assert not should_retry(http(status), chunks_received=0, attempt=3, max_retries=2)


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_other_client_errors_never_retry(status: int) -> None:
    assert not should_retry(http(status), chunks_received=0, attempt=1, max_retries=5)


def test_nothing_retries_once_chunks_were_published() -> None:
    dropped = ModelHTTPError(0, "peer closed connection", True)
    assert should_retry(dropped, chunks_received=0, attempt=1, max_retries=2)
    assert not should_retry(dropped, chunks_received=4, attempt=1, max_retries=2)


@pytest.mark.parametrize(
    "exc",
    [
        Aborted("t1", "user"),
        MalformedStreamChunk(0, "not valid JSON"),
        StreamDurationExceeded(60, 61),
        RuntimeError("bug"),
    ],
)
def test_never_retried(exc: BaseException) -> None:
    assert not should_retry(exc, chunks_received=0, attempt=1, max_retries=10)


def no_jitter() -> float:
    return 0.0


def test_backoff_is_exponential_from_a_small_base() -> None:
    assert [backoff_s(a, rand=no_jitter) for a in (1, 2, 3, 4)] == [
        BASE_BACKOFF_S,
        BASE_BACKOFF_S * 2,
        BASE_BACKOFF_S * 4,
        BASE_BACKOFF_S * 8,
    ]
    assert BASE_BACKOFF_S <= 0.5


def test_backoff_is_capped_and_never_overflows() -> None:
    assert backoff_s(50, rand=no_jitter) == MAX_BACKOFF_S
    assert backoff_s(10_000, rand=no_jitter) == MAX_BACKOFF_S
    assert backoff_s(0, rand=no_jitter) == backoff_s(1, rand=no_jitter) == BASE_BACKOFF_S


def test_backoff_is_jittered_by_up_to_a_quarter() -> None:
    assert backoff_s(3, rand=lambda: 0.999999) == pytest.approx(BASE_BACKOFF_S * 4 * 0.75)
    delays = {backoff_s(3) for _ in range(50)}
    # Spread out, never above the exponential delay, never below three quarters of it.
    assert len(delays) > 40
    assert all(BASE_BACKOFF_S * 3 <= d <= BASE_BACKOFF_S * 4 for d in delays)
    assert backoff_s(50) >= MAX_BACKOFF_S * 0.75


def test_backoff_honours_retry_after_within_the_cap() -> None:
    assert backoff_s(1, retry_after_s=2.5) == 2.5
    assert backoff_s(5, retry_after_s=0.0) == 0.0
    assert backoff_s(1, retry_after_s=-3) == 0.0
    assert backoff_s(1, retry_after_s=3600) == MAX_BACKOFF_S


def test_parse_retry_after_prefers_milliseconds() -> None:
    assert parse_retry_after({"retry-after-ms": "1500", "Retry-After": "2"}) == 1.5


def test_parse_retry_after_skips_milliseconds_that_are_no_number() -> None:
    assert parse_retry_after({"retry-after-ms": "nan", "Retry-After": "2"}) == 2.0
    assert parse_retry_after({"retry-after-ms": "inf"}) is None


def test_parse_retry_after_seconds_and_case() -> None:
    assert parse_retry_after({"Retry-After": "3"}) == 3.0
    assert parse_retry_after({"RETRY-AFTER": "0.25"}) == 0.25
    assert parse_retry_after({}) is None
    assert parse_retry_after({"retry-after": "soon"}) is None


def test_parse_retry_after_http_date() -> None:
    now_s = 1_700_000_000.0  # 2023-11-14 22:13:20 GMT
    header = {"Retry-After": "Tue, 14 Nov 2023 22:13:30 GMT"}
    assert parse_retry_after(header, now_s=now_s) == pytest.approx(10.0)
    assert parse_retry_after(header, now_s=now_s + 60) == 0.0
