"""The llm worker, as `agentq worker llm`: `python -m workers.llm [celery worker options]`."""

from __future__ import annotations

import sys

from agentq.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main(["worker", "llm", *sys.argv[1:]]))
