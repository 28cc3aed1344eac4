"""The admitted rate of a model, in Lua for the capacity scripts (`capacity_lua`): a
ceiling, not a schedule, cut by a 429 and climbing back (docs/capacity.md). Its state, per
model, in the `rate` hash: r, t, ai (the rate cut to at t, its climb a second), d (the
last cut), top (where the climb ends), lr, lt (the provider's limits), w, n, f (the latest
second granted in, its grants, the last second that filled up), expiring `rate_ttl_ms`
after the last news of it."""

from __future__ import annotations

DECREASE = 0.8
"""A 429 despite pacing multiplies the admitted rate by this, at once, fleet-wide."""
RECOVER_S = 4.0
"""...and it climbs back to the ceiling in this many seconds."""
TOP_SHARE = 0.9
"""Without a ceiling the climb ends at this share of the rate refused: the provider's limit
is under it. Climbing back to the rate refused itself never came down to the limit: a rate
overshot in slow start (34/s against 20) was refused again every few seconds."""
PROBE = 0.02
"""...and goes on past it by this share of it a second: the provider's limit may have
grown."""
SLOW_START = 1.5
"""Before a 429 came while paced, the guessed rate grows by this factor each second."""
# RATE_LUA: the adaptation as pure functions of the rate state (no Redis call), which the
# unit tests run alone (tests/unit/test_rate_adaptation.py).
RATE_LUA = f"""
local DECREASE, RECOVER_S = {DECREASE!r}, {RECOVER_S!r}
local PROBE, SLOW_START, TOP_SHARE = {PROBE!r}, {SLOW_START!r}, {TOP_SHARE!r}

-- The configured rpm, else the provider's own limit learned from its headers (0: none).
local function ceiling_of(cfg_rpm, st)
  if cfg_rpm > 0 then return cfg_rpm end
  return st.lr
end

-- The rpm admitted at `now` (0: unpaced). After a cut to `r` at `t` it climbs by `ai` a
-- second to the ceiling; without one, to `top` (under the rate refused) and on by PROBE,
-- or by SLOW_START while `top` is unknown.
local function admitted_rpm(st, ceiling, now)
  if not st.r then return ceiling end
  local dt = math.max(now - st.t, 0) / 1000
  if ceiling > 0 then return math.min(st.r + st.ai * dt, ceiling) end
  if st.top <= 0 then return st.r * SLOW_START ^ math.min(dt, 30) end
  local r = st.r + st.ai * dt
  if r > st.top and st.ai > 0 then
    r = st.top * (1 + PROBE * (dt - (st.top - st.r) / st.ai))
  end
  return r
end

-- A 429 despite pacing at `rpm` (0: none known, `seen_rpm` is the guess): the rate cut
-- to, its climb a second, and where the climb ends (the ceiling, else TOP_SHARE of the
-- rate refused; 0 when that was a guess, and slow start goes on).
local function cut(rpm, ceiling, seen_rpm)
  local guess = rpm
  if guess <= 0 then guess = math.max(seen_rpm, 60) end
  local top = ceiling
  if top <= 0 and rpm > 0 then top = math.max(guess * TOP_SHARE, 1) end
  return math.max(guess * DECREASE, 1), top * (1 - DECREASE) / RECOVER_S, top
end
"""

# RATE_HELPERS_LUA: part of every deciding script's helpers, after num() and fmt().
RATE_HELPERS_LUA = (
    RATE_LUA
    + """
local RATE_TTL_MS = cfg.rate_ttl_ms
local RS = nil
local function rate_state()
  if RS == nil then
    local fields = {'r', 't', 'ai', 'd', 'lr', 'lt', 'w', 'n', 'f', 'top'}
    local v = redis.call('HMGET', RATE, unpack(fields))
    RS = {}
    for i, f in ipairs(fields) do RS[f] = num(v[i]) end
    RS.r = tonumber(v[1])  -- nil: no cut yet
  end
  return RS
end

local function tpm_limit()
  if cfg.tpm > 0 then return cfg.tpm end
  return rate_state().lt
end

-- The rpm admitted now (0: no rate known, unpaced).
local function rate_rpm()
  return admitted_rpm(rate_state(), ceiling_of(cfg.rpm, rate_state()), now)
end

-- At most a second's worth is granted in each wall-clock second, counted in the second of
-- the grant's slot, which never goes back (a slot in the next second holds this one's rest).
local function window_now()
  local st = rate_state()
  local w = math.max(math.floor(now / 1000), st.w)
  if st.w ~= w then
    -- A second that filled up held rounds back: the next goes on at the pace, no burst.
    st.smooth = st.f == w - 1
    st.w, st.n = w, 0
  end
  return w
end

local function window_ready(rpm)
  if rpm <= 0 then return now end
  local w = window_now()
  if rate_state().n >= math.max(math.floor(rpm / 60 + 0.001), 1) then return (w + 1) * 1000 end
  return math.max(now, w * 1000)
end

-- A request given back (k < 0) leaves the count of a second past, and never goes below none.
local function window_add(rpm, k, at)
  if rpm <= 0 then return end
  local st = rate_state()
  if math.floor(at / 1000) ~= window_now() or st.n + k < 0 then return end
  if st.smooth then
    gcra_defer(GCRA, 'r', 60000 / rpm, cfg.burst_ms, now)
    st.smooth = false
  end
  st.n = st.n + k
  redis.call('HSET', RATE, 'w', st.w, 'n', st.n)
  if st.n >= math.max(math.floor(rpm / 60 + 0.001), 1) then redis.call('HSET', RATE, 'f', st.w) end
  if st.n == k then redis.call('PEXPIRE', RATE, RATE_TTL_MS) end
end

"""
)

# NOTE_BODY_LUA, the end of NOTE_LUA: what one answer said (docs/capacity.md): limits
# learned, the rate cut by a 429 despite pacing (once a second: one overfull window's 429s
# are one signal), a pause. Returns when the pause ends (0: none).
NOTE_BODY_LUA = """
local st = rate_state()
local learned = false
for _, x in ipairs({{'lr', limit_rpm}, {'lt', limit_tpm}}) do
  local v = tonumber(x[2]) or 0
  if v > 0 and v ~= st[x[1]] then
    redis.call('HSET', RATE, x[1], v)
    st[x[1]], learned = v, true
  end
end
local rpm = rate_rpm()
if tonumber(refused) == 1 and now - st.d >= 1000 then
  local seen_rpm = 0
  if rpm <= 0 then
    window_now()
    seen_rpm = math.max(tonumber(hint_rpm) or 0, st.n * 60)
  end
  st.r, st.ai, st.top = cut(rpm, ceiling_of(cfg.rpm, st), seen_rpm)
  st.t, st.d, rpm = now, now, st.r
  redis.call('HSET', RATE, 'r', fmt(rpm), 't', now, 'd', now, 'ai', fmt(st.ai), 'top', fmt(st.top))
end
local until_at = 0
local wait = tonumber(wait_ms)
if wait then
  until_at = now + wait
  -- A wait of a second or less is the provider's window: its next one opens on the second.
  -- A longer wait (a window per minute spent) is meant as said.
  if rpm > 0 and wait <= 1000 then
    until_at = math.min(until_at, (math.floor(now / 1000) + 1) * 1000)
  end
  local cur = num(redis.call('HGET', PAUSE, field))
  if until_at > cur then
    redis.call('HSET', PAUSE, field, string.format('%d', until_at))
    local ttl = redis.call('PTTL', PAUSE)
    redis.call('PEXPIRE', PAUSE, math.max(ttl, until_at - now) + 1)
  else
    until_at = cur
  end
  if rpm > 0 then gcra_defer(GCRA, 'r', 60000 / rpm, cfg.burst_ms, until_at) end
end
if learned or tonumber(refused) == 1 then redis.call('PEXPIRE', RATE, RATE_TTL_MS) end
return cjson.encode({until_at = until_at, rpm = rpm})
"""
