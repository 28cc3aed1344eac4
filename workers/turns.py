"""The turns worker, as `agentq worker turns`: `python -m workers.turns [celery worker options]`."""

from __future__ import annotations

import sys

from agentq.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main(["worker", "turns", *sys.argv[1:]]))
