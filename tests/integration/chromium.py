"""Headless Chromium for the browser tests: where it is, how it starts, when it must exist."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def unavailable(reason: str) -> None:
    """Skip, except on CI where Chromium is installed: there a missing browser is a failure."""
    if os.environ.get("CI") == "true" and CHROMIUM.exists():
        pytest.fail(f"browser test cannot run on CI: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    try:
        from playwright.sync_api import Error, sync_playwright
    except ImportError:
        unavailable("the playwright package is not installed (pip install -e '.[dev]')")
    if not CHROMIUM.exists():
        unavailable(f"no Chromium at {CHROMIUM} (apt-get install chromium)")
    with sync_playwright() as pw:
        try:
            b = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        except Error as exc:
            unavailable(f"Chromium did not start: {exc}")
        yield b
        b.close()
