"""A user's code type-checks under mypy --strict against agentq's API, and mypy refuses
what the API refuses (a @tool policy knob that does not exist)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _mypy(tmp_path: Path, *files: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--follow-imports",
            "silent",
            *files,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_user_style_modules_pass_mypy_strict(tmp_path: Path) -> None:
    done = _mypy(tmp_path, "tests/example/counter.py", "tests/example/usage.py")
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_refuses_an_unknown_tool_policy(tmp_path: Path) -> None:
    bad = tmp_path / "bad_tool.py"
    bad.write_text(
        "from agentq import tool\n\n\n@tool(timeout=5)\ndef f(text: str) -> str:\n    return text\n"
    )
    done = _mypy(tmp_path, str(bad))
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
