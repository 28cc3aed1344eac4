"""One attempt: post a signed body to a checked address, keep only the answer's status."""

from __future__ import annotations

import time
from dataclasses import dataclass

from agentq.errors import WebhookRefused
from agentq.webhooks.target import check_url, resolve


@dataclass(frozen=True)
class Attempt:
    status_code: int | None
    """The answer's status; None when there was none (refused, unreachable, timed out)."""
    error: str | None
    duration_ms: int


def post(
    url: str,
    body: bytes,
    headers: dict[str, str],
    *,
    timeout_s: float,
    allow_http: bool,
    allow_private: bool,
) -> Attempt:
    """POST `body` once. Redirects are not followed (a 3xx is a failed attempt): following
    one would post the signed body to a place nobody checked. The answer's body is never read."""
    # Imported here: every process that can end a turn imports this module, `agentq abort`
    # among them, and only a delivery needs an HTTP client.
    import httpx

    started = time.monotonic()

    def took_ms() -> int:
        return int((time.monotonic() - started) * 1000)

    try:
        target = check_url(url, allow_http=allow_http, allow_private=allow_private)
        address = resolve(target, allow_private=allow_private)[0]
    except WebhookRefused as exc:
        return Attempt(None, f"refused: {exc.reason}", took_ms())
    try:
        # trust_env=False: no proxy from the environment, which would resolve the name again.
        with (
            httpx.Client(
                timeout=httpx.Timeout(timeout_s), follow_redirects=False, trust_env=False
            ) as client,
            client.stream(
                "POST",
                target.url_for(address),
                content=body,
                headers={**headers, "host": target.host_header},
                extensions={"sni_hostname": target.host},
            ) as response,
        ):
            code = response.status_code
    except httpx.TimeoutException:
        return Attempt(None, f"timed out after {timeout_s:g}s", took_ms())
    except httpx.HTTPError as exc:
        return Attempt(None, f"{type(exc).__name__}: {exc}"[:300], took_ms())
    error = None
    if not 200 <= code < 300:
        error = f"HTTP {code}" + (" (redirects are not followed)" if 300 <= code < 400 else "")
    return Attempt(code, error, took_ms())
