"""Help for the commands whose options pass through: `agentq worker` and `agentq flower`."""

from __future__ import annotations

WORKER_HELP = """usage: agentq worker {turns,llm,tools,io} [celery worker options...]

Start an agentq worker; every further option goes to `celery worker`.
`agentq worker KIND --help` lists them (--concurrency, --hostname, --queues, ...).

  turns   the turn state machine's steps      queue agentq.turns, threads pool
  llm     model streams on event loops        queue agentq.llm, threads pool
  tools   sync `def` tools, hard time limits  queue agentq.tools + tool queues, prefork
  io      `async def` tools on one event loop queue agentq.io + tool queues, threads

llm and io take one option of agentq's own, before or among Celery's:
  --processes N   event-loop processes, each a Celery worker named KIND-i@host
                  (llm: one per CPU, at most 4, or AGENTQ_LLM_PROCESSES;
                   io: 1, or AGENTQ_IO_PROCESSES)
"""


def flower_help() -> str:
    """Flower's own options (tornado's), which `agentq flower` passes through."""
    import io
    import re

    from flower.options import options

    buf = io.StringIO()
    options.print_help(buf)
    text = buf.getvalue()
    start = text.find("\n", text.find("options.py options:")) + 1
    # The default cookie secret is random per process: no use to a reader, and a secret.
    body = re.sub(
        r"(--cookie-secret\s+secure cookie secret)\s+\(default\s[^)]*\)", r"\1", text[start:]
    )
    return (
        "usage: agentq flower [--name=value ...]\n\n"
        "Flower on agentq's Celery app. agentq sets --port (AGENTQ_FLOWER_PORT), "
        "--address=127.0.0.1\nand --basic_auth (AGENTQ_FLOWER_BASIC_AUTH) unless given; "
        "every option below passes through.\n\nFlower options:\n" + body
    )
