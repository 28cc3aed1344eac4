"""A private RabbitMQ node for tests: its own name, ports and data directory, stopped and
started again by PID, so a test can take the broker away under a running fleet."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

from agentq.fleet.lifecycle import Started
from agentq.local.processes import ManagedProcess, start_process, wait_for
from agentq.local.redis_server import find_free_port

SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
START_TIMEOUT_S = 60.0


def find_rabbitmq_server() -> str | None:
    """The rabbitmq-server script that runs in the foreground as the caller, if installed."""
    # /usr/sbin/rabbitmq-server switches to the rabbitmq user, out of our process group.
    if Path(SERVER).exists():
        return SERVER
    return shutil.which("rabbitmq-server")


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"AMQP\x00\x00\x09\x01")
            return s.recv(1)[:1] == b"\x01"  # connection.start: a frame of type 1
    except OSError:
        return False


class RabbitServer(Started):
    """One RabbitMQ node on 127.0.0.1, without plugins; its queues survive `restart()`."""

    def __init__(self, executable: str | None = None) -> None:
        found = executable or find_rabbitmq_server()
        if found is None:
            raise FileNotFoundError("rabbitmq-server is not installed")
        self.executable = found
        self.port = find_free_port()
        self.dist_port = find_free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="agentq-rabbit-"))
        self.node = f"agentq{self.port}@localhost"
        self.proc: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}//"

    def start(self) -> RabbitServer:
        (self.dir / "plugins").write_text("[].\n")
        env = {
            "HOME": str(self.dir),  # its own Erlang cookie
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(self.dir / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.dir / "log"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.dir / "plugins"),
            "RABBITMQ_CONFIG_FILE": str(self.dir / "rabbitmq"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.dir / "advanced.config"),
        }
        self.proc = start_process(
            [self.executable], env=env, log_path=self.dir / "server.log", name="rabbitmq"
        )
        proc = self.proc
        wait_for(
            lambda: _answers(self.port) or proc.poll() is not None,
            START_TIMEOUT_S,
            interval_s=0.25,
            message=f"RabbitMQ to answer on port {self.port}",
        )
        if proc.poll() is not None:
            raise RuntimeError(f"rabbitmq-server exited:\n{proc.log_tail()}")
        return self

    def stop(self, *, keep_data: bool = False) -> None:
        """Stop the node (SIGTERM: beam shuts down cleanly); remove its data unless kept."""
        if self.proc is not None:
            self.proc.stop(timeout_s=30)
            self.proc = None
        if not keep_data:
            shutil.rmtree(self.dir, ignore_errors=True)

    def kill(self) -> None:
        """Kill the node at once, as a crash or `docker kill` would; its data stays."""
        if self.proc is not None:
            self.proc.kill()
            self.proc = None

    def restart(self) -> None:
        self.stop(keep_data=True)
        self.start()
