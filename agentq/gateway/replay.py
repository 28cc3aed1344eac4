"""Retry and fork over HTTP: a new turn from a turn's history (agentq.orchestrator.replay),
for whoever may steer the source (`Gateway.steerer`), and the bulk retry of the caller's
turns that a filter names (without keys: from this machine only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentq.gateway.auth import visible_to
from agentq.gateway.errors import NO_STORE, accepted, validated
from agentq.gateway.validate import client_host, read_json, turn_id_of
from agentq.orchestrator.replay import BulkRetryRequest, ForkRequest, RetryRequest, bulk_retry

if TYPE_CHECKING:
    from agentq.gateway.endpoints import Endpoint, Gateway


def replay_handlers(gw: Gateway) -> list[Endpoint]:
    async def body(request: Request) -> Any:
        """The JSON body; none at all is `{}` (a retry needs no field)."""
        empty = request.headers.get("content-length") == "0"
        return {} if empty else await read_json(request, gw.body_limit_bytes)

    async def retry_or_fork(request: Request) -> Response:
        turn_id = turn_id_of(request.path_params["turn_id"])
        principal = await gw.steerer(request, turn_id)
        data = await body(request)
        retry = request.url.path.endswith("/retry")
        req = validated(RetryRequest, data) if retry else validated(ForkRequest, data)
        handle = await run_in_threadpool(
            gw.limited, principal, client_host(request), lambda: gw.client._replay(turn_id, req)
        )
        return accepted(handle)

    async def retry_many(request: Request) -> Response:
        principal = gw.require(request, "operator")
        host = client_host(request)
        req = validated(BulkRetryRequest, await body(request))
        c = gw.client
        done = await run_in_threadpool(
            lambda: bulk_retry(
                c._store,
                c.app,
                c.settings,
                req,
                visible=visible_to(principal),
                traced=c.traced,
                limited=lambda start: gw.limited(principal, host, start),
            )
        )
        return JSONResponse(
            {"dry_run": req.dry_run, "turns": [d.model_dump(exclude_none=True) for d in done]},
            headers=NO_STORE,
        )

    return [retry_many, retry_or_fork]
