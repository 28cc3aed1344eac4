"""Options of agentq's commands: a budget's argparse type, and the Celery worker options
agentq reads, or takes out, before the rest goes to Celery, in each form Celery accepts:
`-n X`, `-nX`, `--hostname X`, `--hostname=X`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


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


def positive(kind: type[int] | type[float]) -> Any:
    """An argparse type: a finite number of `kind` above 0 (a budget)."""

    def parse(raw: str) -> int | float:
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not a number") from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{raw!r}: must be above 0")
        return value

    return parse
