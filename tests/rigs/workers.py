"""Settings for the workers a test starts: tiny real limits, so faults show in seconds."""

from __future__ import annotations


def worker_env(
    redis_url: str,
    llm_url: str | None = None,
    *,
    tools: str = "agentq.testing.tools",
    pythonpath: str | None = None,
    **extra: str,
) -> dict[str, str]:
    """Settings for test workers: tiny real limits so faults show in seconds, not minutes."""
    env = {
        "AGENTQ_REDIS_URL": redis_url,
        "AGENTQ_TOOLS": tools,
        "AGENTQ_TURN_LEASE_S": "1.5",
        "AGENTQ_STEP_LOCK_S": "1.5",
        "AGENTQ_TOOL_GRACE_S": "1.5",
        "AGENTQ_ABORT_KILL_GRACE_S": "0.5",
        "AGENTQ_PROGRESS_INTERVAL_S": "1",
        "AGENTQ_STREAM_IDLE_TIMEOUT_MS": "3000",
        "AGENTQ_LLM_MAX_RETRIES": "2",
        "AGENTQ_APPROVAL_TIMEOUT_S": "120",
        # One event loop per stream worker, as `agentq dev` runs it: a test streams tens of
        # rounds, not thousands, and a process a CPU (with their supervisor) cost every
        # start 7 CPU-s instead of 3. `--processes N` still overrides it where a test
        # needs a supervised stream worker.
        "AGENTQ_LLM_PROCESSES": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if llm_url:
        env["AGENTQ_LLM_BASE_URL"] = llm_url
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    env.update(extra)
    return env
