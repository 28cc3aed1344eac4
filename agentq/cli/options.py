"""A budget's argparse type, and the Celery options agentq reads or takes out before the
rest goes to Celery, in each form Celery accepts (`-nX`, `--hostname=X`, ...)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any


def take_option(opts: Sequence[str], *names: str) -> tuple[str | None, list[str]]:
    """The option's last value (as Celery takes it; "" when bare) and the other options."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument(*names, dest="value", nargs="?", const="")
    found, rest = parser.parse_known_args(opts)
    return found.value, rest


def has_option(opts: Sequence[str], *names: str) -> bool:
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
