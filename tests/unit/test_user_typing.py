"""A user's code type-checks under mypy --strict against agentq's API, and mypy refuses
what the API refuses (a @tool policy knob that does not exist)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One mypy cache for the user-style runs, whose options are the same: a run from nothing
    re-read agentq and its dependencies' stubs (20-50 s on a loaded 2-core VM)."""
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(cache: Path, *files: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            str(cache),
            "--follow-imports",
            "silent",
            *files,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_user_style_modules_pass_mypy_strict(cache: Path) -> None:
    done = _mypy(cache, "tests/example/counter.py", "tests/example/usage.py")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_refuses_an_unknown_tool_policy(tmp_path: Path, cache: Path) -> None:
    bad = tmp_path / "bad_tool.py"
    bad.write_text(
        "from agentq import tool\n\n\n@tool(timeout=5)\ndef f(text: str) -> str:\n    return text\n"
    )
    done = _mypy(cache, str(bad))
    assert done.returncode == 1 and "timeout" in done.stdout, done.stdout + done.stderr


def test_the_package_scripts_and_workers_pass_the_projects_mypy(tmp_path: Path) -> None:
    # pyproject's [tool.mypy] files: the benchmark scripts call the package's internals, and a
    # change that broke one (a78bae5) passed every test until a benchmark run.
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    sources = [p for d in ("agentq", "scripts", "workers") for p in (ROOT / d).rglob("*.py")]
    checked = re.search(r"no issues found in (\d+) source files", done.stdout)
    assert checked and int(checked[1]) == len(sources), done.stdout
