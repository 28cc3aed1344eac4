"""The I/O tool worker, as `agentq worker io`: `python -m workers.io [celery worker options]`."""

from __future__ import annotations

import sys

from agentq.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main(["worker", "io", *sys.argv[1:]]))
