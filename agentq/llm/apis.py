"""Which API a model is called with, and what `auto` learned of it fleet-wide
(docs/models.md): one Redis hash, `API_KEY`, read by every stream worker."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal

import redis

from agentq import constants as k
from agentq.config import Settings
from agentq.errors import ModelHTTPError
from agentq.llm.limits import ModelLimitsEntry
from agentq.llm.responses import ModelApi
from agentq.state.base import text

log = logging.getLogger("agentq.llm")

API_KEY = f"{k.PREFIX}:llm:api"
"""Hash: model -> the API `auto` learned for it (JSON `{api, reason, at}`)."""
CACHE_S = 5.0
"""How long a stream worker trusts what it read of `API_KEY` (a switch it makes itself is
seen at once; another worker's within this, or at that worker's own refused round)."""

Setting = Literal["chat", "responses", "auto"]


def configured(model: str, settings: Settings, limits: dict[str, ModelLimitsEntry]) -> Setting:
    """The model's configured API: its own `api`, else AGENTQ_LLM_API."""
    entry = limits.get(model)
    return entry.api if entry is not None and entry.api is not None else settings.llm_api


def names_responses(exc: ModelHTTPError) -> bool:
    """A 400 that says the round needs the Responses API."""
    return exc.status_code == 400 and "/v1/responses" in exc.message


def read_learned(client: redis.Redis) -> dict[str, dict[str, Any]]:
    """Every model's learned API (`learn`'s JSON), by model."""
    return {text(model): json.loads(raw) for model, raw in client.hgetall(API_KEY).items()}


def api_view(
    model: str,
    settings: Settings,
    limits: dict[str, ModelLimitsEntry],
    learned: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """What `GET /v1/capacity` shows of a model's API: configured, in use, and why."""
    setting = configured(model, settings, limits)
    found = learned.get(model) if setting == "auto" else None
    in_use = setting if setting != "auto" else (found or {}).get("api", "chat")
    view: dict[str, Any] = {"setting": setting, "in_use": in_use}
    if found is not None:
        view["learned"] = {"reason": found.get("reason"), "at": found.get("at")}
    return view


class ApiChoice:
    """A stream worker's view of the learned APIs: read from Redis at most every CACHE_S."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._learned: dict[str, ModelApi] = {}
        self._read_at = float("-inf")

    def stale(self) -> bool:
        return time.monotonic() - self._read_at > CACHE_S

    def refresh(self) -> None:
        """Blocking: call it off the loop."""
        self._learned = {model: v["api"] for model, v in read_learned(self._client).items()}
        self._read_at = time.monotonic()

    def api_for(self, model: str, setting: Setting) -> ModelApi:
        return self._learned.get(model, "chat") if setting == "auto" else setting

    def kept_on_chat(self, model: str) -> bool:
        """`auto` found no Responses API on the model's server: it stays on chat."""
        return self._learned.get(model) == "chat"

    def learn(self, model: str, api: ModelApi, reason: str) -> bool:
        """Blocking: record what `auto` learned of the model, fleet-wide; True when this
        call changed it (the first worker to learn it logs it)."""
        value = {"api": api, "reason": reason[:500], "at": time.time()}
        previous = self._client.hget(API_KEY, model)
        self._client.hset(API_KEY, model, json.dumps(value))
        self._learned[model] = api
        changed = previous is None or json.loads(previous).get("api") != api
        if changed and api == "responses":
            log.warning("model %s moves to the Responses API fleet-wide: %s", model, reason)
        elif changed:
            log.warning("model %s stays on Chat Completions: %s", model, reason)
        return changed
