"""Every Lua script names its inputs before anything else: a header giving its layout,
then its KEYS and ARGV bound to names (`agentq.events.lua_args.bind_lua`); past that, no
script reads an input by a literal position (loops over a variable tail excepted)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agentq.events import bus
from agentq.events.lua_args import LuaScript
from agentq.limits import bucket, semaphore
from agentq.limits.bucket import TokenBucket
from agentq.limits.semaphore import LeasedSemaphore
from agentq.llm import capacity_lua
from agentq.llm.capacity import Capacity
from agentq.state import conversation_lua, interactions, listing, spend
from agentq.state.store import TurnStore
from agentq.webhooks import deliveries
from agentq.webhooks.deliveries import Deliveries


def _store_scripts() -> dict[str, str]:
    scripts: dict[str, str] = {}
    for cls in TurnStore.__mro__:
        for attr, script in vars(cls).items():
            if isinstance(script, LuaScript):
                scripts[f"{cls.__name__}.{attr}"] = script.source
    return scripts


SCRIPTS = {
    **_store_scripts(),
    "interactions._CLOSE_LUA": interactions._CLOSE_LUA,
    "listing._SUMMARY_LUA": listing._SUMMARY_LUA,
    "bus.PUBLISH_QUEUED_LUA": bus.PUBLISH_QUEUED_LUA,
    "bus.PUBLISH_MANY_LUA": bus.PUBLISH_MANY_LUA,
    "bus.WATCH_LUA": bus.WATCH_LUA,
    **{
        f"capacity_lua.{name}": getattr(capacity_lua, name)
        for name in (
            "ACQUIRE_LUA",
            "FREE_LUA",
            "SNAPSHOT_LUA",
            "RENEW_LUA",
            "BREAKER_LUA",
            "NOTE_LUA",
        )
    },
    "bucket.TAKE_LUA": bucket.TAKE_LUA,
    "semaphore.ACQUIRE_LUA": semaphore.ACQUIRE_LUA,
    "deliveries.CREATE_LUA": deliveries.CREATE_LUA,
    "deliveries.CLAIM_LUA": deliveries.CLAIM_LUA,
    **{
        f"conversation_lua.{name}": getattr(conversation_lua, name)
        for name in (
            "ADMIT_LUA",
            "IN_PLACE_LUA",
            "RELEASE_LUA",
            "READ_LUA",
            "DELETE_LUA",
            "NOTE_INJECTED_LUA",
        )
    },
    "spend.RESERVE_LUA": spend.RESERVE_LUA,
    "spend.SETTLE_LUA": spend.SETTLE_LUA,
}

_BINDING = re.compile(r"^local \w+ = (KEYS|ARGV)\[\d+\]$|^local \w+_at = \d+$")
_BY_POSITION = re.compile(r"\b(KEYS|ARGV)\[\d+\]")


def test_the_store_has_scripts() -> None:
    assert len(_store_scripts()) >= 12
    # Read on the class (mock.patch.object, inspect), a script is its LuaScript.
    assert isinstance(TurnStore._settle, LuaScript)


@pytest.mark.parametrize("cls", [bus.EventBus, LeasedSemaphore, TokenBucket, Capacity, Deliveries])
def test_a_class_names_its_scripts_as_the_store_does(cls: type) -> None:
    scripts = [s.source for s in vars(cls).values() if isinstance(s, LuaScript)]
    assert scripts
    assert all(source in SCRIPTS.values() for source in scripts)


def test_scripts_are_registered_one_way() -> None:
    pkg = Path(bus.__file__).resolve().parents[1]
    users = {p.name for p in pkg.rglob("*.py") if "register_script(" in p.read_text()}
    assert users == {"lua_args.py"}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_script_opens_with_its_layout_and_reads_its_inputs_by_name(name: str) -> None:
    lines = SCRIPTS[name].splitlines()
    assert lines[0].startswith("-- KEYS: "), f"{name} does not open with its layout"
    body = lines[1:]
    while body and _BINDING.match(body[0]):
        body = body[1:]
    by_position = [line for line in body if _BY_POSITION.search(line)]
    assert not by_position, f"{name} reads inputs by position: {by_position}"
