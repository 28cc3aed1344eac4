"""`POST /v1/waitpoints/{id}?token=...`: an outside system completes a tool's waitpoint.

The token is the capability (an HMAC of the id), so this route needs no API key: whoever
holds the callback URL may complete that one waitpoint, and nothing else. A wrong token
answers as an unknown id does (404), so the route tells nobody which ids exist.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentq.gateway.errors import bearer
from agentq.gateway.validate import read_json_value
from agentq.state.waitpoints import not_found, parse_waitpoint_id

if TYPE_CHECKING:
    from agentq.gateway.endpoints import Endpoint, Gateway

BODY_MARGIN_BYTES = 4096
"""Room for JSON escaping above `max_result_bytes`; the result's own size is checked after."""


def waitpoint_handlers(gw: Gateway) -> list[Endpoint]:
    client = gw.client
    limit_bytes = client.settings.max_result_bytes + BODY_MARGIN_BYTES

    async def complete_waitpoint(request: Request) -> Response:
        wp_id = request.path_params["waitpoint_id"]
        token = request.query_params.get("token") or bearer(request)
        ids = parse_waitpoint_id(wp_id)
        if not token or ids is None:
            raise not_found(wp_id)
        value = await read_json_value(request, limit_bytes)
        result = await run_in_threadpool(client.complete_waitpoint, wp_id, token, value)
        return JSONResponse(
            {
                "ok": True,
                "waitpoint_id": wp_id,
                "turn_id": ids[0],
                "call_id": ids[1],
                "status": result.status,
            }
        )

    return [complete_waitpoint]
