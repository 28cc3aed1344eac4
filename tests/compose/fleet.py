"""The compose fleet under test: `docker compose` with the repository's files, published on
127.0.0.1 only, with keys of its own; and the HTTP client that drives it as a user would."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from agentq.local.processes import wait_for

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
FILES = ("docker-compose.yml", "docker-compose.demo.yml", "docker-compose.rabbitmq.yml")
ENGINE = Path(os.environ.get("AGENTQ_DOCKER_ENGINE", ROOT.parent / "shared" / "docker" / "engine"))
TERMINAL = ("finished", "aborted", "error")
IMAGE = "agentq:local"
WORKER_SERVICES = ("turns", "llm", "tools", "io")


def docker_works() -> bool:
    if shutil.which("docker") is None:
        return False
    done = subprocess.run(["docker", "info"], capture_output=True, timeout=30, check=False)
    return done.returncode == 0


def start_engine() -> tuple[str | None, bool]:
    """Make sure a Docker engine answers: (None, whether this call started it), or (why
    none can, False)."""
    if docker_works():
        return None, False
    if not ENGINE.exists():
        return f"no Docker engine answers and there is no {ENGINE} to start one", False
    done = subprocess.run([str(ENGINE)], capture_output=True, text=True, timeout=1200, check=False)
    if done.returncode != 0 or not docker_works():
        tail = "\n".join((done.stdout + done.stderr).splitlines()[-10:])
        why = f"{ENGINE} could not start a Docker engine (exit {done.returncode}):\n{tail}"
        return why, False
    return None, True


def stop_engine() -> None:
    """Stop the engine `start_engine` started (the script stops it by its PID)."""
    subprocess.run([str(ENGINE), "--stop"], capture_output=True, timeout=120, check=False)


@dataclass
class ComposeFleet:
    """One compose project: the demo fleet on RabbitMQ, its ports on 127.0.0.1."""

    project: str = field(default_factory=lambda: f"agentq-test-{os.getpid()}")
    api_key: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    flower_password: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    gateway_url: str = ""
    flower_url: str = ""

    @property
    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "FLOWER_BASIC_AUTH": f"test:{self.flower_password}",
            "AGENTQ_API_KEYS": f"tester={self.api_key}",
            "AGENTQ_ADMIN_KEYS": "",
            # Published on loopback only, on ports the engine picks.
            "AGENTQ_GATEWAY_PUBLISH": "127.0.0.1:",
            "FLOWER_PUBLISH": "127.0.0.1:",
        }

    def compose(
        self, *args: str, timeout_s: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = ["docker", "compose", "-p", self.project]
        for f in FILES:
            argv += ["-f", str(COMPOSE / f)]
        done = subprocess.run(
            [*argv, *args],
            cwd=COMPOSE,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        if check and done.returncode != 0:
            # Compose's progress lines repeat: the last ones say what went wrong.
            tail = "\n".join((done.stdout + done.stderr).splitlines()[-15:])
            what = f"docker compose {' '.join(args)} exited {done.returncode}"
            raise AssertionError(f"{what}:\n{tail}")
        return done

    def build(self) -> None:
        argv = ["docker", "build", "-q", "-f", str(COMPOSE / "Dockerfile"), "-t", IMAGE, str(ROOT)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
        assert done.returncode == 0, done.stderr[-3000:]

    def up(self, *args: str, timeout_s: float = 900) -> None:
        self.compose("up", "-d", "--wait", "--wait-timeout", "300", *args, timeout_s=timeout_s)
        self.gateway_url = "http://" + self.port("gateway", 8000)
        self.flower_url = "http://" + self.port("flower", 5555)

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", "--timeout", "10", check=False)

    def port(self, service: str, port: int) -> str:
        return self.compose("port", service, str(port)).stdout.strip()

    def containers(self, service: str) -> list[str]:
        out = self.compose("ps", "-q", service).stdout
        return [c for c in out.split() if c]

    def health(self) -> dict[str, str]:
        """Each container's name and health (or state, for one without a healthcheck)."""
        out = self.compose("ps", "--format", "json").stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip()]
        return {r["Name"]: r.get("Health") or r.get("State", "") for r in rows}

    def logs(self, *services: str, tail: int = 60) -> str:
        """The services' last `tail` log lines (all of them for a negative `tail`)."""
        args = (
            "logs",
            "--no-color",
            "--timestamps",
            "--tail",
            str(tail) if tail >= 0 else "all",
            *services,
        )
        return self.compose(*args, check=False).stdout

    # -- as a user of the gateway ------------------------------------------------

    def http(self, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"}
        return httpx.Client(base_url=self.gateway_url, headers=headers, timeout=30, **kwargs)

    def start_turns(self, n: int, prompt: str = "hello") -> list[str]:
        with self.http() as client:
            ids = []
            for i in range(n):
                r = client.post("/v1/turns", json={"prompt": f"{prompt} #{i}", "detach": True})
                assert r.status_code == 202, r.text
                ids.append(r.json()["turn_id"])
            return ids

    def turns(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        with self.http() as client:
            for tid in ids:
                try:
                    r = client.get(f"/v1/turns/{tid}")
                except httpx.HTTPError:
                    continue  # the gateway is restarting: not known now
                if r.status_code == 200:
                    out[tid] = r.json()
        return out

    def wait_ended(self, ids: Sequence[str], bound_s: float) -> dict[str, dict[str, Any]]:
        """Every turn's record once all have ended; fails naming the ones that did not."""
        seen: dict[str, dict[str, Any]] = {}

        def ended() -> bool:
            seen.update(self.turns([t for t in ids if _status(seen.get(t)) not in TERMINAL]))
            return all(_status(seen.get(t)) in TERMINAL for t in ids)

        try:
            wait_for(ended, bound_s, interval_s=1.0)
        except AssertionError:
            stuck = {t: _status(seen.get(t)) for t in ids if _status(seen.get(t)) not in TERMINAL}
            raise AssertionError(
                f"{len(stuck)} of {len(ids)} turns did not end in {bound_s:g} s: {stuck}\n"
                + self.logs("turns", "llm", tail=40)
            ) from None
        return seen


def _status(turn: dict[str, Any] | None) -> str | None:
    if turn is None:
        return None
    state = turn.get("state") or {}
    return state.get("status") if isinstance(state, dict) else None


def since(t0: float) -> float:
    return round(time.monotonic() - t0, 1)
