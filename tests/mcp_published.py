"""Where the tests find the published MCP servers of tests/mcp-servers (npm, pinned there and
installed by .ci/run): installed here too when npm is on PATH, skipped only without node."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SERVERS = Path(__file__).resolve().parent / "mcp-servers"
EVERYTHING = SERVERS / "node_modules/@modelcontextprotocol/server-everything/dist/index.js"
INSTALL_TIMEOUT_S = 300


def everything_argv() -> list[str]:
    """argv of the reference server `@modelcontextprotocol/server-everything` on stdio."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip(
            "node and npm are needed to run @modelcontextprotocol/server-everything "
            f"(node: {node or 'not on PATH'}, npm: {npm or 'not on PATH'})"
        )
    if not EVERYTHING.exists():
        done = subprocess.run(
            [npm, "ci", "--prefix", str(SERVERS), "--no-audit", "--no-fund"],
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
            check=False,
        )
        assert EVERYTHING.exists(), (
            f"npm ci --prefix {SERVERS} failed ({done.returncode}): {done.stderr[-2000:]}"
        )
    return [node, str(EVERYTHING), "stdio"]
