"""Options of agentq's commands: a budget's argparse type, and the Celery worker options
agentq reads, or takes out, before the rest goes to Celery, in each form Celery accepts:
`-n X`, `-nX`, `--hostname X`, `--hostname=X`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def take_option(opts: Sequence[str], *names: str) -> tuple[str | None, list[str]]:
    """The value of the option `names` spell (the last one given, as Celery takes it;
    "" when it comes without one) and the other options, in their order."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(*names, dest="value", nargs="?", const="")
    found, rest = parser.parse_known_args(opts)
    return found.value, rest


def has_option(opts: Sequence[str], *names: str) -> bool:
    """Whether any of `names` is given, in any form."""
    return take_option(opts, *names)[0] is not None


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
