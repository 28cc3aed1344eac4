"""The llm worker: `python -m workers.llm [celery worker options]`, same as `agentq worker llm`."""

from __future__ import annotations

import sys

from agentq.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main(["worker", "llm", *sys.argv[1:]]))
