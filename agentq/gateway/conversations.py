"""Conversations over HTTP: `GET /v1/conversations`, `GET|DELETE /v1/conversations/{id}`,
for the holders openapi.AUTH_RULES["conversation"] names (anyone else: 404, as unknown)."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentq.errors import ConversationNotFound
from agentq.gateway.errors import NO_STORE, bearer
from agentq.gateway.validate import query_number

if TYPE_CHECKING:
    from agentq.gateway.endpoints import Endpoint, Gateway

MAX_LISTED = 200
_CONVERSATION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def conversation_id_of(raw: str) -> str:
    """A path's conversation id, or the 404 any unknown one gets (nothing else names a key)."""
    if not _CONVERSATION_ID.match(raw):
        raise ConversationNotFound(raw[:128])
    return raw


def conversation_handlers(gw: Gateway) -> list[Endpoint]:
    client = gw.client

    def target(request: Request) -> tuple[str, dict[str, Any]]:
        """The path's conversation, and who asks (as the Client's keyword arguments)."""
        cid = conversation_id_of(request.path_params["conversation_id"])
        principal = gw.require(request, "key")
        if principal is not None:
            return cid, {"owner": principal.name, "operator": principal.admin}
        # No keys configured (require refuses a missing or unknown key when there are).
        return cid, {"token": bearer(request)}

    async def conversation(request: Request) -> Response:
        cid, who = target(request)
        view = await run_in_threadpool(lambda: client.conversation(cid, **who))
        return JSONResponse(view, headers=NO_STORE)

    async def delete_conversation(request: Request) -> Response:
        cid, who = target(request)
        aborted = await run_in_threadpool(lambda: client.delete_conversation(cid, **who))
        return JSONResponse(
            {"ok": True, "conversation_id": cid, "aborted_turns": aborted}, headers=NO_STORE
        )

    async def conversations(request: Request) -> Response:
        principal = gw.require(request, "key")
        limit = query_number(request, "limit", 50, low=1, high=MAX_LISTED, integer=True)
        before = query_number(request, "before", None, low=0, high=1e12)
        owner = principal.name if principal else None
        # Without keys (loopback only) the caller may list every conversation, as the CLI.
        operator = principal.admin if principal else True
        rows = await run_in_threadpool(
            lambda: client.conversations(owner=owner, operator=operator, limit=limit, before=before)
        )
        return JSONResponse({"conversations": rows}, headers=NO_STORE)

    return [conversations, conversation, delete_conversation]
