"""`POST /v1/turns/{id}/retry` and `POST /v1/turns/{id}/fork`: a new turn from a turn's
history (agentq.orchestrator.replay), for whoever may steer the source: its owner's key,
an admin key or its token; anyone else gets 404, as for any turn not theirs.
`POST /v1/turns/retry` (and the console's `POST /v1/console/turns/retry`): the caller's
turns that a filter names, each retried once (agentq.orchestrator.replay; an admin's: every
owner's; without keys: from this machine, as the console's other buttons)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentq.errors import Forbidden
from agentq.gateway.auth import Principal, is_loopback, may_list
from agentq.gateway.context import NO_STORE
from agentq.gateway.errors import require_token, validated
from agentq.gateway.validate import read_json, turn_id_of
from agentq.orchestrator.replay import BulkRetryRequest, ForkRequest, RetryRequest, bulk_retry

if TYPE_CHECKING:
    from agentq.gateway.context import RouteContext
    from agentq.models import TurnHandle


def accepted(handle: TurnHandle) -> Response:
    """202 for a turn started (a request's, a retry's, a fork's), with where to read it."""
    return JSONResponse(
        handle.model_dump(exclude_none=True),
        status_code=202,
        headers={"Location": f"/v1/turns/{handle.turn_id}", **NO_STORE},
    )


async def _body(gw: RouteContext, request: Request) -> Any:
    """The JSON body; none at all is `{}` (a retry needs no field)."""
    empty = request.headers.get("content-length") == "0"
    return {} if empty else await read_json(request, gw.body_limit_bytes)


async def replay(
    gw: RouteContext, request: Request, turn_id: str, principal: Principal | None
) -> Response:
    """Retry or fork (the path's last part) `turn_id` for a caller who may steer it."""
    data = await _body(gw, request)
    retry = request.url.path.endswith("/retry")
    req = validated(RetryRequest, data) if retry else validated(ForkRequest, data)
    host = request.client.host if request.client else ""
    handle = await run_in_threadpool(
        gw.limited, principal, host, lambda: gw.client._replay(turn_id, req)
    )
    return accepted(handle)


def replay_routes(gw: RouteContext) -> list[Route]:
    async def retry_or_fork(request: Request) -> Response:
        turn_id = turn_id_of(request.path_params["turn_id"])
        if not gw.keyring.enabled:
            await run_in_threadpool(gw.client.check_token, turn_id, require_token(request))
            return await replay(gw, request, turn_id, None)
        principal, presented = gw.caller(request)
        await run_in_threadpool(gw.authorize, turn_id, principal, presented)
        return await replay(gw, request, turn_id, principal)

    async def retry_many(request: Request) -> Response:
        principal = gw.require_key(request)
        host = request.client.host if request.client else ""
        if principal is None and not is_loopback(host):
            raise Forbidden("without keys, turns are retried in bulk from this machine only")
        req = validated(BulkRetryRequest, await _body(gw, request))
        c = gw.client
        visible = None if principal is None else (lambda st: may_list(st, principal))
        done = await run_in_threadpool(
            lambda: bulk_retry(
                c._store,
                c.app,
                c.settings,
                req,
                visible=visible,
                traced=c.traced,
                limited=lambda start: gw.limited(principal, host, start),
            )
        )
        return JSONResponse(
            {"dry_run": req.dry_run, "turns": [d.model_dump(exclude_none=True) for d in done]},
            headers=NO_STORE,
        )

    return [
        Route("/v1/turns/retry", retry_many, methods=["POST"]),
        # The console's bulk control: the same bulk retry under the same rules, beside the
        # console's other buttons (`gateway.console`).
        Route("/v1/console/turns/retry", retry_many, methods=["POST"]),
        Route("/v1/turns/{turn_id}/retry", retry_or_fork, methods=["POST"]),
        Route("/v1/turns/{turn_id}/fork", retry_or_fork, methods=["POST"]),
    ]
