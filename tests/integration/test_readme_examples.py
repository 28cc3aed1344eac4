"""The README's Python examples run as written, against a local fleet and a scripted model.

A block whose first line is `# NAME.py` is a module of the reader's app: the blocks of one
name are joined into that file, which the workers import (AGENTQ_TOOLS). Every other block
runs in order in one namespace, and the `test_*` functions it defines are called."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from agentq.testing import ScriptedModel, call, local_fleet, reply

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
MODULE = re.compile(r"# (\w+)\.py")


def readme_blocks() -> tuple[dict[str, str], list[str]]:
    modules: dict[str, list[str]] = {}
    runs: list[str] = []
    for code in BLOCK.findall((ROOT / "README.md").read_text()):
        named = MODULE.fullmatch(code.splitlines()[0])
        if named:
            modules.setdefault(named.group(1), []).append(code)
        else:
            runs.append(code)
    return {name: "\n".join(parts) for name, parts in modules.items()}, runs


def test_the_readme_has_the_examples_it_teaches() -> None:
    modules, runs = readme_blocks()
    assert list(modules) == ["myapp"]
    text = "\n".join(runs)
    for name in ("Client()", "client.run(", "client.start(", "AsyncClient", "local_fleet("):
        assert name in text, name


def test_the_readmes_python_examples_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    modules, runs = readme_blocks()
    for name, code in modules.items():
        (tmp_path / f"{name}.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    model = ScriptedModel([[call("word_count", text="a b")], reply('{"words": 2}')])
    with local_fleet(tools=list(modules), model=model):
        namespace: dict[str, object] = {"__name__": "readme"}
        for code in runs:
            exec(compile(code, "README.md", "exec"), namespace)
            for name in [n for n in namespace if n.startswith("test_")]:
                test = namespace.pop(name)
                assert callable(test)
                test()
    printed = capsys.readouterr().out
    assert "2 " in printed and "word_count ok" in printed
