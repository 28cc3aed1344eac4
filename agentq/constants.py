"""Redis key layout and queue names, in one place.

Keys are built only from ids checked at the edge (agentq.models): any other id could name
another of the turn's keys (``{id}:log``). Every key of a turn shares one hash tag, the turn
id (one shard) or its shard's tag (a Cluster), which that shard's fleet-wide indexes share:
a script writes a turn and its index entries on one slot, atomically (docs/operations.md,
"One Redis or a Cluster"). A conversation's keys carry ``{<conversation id>}``.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from typing import Final, Literal

VERSION = "0.1.0"
"""agentq.__version__; here so that no part of the package imports the package itself."""

PREFIX = "agentq"

RELAY_DEPTH_MAX = 8
"""The deepest sub-agent level relayed to a reader; here so the CLI skips the event bus."""

QUEUE_TURNS = "agentq.turns"
QUEUE_LLM = "agentq.llm"
QUEUE_TOOLS = "agentq.tools"
QUEUE_IO = "agentq.io"
"""The I/O tool worker's queue: `async def` tools and sync tools declared `thread=True`."""

TASK_STEP = "agentq.turn.step"
TASK_LLM_ROUND = "agentq.llm.round"
TOOL_TASK_PREFIX = "agentq.tool."

CANCEL_CHANNEL = f"{PREFIX}:control:cancel"
"""Pub/sub: the id of every turn aborted, for the event-loop workers that cancel in-process."""
WATCH_CHANNEL = f"{PREFIX}:control:watch"
"""Pub/sub: a turn id each time a follower comes, so stream workers send its deltas live."""

SLOTS_CHANNEL = f"{PREFIX}:control:slots"
"""Pub/sub: a semaphore's key each time a place is given back (an MCP server's `concurrency`)."""

TURNS_INDEX = f"{PREFIX}:turns:index"
"""Sorted set: every turn kept, by created_at; entries whose turn expired go when listed."""

WAKEUPS = f"{PREFIX}:turns:wakeups"
"""Sorted set: every open turn (`agentq turns`) by its earliest deadline (+inf: none), swept
by every turn worker, so a deadline fires even when the worker that set it died."""

PRESENCE = f"{PREFIX}:fleet:presence"
"""Hash: worker hostname -> JSON {role, queues, pid, at}, renewed every WORKER_HEARTBEAT_S."""

KILLS = f"{PREFIX}:kills"
"""Sorted set: an aborted turn's SIGKILL order, by when due; the turn workers' sweepers send
it, so it fires however soon the process that aborted the turn exits."""

KILL_COMMAND = "agentq_kill"
"""The remote control command that sends a due order of `KILLS` (agentq.tools.task.agentq_kill)."""

WORKERS = f"{PREFIX}:workers"
"""Sorted set: worker hostname scored by its last heartbeat; a lapsed one is dead."""

AGENTS = f"{PREFIX}:agents"
"""Hash: agent name -> JSON {model, tools, seen_at, description, output_schema}."""

MCP_TOOLS = f"{PREFIX}:mcp:tools"
"""Hash: MCP server name -> JSON {listed_at, tools}, the fleet's shared listing (agentq.mcp)."""
MCP_HEALTH = f"{PREFIX}:mcp:health"
"""Hash: MCP server name -> JSON {ok, failures, error, worker, at}: how its last start went."""


def mcp_slots_key(server: str) -> str:
    """Sorted set: an MCP server's running calls, by when each one's slot lapses."""
    return f"{PREFIX}:mcp:{server}:slots"


FLEET_COUNTS = f"{PREFIX}:metrics:fleet"
"""Hash: the fleet's counters and histograms, added to by every process; /metrics reads it."""


DEFAULT_CLUSTER_SHARDS = 16
_shards: int | None = None


def shard_count() -> int:
    """`AGENTQ_REDIS_SHARDS`, else 16 on a Cluster, else 1: it names keys, so a fleet agrees."""
    global _shards
    if _shards is None:
        raw = os.environ.get("AGENTQ_REDIS_SHARDS", "").strip()
        cluster = bool(os.environ.get("AGENTQ_REDIS_CLUSTER_NODES", "").strip())
        _shards = int(raw) if raw else (DEFAULT_CLUSTER_SHARDS if cluster else 1)
    return _shards


def set_shard_count(n: int | None) -> None:
    """Fix the shard count for this process (None: read the environment again)."""
    global _shards
    _shards = n


def shard_of(turn_id: str) -> int:
    """The shard of a turn: its first four hex digits modulo the shard count."""
    n = shard_count()
    if n == 1:
        return 0
    try:
        return int(turn_id[:4], 16) % n
    except ValueError:  # not a turn id: names no stored turn, any shard will do
        return 0


@lru_cache(maxsize=1024)
def shard_tag(shard: int, shards: int) -> str:
    """A tag in the shard's share of the 16384 slots, so even slot ranges get even shares."""
    # Imported here: `agentq --version` reads this module and should not load redis.
    from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

    lo = shard * REDIS_CLUSTER_HASH_SLOTS // shards
    hi = (shard + 1) * REDIS_CLUSTER_HASH_SLOTS // shards
    n = 0
    while not lo <= key_slot(f"s{shard}.{n}".encode()) < hi:
        n += 1
    return f"s{shard}.{n}"


def shards() -> range:
    return range(shard_count())


def shard_key(name: str, shard: int | str) -> str:
    """A fleet-wide index's key for a shard, or a turn id's shard; with one shard, its name."""
    n = shard_count()
    if isinstance(shard, str):
        shard = shard_of(shard)
    return name if n == 1 else f"{name}:{{{shard_tag(shard, n)}}}"


TurnPart = Literal["", "log", "events", "children", "cancel", "interaction", "secret", "beat"]


def turn_key(turn_id: str, part: TurnPart = "", item: str = "") -> str:
    """A turn's keys, on one slot: its state hash, its events' `log` and channel, `children`
    (aborted with it), `cancel` (one MGET for pollers), `interaction` or `secret` (a
    password answer, read once) + request id, `beat` + call id (an agent call's heartbeat)."""
    n = shard_count()
    tag = "{" + turn_id + "}" if n == 1 else "{" + shard_tag(shard_of(turn_id), n) + "}" + turn_id
    key = f"{PREFIX}:turn:{tag}"
    return key + "".join(f":{s}" for s in (part, item) if s)


# A call's records are fields of the turn's state hash (prefix + call id): written in the
# HSET their script makes anyway, and read with the state, costing no command of their own.
DISPATCHED = "d:"
"""A call's dispatch record (task id, when sent, limits, queue), written by the step."""
STARTED = "s:"
"""A call's start record (worker, pid, started_at, delivery), written by the tool worker."""
SETTLED = "r:"
"""A call's settled ToolResult JSON; the first writer wins (a later settle writes nothing)."""
PLANNED = "p:"
"""A call's CallPlan JSON, written once, before the call is sent."""
WAITING = "w:"
"""A call's open waitpoint (id, deadline, data): its completion, timeout or abort settles it."""
CALL_RECORDS = (DISPATCHED, STARTED, SETTLED, PLANNED, WAITING)

# The history is fields of the state hash too, a message a field, for the same reason.
MESSAGE = "m:"
"""A history message: the prefix of its field, before its index."""
HISTORY_LEN_FIELD: Final = "history_len"
"""How many messages the turn's history holds (fields MESSAGE + 0 .. n - 1)."""
RECORDS = (*CALL_RECORDS, MESSAGE)


def is_record(field: str) -> bool:
    """Whether a field of a turn's state hash is a record (a call's or a message), not state."""
    return field[:2] in RECORDS


# Fields of a turn's state hash besides its records.
STEP_FIELD: Final = "step"
"""The step lock, `"<token>:<until ms>"` (JSON); its token fences the one step's writes."""
DIRTY_FIELD: Final = "dirty"
"""1 once something woke the turn; a step that finds it set at its end runs once more."""
UNSETTLED_FIELD: Final = "unsettled"
"""How many calls of the batch in flight have no result; the settle that makes it 0 wakes."""
CANCEL_FIELD: Final = "cancel"
"""The `cancel` key's reason (JSON) again, for the scripts that read the state anyway."""
CHILDREN_FIELD: Final = "has_children"
"""Set with the first sub-agent turn: only then does the end delete `children` (a command)."""
LLM_RESULT_FIELD: Final = "llm_result"
"""The last round's LlmRoundResult JSON, cleared once a step wrote it to the history."""
LLM_RESULT_ROUND_FIELD: Final = "llm_result_round"
"""The last round with a result: rounds only go up, so a delivery at or below it is stale."""
LLM_TAKEN_FIELD: Final = "llm_taken"
"""The round a stream worker took last; with its lease gone and no result, the worker died."""
LLM_ALIVE_FIELD: Final = "llm_alive"
"""`"<round>:<until ms>:<worker>"` (JSON): the stream worker's lease on the round, renewed
while it streams; written with the claim, cleared with the result."""

PICKUP_LEASES = 4
"""A round or call not taken within this many turn leases of being sent is sent again: its
step died before sending, or a failover lost the message."""


def llm_alive(value: object, round_no: int, now_ms: int) -> bool:
    """Whether a stream worker's lease (as read) holds `round_no` at `now_ms`."""
    raw = value.decode() if isinstance(value, bytes) else value
    if not isinstance(raw, str) or not raw.startswith('"'):
        return False
    held, _, rest = raw.strip('"').partition(":")
    until = rest.partition(":")[0]
    return held == str(round_no) and until.isdigit() and int(until) > now_ms


def llm_alive_value(round_no: int, until_ms: int, worker: str) -> str:
    return json.dumps(f"{round_no}:{until_ms}:{worker}")


BOOKKEEPING_FIELDS = (
    STEP_FIELD,
    LLM_ALIVE_FIELD,
    DIRTY_FIELD,
    UNSETTLED_FIELD,
    LLM_TAKEN_FIELD,
    LLM_RESULT_FIELD,
    LLM_RESULT_ROUND_FIELD,
    HISTORY_LEN_FIELD,
)
"""The machinery's fields of the state hash, left out of a client's view of the turn."""


RECYCLE_EXIT_CODE = 75
"""An event-loop worker a blocked loop made unusable exits so, and is started afresh."""

WORKER_HEARTBEAT_S = 1.0
WORKER_ALIVE_TTL_S = 5.0
"""A tool worker silent this long is dead: its running calls settle as lost."""


def worker_alive_key(hostname: str) -> str:
    return f"{PREFIX}:worker:{hostname}:alive"


ConversationPart = Literal["history", "owner", "meta", "queue", "inject"]


def conversation_key(conversation_id: str, part: ConversationPart = "history") -> str:
    """A conversation's keys, on one slot; `owner` holds only sha256s of a key name or token,
    `queue` its waiting turns in order, `inject` those whose message may join the running one."""
    return f"{PREFIX}:conv:{{{conversation_id}}}:{part}"


CONVERSATIONS_INDEX = f"{PREFIX}:conversations:index"
"""Sorted set: every conversation by its last change; expired ones go when listed."""

IDEMPOTENCY_TTL_S = 24 * 3600


def idempotency_key(caller: str, key: str) -> str:
    """A start's record under a caller's Idempotency-Key, hashed so neither appears in Redis."""
    digest = hashlib.sha256(f"{caller}\0{key}".encode()).hexdigest()
    return f"{PREFIX}:idem:{digest}"


def limits_key(subject: str, part: Literal["turns", "bucket"]) -> str:
    """One caller's (key name or address) running `turns` and start-rate token `bucket`."""
    return f"{PREFIX}:limits:{subject}:{part}"


def turn_keys(turn_id: str) -> list[str]:
    """The keys that get the retention TTL at the turn's end (`cancel` has it already)."""
    return [turn_key(turn_id), turn_key(turn_id, "log")]


def approval_request_id(call_id: str) -> str:
    return f"{call_id}.approval"


QUEUE_WEBHOOKS = "agentq.webhooks"
"""Webhook deliveries; the I/O worker consumes it unless a worker is started for it alone."""
TASK_WEBHOOK_DELIVER = "agentq.webhook.deliver"
TASK_SCHEDULE_TICK = "agentq.turn.scheduled"
"""Sent by `agentq beat` for a due schedule; routed to the turn workers with agentq.turn.*."""

WEBHOOKS = f"{PREFIX}:{{webhooks}}"
"""Every webhook key's start: one hash tag, so the delivery scripts run on one slot."""
WEBHOOKS_DUE = f"{WEBHOOKS}:due"
"""Sorted set: delivery id by its next attempt (or running lease's end), swept by every
webhook worker, so a lost message or a restart loses nothing."""
WEBHOOKS_INDEX = f"{WEBHOOKS}:index"
"""Sorted set: delivery id scored by created_at, for the console and `agentq webhooks`."""
WEBHOOK_COUNTS = f"{WEBHOOKS}:counts"
"""Hash: delivery and attempt counters (`attempts:<outcome>`, `deliveries:<status>`)."""


def webhook_key(delivery_id: str, part: Literal["", "attempts", "lock"] = "") -> str:
    """Hash of one delivery; its `attempts` (list, JSON); its `lock`, held by the one attempt
    in flight, so two messages never post at once."""
    return f"{WEBHOOKS}:delivery:{delivery_id}" + (f":{part}" if part else "")


def webhook_id(turn_id: str) -> str:
    """The `webhook-id` of a turn's delivery: one per turn, the same on every retry."""
    return f"msg_{turn_id}"


SCHEDULES = f"{PREFIX}:schedules"
"""Hash: schedule name -> ScheduleSpec JSON (the beat's entries live under BEAT_PREFIX)."""
BEAT_PREFIX = f"{PREFIX}:beat:"
"""celery-redbeat's key prefix: its entries, its schedule set and the lock of the one beat."""


def schedule_key(name: str, tick: str | None = None) -> str:
    """Hash of a schedule's runs; with a tick, SET NX by the one task that starts its turn."""
    return f"{PREFIX}:schedule:{name}:" + ("runs" if tick is None else f"tick:{tick}")
