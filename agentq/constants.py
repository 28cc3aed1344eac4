"""Redis key layout and queue names, in one place.

Keys are built only from ids checked at the edge (agentq.models): a turn id is 32
lowercase hex digits (`secrets.token_hex(16)`); an interaction request id is
``<call id>.approval`` (`approval_request_id`) with a call id of safe characters.
Anything else names nothing: a key built from it could name another of the turn's keys
(``{id}:log``, ``{id}:events``).

Every key of one turn shares one Redis Cluster hash tag, so each script runs on one slot.
On one Redis (one shard) the tag is the turn id, in literal braces
(``agentq:turn:{<turn id>}:log``); on a Cluster the state is split into `shard_count()`
shards and the tag is the turn's shard (``agentq:turn:{s3}<turn id>:log``), which the
fleet-wide indexes of that shard (wakeups, active turns, the listing, a worker's running
calls) share too: a script writes a turn and its index entries on one slot, atomically,
and a sweeper reads one index a shard. A sub-agent's turn id starts with its parent's
four hex digits (`orchestrator.subturns.child_turn_id`), so it lands in its parent's
shard and its end settles the parent's call in the same script. A conversation's keys
carry ``{<conversation id>}``.
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
"""The deepest sub-agent level a reader may ask to have relayed (agentq.events.follow);
here so that the command line can name it without loading the event bus."""

QUEUE_TURNS = "agentq.turns"
QUEUE_LLM = "agentq.llm"
QUEUE_TOOLS = "agentq.tools"
QUEUE_IO = "agentq.io"
"""The I/O tool worker's queue: `async def` tools and sync tools declared `thread=True`."""

TASK_STEP = "agentq.turn.step"
TASK_LLM_ROUND = "agentq.llm.round"
TOOL_TASK_PREFIX = "agentq.tool."

CANCEL_CHANNEL = f"{PREFIX}:control:cancel"
"""Pub/sub channel carrying the id of every turn aborted, for workers that cancel in-process
(the I/O and stream workers' event loops), within milliseconds of the abort."""
WATCH_CHANNEL = f"{PREFIX}:control:watch"
"""Pub/sub channel carrying a turn id each time a follower starts following that turn, so
stream workers send its deltas live (`AGENTQ_LLM_QUIET_DELTA_INTERVAL_MS`)."""

SLOTS_CHANNEL = f"{PREFIX}:control:slots"
"""Pub/sub channel carrying a semaphore's key each time a place of it is given back, for
calls on an event loop waiting for one (an MCP server's `concurrency`)."""

TURNS_INDEX = f"{PREFIX}:turns:index"
"""Sorted set: every turn (running or kept) scored by created_at, for the operator console;
entries whose turn expired are pruned when listed."""

WAKEUPS = f"{PREFIX}:turns:wakeups"
"""Sorted set of every open turn, scored by its earliest deadline (+inf: none). Every turn
worker sweeps it, so a deadline fires even when the worker that set it died; it is also
the list of open turns (`agentq turns`, /v1/turns/active)."""

PRESENCE = f"{PREFIX}:fleet:presence"
"""Hash: worker hostname -> JSON {role, queues, pid, at}, renewed by every worker every
WORKER_HEARTBEAT_S (agentq.fleet.presence)."""

KILLS = f"{PREFIX}:kills"
"""Sorted set: an aborted turn's SIGKILL escalation (JSON: the task ids, the workers running
them), scored by when it is due; the turn workers' sweepers send it, so it fires whichever
process aborted the turn and however soon that process exits."""

KILL_COMMAND = "agentq_kill"
"""The remote control command that sends a due order of `KILLS` (agentq.tools.task.agentq_kill)."""

WORKERS = f"{PREFIX}:workers"
"""Sorted set: worker hostname scored by its last heartbeat; a lapsed one is dead."""

AGENTS = f"{PREFIX}:agents"
"""Hash: agent name -> JSON {model, tools, seen_at, description, output_schema}, published
by turn workers."""

MCP_TOOLS = f"{PREFIX}:mcp:tools"
"""Hash: MCP server name -> JSON {listed_at, tools}, the fleet's shared listing (agentq.mcp)."""
MCP_HEALTH = f"{PREFIX}:mcp:health"
"""Hash: MCP server name -> JSON {ok, failures, error, worker, at}: how its last start went."""


def mcp_slots_key(server: str) -> str:
    """Sorted set: the calls of an MCP server with a fleet-wide `concurrency` now running
    (call id scored by when its slot lapses)."""
    return f"{PREFIX}:mcp:{server}:slots"


FLEET_COUNTS = f"{PREFIX}:metrics:fleet"
"""Hash: the fleet's counters and histograms (agentq.telemetry.fleetcounts), added to by
every process that publishes turn events or runs steps; /metrics reads it."""


DEFAULT_CLUSTER_SHARDS = 16
_shards: int | None = None


def shard_count() -> int:
    """How many shards the turn state is split into: `AGENTQ_REDIS_SHARDS`, else 16 on a
    Cluster (`AGENTQ_REDIS_CLUSTER_NODES` set), else 1. It names keys, so every process of
    a fleet must agree on it, and it does not change while turns are stored."""
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
    """The hash tag of a shard: a short string whose slot lies in the shard's share of the
    16384 slots, so a cluster whose masters hold even slot ranges gets even shares."""
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
    """A fleet-wide index's (WAKEUPS, TURNS_INDEX) key for one shard, or for a turn id's
    shard (which holds the turn's entry); with one shard, its name."""
    n = shard_count()
    if isinstance(shard, str):
        shard = shard_of(shard)
    return name if n == 1 else f"{name}:{{{shard_tag(shard, n)}}}"


TurnPart = Literal["", "log", "events", "children", "cancel", "interaction", "secret", "beat"]


def turn_key(turn_id: str, part: TurnPart = "", item: str = "") -> str:
    """A turn's keys, on one slot: its state hash; `log` (stream of its events); `events`
    (their pub/sub channel); `children` (set of the sub-agent turns it started, aborted
    with it); `cancel` (why it was cancelled, for the processes that poll many turns, one
    MGET); `interaction` + request id; `secret` + request id (a password answer, read once
    by the tool and never written elsewhere); `beat` + call id (set NX PX when a step
    publishes the heartbeat `tool_progress` of an agent call)."""
    n = shard_count()
    tag = "{" + turn_id + "}" if n == 1 else "{" + shard_tag(shard_of(turn_id), n) + "}" + turn_id
    key = f"{PREFIX}:turn:{tag}"
    return key + "".join(f":{s}" for s in (part, item) if s)


# A turn's calls are fields of its state hash, up to four a call (one of these prefixes
# and the call id): a call's start, settle and plan are then written in the HSET their
# script makes of the state anyway, a start reads whether its call settled in the command
# that reads the turn, and a step's read of the state brings its round along.
DISPATCHED = "d:"
"""A call's dispatch record (task id, when sent, limits, queue), written by the step."""
STARTED = "s:"
"""A call's start record (worker, pid, started_at, delivery), written by the tool worker."""
SETTLED = "r:"
"""A call's settled ToolResult JSON; the first writer wins (a later settle writes nothing)."""
PLANNED = "p:"
"""A call's CallPlan JSON, written once, before the call is sent."""
WAITING = "w:"
"""A call's open waitpoint (its id, deadline, data), written when its tool returned a
Waitpoint: the call holds no worker, and its completion, timeout or abort settles it."""
CALL_RECORDS = (DISPATCHED, STARTED, SETTLED, PLANNED, WAITING)

# A turn's history is fields of its state hash too, a message a field (this prefix and
# its index from 0; OpenAI chat format, JSON), with their count: a step reads its history
# in the command that reads its state, and writes the messages it adds in the HSET of
# its state, so the history costs a turn no command of its own, nor a TTL at its end.
MESSAGE = "m:"
"""A history message: the prefix of its field, before its index."""
HISTORY_LEN_FIELD: Final = "history_len"
"""How many messages the turn's history holds (fields MESSAGE + 0 .. n - 1)."""
RECORDS = (*CALL_RECORDS, MESSAGE)


def is_record(field: str) -> bool:
    """Whether a field of a turn's state hash is a record (a call's or a message), not state."""
    return field[:2] in RECORDS


STEP_FIELD: Final = "step"
"""Field of the turn's state hash: the step lock, `"<token>:<until ms>"` (JSON), held by the
one step advancing the turn until then; its token fences the step's writes."""

DIRTY_FIELD: Final = "dirty"
"""Field of the turn's state hash: 1 once whatever wakes the turn has; a step that finds it
set at its end runs once more."""


PICKUP_LEASES = 4
"""A model round no stream worker took, or a tool call no worker started, within this many
turn leases of being recorded as sent is sent again: its step died before the message went
out, or the message was lost (it went to a Redis master that a failover replaced)."""


UNSETTLED_FIELD: Final = "unsettled"
"""Field of the turn's state hash: how many calls of the batch in flight (recorded as sent
before they settled) have no result yet; the settle that brings it to 0 wakes the turn."""


CANCEL_FIELD: Final = "cancel"
"""Field of the turn's state hash: the same reason (JSON), which the scripts read with the
state they read anyway."""


LLM_RESULT_FIELD: Final = "llm_result"
"""Field of the turn's state hash: the last model round's result (LlmRoundResult JSON), as
its stream worker stored it; cleared once a step has written its message to the history."""
LLM_RESULT_ROUND_FIELD: Final = "llm_result_round"
"""Field of the turn's state hash: the last round with a result. Rounds only go up, so a
delivery of a round at or below it has nothing to stream."""


LLM_TAKEN_FIELD: Final = "llm_taken"
"""Field of the turn's state hash: the round a stream worker took last, written with the
round's llm_started; with its heartbeat gone and no result, the worker died."""

LLM_ALIVE_FIELD: Final = "llm_alive"
"""Field of the turn's state hash: `"<round>:<until ms>:<worker>"` (JSON), the lease of the
stream worker that took the round, renewed while it streams (on the workers' clocks, as
the step lock); written with the claim, cleared with the result."""


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
"""Fields of the turn's state hash that are the machinery's, not the turn's: a client's
view of the turn leaves them out."""


RECYCLE_EXIT_CODE = 75
"""An event-loop worker exits with this code when a blocked loop made it unusable;
`agentq worker io|llm` starts a fresh process in its place."""

WORKER_HEARTBEAT_S = 1.0
"""How often a worker's main process says it is alive."""
WORKER_ALIVE_TTL_S = 5.0
"""A tool worker silent this long is dead: its running calls settle as lost."""


def worker_alive_key(hostname: str) -> str:
    return f"{PREFIX}:worker:{hostname}:alive"


ConversationPart = Literal["history", "owner", "meta", "queue", "inject"]


def conversation_key(conversation_id: str, part: ConversationPart = "history") -> str:
    """A conversation's keys, on one slot: `history` (list: its messages); `owner` (who may
    continue it: `owner:<sha256 of the key name>` or `secret:<sha256 of the conversation
    token>`, never a plain key or token); `meta` (hash: the turn that holds it, `running`,
    one to roll back, its size); `queue` (list: the turns waiting for it, in the order they
    run); `inject` (set: queued turns whose message may join the running turn's next round)."""
    return f"{PREFIX}:conv:{{{conversation_id}}}:{part}"


CONVERSATIONS_INDEX = f"{PREFIX}:conversations:index"
"""Sorted set: every conversation scored by its last change, for listing them; entries whose
conversation expired are pruned when listed."""

IDEMPOTENCY_TTL_S = 24 * 3600


def idempotency_key(caller: str, key: str) -> str:
    """A start's record under one caller's (key name, or '' without a key) Idempotency-Key;
    both hashed, so neither a key name nor the client's key appears in Redis."""
    digest = hashlib.sha256(f"{caller}\0{key}".encode()).hexdigest()
    return f"{PREFIX}:idem:{digest}"


def limits_key(subject: str, part: Literal["turns", "bucket"]) -> str:
    """One caller's (key name or client address) start limits: `turns` (sorted set of its
    turns, for the running cap), `bucket` (hash: its start-rate token bucket, tokens and
    last refill)."""
    return f"{PREFIX}:limits:{subject}:{part}"


def turn_keys(turn_id: str) -> list[str]:
    """The per-turn keys that get the retention TTL when the turn ends (the cancel flag has
    it already; the children set is deleted)."""
    return [turn_key(turn_id), turn_key(turn_id, "log")]


CHILDREN_FIELD: Final = "has_children"
"""Field of the turn's state hash, set when its first sub-agent turn is created: only
then does its end delete its `children` key (a command fewer for every other turn)."""


def approval_request_id(call_id: str) -> str:
    return f"{call_id}.approval"


QUEUE_WEBHOOKS = "agentq.webhooks"
"""Webhook deliveries; the I/O worker consumes it unless a worker is started for it alone."""
TASK_WEBHOOK_DELIVER = "agentq.webhook.deliver"
TASK_SCHEDULE_TICK = "agentq.turn.scheduled"
"""Sent by `agentq beat` for a due schedule; routed to the turn workers with agentq.turn.*."""

WEBHOOKS = f"{PREFIX}:{{webhooks}}"
"""What every webhook key starts with: one hash tag, so the delivery scripts (a delivery and
the fleet-wide queues it is in) run on one slot of a Cluster."""
WEBHOOKS_DUE = f"{WEBHOOKS}:due"
"""Sorted set: delivery id scored by its next attempt (or, while one runs, its lease's end).
Every worker consuming the webhook queue sweeps it: a lost message or a restart loses nothing."""
WEBHOOKS_INDEX = f"{WEBHOOKS}:index"
"""Sorted set: delivery id scored by created_at, for the console and `agentq webhooks`."""
WEBHOOK_COUNTS = f"{WEBHOOKS}:counts"
"""Hash: delivery and attempt counters (`attempts:<outcome>`, `deliveries:<status>`)."""


def webhook_key(delivery_id: str, part: Literal["", "attempts", "lock"] = "") -> str:
    """Hash of one delivery (url, body, status, attempts, next_at); its `attempts` (list,
    JSON: at, status_code, error, duration_ms); its `lock` (held, SET NX PX, by the one
    attempt in flight, so two messages never post at once)."""
    return f"{WEBHOOKS}:delivery:{delivery_id}" + (f":{part}" if part else "")


def webhook_id(turn_id: str) -> str:
    """The `webhook-id` of a turn's delivery: one per turn, the same on every retry."""
    return f"msg_{turn_id}"


SCHEDULES = f"{PREFIX}:schedules"
"""Hash: schedule name -> ScheduleSpec JSON (the beat's entries live under BEAT_PREFIX)."""
BEAT_PREFIX = f"{PREFIX}:beat:"
"""celery-redbeat's key prefix: its entries, its schedule set and the lock of the one beat."""


def schedule_key(name: str, tick: str | None = None) -> str:
    """Hash of a schedule's runs (last turn id, fired, skipped counts); with a tick, the key
    SET NX by the one tick task that starts the tick's turn (two beats, one turn)."""
    return f"{PREFIX}:schedule:{name}:" + ("runs" if tick is None else f"tick:{tick}")
