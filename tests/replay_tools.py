"""Tools of the retry and fork tests (their own fleet loads them): a side effect a retry
must not repeat, counted in a file."""

from __future__ import annotations

import os
import time

from agentq import tool


def _tally(path: str, label: str, hold: str) -> str:
    """Write one line per run to `path`, then wait while the file `hold` exists (a call the
    test keeps running until it removes the file)."""
    with open(path, "a") as f:
        f.write(label + "\n")
    while hold and os.path.exists(hold):
        time.sleep(0.02)
    return f"tallied {label}"


@tool(timeout_s=40)
def tally(path: str, label: str, hold: str = "") -> str:
    """Count a run (a side effect a retry must not repeat)."""
    return _tally(path, label, hold)


@tool(timeout_s=40, idempotent=True)
def tally_again(path: str, label: str, hold: str = "") -> str:
    """`tally`, declared idempotent: a retry runs a lost call of it again."""
    return _tally(path, label, hold)
