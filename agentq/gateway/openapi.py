"""`GET /openapi.json`: the HTTP API, listed by hand with who may call each and its handler."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cache
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from agentq.constants import VERSION
from agentq.models import InteractionAnswer, TurnHandle, TurnRequest
from agentq.orchestrator.replay import BulkRetryRequest, ForkRequest, RetryRequest

Auth = Literal[
    "public", "key", "turn", "owner", "conversation", "operator", "admin", "admin_key", "capability"
]
FALLS_SHORT = ("operator", "admin", "admin_key")  # rules a known key can fall short of: 403
AUTH_RULES: dict[Auth, str] = {
    "public": "No credential.",
    "key": "With keys configured: an API or admin key; lists show the caller's own turns "
    "(every turn for an admin).",
    "turn": "With keys configured: the turn's token, its owner's key or an admin key; "
    "anyone else gets 404, as for an unknown turn. Without keys: anyone for reading, the "
    "turn's token for steering.",
    "owner": "With keys configured: the turn owner's key or an admin key; anyone else gets 404.",
    "conversation": "With keys configured: the key that created the conversation or an admin "
    "key; anyone else gets 404, as for an unknown conversation. Without keys: the "
    "conversation token its first turn returned.",
    "operator": "With keys configured: the turn owner's key or an admin key (anyone else "
    "gets 404). Without keys: a client on this machine only (403 otherwise).",
    "admin": "An admin key or AGENTQ_METRICS_TOKEN; another key gets 403.",
    "admin_key": "With keys configured: an admin key; another key gets 403. Without keys: "
    "anyone (the gateway serves loopback only).",
    "capability": "No key: the token of the callback URL (`?token=`, or Authorization: "
    "Bearer) is the credential, for this one waitpoint; a wrong token or none gets 404, as "
    "an unknown waitpoint.",
}


def _query(name: str, description: str, type_: str = "string") -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": {"type": type_}} | {
        "description": description
    }


def _path(name: str) -> dict[str, Any]:
    param = {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
    if name == "waitpoint_id":
        param["description"] = "`wp_<turn id>_<call id>`, from the call's tool_waiting event."
    return param


WAITPOINT_TOKEN = _query("token", "The waitpoint's capability, from its callback_url.") | {
    "required": True
}
IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "minLength": 1, "maxLength": 255},
    "description": "The same key from the same caller within 24 h answers with the first "
    "request's turn (the same body) instead of starting another; another body: 422, code "
    "idempotency_key_reused.",
}


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    handler: str
    summary: str
    auth: Auth
    ok: str = "200"
    request: type[BaseModel] | None = None
    response: type[BaseModel] | None = None
    media_type: str = "application/json"
    parameters: tuple[dict[str, Any], ...] = ()
    errors: tuple[str, ...] = ()
    """Beyond the 401 (and 403) its auth rule implies."""


OPERATIONS: tuple[Operation, ...] = (
    Operation("GET", "/", "index", "The web page: chat, live tool chips, Cancel, approvals.",
              "public", media_type="text/html"),
    Operation("GET", "/static/{path}", "static", "The page's script and style.", "public",
              media_type="text/plain"),
    Operation("GET", "/healthz", "healthz", "Liveness, and whether Redis answers; `workers`: "
              "the live workers per queue of agentq's own, `missing_workers`: the kinds every "
              "turn needs that no live worker is (turns wait for them: still 200).", "public",
              errors=("503",)),
    Operation("GET", "/openapi.json", "openapi_page", "This document.", "public"),
    Operation("GET", "/metrics", "metrics_page", "Prometheus metrics.", "admin",
              media_type="text/plain"),
    Operation("POST", "/v1/turns", "start_turn", "Start a turn; with conversation_id, one turn "
              "of the conversation runs at a time and multitask says what this message does "
              "while another runs (docs/conversations.md); `missing_workers` names the kinds of "
              "worker no live one is (the turn waits for them).", "key", ok="202",
              request=TurnRequest, response=TurnHandle, parameters=(IDEMPOTENCY_KEY,),
              errors=("404", "409", "413", "415", "422", "429")),
    Operation("GET", "/v1/conversations", "conversations", "The caller's conversations (every "
              "one for an admin), most recently changed first.", "key",
              parameters=(
                  _query("limit", "At most this many (1 to 200; default 50).", "integer"),
                  _query("before", "Conversations changed before this time (epoch "
                         "seconds), for the next page.", "number"),
              ), errors=("422",)),
    Operation("GET", "/v1/conversations/{conversation_id}", "conversation", "A conversation: "
              "status (idle, busy), running_turn_id, queued turn ids, messages, updated_at.",
              "conversation", errors=("404",)),
    Operation("DELETE", "/v1/conversations/{conversation_id}", "delete_conversation", "Abort "
              "the conversation's running and queued turns and remove it.", "conversation",
              errors=("404",)),
    Operation("GET", "/v1/usage", "usage", "Tokens and cost of the UTC days from since to until: "
              "totals and rows (prompt_tokens, completion_tokens, cached_tokens, "
              "total_tokens, cost_usd, turns) by model, agent or key; a key sees its own, "
              "an admin every key's (docs/spend.md).", "key",
              parameters=(
                  _query("since", "First UTC day (YYYY-MM-DD) or epoch seconds; default "
                         "29 days before until."),
                  _query("until", "Last UTC day (YYYY-MM-DD) or epoch seconds; default now."),
                  _query("key", "Only this key's usage (an admin; a key may name itself)."),
                  _query("group_by", "model (default), agent or key."),
              ), errors=("403", "422")),
    Operation("GET", "/v1/turns", "list_turns", "Recent and running turns, newest first.", "key",
              parameters=(
                  _query("status", "Comma-separated: queued, running, finished, aborted, "
                         "error, active, ended."),
                  _query("agent", "Only turns of this agent."),
                  _query("limit", "At most this many turns.", "integer"),
                  _query("before", "Turns started before this time (epoch seconds), "
                         "for the next page.", "number"),
              ), errors=("422",)),
    Operation("GET", "/v1/turns/active", "active", "Running turns: id, started, current tools, "
              "call count.", "key"),
    Operation("GET", "/v1/agents", "agents", "The agents the turn workers run: name, model, "
              "tools, description, the JSON schema of a typed output.",
              "key"),
    Operation("GET", "/v1/turns/{turn_id}", "get_turn", "A turn's state, history and "
              "invocation records.", "turn", errors=("404",)),
    Operation("GET", "/v1/turns/{turn_id}/events", "events", "The turn's events as Server-Sent "
              "Events, from the start (or after Last-Event-ID), then live.", "turn",
              media_type="text/event-stream",
              parameters=(
                  _query("token", "The turn's token, for EventSource, which cannot set "
                         "headers."),
                  _query("heartbeat", "Seconds between keep-alive comments.", "number"),
                  _query("depth", "Levels of sub-agents whose events are relayed, each "
                         "with `path` (0 to 8; default 1).", "integer"),
                  {"name": "Last-Event-ID", "in": "header", "required": False,
                   "schema": {"type": "string"}},
              ), errors=("404",)),
    Operation("GET", "/v1/turns/{turn_id}/timeline", "turn_timeline", "A turn's model rounds "
              "and calls on a time line (the console).", "owner", errors=("404",)),
    Operation("POST", "/v1/turns/{turn_id}/abort", "abort", "Abort a running turn and its "
              "sub-agents.", "turn", errors=("404",)),
    Operation("POST", "/v1/turns/retry", "retry_many", "Retry in bulk: each of the caller's "
              "turns (every owner's for an admin) that ended `status` in the last `since_s` "
              "seconds, of `agent`, once (a turn retried by a bulk retry already is answered "
              "with its retry), at most `rate_per_s` a second; `dry_run` starts nothing. "
              "Without keys: from this machine only. docs/retry.md.", "key",
              request=BulkRetryRequest, errors=("403", "422")),
    Operation("POST", "/v1/turns/{turn_id}/retry", "retry_or_fork", "Retry a turn that ended "
              "error or aborted: a new turn (retry_of) that reuses its settled calls and answered "
              "rounds and goes on from its first unsettled step, with its agent, owner, "
              "webhook and budgets (its spend counts). A conversation's last turn is retried in "
              "its conversation, the retry's exchange replacing the source's; any other "
              "conversation turn's retry starts a new conversation (`conversation_id`, "
              "`branched`). docs/retry.md.", "turn", ok="202",
              request=RetryRequest, response=TurnHandle,
              errors=("403", "404", "409", "410", "422")),
    Operation("POST", "/v1/turns/{turn_id}/fork", "retry_or_fork", "Fork a turn: a new turn "
              "(fork_of) from its history before round at_round (1-based), optionally edited (the "
              "last user message, the instructions, the model, one settled call's result); a "
              "turn of a conversation forks into a new conversation. docs/retry.md.", "turn",
              ok="202", request=ForkRequest, response=TurnHandle,
              errors=("403", "404", "410", "422")),
    Operation("POST", "/v1/turns/{turn_id}/interactions/{request_id}", "answer", "Answer an "
              "interaction (approval, password, confirm, input: `value` is the answer, checked "
              "against its answer_schema, 422 AnswerInvalid when it does not fit).", "turn",
              request=InteractionAnswer, errors=("404", "409", "422")),
    Operation("POST", "/v1/waitpoints/{waitpoint_id}", "complete_waitpoint", "Complete a tool's "
              "waitpoint: the body (any JSON) is the call's result, settled ok; `{\"error\": "
              "\"...\"}` settles it error (docs/waitpoints.md). 409: completed already, `first` "
              "holds that completion; 410: timed out, or its call cancelled or its turn over.",
              "capability", parameters=(WAITPOINT_TOKEN,),
              errors=("404", "409", "410", "413", "415", "422")),
    Operation("GET", "/v1/interactions", "inbox", "Every pending interaction of the running "
              "turns, the soonest to expire first (the console's inbox).", "key"),
    Operation("GET", "/v1/capacity", "capacity", "The fleet's model capacity per model (the "
              "console's panel): rounds queued by class, streams in use, pauses, requests and "
              "tokens in the last minute, deployments with their breakers, configured limits, "
              "and the model API in use (`api`: setting, in_use, what auto learned).",
              "admin", errors=("503",)),
    Operation("GET", "/v1/mcp/servers", "mcp_servers", "Every MCP server of AGENTQ_MCP_SERVERS "
              "(and any a worker listed): where it is, its last listing's error, its tools by the "
              "name the model sees (`name`) and on the server (`tool`), the tools refused and why "
              "(a bad name or schema, listed twice, a name another tool maps to), and how its "
              "last start or call went (`health`).", "admin", errors=("503",)),
    Operation("GET", "/v1/schedules", "list_schedules", "Every schedule, its last turn and its "
              "next tick.", "admin_key"),
    Operation("POST", "/v1/schedules", "add_schedule", "Add a schedule: name, every (30s, 5m) or "
              "cron (5 fields, UTC), prompt, agent?, webhook_url?, overlap?.", "admin_key",
              ok="201", errors=("422",)),
    Operation("DELETE", "/v1/schedules/{name}", "remove_schedule", "Remove a schedule.",
              "admin_key", errors=("404",)),
    Operation("GET", "/v1/webhooks", "list_webhooks", "Recent webhook deliveries: status, "
              "attempts, next attempt.", "admin",
              parameters=(_query("limit", "At most this many (1 to 200; default 50).",
                                 "integer"),),
              errors=("422",)),
    Operation("POST", "/mcp", "mcp", "MCP over Streamable HTTP (JSON-RPC): the fleet's agents as "
              "tools, each call a turn of the caller's; see docs/mcp.md.", "key",
              media_type="text/event-stream", errors=("404", "422")),
    Operation("GET", "/mcp", "mcp", "MCP: a session's stream of server messages (Mcp-Session-Id).",
              "key", media_type="text/event-stream", errors=("404", "422")),
    Operation("DELETE", "/mcp", "mcp", "MCP: end a session (Mcp-Session-Id).", "key",
              errors=("404", "422")),
)  # fmt: skip
# The console's buttons (abort, answer, retry, fork, bulk retry) are the steering of a turn
# with the same bodies, as an operator (no token).
OPERATIONS += tuple(
    replace(op, path=op.path.replace("/v1/", "/v1/console/"),
            summary=f"From the console, as an operator: {op.summary}",
            auth="operator" if op.auth == "turn" else op.auth)
    for op in OPERATIONS if op.method == "POST" and op.path.startswith("/v1/turns/")
)  # fmt: skip

_ERROR_TEXT = {
    "401": "No credential, or not a known key.",
    "403": "Not allowed: see x-agentq-auth.",
    "404": "Unknown, finished (abort) or not the caller's.",
    "409": "Answered or timed out already; or (code conversation_busy, multitask reject) "
    "another turn of the conversation runs: running_turn_id names it; or (code "
    "not_retryable) the turn to retry still runs or finished: `status` says which.",
    "410": "(code source_gone) the turn's conversation was deleted, its history with it; "
    "or the waitpoint timed out, or its call was cancelled or its turn ended.",
    "413": "The body is too large.",
    "415": "The body is not application/json.",
    "422": "The request does not validate (the message starts with the field; code "
    "fork_invalid: a round out of range or an edit the history refuses, `field`).",
    "429": "Too many starts or running turns for this caller; see Retry-After.",
    "503": "Redis does not answer.",
}


def _schema(name: str) -> dict[str, Any]:
    """A response's or request body's content: JSON of the schema `name`."""
    return {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}}


def _operation(op: Operation) -> dict[str, Any]:
    ok_content = _schema(op.response.__name__)["application/json"] if op.response else {}
    operation_id = re.sub(r"[^a-z0-9]+", "_", f"{op.method} {op.path}".lower()).strip("_")
    secured = op.auth not in ("public", "capability")
    errors = {*op.errors, *("401",) * secured, *("403",) * (op.auth in FALLS_SHORT)}
    out: dict[str, Any] = {
        "summary": op.summary,
        "operationId": operation_id or "page",
        "x-agentq-auth": op.auth,
        "description": AUTH_RULES[op.auth],
        "security": [{"bearer": []}] if secured else [],
        "responses": {
            op.ok: {"description": "OK", "content": {op.media_type: ok_content}},
            **{
                code: {"description": _ERROR_TEXT[code], "content": _schema("Error")}
                for code in sorted(errors)
            },
        },
    }
    parameters = [*map(_path, re.findall(r"{(\w+)}", op.path)), *op.parameters]
    if parameters:
        out["parameters"] = parameters
    if op.request is not None:
        out["requestBody"] = {"required": True, "content": _schema(op.request.__name__)}
    return out


def _object(*required: str, **properties: Any) -> dict[str, Any]:
    """A JSON Schema object of `properties`, of which `required` are."""
    return {"type": "object", "required": list(required), "properties": properties}


@cache
def openapi_document(version: str) -> dict[str, Any]:
    models = dict.fromkeys(m for op in OPERATIONS for m in (op.request, op.response) if m)
    _, defs = models_json_schema(
        [(m, "validation") for m in models], ref_template="#/components/schemas/{model}"
    )
    schemas: dict[str, Any] = dict(defs.get("$defs", {}))
    string = {"type": "string"}
    code = string | {
        "description": "A stable code where one applies: conversation_busy, "
        "idempotency_key_reused, not_retryable, source_gone, fork_invalid."
    }
    error = _object("type", "message", type=string, message=string, code=code)
    schemas["Error"] = _object("error", error=error)
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        paths.setdefault(op.path, {})[op.method.lower()] = _operation(op)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "agentq gateway",
            "version": version,
            "description": "LLM agent turns on a Celery fleet: start turns, follow their "
            "events, abort, retry and fork them, answer their interactions. Errors are "
            '`{"error": {"type", "message"}}`. Who may call what: each operation\'s '
            "`x-agentq-auth` and description. Without AGENTQ_API_KEYS/AGENTQ_ADMIN_KEYS the "
            "gateway serves loopback only and needs no key.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {
                "bearer": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "An API key, an admin key, or a turn's token.",
                }
            },
        },
    }


async def openapi_page(request: Request) -> Response:
    return JSONResponse(openapi_document(VERSION))
