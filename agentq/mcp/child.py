"""`python -m agentq.mcp.child PROGRAM ARGS...`: a stdio MCP server's launcher. Linux kills
it when the thread that started it (an I/O worker's loop) ends, so no server outlives a
worker killed outright; it keeps only the AGENTQ_MCP_ENV_KEYS variables, then execs."""

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
