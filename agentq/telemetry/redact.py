"""One redaction rule for credentials in log lines, whatever logger writes them: a query
parameter naming a credential once percent-decoded (``%74oken``), an ``Authorization`` or
``Bearer`` value, an agentq or OpenAI style key become ``***``. `install()` wraps the
LogRecord factory, so uvicorn's, agentq's and any library's records are redacted as made.
"""

from __future__ import annotations

import functools
import logging
import re
from typing import Any
from urllib.parse import unquote_plus

MASK = "***"
SECRET_PARAMS = frozenset(
    {
        "token",
        "access_token",
        "conversation_token",
        "api_key",
        "apikey",
        "key",
        "authorization",
        "auth",
        "password",
        "secret",
    }
)
_PARAM = re.compile(r"(?P<sep>^|[?&;\s])(?P<name>[^=&;#\s\"'?]+)=(?P<value>[^&;#\s\"']*)")
_BEARER = re.compile(r"(?i)\b(?P<scheme>bearer|basic)(?P<sp>\s+|%20|\+)(?P<value>[^\s\"',;&]+)")
_AUTH_HEADER = re.compile(
    r"(?i)(?P<name>authorization|x-api-key)(?P<sep>[\"']?\s*[:=]\s*[\"']?)"
    r"(?P<value>(?:(?:bearer|basic)\s+)?[^\s\"',;&]+)"
)
_KEYS = re.compile(r"\b(?:sk|agq)-[A-Za-z0-9_-]{16,}")


def _param(m: re.Match[str]) -> str:
    name = m.group("name")
    # Decoded until it stops changing: %2574oken is %74oken is token.
    for _ in range(4):
        plain = unquote_plus(name)
        if plain == name:
            break
        name = plain
    if name.strip().lower() in SECRET_PARAMS and m.group("value"):
        return f"{m.group('sep')}{m.group('name')}={MASK}"
    return m.group(0)


def redact(text: str) -> str:
    """`text` with every credential it shows replaced by ***."""
    text = _AUTH_HEADER.sub(lambda m: f"{m.group('name')}{m.group('sep')}{MASK}", text)
    text = _PARAM.sub(_param, text)
    text = _BEARER.sub(lambda m: f"{m.group('scheme')}{m.group('sp')}{MASK}", text)
    return _KEYS.sub(MASK, text)


def _redact_arg(arg: Any) -> Any:
    return redact(arg) if isinstance(arg, str) else arg


def redact_record(record: logging.LogRecord) -> logging.LogRecord:
    if isinstance(record.msg, str):
        record.msg = redact(record.msg)
    args = record.args
    if isinstance(args, tuple):
        record.args = tuple(_redact_arg(a) for a in args)
    elif isinstance(args, dict):
        record.args = {k: _redact_arg(v) for k, v in args.items()}
    return record


@functools.cache
def install() -> None:
    """Redact every log record this process makes from now on; calling it again is harmless."""
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        return redact_record(make(*args, **kwargs))

    logging.setLogRecordFactory(factory)
