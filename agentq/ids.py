"""The shapes of the ids that travel in URLs: checked at the edge, before any Redis key is built.

A turn id is 32 lowercase hex digits (`secrets.token_hex(16)`); an interaction request id
is ``<call id>.approval`` (agentq.orchestrator.approvals.request_id_of) with a call id of
safe characters. Anything else names nothing: a key built from it could name another of
the turn's keys (``{id}:results``, ``{id}:log``).
"""

from __future__ import annotations

import re

MAX_CALL_ID_CHARS = 128
TURN_ID = re.compile(r"[0-9a-f]{32}")
CALL_ID = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_CALL_ID_CHARS}}}")
REQUEST_ID = re.compile(rf"[A-Za-z0-9_.:-]{{1,{MAX_CALL_ID_CHARS}}}\.approval")
STREAM_ID_PART_MAX = 2**64 - 1
_STREAM_ID = re.compile(r"(\d{1,20})(?:-(\d{1,20}))?")


def is_turn_id(value: str) -> bool:
    return TURN_ID.fullmatch(value) is not None


def is_call_id(value: str) -> bool:
    return CALL_ID.fullmatch(value) is not None


def is_request_id(value: str) -> bool:
    return REQUEST_ID.fullmatch(value) is not None


def parse_stream_id(value: str) -> tuple[int, int] | None:
    """(ms, seq) of a Redis stream id ("1-0", or "0"); None if it is not one Redis accepts.

    Both parts are unsigned 64-bit integers: a larger one makes XRANGE fail.
    """
    found = _STREAM_ID.fullmatch(value)
    if found is None:
        return None
    ms, seq = int(found.group(1)), int(found.group(2) or 0)
    if ms > STREAM_ID_PART_MAX or seq > STREAM_ID_PART_MAX:
        return None
    return ms, seq


__all__ = [
    "MAX_CALL_ID_CHARS",
    "is_call_id",
    "is_request_id",
    "is_turn_id",
    "parse_stream_id",
]
