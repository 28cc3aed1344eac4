"""How a Lua script's inputs are named: each script opens by binding its KEYS and ARGV
to names, in the order of the NamedTuples the Python builds its lists from, so an
argument's position is written in one place; and how a class names its scripts
(`LuaScript`). Imports nothing of agentq: every module with a script may use it."""

from __future__ import annotations

from typing import Any, overload

from redis.commands.core import Script


def bind_lua(keys: Any = (), args: Any = (), rest: str = "") -> str:
    """Lua that opens a script: a header giving its argument layout, then its KEYS and ARGV
    bound to names (`local turn_key = KEYS[1]`) in the order of `keys` and `args` (NamedTuple
    classes, or names). `rest` names a variable tail after them: `<rest>_at` is its first
    index."""
    key_names, arg_names = (tuple(getattr(x, "_fields", x)) for x in (keys, args))
    tail = f", {rest}..." if rest else ""
    lines = [f"-- KEYS: {', '.join(key_names) or '-'}; ARGV: {', '.join(arg_names) or '-'}{tail}"]
    lines += [f"local {n} = KEYS[{i}]" for i, n in enumerate(key_names, 1)]
    lines += [f"local {n} = ARGV[{i}]" for i, n in enumerate(arg_names, 1)]
    if rest:
        lines.append(f"local {rest}_at = {len(arg_names) + 1}")
    return "\n".join(lines) + "\n"


class LuaScript:
    """A script its class names once, registered on the instance's `redis` at first use."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> LuaScript: ...
    @overload
    def __get__(self, obj: object, owner: type | None = None) -> Script: ...
    def __get__(self, obj: Any, owner: type | None = None) -> Script | LuaScript:
        if obj is None:  # read on the class (mock.patch.object, inspect)
            return self
        script: Script = obj.redis.register_script(self.source)
        obj.__dict__[self.name] = script  # later reads find it on the instance
        return script
