"""Fleet-wide limits in Redis, each one Lua script on Redis's own clock (the processes
that share a limit may disagree on time): a leased semaphore (`semaphore`) and a token
bucket (`bucket`). The gateway's start limits and MCP servers' concurrency use them; model
capacity keeps its own pacing (`agentq.llm.capacity`)."""
