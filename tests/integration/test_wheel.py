"""The wheel ships what users run: the `agentq` package alone, without the project's rigs."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.network, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
RIGS = (
    *("sentinel", "rabbitmq", "chaos_tools", "forkserver", "rounds", "ratelimit"),
    *("workers", "webhooks"),
    # The hand-written HTTP/1.1 server the scripted model ran on before uvicorn.
    *("http_wire", "http_loop"),
)


def test_the_wheel_holds_the_agentq_package_and_none_of_the_rigs(tmp_path: Path) -> None:
    # Built from a copy without a checkout's leftovers: an old `build/` would put what it
    # holds in the wheel, as it would for anyone building in that checkout.
    src = tmp_path / "src"
    shutil.copytree(
        ROOT,
        src,
        ignore=shutil.ignore_patterns(
            ".git", "build", "dist", "*.egg-info", "artifacts", "node_modules", "__pycache__"
        ),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("agentq-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        declared = zf.read(top_level).decode().split()
    assert declared == ["agentq"]
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {
        "agentq"
    }
    # Where the rigs lived (agentq.state.rounds, a model round's state, is no rig).
    rigs = [n for n in names if n.startswith(("agentq/testing/", "agentq/local/"))]
    assert not [n for n in rigs if Path(n).stem in RIGS], rigs
    # The scripted model server is what users test their own agents with: it ships.
    assert "agentq/testing/openai_server.py" in names
    assert "agentq/py.typed" in names
