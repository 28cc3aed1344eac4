"""The Lua scripts behind `agentq.llm.capacity`, one per decision, so workers racing for
the same slot never both get it, and their inputs, one NamedTuple each: a deciding script
gets the model's keys (`ModelKeys`), `DecidingArgs`, then its own (`AcquireArgs`, ...);
the scripts on one key (renew, the breaker) get that key and their own."""

from __future__ import annotations

from typing import NamedTuple

from agentq.events.lua_args import bind_lua
from agentq.limits import REDIS_NOW_MS_LUA
from agentq.limits.bucket import GCRA_LUA
from agentq.limits.semaphore import LEASES_LUA
from agentq.llm.capacity_rate import NOTE_BODY_LUA, RATE_HELPERS_LUA


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
    config: str  # the model's limits (JSON)
    now_arg: str | int  # the caller's clock (ms); "": Redis TIME
    model: str
    nonce: str  # random: makes the lease ids a script hands out unique


class AcquireArgs(NamedTuple):
    waiter: str  # unique per round
    class_: str  # "i" (interactive) or "b" (background)
    owner: str
    weight: str  # the owner's weight in the fair queue
    tokens: int  # the round's estimated tokens


class FreeArgs(NamedTuple):
    """A release (`lease_id`) or a withdrawal (`waiter`): the other is ""."""

    lease_id: str
    used: str | int  # tokens the round used ("": unknown)
    waiter: str


class NoteArgs(NamedTuple):
    """What one answer of the provider said about its limits (`Capacity.note_answer`)."""

    refused: int  # 1: a 429 although the fleet paced its requests: the rate comes down
    field: str  # what to pause: "m" (the model) or "d:<deployment>"
    wait_ms: str | int  # how long the provider asked to wait ("": no wait)
    limit_rpm: int  # the provider's own limits from its headers (0: not sent)
    limit_tpm: int
    hint_rpm: int  # requests a minute this process saw answered lately: the guess


class RenewArgs(NamedTuple):
    now_arg: str | int
    lease_id: str
    ttl_ms: int


class BreakerArgs(NamedTuple):
    now_arg: str | int
    deployment: str
    kind: str  # what failed: 5xx, stall, connection...
    failures_to_open: int
    cooldown_ms: int


def deciding_lua(args: type[NamedTuple] | None = None) -> str:
    """The opening of a deciding script whose own arguments are `args`: its inputs, and
    `cfg`, the caller's limits."""
    own = args._fields if args is not None else ()
    return bind_lua(ModelKeys, (*DecidingArgs._fields, *own)) + "local cfg = cjson.decode(config)\n"


CONFIG_TTL_S = 86_400
"""The fleet's stored limits of a model outlive the last configured caller this long."""

# The caller's clock is a test's: production passes "" and runs on Redis's (`agentq.limits`).
NOW_LUA = f"""{REDIS_NOW_MS_LUA}
local now = tonumber(now_arg) or redis_now_ms()
"""

CONFIG_STORE_S = 30.0
"""A configured process stores its limits again after this long (`store` in its config):
once per round would be a write per round; a stored copy Redis lost is back this soon."""

# A process configured with the limits stores them; one that is not decides by them too.
CONFIG_LUA = f"""
if cfg.configured then
  if cfg.store then redis.call('SET', CONFIG, config, 'EX', {CONFIG_TTL_S}) end
else
  local stored = redis.call('GET', CONFIG)
  if stored then cfg = cjson.decode(stored) end
end
"""

# A model without limits (nor a learned rate) that the fleet holds nothing of (no queue,
# grant, lease, breaker, or pause, whose hash expires with its last pause) goes at once: no
# lease, no write, no clock. A background round going so leaves the interactive-grant count
# alone: it matters only while both classes wait. An unconfigured caller counts the stored
# limits (`also`: CONFIG) among what holds the model: no GET of its own.
UNMETERED_LUA = f"""
local function unmetered(also)
  if cfg.rpm > 0 or cfg.tpm > 0 or cfg.streams > 0 or not cfg.deps[1] then return nil end
  -- least_loaded weighs deployments by the leases they hold: it needs them recorded.
  if cfg.deps[2] and cfg.strategy ~= 'ordered' then return nil end
  for _, d in ipairs(cfg.deps) do
    if d.rpm > 0 or d.tpm > 0 or d.streams > 0 then return nil end
  end
  if redis.call('EXISTS', unpack({{QI, QB, LEASES, GRANTS, BRK, PAUSE, RATE, also}})) > 0 then
    return nil
  end
  local at = tonumber(now_arg) or false
  local g = {{l = '', d = cfg.deps[1].n, at = at, t = tonumber(tokens), k = 1}}
  return cjson.encode({{g = g, now = at}})
end
local at_once = not cfg.configured and unmetered(CONFIG)
if at_once then return at_once end
{CONFIG_LUA}
at_once = unmetered(nil)
if at_once then return at_once end
"""

HELPERS_LUA = (
    """
local DEPS = {}
for _, d in ipairs(cfg.deps) do DEPS[d.n] = d end

local function num(v) return tonumber(v) or 0 end
-- %.17g keeps epoch milliseconds and fractional tags exact; tostring would round them.
local function fmt(x) return string.format('%.17g', x) end

"""
    + GCRA_LUA
    + LEASES_LUA
    + RATE_HELPERS_LUA
    + """
-- Every limit of the model and its deployments is a GCRA field, `limit` per minute (0: none).
local function paced(field, limit)
  if limit <= 0 then return now end
  return gcra_ready(GCRA, field, 60000 / limit, cfg.burst_ms, now)
end

local function pace_add(field, limit, cost)
  if limit <= 0 or cost == 0 then return end
  gcra_add(GCRA, field, 60000 / limit, cost, now)
end

-- Counts the share of a request whose slot is `at` against the model's limits and
-- deployment `d`'s (nil: none known), or gives it back (negative).
local function charge(d, requests, tokens, at)
  -- rate_rpm() may read the rate hash: a release, which counts no request, does not.
  if requests ~= 0 then
    local rpm = rate_rpm()
    window_add(rpm, requests, at)
    pace_add('r', rpm, requests)
  end
  pace_add('t', tpm_limit(), tokens)
  if d then
    pace_add('r:' .. d.n, d.rpm, requests)
    pace_add('t:' .. d.n, d.tpm, tokens)
  end
  -- Requests and tokens per 10 s bucket; the last six buckets are the last minute.
  local b = math.floor(now / 10000)
  if num(redis.call('HGET', USE, 'cur')) ~= b then
    redis.call('HSET', USE, 'cur', b)
    for _, f in ipairs(redis.call('HKEYS', USE)) do
      local fb = tonumber(string.sub(f, 3))
      if fb and fb < b - 5 then redis.call('HDEL', USE, f) end
    end
  end
  if requests ~= 0 then redis.call('HINCRBY', USE, 'r:' .. b, requests) end
  if tokens ~= 0 then redis.call('HINCRBY', USE, 't:' .. b, tokens) end
end

-- What a lease held besides its place, given back once its place is gone.
local function undo_lease(lid)
  local raw = redis.call('HGET', LMETA, lid)
  if not raw then return nil end
  redis.call('HDEL', LMETA, lid)
  local m = cjson.decode(raw)
  if redis.call('HINCRBY', INFL, m.d, -1) <= 0 then redis.call('HDEL', INFL, m.d) end
  local g = redis.call('HGET', GRANTS, m.w)
  if g and cjson.decode(g).l == lid then redis.call('HDEL', GRANTS, m.w) end
  -- A probe that ends without a verdict (its worker died) lets the next request probe.
  if m.p == 1 then redis.call('HDEL', BRK, 'p:' .. m.d) end
  return m
end

local function breaker(dep)
  local o = tonumber(redis.call('HGET', BRK, 'o:' .. dep))
  if not o then return 'closed', now end
  if o > now then return 'open', o end
  local p = tonumber(redis.call('HGET', BRK, 'p:' .. dep))
  if p and p > now then return 'probing', p end
  return 'half_open', now
end

local function dep_ready(d)
  local state, ready = breaker(d.n)
  ready = math.max(ready, num(redis.call('HGET', PAUSE, 'd:' .. d.n)))
  if d.streams > 0 and num(redis.call('HGET', INFL, d.n)) >= d.streams then
    ready = math.max(ready, leases_next_end(LEASES, now))
  end
  return math.max(ready, paced('r:' .. d.n, d.rpm), paced('t:' .. d.n, d.tpm)), state
end

-- Takes the model's and a deployment's share for one request (the deployment, whether it
-- probes a half-open breaker), or says when to try again (nil, 0, ready_ms).
local function admit(tokens)
  -- The model's pause, streams and pace first (`dep_ready`: each deployment's).
  local rpm, ready = rate_rpm(), math.max(now, num(redis.call('HGET', PAUSE, 'm')))
  if leases_full(LEASES, cfg.streams) then ready = math.max(ready, leases_next_end(LEASES, now)) end
  ready = math.max(ready, paced('r', rpm), paced('t', tpm_limit()), window_ready(rpm))
  if ready > now then return nil, 0, ready end
  local best, best_load, best_state, soonest = nil, 0, nil, nil
  for _, d in ipairs(cfg.deps) do
    local r, state = dep_ready(d)
    if r <= now then
      local load = num(redis.call('HGET', INFL, d.n))
      if d.streams > 0 then load = load / d.streams end
      if best == nil or load < best_load then best, best_load, best_state = d, load, state end
      if cfg.strategy == 'ordered' then break end
    elseif soonest == nil or r < soonest then
      soonest = r
    end
  end
  if best == nil then return nil, 0, soonest end
  charge(best, 1, tokens, now)
  -- One request probes a deployment whose cool-down ended; the rest wait for its verdict.
  local probe = best_state == 'half_open' and 1 or 0
  if probe == 1 then redis.call('HSET', BRK, 'p:' .. best.n, now + cfg.lease_ttl_ms) end
  return best, probe, now
end

-- Each class's queue and finish tags.
local Q, FT = {i = QI, b = QB}, {i = FTI, b = FTB}

-- Start-time fair queuing per class: a round's start tag is the later of the class's
-- virtual time and its owner's previous finish tag, so owners take turns whatever
-- their backlog, and an owner's own rounds keep their order.
local function enqueue(w, cls, owner, weight, tokens)
  local q, ft = Q[cls], FT[cls]
  local v = num(redis.call('HGET', ST, 'v:' .. cls))
  local start = math.max(v, num(redis.call('HGET', ft, owner)))
  redis.call('HSET', ft, owner, fmt(start + 1 / weight))
  redis.call('ZADD', q, fmt(start), w)
  redis.call('HSET', QM, w, cjson.encode({c = cls, o = owner, t = tokens, s = now}))
end

local function unqueue(w, cls, tag)
  local q, ft = Q[cls], FT[cls]
  redis.call('ZREM', q, w)
  redis.call('HDEL', QM, w)
  if tag and tag > num(redis.call('HGET', ST, 'v:' .. cls)) then
    redis.call('HSET', ST, 'v:' .. cls, fmt(tag))
  end
  -- An empty class forgets finish tags, so rounds withdrawn in bulk hold no owner back.
  if redis.call('ZCARD', q) == 0 then redis.call('DEL', ft) end
end

local function pick_class()
  local ni, nb = redis.call('ZCARD', QI), redis.call('ZCARD', QB)
  if nb == 0 then return ni > 0 and 'i' or nil end
  if ni == 0 then return 'b' end
  -- While both wait, background gets one grant in bg_every (0: strict priority).
  if cfg.bg_every > 0 and num(redis.call('HGET', ST, 'ic')) >= cfg.bg_every - 1 then return 'b' end
  return 'i'
end

-- Grants the head waiters while capacity allows, now or at a slot due within `reserve_ms`.
-- Returns `capacity.Wakes`' fields (none empty: cjson writes {} for an empty array), the
-- slot of the head left waiting (`ready`), and the caller's (`me`) grant, now or later.
local function pump(me)
  local woken, later, own, head, ready = {}, {}, nil, nil, nil
  local real_now = now
  for i = 1, cfg.max_pump + 1 do
    local cls = pick_class()
    if not cls then break end
    local top = redis.call('ZRANGE', Q[cls], 0, 0, 'WITHSCORES')
    local w, tag = top[1], tonumber(top[2])
    -- This call granted its share; whoever is at the head may go on at once.
    if i > cfg.max_pump then
      head, ready = w, now
      break
    end
    local raw = redis.call('HGET', QM, w)
    local m = raw and cjson.decode(raw)
    if not m or m.s + cfg.waiter_ttl_ms < now then
      -- Its turn stopped asking without withdrawing: a grant would hold a slot for nobody.
      unqueue(w, cls, nil)
    else
      local d, probe, slot = admit(m.t)
      if not d and slot <= now + cfg.reserve_ms then
        -- Decided as at the slot: by then only releases (more room) and pauses differ.
        now = slot
        d, probe, slot = admit(m.t)
      end
      if not d then
        head, ready = w, slot
        break
      end
      unqueue(w, cls, tag)
      if cls == 'b' then
        redis.call('HSET', ST, 'ic', 0)
      elseif redis.call('ZCARD', QB) > 0 then
        redis.call('HINCRBY', ST, 'ic', 1)
      end
      -- A lease of deployment `d` for `w`, taken (by the caller itself, now) or not yet.
      local lid, taken = nonce .. i .. ':' .. model, w == me and now == real_now
      lease_hold(LEASES, lid, now + (taken and cfg.lease_ttl_ms or cfg.grant_ttl_ms))
      redis.call('HSET', LMETA, lid, cjson.encode({d = d.n, t = m.t, w = w, p = probe}))
      redis.call('HINCRBY', INFL, d.n, 1)
      local g = {l = lid, d = d.n, at = now, t = m.t, k = taken and 1 or 0}
      redis.call('HSET', GRANTS, w, cjson.encode(g))
      if w == me then
        own = g
      elseif now > real_now then
        later[#later + 1] = {waiter = w, at_ms = math.ceil(now)}
      else
        woken[#woken + 1] = w
      end
      now = real_now
    end
  end
  now = real_now
  local out = {now = now, ready = ready}
  if woken[1] then out.woken = woken end
  if later[1] then out.later = later end
  if head and head ~= me then
    -- Asked early enough to be given its slot (`reserve_ms`).
    local at = math.max(math.ceil(ready) - cfg.reserve_ms, math.floor(now))
    out.wake_next = {waiter = head, at_ms = at}
  end
  return out, own
end

"""
)

PRELUDE_LUA = CONFIG_LUA + NOW_LUA + HELPERS_LUA

ACQUIRE_LUA = (
    deciding_lua(AcquireArgs)
    + UNMETERED_LUA
    + NOW_LUA
    + HELPERS_LUA
    + """
local w = waiter
leases_lapse(LEASES, now, undo_lease)
local raw = redis.call('HGET', GRANTS, w)
if raw then
  local g = cjson.decode(raw)
  -- A slot given ahead of its time: the turn asks again then.
  if g.at > now then return cjson.encode({held = true, position = 1, ready = g.at, now = now}) end
  -- Taking a grant (or asking again for one taken) gives its lease a full term.
  lease_hold(LEASES, g.l, now + cfg.lease_ttl_ms, true)
  if g.k == 0 then
    g.k = 1
    redis.call('HSET', GRANTS, w, cjson.encode(g))
  end
  return cjson.encode({g = g, now = now})
end
raw = redis.call('HGET', QM, w)
local cls = class_
if raw then
  local m = cjson.decode(raw)
  m.s, cls = now, m.c
  redis.call('HSET', QM, w, cjson.encode(m))
else
  enqueue(w, cls, owner, tonumber(weight), tonumber(tokens))
end
local out, own = pump(w)
if not own then
  -- Still queued (it asked just now): background rounds come after every interactive one.
  out.position = redis.call('ZRANK', Q[cls], w) + 1
  if cls == 'b' then out.position = out.position + redis.call('ZCARD', QI) end
elseif own.at > now then
  out.held, out.position, out.ready = true, 1, own.at
else
  out.g = own
end
return cjson.encode(out)
"""
)

# FREE_LUA: a release names its lease; a withdrawal (`waiter`), the round it takes out of
# the queue, whose grant nobody took was never sent: that grant's request and tokens come
# back, as a release that used none. Then it grants whom the freed capacity lets go.
FREE_LUA = f"""{deciding_lua(FreeArgs)}{PRELUDE_LUA}
local lid, used, requests, at = lease_id, tonumber(used), 0, nil
if waiter ~= '' then
  local raw = redis.call('HGET', QM, waiter)
  if raw then unqueue(waiter, cjson.decode(raw).c, nil) end
  raw = redis.call('HGET', GRANTS, waiter)
  local g = raw and cjson.decode(raw)
  if g and g.k == 0 then lid, used, requests, at = g.l, 0, -1, num(g.at) end
end
local m = nil
if lid ~= '' then
  redis.call('ZREM', LEASES, lid)
  m = undo_lease(lid)
end
if m and used then
  -- The estimate counted against tpm becomes the real usage: the difference is taken or
  -- given back, so a short answer frees what its max_completion_tokens had reserved.
  charge(DEPS[m.d], requests, used - m.t, at)
end
-- Leases past their expiry belong to dead workers (or grants nobody took): free them.
leases_lapse(LEASES, now, undo_lease)
return cjson.encode((pump('')))
"""

SNAPSHOT_LUA = (
    deciding_lua()
    + PRELUDE_LUA
    + """
local b = math.floor(now / 10000)
local used = {r = 0, t = 0}
local flat = redis.call('HGETALL', USE)
for i = 1, #flat, 2 do
  local kind, fb = string.sub(flat[i], 1, 1), tonumber(string.sub(flat[i], 3))
  if fb and fb >= b - 5 and fb <= b then used[kind] = used[kind] + tonumber(flat[i + 1]) end
end
-- The snapshot as `Capacity.snapshot` answers it: a time or count of 0 is null.
local function some(x) if x > 0 then return x end return cjson.null end
local function pause_of(field)
  local paused = num(redis.call('HGET', PAUSE, field))
  return some(paused > now and paused or 0)
end
local deps = {}
for _, d in ipairs(cfg.deps) do
  deps[d.n] = {
    breaker = breaker(d.n), streams_in_use = num(redis.call('HGET', INFL, d.n)),
    failures = num(redis.call('HGET', BRK, 'f:' .. d.n)),
    open_until_ms = some(num(redis.call('HGET', BRK, 'o:' .. d.n))),
    last_failure = redis.call('HGET', BRK, 'k:' .. d.n) or cjson.null,
    paused_until_ms = pause_of('d:' .. d.n),
  }
end
return cjson.encode({
  now_ms = math.floor(now),
  queued = {interactive = redis.call('ZCARD', QI), background = redis.call('ZCARD', QB)},
  streams_in_use = redis.call('ZCOUNT', LEASES, '(' .. now, '+inf'),
  grants_outstanding = redis.call('HLEN', GRANTS), paused_until_ms = pause_of('m'),
  requests_last_minute = used.r, tokens_last_minute = used.t,
  admitted_rpm = some(math.floor(rate_rpm() * 10 + 0.5) / 10),
  learned_rpm = some(rate_state().lr), learned_tpm = some(rate_state().lt), deployments = deps,
})
"""
)

NOTE_LUA = deciding_lua(NoteArgs) + PRELUDE_LUA + NOTE_BODY_LUA

# RENEW_LUA: an expired lease not yet purged still holds its slot, so renewing it is safe.
RENEW_LUA = f"""{bind_lua(("LEASES",), RenewArgs._fields)}{NOW_LUA}{LEASES_LUA}
return lease_hold(LEASES, lease_id, now + tonumber(ttl_ms), true) and 1 or 0
"""

# BREAKER_LUA: a failure counted (a success needs no script: `Capacity.report_success`).
BREAKER_LUA = f"""{bind_lua(("BRK",), BreakerArgs._fields)}{NOW_LUA}
local d = deployment
local fails = redis.call('HINCRBY', BRK, 'f:' .. d, 1)
redis.call('HSET', BRK, 'k:' .. d, kind)
local o = tonumber(redis.call('HGET', BRK, 'o:' .. d))
-- Failures of requests sent before it opened do not lengthen the cool-down.
if o and o > now then return 'open' end
if o or fails >= tonumber(failures_to_open) then
  -- Tripped, or the half-open probe failed: every worker skips it for a cool-down.
  redis.call('HSET', BRK, 'o:' .. d, string.format('%d', now + tonumber(cooldown_ms)))
  redis.call('HDEL', BRK, 'p:' .. d)
  return 'open'
end
return 'closed'
"""
