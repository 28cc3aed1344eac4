"""Test doubles users test their agents with: a scripted model and a local fleet
(`ScriptedModel`, `call`, `reply`, `local_fleet`; docs/python-api.md)."""

from __future__ import annotations

import importlib as _importlib
import typing as _typing

if _typing.TYPE_CHECKING:
    from agentq.testing.fleet import FleetClient, ScriptedModel, call, local_fleet, reply

__all__ = ["FleetClient", "ScriptedModel", "call", "local_fleet", "reply"]


def __getattr__(name: str) -> _typing.Any:
    """Imported on first use: the servers and fakes of this package need none of it."""
    if name not in __all__:
        raise AttributeError(f"module 'agentq.testing' has no attribute {name!r}")
    value = getattr(_importlib.import_module("agentq.testing.fleet"), name)
    globals()[name] = value
    return value
