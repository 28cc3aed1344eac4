"""How an MCP server's tool is named to the model: `SERVER__TOOL`."""

from __future__ import annotations

import hashlib
import re

SEPARATOR = "__"
MAX_NAME = 64
"""The longest function name the OpenAI API accepts."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def tool_name(server: str, tool: str) -> str:
    """`SERVER__TOOL`, characters outside [A-Za-z0-9_-] replaced by `_`; a name past 64
    characters keeps its start and ends in a short hash of the whole, so two long names
    stay two names."""
    name = _UNSAFE.sub("_", f"{server}{SEPARATOR}{tool}")
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: MAX_NAME - 9]}_{digest}"
