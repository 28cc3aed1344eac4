"""What a schedule is: a name, when (every N seconds or a cron expression), and the turn."""

from __future__ import annotations

import re
from typing import Any

from celery.schedules import crontab, schedule
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from agentq.errors import ScheduleInvalid, describe_invalid

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
MIN_EVERY_S = 1.0
_UNITS_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d)?\s*$")


class ScheduleSpec(BaseModel):
    """A schedule as stored in Redis and shown by `agentq schedule list`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=NAME_PATTERN)
    every_s: float | None = Field(default=None, ge=MIN_EVERY_S)
    cron: str | None = Field(default=None, max_length=128)
    """Five fields (minute hour day-of-month month day-of-week), in UTC."""
    prompt: str = Field(min_length=1, max_length=64 * 1024)
    agent: str | None = Field(default=None, max_length=64)
    webhook_url: str | None = Field(default=None, max_length=2048)
    overlap: bool = False
    """Start the tick's turn even while the previous turn of the schedule still runs."""
    owner: str | None = None
    """The key name that added it: its turns belong to that key."""
    created_at: float = 0.0

    @model_validator(mode="after")
    def _one_timing(self) -> ScheduleSpec:
        if (self.every_s is None) == (self.cron is None):
            raise ValueError("give either every_s (--every) or cron (--cron), not both or none")
        if self.cron is not None:
            cron_schedule(self.cron, self.name)
        return self

    def celery_schedule(self) -> schedule:
        if self.cron is not None:
            return cron_schedule(self.cron, self.name)
        assert self.every_s is not None
        return schedule(run_every=self.every_s)

    @property
    def when(self) -> str:
        return f"cron {self.cron}" if self.cron else f"every {self.every_s:g}s"


def cron_schedule(expr: str, name: str = "") -> crontab:
    if len(expr.split()) != 5:
        raise ScheduleInvalid(name, f"--cron takes 5 fields (m h dom mon dow), not {expr!r}")
    try:
        return crontab.from_string(expr)
    except (ValueError, KeyError) as exc:
        raise ScheduleInvalid(name, f"--cron {expr!r}: {exc}") from None


def to_seconds(text: str) -> float | None:
    """`30s`, `5m`, `2h`, `1d`, `90` (seconds) -> seconds; None if it is not a duration."""
    m = _DURATION.match(text)
    return float(m.group(1)) * _UNITS_S[m.group(2) or "s"] if m else None


def parse_every(text: str, name: str = "") -> float:
    """A schedule's period in seconds: at least MIN_EVERY_S."""
    seconds = to_seconds(text)
    if seconds is None:
        raise ScheduleInvalid(name, f"--every {text!r}: a number with s, m, h or d (e.g. 30s)")
    if seconds < MIN_EVERY_S:
        raise ScheduleInvalid(name, f"--every {text!r}: at least {MIN_EVERY_S:g}s")
    return seconds


def build_spec(data: dict[str, Any]) -> ScheduleSpec:
    """A ScheduleSpec from a request or the command line (its own `data`), whose `every` is a
    period such as `30s`; ScheduleInvalid naming the field."""
    name = str(data.get("name") or "")
    if (every := data.pop("every", None)) is not None:
        data["every_s"] = parse_every(str(every), name)
    try:
        return ScheduleSpec.model_validate(data)
    except ValidationError as exc:
        raise ScheduleInvalid(name, describe_invalid(exc, "schedule")) from None
