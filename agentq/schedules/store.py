"""Adding, listing and removing schedules: the spec, and the redbeat entry `agentq beat` fires."""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from celery import Celery
from redbeat import RedBeatSchedulerEntry

from agentq import constants as k
from agentq.config import Settings
from agentq.errors import ScheduleInvalid, ScheduleNotFound
from agentq.schedules.beat import configure
from agentq.schedules.spec import ScheduleSpec
from agentq.state.base import text

if TYPE_CHECKING:
    import redis


class Schedules:
    def __init__(self, app: Celery, redis: redis.Redis, settings: Settings) -> None:
        self.app = configure(app, settings)
        self.redis = redis

    def add(self, spec: ScheduleSpec) -> ScheduleSpec:
        """Store a new schedule; its first tick is one period (or the next cron time) away."""
        spec = spec.model_copy(update={"created_at": time.time()})
        if not self.redis.hsetnx(k.SCHEDULES, spec.name, spec.model_dump_json()):
            raise ScheduleInvalid(spec.name, "exists already; remove it first")
        entry = RedBeatSchedulerEntry(
            spec.name,
            k.TASK_SCHEDULE_TICK,
            spec.celery_schedule(),
            kwargs={"name": spec.name},
            options={"queue": k.QUEUE_TURNS},
            app=self.app,
        )
        # From now, not from year 1: celery would find a never-run entry due at once.
        entry.last_run_at = datetime.now(timezone.utc)
        entry.save()
        return spec

    def remove(self, name: str) -> None:
        if not self.redis.hdel(k.SCHEDULES, name):
            raise ScheduleNotFound(name)
        # The beat's entry through celery-redbeat's own client: on a Cluster it lives on
        # the plain Redis, not beside the spec.
        entry = self._beat_entry(name)
        if entry is not None:
            entry.delete()
        self.redis.delete(k.schedule_key(name))

    def list(self) -> list[dict[str, Any]]:
        """Every schedule with its runs: last turn, fired and skipped ticks, next due."""
        out = []
        for name, raw in sorted(self.redis.hgetall(k.SCHEDULES).items()):
            spec = ScheduleSpec.model_validate_json(raw)
            runs = {
                text(f): text(v) for f, v in self.redis.hgetall(k.schedule_key(text(name))).items()
            }
            last_fired_at = runs.get("last_fired_at")
            entry = self._beat_entry(spec.name)
            out.append(
                {
                    **spec.model_dump(mode="json"),
                    "when": spec.when,
                    "fired": int(runs.get("fired", 0)),
                    "skipped": int(runs.get("skipped", 0)),
                    "last_turn_id": runs.get("last_turn_id"),
                    "last_fired_at": None if last_fired_at is None else float(last_fired_at),
                    "last_error": runs.get("last_error"),
                    "next_at": None if entry is None else float(entry.due_at.timestamp()),
                }
            )
        return out

    def _beat_entry(self, name: str) -> RedBeatSchedulerEntry | None:
        key = RedBeatSchedulerEntry.generate_key(self.app, name)
        try:
            return RedBeatSchedulerEntry.from_key(key, app=self.app)
        except KeyError:
            return None


def load_spec(redis: redis.Redis, name: str) -> ScheduleSpec:
    raw = redis.hget(k.SCHEDULES, name)
    if raw is None:
        raise ScheduleNotFound(name)
    return ScheduleSpec.model_validate_json(raw)  # type: ignore[arg-type]
