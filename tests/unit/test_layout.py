"""The package layout of docs/architecture.md, checked: imports run one way, down.

Each package (or top-level module) has a rank; a module may import only from its own
package or from a lower rank. Imports under `if TYPE_CHECKING:` are annotations, not
dependencies, and are not counted.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "agentq"

RANKS: dict[str, int] = {
    "errors": 0,
    "constants": 0,
    "models": 1,
    "config": 1,
    "telemetry": 2,
    "events": 3,
    "state": 4,
    "fleet": 5,
    "aio": 6,
    "webhooks": 6,
    "schedules": 6,
    "llm": 7,
    "tools": 7,
    "agents": 8,
    "mcp": 8,
    "orchestrator": 9,
    "api": 10,
    "worker": 10,
    "celery": 11,
    "gateway": 11,
    "local": 11,
    "cli": 12,
    "testing": 12,
    "__init__": 13,
    "__main__": 13,
}
"""The order of docs/architecture.md, bottom up."""

MAX_LAYERS = 12
MAX_LINES = 600
MAX_TOP_LEVEL = 8


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__" and len(parts) > 2:
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _room(module: str) -> str:
    return module.split(".")[1]


def _runtime_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for field in ("body", "orelse", "finalbody", "handlers"):
            sub = getattr(node, field, None)
            if isinstance(sub, list) and sub and isinstance(sub[0], ast.AST):
                found += _runtime_imports(sub)  # type: ignore[arg-type]
    return found


@cache
def imports_of(module: str) -> frozenset[str]:
    path = MODULES[module]
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in _runtime_imports(ast.parse(path.read_text()).body):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = module.split(".") if is_pkg else module.split(".")[:-1]
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [f"{target}.{a.name}" for a in node.names] + [target]
        for name in names:
            while name and name not in MODULES and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in MODULES and name != module and name != "agentq":
                out.add(name)
    return frozenset(out)


def test_every_room_has_a_rank() -> None:
    rooms = {_room(m) for m in MODULES if m != "agentq"}
    assert rooms <= set(RANKS), f"not in docs/architecture.md: {rooms - set(RANKS)}"


def test_imports_run_down() -> None:
    up = [
        f"{m} -> {dep}"
        for m in MODULES
        if m != "agentq"
        for dep in imports_of(m)
        if _room(dep) != _room(m) and RANKS[_room(dep)] >= RANKS[_room(m)]
    ]
    assert not up, "imports that run sideways or back up:\n" + "\n".join(sorted(up))


def test_nothing_imports_the_package_itself() -> None:
    for m in MODULES:
        tree = ast.parse(MODULES[m].read_text())
        for node in _runtime_imports(tree.body):
            if isinstance(node, ast.ImportFrom) and node.module == "agentq" and not node.level:
                # `from agentq import constants` names a module; anything else is the package.
                names = [a.name for a in node.names if f"agentq.{a.name}" not in MODULES]
                assert not names, f"{m} imports {names} from the package itself"


@cache
def _depth(module: str) -> int:
    return 1 + max((_depth(d) for d in imports_of(module)), default=0)


def test_no_cycles_and_at_most_twelve_layers() -> None:
    # _depth recurses without a guard: a cycle would recurse forever, so look for one first.
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in imports_of(m):
            assert state.get(d) != 1, "import cycle: " + " -> ".join([*path, m, d])
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in MODULES:
        if m not in state:
            visit(m, [])
    deepest = max(MODULES, key=_depth)
    assert _depth(deepest) <= MAX_LAYERS, f"{deepest}: {_depth(deepest)} layers"


def test_modules_are_small_and_the_top_level_is_the_public_surface() -> None:
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long
    top = sorted(p.stem for p in PKG.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= MAX_TOP_LEVEL, top
