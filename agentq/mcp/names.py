"""How an MCP server's tool is named to the model: `SERVER__TOOL`, made a valid function name
(the mapping and its collisions: docs/mcp.md, "What the model sees"). A pure function, the
same in every process; task names (`agentq.tool.<name>`) take the mapped name, which only
has characters safe there, and no Python identifier is ever made from it.
"""

from __future__ import annotations

import hashlib
import re

SEPARATOR = "__"
MAX_NAME = 64
"""The longest function name the OpenAI API accepts."""
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")
_HASH_CHARS = 8


def tool_name(server: str, tool: str) -> str:
    """The model's name of `tool` of `server`: `SERVER__TOOL` when that is a valid function
    name, else made one, ending in a short hash of the original."""
    name = f"{server}{SEPARATOR}{tool}"
    if FUNCTION_NAME.match(name):
        return name
    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]
    safe = _UNSAFE.sub("_", name)
    return f"{safe[: MAX_NAME - _HASH_CHARS - 1]}_{digest}"
