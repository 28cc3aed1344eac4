"""The fleet's model capacity as the gateway shows it: `GET /v1/capacity` (the console's
panel) and the scrape-time capacity gauges of /metrics.

The models shown are those the gateway knows: configured in `AGENTQ_LLM_LIMITS`,
`AGENTQ_LLM_MODEL`, the models of the agents the turn workers publish, and those whose API
`auto` learned. Each is one `Capacity.snapshot` (a read-only script on the model's keys).
Only names and numbers go out: a deployment's `base_url`, provider model name and `api_key`
never do.
"""

from __future__ import annotations

from typing import Any

from agentq.agents import published_agent_details
from agentq.config import Settings
from agentq.llm.apis import api_view, read_learned
from agentq.llm.capacity import Capacity
from agentq.llm.limits import ModelLimitsEntry


def read_snapshots(cap: Capacity, settings: Settings) -> list[dict[str, Any]]:
    """`Capacity.snapshot` of every model the gateway knows (above), by name, each with the
    API it is called with (`api`: its setting, the one in use, what `auto` learned)."""
    learned = read_learned(cap.redis)
    agents = [
        a["model"] for a in published_agent_details(cap.redis) if isinstance(a.get("model"), str)
    ]
    models = {*cap.limits, settings.llm_model, *agents, *learned}
    # A brace would end the model's Redis Cluster hash tag early (as parse_limits refuses).
    return [
        {**cap.snapshot(model), "api": api_view(model, settings, cap.limits, learned)}
        for model in sorted(m for m in models if m.strip() and "{" not in m and "}" not in m)
    ]


def _limits(limits: Any) -> dict[str, Any]:
    return {"rpm": limits.rpm, "tpm": limits.tpm, "streams": limits.streams}


def capacity_view(cap: Capacity, snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """The body of `GET /v1/capacity`: each snapshot with the configured limits beside it
    (None for a model without configured limits)."""
    models = []
    for snap in snapshots:
        entry: ModelLimitsEntry | None = cap.limits.get(snap["model"])
        if not snap["configured"]:
            entry = None
        routes = {d.name: d for d in entry.routes} if entry is not None else {}
        deployments = {
            name: {**dep, "limits": _limits(routes[name]) if name in routes else None}
            for name, dep in snap["deployments"].items()
        }
        limits = None if entry is None else {**_limits(entry), "strategy": entry.strategy}
        models.append({**snap, "limits": limits, "deployments": deployments})
    now_ms = max((int(s["now_ms"]) for s in snapshots), default=None)
    return {"now_ms": now_ms, "models": models}
