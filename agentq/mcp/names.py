"""How an MCP server's tool is named to the model: `SERVER__TOOL`, made a valid function name
(the mapping and its collisions: docs/mcp.md, "What the model sees"). A pure function, the
same in every process; task names (`agentq.tool.<name>`) take the mapped name, which only
has characters safe there, and no Python identifier is ever made from it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable

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


def mapped_names(
    tools: Iterable[tuple[str, str]],
) -> tuple[dict[str, tuple[str, str]], dict[str, list[tuple[str, str]]]]:
    """The model name of every (server, tool), reversed: `{name: (server, tool)}` for the
    names one tool has, and `{name: [(server, tool), ...]}` for those two or more would
    share (all of them refused: which one the model meant cannot be told)."""
    seen: dict[str, list[tuple[str, str]]] = {}
    for server, tool in tools:
        seen.setdefault(tool_name(server, tool), []).append((server, tool))
    unique = {name: owners[0] for name, owners in seen.items() if len(owners) == 1}
    shared = {name: owners for name, owners in seen.items() if len(owners) > 1}
    return unique, shared
