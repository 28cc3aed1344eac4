"""Fleet-wide limits in Redis, as Lua that every limit composes: leases on places
(`semaphore`) and GCRA pacing (`bucket`), run as scripts of their own or inside model
capacity's (`agentq.llm.capacity`)."""

# The one clock of every limit script, Redis's TIME in ms: processes whose clocks disagree
# still agree on when a lease lapses or a slot comes due.
REDIS_NOW_MS_LUA = """
local function redis_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""
