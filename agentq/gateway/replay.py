"""`POST /v1/turns/{id}/retry` and `POST /v1/turns/{id}/fork`: a new turn from a turn's
history (agentq.orchestrator.replay), for whoever may steer the source: its owner's key,
an admin key or its token; anyone else gets 404, as for any turn not theirs.
`POST /v1/turns/retry` (and the console's `POST /v1/console/turns/retry`): the caller's
turns that a filter names, each retried once (agentq.orchestrator.replay; an admin's: every
owner's; without keys: from this machine, as the console's other buttons)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentq.errors import Forbidden
from agentq.gateway.auth import Principal, is_loopback, may_list
from agentq.gateway.errors import require_token, validation_error
from agentq.gateway.validate import read_json, turn_id_of
from agentq.orchestrator.replay import BulkRetryRequest, ForkRequest, RetryRequest, bulk_retry

if TYPE_CHECKING:
    from agentq.gateway.context import RouteContext


class Replays:
    def __init__(self, gw: RouteContext) -> None:
        self.gw = gw

    async def _source(self, request: Request) -> tuple[str, Principal | None]:
        """The source's id, once the caller is known to may steer it, and the caller's key."""
        turn_id = turn_id_of(request.path_params["turn_id"])
        if not self.gw.keyring.enabled:
            await run_in_threadpool(self.gw.client.check_token, turn_id, require_token(request))
            return turn_id, None
        principal, presented = self.gw.caller(request)
        await run_in_threadpool(self.gw.authorize, turn_id, principal, presented)
        return turn_id, principal

    async def _body(self, request: Request, model: type[BaseModel]) -> BaseModel:
        empty = request.headers.get("content-length") == "0"
        data = {} if empty else await read_json(request, self.gw.body_limit_bytes)
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            raise validation_error(exc) from None

    async def _start(self, request: Request, model: type[BaseModel]) -> Response:
        turn_id, principal = await self._source(request)
        req = await self._body(request, model)
        assert isinstance(req, (RetryRequest, ForkRequest))
        host = request.client.host if request.client else ""
        handle = await run_in_threadpool(
            self.gw.limited, principal, host, lambda: self.gw.client._replay(turn_id, req)
        )
        return JSONResponse(
            handle.model_dump(exclude_none=True),
            status_code=202,
            headers={"Location": f"/v1/turns/{handle.turn_id}", "Cache-Control": "no-store"},
        )

    async def retry_many(self, request: Request) -> Response:
        principal = self.gw.require_key(request)
        if principal is None and not is_loopback(request.client.host if request.client else ""):
            raise Forbidden("without keys, turns are retried in bulk from this machine only")
        req = await self._body(request, BulkRetryRequest)
        assert isinstance(req, BulkRetryRequest)
        c = self.gw.client
        visible = None if principal is None else (lambda st: may_list(st, principal))
        host = request.client.host if request.client else ""
        done = await run_in_threadpool(
            lambda: bulk_retry(
                c._store,
                c.app,
                c.settings,
                req,
                visible=visible,
                traced=c.traced,
                limited=lambda start: self.gw.limited(principal, host, start),
            )
        )
        return JSONResponse(
            {"dry_run": req.dry_run, "turns": [d.model_dump(exclude_none=True) for d in done]},
            headers={"Cache-Control": "no-store"},
        )

    async def retry(self, request: Request) -> Response:
        return await self._start(request, RetryRequest)

    async def fork(self, request: Request) -> Response:
        return await self._start(request, ForkRequest)


def replay_routes(gw: RouteContext) -> list[Route]:
    r = Replays(gw)
    return [
        Route("/v1/turns/retry", r.retry_many, methods=["POST"]),
        # The console's bulk control: the same bulk retry under the same rules, beside the
        # console's other buttons (`gateway.console`).
        Route("/v1/console/turns/retry", r.retry_many, methods=["POST"]),
        Route("/v1/turns/{turn_id}/retry", r.retry, methods=["POST"]),
        Route("/v1/turns/{turn_id}/fork", r.fork, methods=["POST"]),
    ]


__all__ = ["Replays", "replay_routes"]
