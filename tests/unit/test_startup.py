"""What `agentq --version` and `agentq --help` load, and the lazy public names of `agentq`.

The CLI's wall-clock timings are measured by scripts/cli_timings.py, not here: a timed test
fails on a busy machine. What a bare command imports does not depend on the machine.
"""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

import agentq

HEAVY = ("celery", "kombu", "billiard", "openai", "redis", "hiredis", "httpx", "starlette")
"""Packages no command that only prints may import: a broker client, an SDK, a server."""


def imported_by(*args: str) -> dict[str, int]:
    """The modules `python -X importtime -m agentq ARGS` imports, each with its own time (µs)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTQ_")}
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "agentq", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "AGENTQ_REDIS_URL": "redis://127.0.0.1:1/0"},
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    modules: dict[str, int] = {}
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        own, _, name = line.removeprefix("import time:").split("|")
        if own.strip().isdigit():
            modules[name.strip()] = int(own)
    return modules


@pytest.mark.parametrize("args", [("--version",), ("--help",), ("run", "--help")])
def test_a_command_that_only_prints_loads_no_broker_or_sdk(args: tuple[str, ...]) -> None:
    modules = imported_by(*args)
    assert "agentq.cli.main" in modules, sorted(modules)  # the reader did read the output
    heavy = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert not heavy, f"agentq {' '.join(args)} imports {heavy}"


def _imports_of(code: str) -> set[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTQ_")}
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()}


def test_the_reader_sees_heavy_imports() -> None:
    # The check above must be able to fail: a worker loads Celery's app and its broker.
    assert {"celery.app", "kombu", "redis"} <= _imports_of("import agentq.worker")


def test_the_client_builds_no_celery_app_until_it_sends() -> None:
    # `agentq abort` of a turn no task holds takes the abort step itself and sends
    # nothing: Celery's app and kombu are most of what it would otherwise import.
    names = _imports_of("import agentq.api, agentq.cli.main")
    assert "redis" in names
    assert not names & {"celery.app", "celery.app.base", "kombu"}, sorted(
        n for n in names if n.startswith(("celery.app", "kombu"))
    )


def _type_checking_names() -> set[str]:
    """The names `agentq/__init__.py` imports under `if TYPE_CHECKING:` (what mypy sees), a
    star import's as `from module import *` gives them."""
    tree = ast.parse(Path(agentq.__file__).read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for imp in ast.walk(node):
                if isinstance(imp, ast.ImportFrom):
                    for alias in imp.names:
                        if alias.name == "*":
                            module = importlib.import_module(str(imp.module))
                            names |= set(getattr(module, "__all__", None) or vars(module))
                        else:
                            names.add(alias.asname or alias.name)
    return names


def test_lazy_names_are_exactly_all() -> None:
    public = set(agentq.__all__)
    assert len(public) == len(agentq.__all__), "a name twice in __all__"
    placed = {n for names in agentq._SOURCES.values() for n in names}
    assert placed <= public, f"placed but not public: {placed - public}"
    assert public <= _type_checking_names(), public - _type_checking_names()


def test_every_public_name_is_the_object_of_its_module() -> None:
    for name in agentq.__all__:
        module = next((m for m, ns in agentq._SOURCES.items() if name in ns), "agentq.errors")
        origin = agentq._ALIASES.get(name, name)
        assert getattr(agentq, name) is getattr(importlib.import_module(module), origin), name
    assert set(agentq.__all__) <= set(dir(agentq))
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = agentq.no_such_name  # type: ignore[attr-defined]


def test_from_agentq_import_works_in_a_fresh_process() -> None:
    code = (
        "import sys\n"
        "from agentq import tool, ToolContext, AgentqError, __version__\n"
        "assert 'celery' not in sys.modules, 'tool pulled in celery'\n"
        "ns = {}\n"
        "exec('from agentq import *', ns)\n"
        "import agentq\n"
        "assert set(agentq.__all__) <= set(ns), set(agentq.__all__) - set(ns)\n"
        "print(__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == agentq.__version__
