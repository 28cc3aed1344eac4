"""A worker's health as a file's age, touched while its consumer runs: a healthcheck costs
a `find`, not a Python process and a broadcast (`celery inspect ping`)."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

from celery import bootsteps

HEALTH_EVERY_S = 5.0
HEALTHY_WITHIN_S = 30
"""The compose healthchecks' bound on the file's age: several missed touches."""


class HealthFile(bootsteps.StartStopStep):  # type: ignore[misc]
    """Touches `path` every HEALTH_EVERY_S while the consumer runs (a lost broker stops it)."""

    requires = ("celery.worker.consumer.tasks:Tasks",)
    path = ""
    tref: Any = None

    def start(self, parent: Any) -> None:
        touch = Path(self.path).touch
        touch()
        self.tref = parent.timer.call_repeatedly(HEALTH_EVERY_S, touch)

    def stop(self, parent: Any) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None

    def shutdown(self, parent: Any) -> None:
        self.stop(parent)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def install(app: Any, path: str) -> None:
    """Add the step to the app's workers' consumers."""
    step = type("AgentqHealthFile", (HealthFile,), {"path": path})
    app.steps["consumer"].add(step)
