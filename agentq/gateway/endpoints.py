"""The gateway's endpoints. Redis calls run in worker threads (a handler that reads no body
is a plain function, run in starlette's pool). An SSE client that shows an attached turn's
token owns it: if it leaves before the end, the turn is aborted (reason ``disconnect``)."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Generator
from functools import cached_property, partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.to_thread
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from agentq.agents import published_agent_details
from agentq.constants import RELAY_DEPTH_MAX, turn_key
from agentq.errors import (
    REDIS_ERRORS,
    AgentqError,
    ConversationNotFound,
    Forbidden,
    TurnNotFound,
    Unauthorized,
)
from agentq.events import Event
from agentq.events.follow import Cursor, follow, stream_pos
from agentq.fleet.presence import Presence, missing_kinds, workers_view
from agentq.gateway.auth import (
    Keyring,
    Principal,
    is_loopback,
    may_access,
    reveal,
    secret_matches,
    visible_to,
)
from agentq.gateway.errors import NO_STORE, accepted, bearer, invalid, validated
from agentq.gateway.limits import StartLimits
from agentq.gateway.metrics import CONTENT_TYPE, GatewayMetrics, Scrape, read_snapshots
from agentq.gateway.sse import EventStreamResponse, event_source
from agentq.gateway.validate import (
    client_host,
    query_number,
    read_json,
    read_json_value,
    request_id_of,
    turn_id_of,
)
from agentq.llm.capacity import capacity_for
from agentq.mcp.listing import server_health
from agentq.models import TERMINAL_STATUSES, InteractionAnswer, TurnHandle, TurnRequest
from agentq.orchestrator.replay import BulkRetryRequest, ForkRequest, RetryRequest
from agentq.orchestrator.start import token_matches
from agentq.schedules.spec import build_spec
from agentq.schedules.store import Schedules
from agentq.state.base import text
from agentq.state.idempotency import check_key
from agentq.state.turn_state import TurnState
from agentq.state.waitpoints import not_found, parse_waitpoint_id
from agentq.telemetry.fleetcounts import read_counts
from agentq.webhooks.deliveries import Deliveries
from agentq.webhooks.target import check_for_turn

if TYPE_CHECKING:
    from agentq.api import Client

log = logging.getLogger("agentq.gateway")
Rule = Literal["key", "operator", "admin", "admin_key"]
Endpoint = Callable[[Request], Any]

STATIC_DIR = Path(__file__).resolve().parent / "static"
BODY_MARGIN_BYTES = 64 * 1024
"""Room for JSON escaping and the other fields above `max_prompt_bytes`."""
HEALTH_TIMEOUT_S = 2.0
"""A health check or a scrape abandons its thread after this: a hung socket must not hang it."""
MAX_STREAMS = 1000
"""Open SSE streams the gateway serves at once (each holds a thread while it waits)."""
MAX_LISTED = 200
WAITPOINT_MARGIN_BYTES = 4096
"""Room for JSON escaping above `max_result_bytes`; the result's own size is checked after."""
_CONVERSATION_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
# The page loads only its own script and style: no inline code, nothing from elsewhere.
PAGE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'"
)


class Gateway:
    """The endpoints, sharing one Client, one metrics registry and the SSE thread limiter."""

    def __init__(self, client: Client, *, heartbeat_s: float, poll_s: float) -> None:
        self.client = client
        settings = client.settings
        self.keyring = Keyring.from_settings(settings)
        self.limits = StartLimits(client._store.redis, settings)
        self.metrics_token = reveal(settings.metrics_token) or None
        self.heartbeat_s = heartbeat_s
        self.poll_s = poll_s
        self.metrics = GatewayMetrics()
        # Reads only (snapshots); a bad AGENTQ_LLM_LIMITS stops the gateway at start.
        self.capacity = capacity_for(client._store.redis, settings)
        # Open streams hold a thread each; their own limiter keeps REST calls answering.
        self.stream_limiter = anyio.CapacityLimiter(MAX_STREAMS)
        self.body_limit_bytes = settings.max_prompt_bytes + BODY_MARGIN_BYTES
        # Set at shutdown: open SSE streams end at their next poll instead of being cancelled.
        self.closing = threading.Event()
        self.presence = Presence(client._store.redis)
        self.deliveries = Deliveries(client._store.redis, settings)

    def caller(self, request: Request) -> tuple[Principal | None, str | None]:
        """The key holder (if the bearer is a key) and the bearer itself (maybe a turn token)."""
        presented = bearer(request)
        principal = self.keyring.identify(presented)
        if self.keyring.enabled and presented is None:
            raise Unauthorized("this call needs a key: Authorization: Bearer <key>")
        return principal, presented

    def require(self, request: Request, rule: Rule) -> Principal | None:
        """The caller's key if `rule` (openapi.AUTH_RULES) admits the call, else Unauthorized
        or Forbidden. Without keys, "operator" answers this machine only: a gateway started
        with `--insecure-no-auth` stays read-only to the network."""
        path = request.url.path
        if rule == "admin":
            presented = bearer(request)
            unguarded = not self.keyring.enabled and self.metrics_token is None
            if unguarded or secret_matches(presented, self.metrics_token):
                return None
            principal = self.keyring.identify(presented)
            if principal is None:
                raise Unauthorized(f"{path} needs an admin key or AGENTQ_METRICS_TOKEN")
        else:
            principal, _ = self.caller(request)
            if self.keyring.enabled and principal is None:
                raise Unauthorized("unknown key")
        if rule in ("admin", "admin_key") and principal is not None and not principal.admin:
            raise Forbidden(f"{path} needs an admin key")
        if rule == "operator" and principal is None and not is_loopback(client_host(request)):
            raise Forbidden(f"without keys, {path} answers this machine only")
        return principal

    def authorize(self, turn_id: str, principal: Principal | None, token: str | None) -> TurnState:
        """The turn's state if the caller may read and steer it (anyone may without keys,
        but a token shown then must be the turn's: TokenInvalid); anyone else: TurnNotFound."""
        keyed = self.keyring.enabled
        state = self.client.check_token(turn_id, token, operator=keyed or token is None)
        if keyed and not may_access(state, principal, token):
            raise TurnNotFound(turn_id)
        return state

    async def steerer(self, request: Request) -> tuple[str, Principal | None]:
        """The path's turn, and who steers it (abort, answer, retry, fork): their key, if any."""
        turn_id, token = turn_id_of(request.path_params["turn_id"]), None
        if request.url.path.startswith("/v1/console/"):
            principal = self.require(request, "operator")
        else:
            principal, token = self.caller(request)
            if token is None:  # no keys: with keys, the caller shows one
                raise Unauthorized(
                    "this call needs the turn's token: Authorization: Bearer <token>"
                )
        await run_in_threadpool(self.authorize, turn_id, principal, token)
        return turn_id, principal

    async def start_turn(self, request: Request) -> Response:
        principal = self.require(request, "key")
        data = await read_json(request, self.body_limit_bytes)
        if "parent_turn_id" in data:
            # Only a running turn may start sub-agents; over HTTP it would graft onto any turn.
            raise invalid("parent_turn_id: not accepted over HTTP")
        req = validated(TurnRequest, data)
        if not req.initial_messages():
            raise invalid("prompt: a turn needs a prompt or messages")
        idempotency_key = request.headers.get("idempotency-key")
        if idempotency_key is not None:
            try:
                check_key(idempotency_key)
            except ValueError as exc:
                raise invalid(str(exc)) from None
        handle = await run_in_threadpool(
            self.start_limited, req, principal, client_host(request), idempotency_key
        )
        # A turn in a fleet without the workers every turn needs waits, and is told so.
        missing = missing_kinds(await run_in_threadpool(self.presence.live))
        if missing:
            handle = handle.model_copy(update={"missing_workers": missing})
        return accepted(handle)

    def start_limited(
        self,
        req: TurnRequest,
        principal: Principal | None,
        host: str,
        idempotency_key: str | None = None,
    ) -> TurnHandle:
        """Start a turn under the caller's start limits (POST /v1/turns, the MCP endpoint)."""
        start = partial(
            self.client._start_turn,
            req,
            owner=principal.name if principal else None,
            operator=bool(principal and principal.admin),
            idempotency_key=idempotency_key,
        )
        return self.limits.start(principal, host, start)

    async def optional_body(self, request: Request) -> Any:
        """The JSON body; none at all is `{}` (a retry needs no field)."""
        empty = request.headers.get("content-length") == "0"
        return {} if empty else await read_json(request, self.body_limit_bytes)

    async def retry_or_fork(self, request: Request) -> Response:
        """A new turn from the history of a turn the caller may steer."""
        turn_id, principal = await self.steerer(request)
        data = await self.optional_body(request)
        retry = request.url.path.endswith("/retry")
        req = validated(RetryRequest, data) if retry else validated(ForkRequest, data)
        start = partial(self.client._replay, turn_id, req)
        handle = await run_in_threadpool(self.limits.start, principal, client_host(request), start)
        return accepted(handle)

    async def retry_many(self, request: Request) -> Response:
        principal = self.require(request, "operator")
        req = validated(BulkRetryRequest, await self.optional_body(request))
        limited = partial(self.limits.start, principal, client_host(request))
        done = await run_in_threadpool(
            partial(self.client._retry_many, req, visible=visible_to(principal), limited=limited)
        )
        return JSONResponse(
            {"dry_run": req.dry_run, "turns": [d.model_dump(exclude_none=True) for d in done]},
            headers=NO_STORE,
        )

    async def complete_waitpoint(self, request: Request) -> Response:
        """An outside system completes a tool's waitpoint (openapi.AUTH_RULES "capability"): a
        wrong token answers as an unknown id does, so the route tells nobody which ids exist."""
        wp_id = request.path_params["waitpoint_id"]
        token = request.query_params.get("token") or bearer(request)
        ids = parse_waitpoint_id(wp_id)
        if not token or ids is None:
            raise not_found(wp_id)
        limit_bytes = self.client.settings.max_result_bytes + WAITPOINT_MARGIN_BYTES
        value = await read_json_value(request, limit_bytes)
        result = await run_in_threadpool(self.client.complete_waitpoint, wp_id, token, value)
        return JSONResponse(
            {
                "ok": True,
                "waitpoint_id": wp_id,
                "turn_id": ids[0],
                "call_id": ids[1],
                "status": result.status,
            }
        )

    def conversation_target(self, request: Request) -> tuple[str, dict[str, Any]]:
        """The path's conversation, and who asks as the Client's keyword arguments."""
        cid = request.path_params["conversation_id"]
        if not _CONVERSATION_ID.match(cid):
            # The 404 any unknown one gets: nothing else names a key.
            raise ConversationNotFound(cid[:128])
        principal = self.require(request, "key")
        if principal is not None:
            return cid, {"owner": principal.name, "operator": principal.admin}
        # No keys configured (require refuses a missing or unknown key when there are).
        return cid, {"token": bearer(request)}

    def conversation(self, request: Request) -> Response:
        cid, who = self.conversation_target(request)
        return JSONResponse(self.client.conversation(cid, **who), headers=NO_STORE)

    def delete_conversation(self, request: Request) -> Response:
        cid, who = self.conversation_target(request)
        aborted = self.client.delete_conversation(cid, **who)
        return JSONResponse(
            {"ok": True, "conversation_id": cid, "aborted_turns": aborted}, headers=NO_STORE
        )

    def conversations(self, request: Request) -> Response:
        principal = self.require(request, "key")
        limit = query_number(request, "limit", 50, low=1, high=MAX_LISTED, integer=True)
        before = query_number(request, "before", None, low=0, high=1e12)
        owner = principal.name if principal else None
        # Without keys (loopback only) the caller may list every conversation, as the CLI.
        operator = principal.admin if principal else True
        rows = self.client.conversations(owner=owner, operator=operator, limit=limit, before=before)
        return JSONResponse({"conversations": rows}, headers=NO_STORE)

    def usage(self, request: Request) -> Response:
        """Without keys (loopback only) the caller sees every key's usage, as the CLI does."""
        principal = self.require(request, "key")
        q = request.query_params
        group_by = q.get("group_by") or "model"
        since, until, key = (q.get(name) or None for name in ("since", "until", "key"))
        admin = principal is None or principal.admin
        owner = principal.name if principal else None
        if not admin and key not in (None, owner):
            raise Forbidden("a key sees its own usage only")
        try:
            report = self.client.usage(
                since=since, until=until, key=key, group_by=group_by, owner=owner, admin=admin
            )
        except ValueError as exc:
            raise invalid(str(exc)) from None
        return JSONResponse(report, headers=NO_STORE)

    @cached_property
    def schedules(self) -> Schedules:
        """Made on first use: behind Sentinel the gateway serves all else, and schedules
        answer with the ConfigError that says why they cannot run there."""
        c = self.client
        return Schedules(c.app, c._store.redis, c.settings)

    def list_schedules(self, request: Request) -> Response:
        self.require(request, "admin_key")
        return JSONResponse({"schedules": self.schedules.list()}, headers=NO_STORE)

    async def add_schedule(self, request: Request) -> Response:
        principal = self.require(request, "admin_key")
        data: dict[str, Any] = await read_json(request, self.body_limit_bytes)
        data["owner"] = principal.name if principal else None
        data.pop("created_at", None)
        spec = build_spec(data)
        if spec.webhook_url:
            check_for_turn(spec.webhook_url, self.client.settings)
        spec = await run_in_threadpool(self.schedules.add, spec)
        return JSONResponse(
            {**spec.model_dump(), "when": spec.when},
            status_code=201,
            headers={"Location": f"/v1/schedules/{spec.name}", **NO_STORE},
        )

    def remove_schedule(self, request: Request) -> Response:
        self.require(request, "admin_key")
        name = request.path_params["name"]
        self.schedules.remove(name)
        return JSONResponse({"ok": True, "name": name})

    def list_webhooks(self, request: Request) -> Response:
        """An API key sees its own turns' deliveries through their timeline instead."""
        self.require(request, "admin")
        limit = query_number(request, "limit", 50, low=1, high=MAX_LISTED, integer=True, clamp=True)
        rows = self.deliveries.recent(limit)
        return JSONResponse({"deliveries": [d.model_dump() for d in rows]}, headers=NO_STORE)

    def get_turn(self, request: Request) -> Response:
        turn_id = turn_id_of(request.path_params["turn_id"])
        if self.keyring.enabled:
            self.authorize(turn_id, *self.caller(request))
        return JSONResponse(self.client.get(turn_id))

    def agents(self, request: Request) -> Response:
        self.require(request, "key")
        return JSONResponse({"agents": published_agent_details(self.client._store.redis)})

    def active(self, request: Request) -> Response:
        visible = visible_to(self.require(request, "key"))
        return JSONResponse({"turns": self.client.active(visible)})

    async def abort(self, request: Request) -> Response:
        turn_id, _ = await self.steerer(request)
        # Checked by the steerer: the Client need not check the caller again.
        await run_in_threadpool(self.client.abort, turn_id, None, "user", operator=True)
        return JSONResponse({"ok": True, "turn_id": turn_id})

    async def answer(self, request: Request) -> Response:
        request_id = request_id_of(request.path_params["request_id"])
        turn_id, _ = await self.steerer(request)
        ans = validated(InteractionAnswer, await read_json(request, self.body_limit_bytes))
        await run_in_threadpool(
            self.client.answer, turn_id, request_id, None, ans.decision, ans.value, operator=True
        )
        return JSONResponse(
            {"ok": True, "turn_id": turn_id, "request_id": request_id, "decision": ans.decision}
        )

    async def events(self, request: Request) -> Response:
        turn_id = turn_id_of(request.path_params["turn_id"])
        # A key only in the header: a URL (?token=) ends up in logs and history.
        principal = self.keyring.identify(bearer(request))
        token = bearer(request) or request.query_params.get("token") or None
        if self.keyring.enabled and token is None:
            raise Unauthorized("this stream needs a key or the turn's token")
        # The header wins: EventSource resends it on every reconnect, the URL never changes.
        q = request.query_params
        try:
            after = Cursor.parse(request.headers.get("last-event-id") or q.get("after") or "0-0")
        except ValueError as exc:
            raise invalid(f"Last-Event-ID: {exc} (an SSE id as the stream sent it)") from None
        depth = query_number(request, "depth", 1, low=0, high=RELAY_DEPTH_MAX, integer=True)
        keep_alive_s = query_number(
            request, "heartbeat", self.heartbeat_s, low=0.05, high=60.0, clamp=True
        )
        poll_s = min(self.poll_s, keep_alive_s)

        def open_stream() -> tuple[Generator[Event | None, None, None], bool] | None:
            state = self.authorize(turn_id, principal, token)
            # Only the turn's token attaches: a key reading along never aborts on leaving.
            owner = token_matches(state, token) and not state.get("detach")
            # A cursor past the log's end resumes from that end: events after an id from the
            # future would be dropped as already seen, so the stream would wait forever.
            if after.root != "0-0":
                last: Any = self.client._store.redis.xrevrange(turn_key(turn_id, "log"), count=1)
                end = text(last[0][0]) if last else "0-0"
                after.root = min(after.root, end, key=stream_pos)
            # Relayed sub-agents are read with the parent's authorization: the follower opens
            # only streams of turns below this one (a cursor naming any other is ignored).
            bus = self.client._store.bus
            if state.get("status") in TERMINAL_STATUSES:
                if not bus.replay(turn_id, after.root, count=1):
                    return None
                return follow(bus, turn_id, after=after, depth=depth, live=False), False
            events = follow(bus, turn_id, after=after, depth=depth, heartbeat_s=poll_s)
            return events, owner

        opened = await run_in_threadpool(open_stream)
        if opened is None:
            # The turn ended and the client has its last event: 204 stops EventSource retrying.
            return Response(status_code=204)
        events, owner = opened

        async def on_disconnect() -> None:
            # Not after a complete stream (the terminal event, a shutdown, a lost Redis).
            if not owner:
                return
            log.info("turn %s: its attached client disconnected; aborting", turn_id)
            try:
                await run_in_threadpool(self.client.abort, turn_id, token, "disconnect")
            except TurnNotFound:
                pass  # it ended in the meantime
            except (AgentqError, *REDIS_ERRORS) as exc:  # type: ignore[misc]
                log.warning("turn %s: abort on disconnect failed: %s", turn_id, exc)

        self.metrics.sse_connections.inc()
        body = event_source(
            events,
            keep_alive_s=keep_alive_s,
            limiter=self.stream_limiter,
            on_event=self.metrics.streamed,
            closing=self.closing,
        )
        return EventStreamResponse(
            body, on_disconnect=on_disconnect, on_close=self.metrics.sse_connections.dec
        )

    async def index(self, request: Request) -> Response:
        return FileResponse(
            STATIC_DIR / "index.html",
            headers={"Content-Security-Policy": PAGE_CSP, "Cache-Control": "no-cache"},
        )

    async def healthz(self, request: Request) -> Response:
        redis = self.client._store.redis

        def read() -> dict[str, Any]:
            redis.ping()
            # Not a 503 without workers (turns wait for them); failing MCP servers show here.
            body = {"ok": True, "redis": "ok", **workers_view(self.presence.live())}
            mcp = server_health(redis)
            return body | ({"mcp": mcp} if mcp else {})

        error = f"no answer within {HEALTH_TIMEOUT_S:g}s"
        with anyio.move_on_after(HEALTH_TIMEOUT_S):
            try:
                return JSONResponse(await anyio.to_thread.run_sync(read, abandon_on_cancel=True))
            except REDIS_ERRORS as exc:
                error = f"{type(exc).__name__}: {exc}"
        return JSONResponse(
            {"ok": False, "error": {"type": "RedisUnavailable", "message": error}}, status_code=503
        )

    def _scrape(self) -> Scrape:
        hooks = self.deliveries.counts(), self.deliveries.backlog()
        counts = read_counts(self.client._store.redis)
        snapshots = read_snapshots(self.capacity, self.client.settings)
        return self.client.active(), counts, snapshots, hooks

    async def metrics_page(self, request: Request) -> Response:
        self.require(request, "admin")
        scrape = None
        with anyio.move_on_after(HEALTH_TIMEOUT_S):
            try:
                scrape = await anyio.to_thread.run_sync(self._scrape, abandon_on_cancel=True)
            except REDIS_ERRORS as exc:
                log.warning("metrics: cannot read the fleet's state from Redis: %s", exc)
        self.metrics.refresh(scrape)
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)
