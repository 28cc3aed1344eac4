"""`pip install agentq` alone, in a fresh venv, is a worker fleet and its Python client:
no extra is installed, each process that needs one says which, and a turn with a sync and
an async tool runs on workers and a client of that venv.

Redis and the scripted model server are the suite's own (agentq.local.redis_server needs
the `local` extra, which a production worker does not have; its Redis is the operator's).
The venv is cached under ~/.cache/agentq-tests, keyed by the core's requirements and the
Python version: the first run downloads (about a minute), later runs reinstall agentq only.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

from agentq.local.processes import CELERY_READY_PATTERN, ManagedProcess, start_process
from agentq.local.redis_server import RedisServer
from agentq.testing.openai_server import Round, ScriptedOpenAIServer
from tests.helpers import calls, script
from tests.rigs.workers import worker_env

pytestmark = [pytest.mark.integration, pytest.mark.network, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "agentq-tests"
NOT_IN_THE_CORE = ("starlette", "uvicorn", "flower", "mcp", "jsonschema", "prometheus_client")
NO_REDIS = "redis://127.0.0.1:1/0"


def clean_env(**extra: str) -> dict[str, str]:
    """No PYTHONPATH (the worktree must not shadow the install), no AGENTQ_* of the suite."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("AGENTQ_")}
    return env | extra


def run(
    argv: list[str], *, env: dict[str, str], timeout_s: float = 600
) -> subprocess.CompletedProcess[str]:
    # From the cache directory: `python -m` puts the working directory first on sys.path.
    return subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=CACHE
    )


def ok(argv: list[str], *, env: dict[str, str], timeout_s: float = 600) -> str:
    proc = run(argv, env=env, timeout_s=timeout_s)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{argv} failed ({proc.returncode}):\n{out[-4000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def core_venv() -> Path:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    key = hashlib.sha256(f"{sys.version}\n{declared}".encode()).hexdigest()[:16]
    venv = CACHE / f"core-{key}"
    py = venv / "bin" / "python"
    CACHE.mkdir(parents=True, exist_ok=True)
    env = clean_env()
    if not (venv / ".complete").exists():
        shutil.rmtree(venv, ignore_errors=True)
        ok([sys.executable, "-m", "venv", str(venv)], env=env)
        ok([str(py), "-m", "pip", "install", "-q", str(ROOT)], env=env)
        (venv / ".complete").write_text(key)
    else:
        ok(
            [str(py), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(ROOT)],
            env=env,
        )
    return venv


def test_the_core_imports_the_worker_and_the_client_and_holds_no_extra(core_venv: Path) -> None:
    probe = (
        "import importlib.util as u, json, sys\n"
        "import agentq, agentq.worker, agentq.api\n"
        "print(json.dumps([m for m in sys.argv[1:] if u.find_spec(m)]))\n"
    )
    out = ok(
        [str(core_venv / "bin" / "python"), "-c", probe, *NOT_IN_THE_CORE],
        env=clean_env(AGENTQ_REDIS_URL=NO_REDIS),
    )
    assert json.loads(out) == []


@pytest.mark.parametrize(
    ("argv", "env", "extra"),
    [
        (["serve"], {}, "gateway"),
        (["flower"], {}, "flower"),
        (["flower", "--help"], {}, "flower"),
        (["dev", "--once"], {}, "local"),
        (["worker", "io"], {"AGENTQ_MCP_SERVERS": '{"t": {"command": ["true"]}}'}, "mcp"),
    ],
)
def test_a_process_that_needs_an_extra_says_which(
    core_venv: Path, argv: list[str], env: dict[str, str], extra: str
) -> None:
    proc = run(
        [str(core_venv / "bin" / "agentq"), *argv],
        env=clean_env(AGENTQ_REDIS_URL=NO_REDIS, **env),
        timeout_s=120,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"pip install 'agentq[{extra}]'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture()
def core_fleet(
    core_venv: Path, redis_server: RedisServer, llm_server: ScriptedOpenAIServer, tmp_path: Path
) -> Iterator[dict[str, str]]:
    """Turn, stream, tool and I/O workers of the core venv, against the suite's Redis."""
    env = clean_env(**worker_env(redis_server.url, llm_server.url))
    procs: list[ManagedProcess] = []
    try:
        for kind in ("turns", "llm", "tools", "io"):
            procs.append(
                start_process(
                    [
                        str(core_venv / "bin" / "python"),
                        *("-m", "agentq", "worker", kind),
                        *("--hostname", f"core-{kind}-{os.getpid()}@%h", "--loglevel", "INFO"),
                    ],
                    env=env,
                    inherit_env=False,
                    cwd=tmp_path,
                    log_path=tmp_path / f"{kind}.log",
                    name=f"core-{kind}",
                    ready_pattern=CELERY_READY_PATTERN,
                    ready_timeout_s=90,
                )
            )
        yield env
    finally:
        for proc in procs:
            proc.stop()


def test_a_core_fleet_runs_a_turn_with_a_sync_and_an_async_tool(
    core_venv: Path, core_fleet: dict[str, str], llm_server: ScriptedOpenAIServer
) -> None:
    key = script(
        llm_server,
        Round(tool_calls=calls(("echo", {"text": "from prefork"}), ("aio_echo", {"text": "io"}))),
        Round(text="both tools answered"),
    )
    client = (
        "import json, sys\n"
        "from agentq.api import Client\n"
        "c = Client()\n"
        "h = c.start(None, sys.argv[1])\n"
        "end = c.wait(h.turn_id, timeout_s=120)\n"
        "view = c.get(h.turn_id)\n"
        "print(json.dumps({'type': end.type, 'content': end.fields.get('content'),\n"
        "    'tools': sorted(r['tool'] + ':' + r['status'] for r in view['invocations'])}))\n"
    )
    out = ok([str(core_venv / "bin" / "python"), "-c", client, key], env=core_fleet, timeout_s=180)
    got = json.loads(out.strip().splitlines()[-1])
    assert got == {
        "type": "turn_finished",
        "content": "both tools answered",
        "tools": ["aio_echo:ok", "echo:ok"],
    }, out
