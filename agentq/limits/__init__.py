"""Fleet-wide limits in Redis, as Lua that every limit composes: leases on places
(`semaphore`) and GCRA pacing (`bucket`). The gateway's start limits and MCP servers'
concurrency run them as scripts of their own; model capacity (`agentq.llm.capacity`)
builds its fair queue, deployments and breakers from the same Lua."""

# REDIS_NOW_MS_LUA: redis_now_ms(), the one clock of every limit script: Redis's TIME in
# epoch milliseconds, so processes whose clocks disagree still agree on when a lease
# lapses or a slot comes due.
REDIS_NOW_MS_LUA = """
local function redis_now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""
