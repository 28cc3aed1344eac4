"""Redis key layout and queue names, in one place."""

from __future__ import annotations

PREFIX = "agentq"

QUEUE_TURNS = "agentq.turns"
QUEUE_LLM = "agentq.llm"
QUEUE_TOOLS = "agentq.tools"

TASK_TURN = "agentq.turn.run"
TASK_LLM_ROUND = "agentq.llm.round"
TOOL_TASK_PREFIX = "agentq.tool."

ACTIVE_TURNS = f"{PREFIX}:turns:active"
"""Sorted set: turn id scored by start time, for `agentq turns` and the lease reaper."""


def turn_key(turn_id: str) -> str:
    """Hash of the turn's state."""
    return f"{PREFIX}:turn:{turn_id}"


def events_channel(turn_id: str) -> str:
    return f"{PREFIX}:turn:{turn_id}:events"


def log_key(turn_id: str) -> str:
    return f"{PREFIX}:turn:{turn_id}:log"


def seq_key(turn_id: str) -> str:
    return f"{PREFIX}:turn:{turn_id}:seq"


def history_key(turn_id: str) -> str:
    """List of the turn's messages (OpenAI chat format, JSON)."""
    return f"{PREFIX}:turn:{turn_id}:history"


def results_key(turn_id: str) -> str:
    """Hash call_id -> settled ToolResult JSON; the first writer wins (HSETNX)."""
    return f"{PREFIX}:turn:{turn_id}:results"


def calls_key(turn_id: str) -> str:
    """Hash call_id -> dispatch record (task id, started, worker)."""
    return f"{PREFIX}:turn:{turn_id}:calls"


def started_key(turn_id: str) -> str:
    """Hash call_id -> start record (worker, pid, started_at), written by the tool worker."""
    return f"{PREFIX}:turn:{turn_id}:started"


def children_key(turn_id: str) -> str:
    """Set of sub-agent turns started by this turn; aborted with it."""
    return f"{PREFIX}:turn:{turn_id}:children"


def inbox_key(turn_id: str) -> str:
    """List the turn blocks on: settled results, model rounds, abort, answers."""
    return f"{PREFIX}:turn:{turn_id}:inbox"


def cancel_key(turn_id: str) -> str:
    return f"{PREFIX}:turn:{turn_id}:cancel"


def resume_claim_key(turn_id: str) -> str:
    """Set NX by the reaper that resumes an orphaned turn, so only one resumes it."""
    return f"{PREFIX}:turn:{turn_id}:resume"


def lease_key(turn_id: str) -> str:
    return f"{PREFIX}:turn:{turn_id}:lease"


def interaction_key(turn_id: str, request_id: str) -> str:
    return f"{PREFIX}:turn:{turn_id}:interaction:{request_id}"


def secret_key(turn_id: str, request_id: str) -> str:
    """A password answer, read once by the tool and never written elsewhere."""
    return f"{PREFIX}:turn:{turn_id}:secret:{request_id}"


def llm_result_key(turn_id: str, round_no: int) -> str:
    return f"{PREFIX}:turn:{turn_id}:llm:{round_no}"


def llm_alive_key(turn_id: str, round_no: int) -> str:
    """Set with a short TTL, renewed by the stream worker while it runs the round."""
    return f"{PREFIX}:turn:{turn_id}:llm:{round_no}:alive"


WORKER_HEARTBEAT_S = 1.0
"""How often a tool worker's main process says it is alive."""
WORKER_ALIVE_TTL_S = 5.0
"""A tool worker silent this long is dead: its running calls settle as lost."""


def worker_alive_key(hostname: str) -> str:
    return f"{PREFIX}:worker:{hostname}:alive"


def conversation_key(conversation_id: str) -> str:
    return f"{PREFIX}:conv:{conversation_id}:history"


def turn_keys(turn_id: str) -> list[str]:
    """Every per-turn key that gets the retention TTL when the turn ends."""
    return [
        turn_key(turn_id),
        log_key(turn_id),
        seq_key(turn_id),
        history_key(turn_id),
        results_key(turn_id),
        calls_key(turn_id),
        started_key(turn_id),
        children_key(turn_id),
        inbox_key(turn_id),
        cancel_key(turn_id),
    ]
