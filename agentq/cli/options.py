"""Celery worker options that agentq reads, or takes out, before the rest goes to Celery,
in each form Celery accepts: `-n X`, `-nX`, `--hostname X`, `--hostname=X`."""

from __future__ import annotations

from collections.abc import Sequence


def _inline_value(opt: str, names: Sequence[str]) -> str | None:
    """The value `opt` carries itself (`--name=value`, `-nvalue`), if it is one of `names`."""
    for n in names:
        if n.startswith("--") and opt.startswith(n + "="):
            return opt[len(n) + 1 :]
        if len(n) == 2 and opt.startswith(n) and len(opt) > 2:
            return opt[2:]
    return None


def has_option(opts: Sequence[str], *names: str) -> bool:
    """Whether any of `names` is given, in any form."""
    return any(o in names or _inline_value(o, names) is not None for o in opts)


def take_option(opts: Sequence[str], *names: str) -> tuple[str | None, list[str]]:
    """The value of the option `names` spell (the last one given, as Celery takes it;
    "" when it ends the command line without one) and the other options."""
    value: str | None = None
    rest: list[str] = []
    it = iter(opts)
    for o in it:
        inline = _inline_value(o, names)
        if o in names:
            value = next(it, "")
        elif inline is not None:
            value = inline
        else:
            rest.append(o)
    return value, rest
