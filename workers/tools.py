"""The tools worker, as `agentq worker tools`: `python -m workers.tools [celery worker options]`."""

from __future__ import annotations

import sys

from agentq.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main(["worker", "tools", *sys.argv[1:]]))
