"""The scheduler `agentq beat` runs: celery-redbeat's, naming each tick by its entry's
stored last run, so two beats that find the same entry due (one lost its lock) name the
same tick, and the tick task starts one turn per name. Ticks missed while no beat ran
fire once (celery's `is_due` looks at the last run only).
"""

from __future__ import annotations

from typing import Any

from celery import Celery
from redbeat import RedBeatScheduler
from redbeat.schedulers import ensure_conf

from agentq import constants as k
from agentq.config import Settings, is_sentinel
from agentq.errors import ConfigError

LOCK_PERIODS = 5
"""A beat's lock outlives it by this many `beat_max_interval_s`; then another beat takes over."""


def configure(app: Celery, settings: Settings) -> Celery:
    """Point celery-redbeat at agentq's Redis and keys (before anything reads its config)."""
    if is_sentinel(settings.redis_url):
        raise ConfigError(
            "AGENTQ_REDIS_URL", "agentq beat and schedules need a redis:// URL (not Sentinel) yet"
        )
    app.conf.update(
        redbeat_redis_url=settings.redis_url,
        redbeat_redis_options={},
        redbeat_key_prefix=k.BEAT_PREFIX,
        redbeat_lock_timeout=int(LOCK_PERIODS * settings.beat_max_interval_s) or 1,
        beat_max_loop_interval=settings.beat_max_interval_s,
    )
    # celery-redbeat reads its settings once per app; a copy read before this is stale.
    vars(app).pop("redbeat_conf", None)
    ensure_conf(app)
    return app


class Scheduler(RedBeatScheduler):  # type: ignore[misc]
    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        last = entry.last_run_at
        # Milliseconds of the stored last run: what every beat reads alike for this tick.
        entry.kwargs = {
            **(entry.kwargs or {}),
            "tick": str(int(last.timestamp() * 1000)) if last is not None else "first",
        }
        return super().apply_async(entry, producer, advance, **kwargs)


def run_beat(app: Celery, settings: Settings) -> None:
    """Run the beat in this process until a signal stops it."""
    configure(app, settings)
    app.Beat(
        scheduler=f"{Scheduler.__module__}:{Scheduler.__name__}",
        max_interval=settings.beat_max_interval_s,
        loglevel="INFO",
    ).run()
