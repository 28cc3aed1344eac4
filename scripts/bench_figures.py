"""The benchmark figures of docs/benchmarks.md, from one place: docs/benchmarks.json.

    python scripts/bench_figures.py --report RUN.json --when "2026-11-28, 3 runs"
        # a bench run's values (`scripts/bench.py --json > RUN.json`) into the file,
        # for every figure the run measured; then the table of docs/benchmarks.md again
    python scripts/bench_figures.py            # the table of docs/benchmarks.md from the file

tests/unit/test_bench_figures.py fails if that table is not the file's, or if the
file names a metric the bench does not report.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "benchmarks.json"
README = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- figures: docs/benchmarks.json, written by scripts/bench_figures.py -->"
END = "<!-- /figures -->"
RANGE = "\u2013"
"""The en dash the README writes a range with."""


def figure_text(row: dict[str, Any]) -> str:
    """A figure as the README shows it: its value, its unit, what qualifies it."""
    v = row["value"]
    shown = f"{v:,}" if isinstance(v, int) else f"{v:g}"
    text = f"{shown}{row['unit']}"
    return f"{text} {row['detail']}" if row["detail"] else text


def readme_table(figures: dict[str, Any]) -> str:
    lines = ["| goal | figure | target | measured |", "|---|---|---|---|"]
    for row in figures["figures"]:
        lines.append(f"| {row['goal']} | {figure_text(row)} | {row['target']} | {row['when']} |")
    return "\n".join(lines)


def readme_section(readme: str) -> str:
    """The README's table, between its markers."""
    start = readme.index(BEGIN) + len(BEGIN)
    return readme[start : readme.index(END, start)].strip("\n")


def with_table(readme: str, figures: dict[str, Any]) -> str:
    start = readme.index(BEGIN) + len(BEGIN)
    end = readme.index(END, start)
    return readme[:start] + "\n" + readme_table(figures) + "\n" + readme[end:]


def spread(report: dict[str, Any], metric: str) -> str:
    """`(min-max)` of a metric the run measured more than once, else ""."""
    runs = report.get(f"{metric}_runs")
    return f"({min(runs):g}{RANGE}{max(runs):g})" if runs else ""


def with_report(figures: dict[str, Any], report: dict[str, Any], when: str) -> dict[str, Any]:
    """The figures with every metric `report` (a `bench.py --json` run) measured taken from
    it: its value, its spread as the detail, `when` as when it was measured."""
    rows = []
    for row in figures["figures"]:
        value = report.get(row["metric"])
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            row = {**row, "value": value, "detail": spread(report, row["metric"]), "when": when}
        rows.append(row)
    return {**figures, "figures": rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", type=Path, help="a `scripts/bench.py --json` output")
    p.add_argument("--when", default="", help="when and how the report's run was taken")
    args = p.parse_args()
    figures = json.loads(FIGURES.read_text())
    if args.report is not None:
        if not args.when:
            p.error("--report needs --when")
        figures = with_report(figures, json.loads(args.report.read_text()), args.when)
        FIGURES.write_text(json.dumps(figures, indent=2, ensure_ascii=False) + "\n")
    README.write_text(with_table(README.read_text(), figures))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
