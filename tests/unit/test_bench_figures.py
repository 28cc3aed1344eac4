"""The benchmark figures of docs/benchmarks.md come from one place (docs/benchmarks.json),
and each is one the bench reports: a figure cannot drift from the file, nor name a stage
that is gone."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def _script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


figures_script = _script("bench_figures")


def _figures() -> dict:
    return json.loads((ROOT / "docs" / "benchmarks.json").read_text())


def test_the_readme_table_is_the_figures_file() -> None:
    readme = (ROOT / "docs" / "benchmarks.md").read_text()
    assert figures_script.readme_section(readme) == figures_script.readme_table(_figures()), (
        "docs/benchmarks.md's benchmark table differs from docs/benchmarks.json: "
        "run python scripts/bench_figures.py"
    )


def test_every_figure_is_a_metric_the_bench_reports() -> None:
    sources = "".join(p.read_text() for p in (ROOT / "scripts").glob("bench*.py"))
    reported = set(re.findall(r'"([a-z][a-z0-9_]*)"', sources))
    for row in _figures()["figures"]:
        assert row["metric"] in reported, f"no bench stage reports {row['metric']!r}"
        assert isinstance(row["value"], (int, float)), row


def test_a_bench_run_writes_its_values_and_spreads_into_the_figures() -> None:
    figures = _figures()
    report = {"cpu_ratio": 1.21, "cpu_ratio_runs": [1.2, 1.21, 1.3], "throughput_ratio": None}
    new = figures_script.with_report(figures, report, "2026-12-01, 3 runs")
    by_metric = {row["metric"]: row for row in new["figures"]}
    old = {row["metric"]: row for row in figures["figures"]}
    assert by_metric["cpu_ratio"]["value"] == 1.21
    dash = figures_script.RANGE
    assert by_metric["cpu_ratio"]["detail"] == f"(1.2{dash}1.3)"
    assert by_metric["cpu_ratio"]["when"] == "2026-12-01, 3 runs"
    # Not measured by this run: kept as it was.
    assert by_metric["throughput_ratio"] == old["throughput_ratio"]
    assert f"| 1.21\u00d7 (1.2{dash}1.3) |" in figures_script.readme_table(new)
