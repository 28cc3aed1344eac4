"""The inputs of the capacity scripts (`capacity_lua`), one NamedTuple each: every deciding
script gets the model's keys (`ModelKeys`), `DecidingArgs`, then its own (`AcquireArgs`,
...); the scripts on one key (renew, the breaker) get that key and their own.
"""

from __future__ import annotations

from typing import NamedTuple


class ModelKeys(NamedTuple):
    """A model's keys in the scripts' order: the name they bind, the suffix after
    `<prefix>:{<model>}:`."""

    QI: str = "q:i"  # ZSET waiter -> start tag: interactive rounds waiting
    QB: str = "q:b"  # ZSET waiter -> start tag: background rounds waiting
    QM: str = "q:meta"  # HASH waiter -> {c: class, o: owner, t: tokens, s: last seen ms}
    FTI: str = "q:ft:i"  # HASH owner -> finish tag of its last interactive round
    FTB: str = "q:ft:b"  # HASH owner -> finish tag of its last background round
    ST: str = "q:state"  # HASH v:i, v:b (virtual times), ic (interactive grants since bg)
    GCRA: str = "gcra"  # HASH r, t, r:<dep>, t:<dep> -> arrival time ms
    LEASES: str = "leases"  # ZSET lease id -> expiry ms
    LMETA: str = "leases:meta"  # HASH lease id -> {d: deployment, t: tokens, w: waiter, p}
    INFL: str = "inflight"  # HASH deployment -> leases held
    GRANTS: str = "grants"  # HASH waiter -> {l: lease, d: deployment, at, t: tokens, k: taken}
    PAUSE: str = "paused"  # HASH m | d:<dep> -> paused until ms
    BRK: str = "breaker"  # HASH f:<dep> failures, o: open until, p: probe until, k: kind
    USE: str = "usage"  # HASH r:<10 s bucket>, t:<10 s bucket>, cur -> requests, tokens used
    CONFIG: str = "config"  # STRING the model's limits as a configured process last sent them
    RATE: str = "rate"  # HASH the admitted rate and learned limits (see capacity_rate)


SUFFIX = ModelKeys()
"""Each key's suffix by its name (`SUFFIX.LEASES`)."""


class DecidingArgs(NamedTuple):
    """The arguments of every deciding script, before its own."""

    config: str
    """The model's limits (JSON)."""
    now_arg: str | int
    """The caller's clock (ms); "": Redis TIME."""
    model: str
    nonce: str
    """Random: makes the lease ids a script hands out unique."""


class AcquireArgs(NamedTuple):
    waiter: str
    """Unique per round."""
    class_: str
    """"i" (interactive) or "b" (background)."""
    owner: str
    weight: str
    """The owner's weight in the fair queue."""
    tokens: int
    """The round's estimated tokens."""


class FreeArgs(NamedTuple):
    """A release (`lease_id`) or a withdrawal (`waiter`): the other is ""."""

    lease_id: str
    used: str | int
    """Tokens the round used ("": unknown)."""
    waiter: str


class NoteArgs(NamedTuple):
    """What one answer of the provider said about its limits (`Capacity.note_answer`)."""

    refused: int
    """1: a 429 although the fleet paced its requests: the admitted rate comes down."""
    field: str
    """What to pause: "m" (the model) or "d:<deployment>"."""
    wait_ms: str | int
    """How long the provider asked to wait ("": no wait)."""
    limit_rpm: int
    """The provider's own limits from its headers (0: not sent)."""
    limit_tpm: int
    hint_rpm: int
    """Requests a minute this process saw answered lately: the guess when nothing told."""


class RenewArgs(NamedTuple):
    now_arg: str | int
    lease_id: str
    ttl_ms: int


class BreakerArgs(NamedTuple):
    now_arg: str | int
    deployment: str
    kind: str
    """What failed: 5xx, stall, connection..."""
    failures_to_open: int
    cooldown_ms: int
