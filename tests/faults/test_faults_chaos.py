"""The chaos soak, short: about a minute of faults of every kind under a mixed load.

`scripts/chaos.py` starts its own Redis behind Sentinel, model server and fleet, and
stops them by PID; it exits 0 only if every invariant held (see its docstring).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]


def test_a_short_soak_holds_every_invariant() -> None:
    logs = ROOT / "artifacts" / "faults" / "chaos"
    # Five drivers: each runs its turns one after another, and on a slow 2-core machine
    # under the rest of the suite four started only 9 turns in the minute.
    argv = ["--duration-s", "60", "--seed", "1123", "--drivers", "5", "--drain-s", "120"]
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "chaos.py"), *argv, "--logs", str(logs)],
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        cwd=ROOT,
    )
    report = out.stdout + out.stderr[-3000:]
    assert out.returncode == 0, report
    faults = {m[0]: int(m[1]) for m in re.findall(r"^\| ([a-z ]+) \| (\d+) \|$", out.stdout, re.M)}
    assert faults["sentinel failover"] >= 3, report
    assert sum(faults.values()) >= 15, report
    held = re.findall(r"^\| ([a-z -]+) \| (\d+) \| (\d+) \| (yes|NO) \|$", out.stdout, re.M)
    assert len(held) == 5 and all(h[2] == "0" and h[3] == "yes" for h in held), report
    assert int(dict((h[0], h[1]) for h in held)["every turn ended"]) >= 10, report
