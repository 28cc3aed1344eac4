"""The launcher of a stdio MCP server: it dies with its worker and sees only its config.

`python -m agentq.mcp.child PROGRAM ARGS...` asks Linux to kill it when the thread that
started it (an I/O worker's event loop) ends, so no server outlives a worker killed
outright, keeps only the variables named in AGENTQ_MCP_ENV_KEYS (the config's `env`), and
becomes the server (exec: same process, so killing it kills the server).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys

ENV_KEYS = "AGENTQ_MCP_ENV_KEYS"
PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m agentq.mcp.child PROGRAM [ARGS...]")
    keys = [k for k in os.environ.get(ENV_KEYS, "").split(",") if k]
    env = {k: os.environ[k] for k in keys if k in os.environ}
    # Found on the worker's PATH: the server's own environment need not have one.
    program = shutil.which(argv[0]) or argv[0]
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:
            sys.exit("agentq.mcp.child: the worker that started this server is gone")
    os.execve(program, argv, env)


if __name__ == "__main__":
    main(sys.argv[1:])
