"""How a Lua script names its inputs (bound in the order of the NamedTuple the Python builds
its lists from, so a position is written once) and how a class names its scripts
(`LuaScript`); imports nothing of agentq, so every module with a script may use it."""

from __future__ import annotations

from typing import Any, overload

from redis.commands.core import Script


def bind_lua(keys: Any = (), args: Any = (), rest: str = "") -> str:
    """Lua that opens a script: a header with its layout, then KEYS and ARGV bound to the
    names of `keys` and `args` (NamedTuple classes, or names); `rest` names a variable tail,
    whose first index is `<rest>_at`."""
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
