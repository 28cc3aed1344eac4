"""The Lua scripts behind `agentq.store`: each write that must be atomic (settle a call,
take or release a step, end a turn) is one script, so a crash leaves it done or not done."""

from __future__ import annotations

from agentq.events.bus import ended_lua, publish_lua

# A turn that is over (or whose state Redis lost) takes no more writes: nothing is
# written after its terminal event, and nothing recreates half of a vanished turn.
TURN_OPEN_LUA = (
    """
local status = redis.call('HGET', KEYS[%d], 'status')
if not status or """
    + ended_lua("status")
    + """ then
  return %s
end
"""
)


def wake_lua(dirty: str, wakeups: str, turn_id: str, at: str, ttl: str) -> str:
    """Lua that marks a turn as woken and makes sure a sweeper steps it by `at`."""
    return f"""
redis.call('SET', {dirty}, '1', 'EX', {ttl})
local cur = redis.call('ZSCORE', {wakeups}, {turn_id})
if (not cur) or tonumber(cur) > tonumber({at}) then
  redis.call('ZADD', {wakeups}, {at}, {turn_id})
end
"""


MAX_ROUND_READ = 500
"""A round with more calls than this is read by the step itself, not by the script."""


def read_view_lua(
    turn: str, cancel: str, history: str, round_keys: tuple[str, str, str] | None = None
) -> str:
    """Lua expressions, comma-separated: what a step reads (state, cancel reason, history,
    round).

    `round` holds the settled results, dispatch records and plans of the calls named by
    the state's `round_calls` (HMGETs of `round_keys`: results, calls, plans), so the step
    that collects a round needs no read of its own; {} without them.
    """
    rnd = "{}"
    if round_keys is not None:
        results, calls, plans = round_keys
        rnd = f"""(function()
  local rc = redis.call('HGET', {turn}, 'round_calls')
  if not rc then return {{}} end
  local ok, ids = pcall(cjson.decode, rc)
  if not ok or type(ids) ~= 'table' or #ids == 0 or #ids > {MAX_ROUND_READ} then return {{}} end
  return {{redis.call('HMGET', {results}, unpack(ids)), redis.call('HMGET', {calls}, unpack(ids)),
          redis.call('HMGET', {plans}, unpack(ids))}}
end)()"""
    return f"""redis.call('HGETALL', {turn}), redis.call('GET', {cancel}) or '',
  redis.call('LRANGE', {history}, 0, -1), {rnd}"""


def take_step_lua(
    lock: str,
    dirty: str,
    turn: str,
    cancel: str,
    history: str,
    token: str,
    ttl_ms: str,
    round_keys: tuple[str, str, str] | None = None,
) -> str:
    """Lua that, for a caller that steps the woken turn itself (`token` set), takes the
    step lock and returns what the step reads, as the begin script would: one round trip
    fewer between the last result of a batch and the step that collects it."""
    return f"""
if {token} ~= '' and redis.call('SET', {lock}, {token}, 'NX', 'PX', {ttl_ms}) then
  redis.call('DEL', {dirty})
  return {{3, {read_view_lua(turn, cancel, history, round_keys)}}}
end
"""


# Settle = store the result under its call id (first writer wins), wake the turn and
# publish tool_finished, in one atomic step: exactly one result per call, whoever
# settles it (the tool, the worker's parent on a hard kill, or the turn on abort/loss).
SETTLE_LUA = (
    TURN_OPEN_LUA % (6, -2)
    + """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
-- Only the settle that completes the batch in flight (or one of a call it does not
-- track) wakes the turn: a round of a thousand calls takes one step, not a thousand.
local tracked = redis.call('SREM', KEYS[9], ARGV[1])
local ready = tracked == 0 or redis.call('SCARD', KEYS[9]) == 0
local start = redis.call('HGET', KEYS[8], ARGV[1])
if start then
  local ok, rec = pcall(cjson.decode, start)
  if ok and type(rec['worker']) == 'string' then
    redis.call('SREM', 'agentq:worker:' .. rec['worker'] .. ':calls', ARGV[8] .. '/' .. ARGV[1])
  end
end
if ARGV[9] == '1' and ready then
"""
    + wake_lua("KEYS[2]", "KEYS[7]", "ARGV[8]", "ARGV[6]", "ARGV[7]")
    + "end\n"
    + publish_lua("KEYS[3]", "KEYS[4]", "KEYS[5]", "ARGV[3]", "ARGV[4]")
    + "if not ready then return 1 end\nif ARGV[9] == '1' then\n"
    + take_step_lua(
        "KEYS[10]",
        "KEYS[2]",
        "KEYS[6]",
        "KEYS[11]",
        "KEYS[12]",
        "ARGV[10]",
        "ARGV[11]",
        ("KEYS[1]", "KEYS[13]", "KEYS[14]"),
    )
    + "end\nreturn 3"
)

# A task that starts checks, in the same step that records its start, that its call
# is not settled yet (a redelivery) and its turn not cancelled. The start record names
# the delivery (task id and retry count): the broker handing the same delivery out
# again while it runs (a restored unacked message) must not run the call twice.
START_LUA = (
    """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
"""
    + TURN_OPEN_LUA % (7, -2)
    + """
if redis.call('EXISTS', KEYS[3]) == 1 then return -1 end
local prev = redis.call('HGET', KEYS[2], ARGV[1])
if prev and ARGV[5] ~= '' then
  local ok, rec = pcall(cjson.decode, prev)
  if ok and rec['delivery'] == ARGV[5] then return 2 end
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if ARGV[6] ~= '' then redis.call('SADD', KEYS[8], ARGV[6]) end
"""
    + publish_lua("KEYS[4]", "KEYS[5]", "KEYS[6]", "ARGV[3]", "ARGV[4]")
    + "return 1"
)

# A woken turn: whoever wakes it (a model round, an answer) in one step.
WAKE_ONLY_LUA = (
    TURN_OPEN_LUA % (3, 0)
    + wake_lua("KEYS[1]", "KEYS[2]", "ARGV[1]", "ARGV[2]", "ARGV[3]")
    + "return 1"
)

FINISH_LLM_LUA = (
    TURN_OPEN_LUA % (3, -2)
    + """
redis.call('SET', KEYS[4], ARGV[4], 'EX', ARGV[3])
redis.call('DEL', KEYS[5])
"""
    + wake_lua("KEYS[1]", "KEYS[2]", "ARGV[1]", "ARGV[2]", "ARGV[3]")
    + take_step_lua("KEYS[6]", "KEYS[1]", "KEYS[3]", "KEYS[7]", "KEYS[8]", "ARGV[5]", "ARGV[6]")
    + "return 1"
)

# A stream worker takes a model round: unless it has a result or its turn is over, claim
# it, and read what the round needs, in one step (each round trip is a handoff to a thread
# on a stream worker that holds thousands of rounds).
BEGIN_LLM_LUA = (
    """
local done = redis.call('GET', KEYS[1])
if done then return {1, done} end
"""
    + TURN_OPEN_LUA % (2, "{2}")
    + """
if not redis.call('SET', KEYS[3], ARGV[1], 'NX', 'PX', ARGV[2]) then return {3} end
redis.call('SET', KEYS[4], ARGV[1], 'EX', ARGV[3])
return {0, redis.call('EXISTS', KEYS[5]), redis.call('LRANGE', KEYS[6], 0, -1)}
"""
)

# Ending a turn: its status, its terminal event and the retention TTL of its keys in one
# atomic step; exactly one ending wins, and nothing is published after it. A child turn
# started by an agent-as-tool call settles that call in its parent in the same step
# (first result wins, as in SETTLE_LUA), and wakes the parent if the batch is complete.
# A step ends the turn fenced by its lock, with the history messages it has not committed
# yet (the round's last tool results): the turn's last words and its end are one write,
# which lets go of the lock too.
CLOSE_LUA = (
    TURN_OPEN_LUA % (1, 0)
    + """
if ARGV[10] ~= '' then
  if redis.call('GET', KEYS[14]) ~= ARGV[10] then return -1 end
  redis.call('DEL', KEYS[14])
end
local n = tonumber(ARGV[11])
for i = 12, 11 + n do redis.call('RPUSH', KEYS[15], ARGV[i]) end
if n > 0 then redis.call('HINCRBY', KEYS[1], 'version', 1) end
"""
    + publish_lua("KEYS[4]", "KEYS[5]", "KEYS[6]", "ARGV[3]", "ARGV[4]")
    + """
for i = 12 + n, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
for i = 16, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[2]) end
if ARGV[5] == '' then return 1 end
local pstatus = redis.call('HGET', KEYS[7], 'status')
if not pstatus or """
    + ended_lua("pstatus")
    + """ then
  return 1
end
if redis.call('HSETNX', KEYS[8], ARGV[6], ARGV[7]) == 0 then return 1 end
local tracked = redis.call('SREM', KEYS[13], ARGV[6])
local ready = tracked == 0 or redis.call('SCARD', KEYS[13]) == 0
do
"""
    + publish_lua("KEYS[10]", "KEYS[11]", "KEYS[12]", "ARGV[8]", "ARGV[4]")
    + "end\nif not ready then return 1 end\n"
    + wake_lua("KEYS[9]", "KEYS[3]", "ARGV[5]", "ARGV[9]", "ARGV[2]")
    + "return 2\n"
)

# A fact about a turn whose state Redis lost (a restart without persistence): the turn
# cannot go on, so it ends here with a clear error, once, and its record expires.
STATE_LOST_LUA = (
    """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'status', '"error"', 'error_code', '"state_lost"', 'error', ARGV[1])
"""
    + publish_lua("KEYS[2]", "KEYS[3]", "KEYS[4]", "ARGV[2]", "ARGV[3]")
    + """
for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[4]) end
return 1
"""
)


# The step's writes are fenced by its lock token: a step whose lock lapsed (a paused
# process) cannot overwrite what the step that took over wrote.
COMMIT_LUA = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
local n = tonumber(ARGV[2])
for i = 3, 2 + 2 * n, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('HINCRBY', KEYS[2], 'version', 1)
for i = 3 + 2 * n, #ARGV do redis.call('RPUSH', KEYS[3], ARGV[i]) end
return 1
"""

# A step begins: take the lock, clear the dirty mark, and read what the step needs (state,
# cancel flag, history) in one round trip.
_ROUND_KEYS = ("KEYS[6]", "KEYS[7]", "KEYS[8]")
BEGIN_LUA = f"""
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return false end
redis.call('DEL', KEYS[2])
return {{{read_view_lua("KEYS[3]", "KEYS[4]", "KEYS[5]", _ROUND_KEYS)}}}
"""

# A step that goes round again (woken while it ran) reads afresh, lock kept.
REREAD_LUA = f"""
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return false end
redis.call('DEL', KEYS[2])
return {{{read_view_lua("KEYS[3]", "KEYS[4]", "KEYS[5]", _ROUND_KEYS)}}}
"""


def record_lua(calls: str, outstanding: str, results: str, first: int) -> str:
    """Lua recording the dispatch records in ARGV[first..] (call id, record pairs): sent,
    and, unless already settled, in the batch in flight whose last settle wakes the turn.

    A step sends a batch's calls first and records them after (still holding its lock), so
    a call may settle before its record; it woke the turn then, and is not in flight.
    """
    return f"""
for i = {first}, #ARGV, 2 do
  redis.call('HSET', {calls}, ARGV[i], ARGV[i + 1])
  if redis.call('HEXISTS', {results}, ARGV[i]) == 0 then
    redis.call('SADD', {outstanding}, ARGV[i])
  end
end
"""


# Releasing the step lock, with the dispatch records of the calls the step sent: if the
# turn was woken meanwhile, keep the lock and step again; else drop it and leave the turn's
# next deadline for the sweepers.
RELEASE_LUA = (
    """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
"""
    + record_lua("KEYS[4]", "KEYS[5]", "KEYS[6]", 5)
    + """
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('PEXPIRE', KEYS[1], ARGV[4])
  return 0
end
redis.call('DEL', KEYS[1])
if ARGV[3] == '' then
  redis.call('ZREM', KEYS[3], ARGV[2])
else
  redis.call('ZADD', KEYS[3], ARGV[3], ARGV[2])
end
return 1
"""
)

# A sweeper claims a due wakeup by pushing it later (its retry if the step never runs):
# several sweepers, one claim.
CLAIM_LUA = """
local cur = redis.call('ZSCORE', KEYS[1], ARGV[1])
if (not cur) or tonumber(cur) > tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('SET', KEYS[2], '1', 'EX', ARGV[4])
return 1
"""

# Dispatch records written apart from a step's release (a sub-agent call's child turn).
RECORD_DISPATCH_LUA = record_lua("KEYS[1]", "KEYS[2]", "KEYS[3]", 1) + "return 1\n"
