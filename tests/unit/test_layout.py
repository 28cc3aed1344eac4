"""The package layout of docs/architecture.md, checked: imports run one way, down.

Each package (or top-level module) has a rank; a module may import only from its own
package or from a lower rank. Imports are read wherever a reader sees them: at the top of
a module, inside functions and methods, under `try`, `with` and `match`. Imports under
`if TYPE_CHECKING:` are annotations, not dependencies, for the ranks and the layers; a
cycle through them is still a cycle (two modules that each need the other to be read).
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
    "limits": 4,
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
    "client": 11,
    "local": 11,
    "cli": 12,
    "testing": 12,
    "__init__": 13,
    "__main__": 13,
}
"""The order of docs/architecture.md, bottom up."""

MAX_LAYERS = 12
MAX_LINES = 600
MAX_FUNCTION_LINES = 80
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


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports(node: ast.AST, *, annotations: bool) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement under `node`, at any depth (functions, classes, `match`...);
    those under `if TYPE_CHECKING:` only with `annotations`."""
    found: list[ast.Import | ast.ImportFrom] = []
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            found.append(child)
        elif _is_type_checking(child) and not annotations:
            assert isinstance(child, ast.If)
            # Its `else:` runs.
            found += _imports(ast.Module(body=child.orelse, type_ignores=[]), annotations=False)
        else:
            found += _imports(child, annotations=annotations)
    return found


def _runtime_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    return _imports(ast.Module(body=body, type_ignores=[]), annotations=False)


def read_imports(
    module: str, source: str, *, is_pkg: bool = False, annotations: bool = False
) -> frozenset[str]:
    """The agentq modules `source` (the text of `module`) imports."""
    out = set()
    for node in _imports(ast.parse(source), annotations=annotations):
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


@cache
def imports_of(module: str, *, annotations: bool = False) -> frozenset[str]:
    path = MODULES[module]
    is_pkg = path.name == "__init__.py"
    return read_imports(module, path.read_text(), is_pkg=is_pkg, annotations=annotations)


SAMPLE = """
from typing import TYPE_CHECKING
import agentq.errors

if TYPE_CHECKING:
    from agentq.api import Client
else:
    from agentq.models import TurnRequest

def f():
    from agentq.config import Settings
    def g():
        import agentq.events.bus

class C:
    def m(self):
        try:
            from agentq.state import listing
        except ImportError:
            from agentq.constants import VERSION
        with open("x"):
            from . import options
        match self:
            case 1:
                from agentq.tools.policy import ToolPolicy
"""


def test_the_reader_reads_every_import_a_person_would() -> None:
    runtime = {
        "agentq.errors",
        "agentq.models",
        "agentq.config",
        "agentq.events.bus",
        "agentq.state.listing",
        "agentq.constants",
        "agentq.cli",
        "agentq.cli.options",
        "agentq.tools.policy",
    }
    assert read_imports("agentq.cli.sample", SAMPLE) == runtime
    assert read_imports("agentq.cli.sample", SAMPLE, annotations=True) == {*runtime, "agentq.api"}


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
    # Annotations count here: a cycle a reader must follow is one, whenever it runs.
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in imports_of(m, annotations=True):
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


def test_functions_are_short() -> None:
    long = {
        f"{m}.{node.name}": length
        for m, p in MODULES.items()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and (length := (node.end_lineno or 0) - node.lineno + 1) > MAX_FUNCTION_LINES
    }
    assert not long, long
