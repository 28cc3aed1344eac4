"""Settings: one pydantic-settings class, read from `AGENTQ_*` environment variables."""

from __future__ import annotations

import base64
import binascii
import json
from functools import lru_cache
from typing import Annotated, Any, Literal, NamedTuple
from urllib.parse import unquote, urlsplit

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PositiveFloat,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from agentq import constants as k
from agentq.errors import ConfigError, field_errors

SENTINEL_SCHEME = "sentinel://"
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", SENTINEL_SCHEME)
"""The URLs of a Redis (AGENTQ_REDIS_URL); a broker URL of another scheme is kombu's (AMQP)."""
DEFAULT_SENTINEL_PORT = 26379


class ModelPrice(BaseModel):
    """A model's price (AGENTQ_LLM_PRICES): USD per million tokens."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    input: float = Field(ge=0, allow_inf_nan=False)
    output: float = Field(ge=0, allow_inf_nan=False)
    cached_input: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    """Prompt tokens read from the provider's cache; unset: the `input` price."""


class KeyBudget(BaseModel):
    """A key's budget (AGENTQ_KEY_BUDGETS); periods are UTC days and months."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens_per_day: int | None = Field(default=None, gt=0)
    usd_per_day: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    usd_per_month: float | None = Field(default=None, gt=0, allow_inf_nan=False)


class SentinelUrl(NamedTuple):
    """The parts of a `sentinel://` URL list."""

    sentinels: list[tuple[str, int]]
    db: int
    username: str | None
    password: str | None


def is_sentinel(url: str) -> bool:
    return url.startswith(SENTINEL_SCHEME)


def parse_sentinel_url(url: str, setting: str = "AGENTQ_REDIS_URL") -> SentinelUrl:
    """`sentinel://[:pw@]h1:26379;sentinel://h2:26379/0`; credentials from the first, as Celery."""
    chunks = [c.strip() for c in url.split(";")]
    sentinels: list[tuple[str, int]] = []
    for chunk in chunks:
        if not chunk.startswith(SENTINEL_SCHEME):
            raise ConfigError(
                setting,
                f"every part of a Sentinel URL starts with sentinel://, not {redact(chunk)!r}",
            )
        parts = urlsplit(chunk)
        try:
            port = parts.port or DEFAULT_SENTINEL_PORT
        except ValueError:
            raise ConfigError(setting, f"bad port in {redact(chunk)!r}") from None
        if not parts.hostname:
            raise ConfigError(setting, f"no host in {redact(chunk)!r}")
        sentinels.append((parts.hostname, port))
    first = urlsplit(chunks[0])
    db = first.path.strip("/")
    if db and not db.isdigit():
        raise ConfigError(setting, f"the database must be a number, not {db!r}")
    username, password = (unquote(c) if c else None for c in (first.username, first.password))
    return SentinelUrl(sentinels=sentinels, db=int(db or 0), username=username, password=password)


def parse_cluster_nodes(nodes: str) -> list[tuple[str, int]]:
    """`h1:7000,h2:7001` -> [(h1, 7000), (h2, 7001)]: the nodes a Cluster client starts from."""
    setting = "AGENTQ_REDIS_CLUSTER_NODES"
    out: list[tuple[str, int]] = []
    for part in (p.strip() for p in nodes.split(",")):
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(setting, f"{part!r} is not host:port (e.g. 10.0.0.5:7000)")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ConfigError(setting, "name at least one node, as host:port,host:port")
    return out


def redact(url: str) -> str:
    """The URL (or `;`-separated URL list) with every password replaced by `**`."""
    out = []
    for chunk in url.split(";"):
        scheme, sep, rest = chunk.partition("://")
        auth, at, host = rest.rpartition("@")
        out.append(f"{scheme}{sep}{auth.split(':', 1)[0]}:**{at}{host}" if at else chunk)
    return ";".join(out)


WEBHOOK_SECRET_PREFIX = "whsec_"


def webhook_key_bytes(secret: str) -> bytes:
    """The HMAC key of a `whsec_` secret; ValueError, never showing it, for anything else."""
    if not secret.startswith(WEBHOOK_SECRET_PREFIX):
        raise ValueError("must start with whsec_ (then the base64 of the key)")
    try:
        key = base64.b64decode(secret[len(WEBHOOK_SECRET_PREFIX) :], validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("the part after whsec_ is not base64") from None
    if not 24 <= len(key) <= 64:
        raise ValueError(f"the key is {len(key)} bytes; Standard Webhooks keys are 24 to 64")
    return key


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="AGENTQ_", extra="ignore", frozen=True)

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Redis for events, state, results, and (by default) the broker."""
    broker_url: str | None = None
    """Celery broker; defaults to `redis_url`. `amqp://` works too."""
    redis_sentinel_master: str | None = None
    """The master's name when `redis_url` or `broker_url` is `sentinel://h1:26379;...`."""
    redis_cluster_nodes: str | None = None
    """`host:port,...` of a Redis Cluster for turn state and events; kombu stays on `redis_url`."""
    redis_shards: int | None = Field(None, ge=1, le=1024)
    """Shards of the turn state (unset: 16 on a Cluster, else 1); names keys, so one per fleet."""
    redis_min_replicas_acked: int | None = Field(None, ge=0)
    """Replicas that must `WAIT`-ack a call's dispatch or settle, or a turn's end (Sentinel: 1)."""
    redis_wait_timeout_ms: int = Field(500, ge=1)
    """Longest `WAIT` for those replicas; past it the write stands, with a warning."""

    llm_base_url: str | None = None
    """OpenAI-compatible server; unset means the scripted demo model under `agentq dev`."""
    llm_api_key: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices("AGENTQ_LLM_API_KEY", "OPENAI_API_KEY", "llm_api_key"),
    )
    """Falls back to OPENAI_API_KEY; `get_secret_value()` reads it, a repr shows ***."""
    llm_model: str = "gpt-4o-mini"
    """Model name sent to the server."""
    llm_limits: str | None = None
    """Fleet-wide model limits (JSON keyed by model name; docs/capacity.md); unset: none."""
    llm_api: Literal["chat", "responses", "auto"] = "auto"
    """The model API; `auto`: Chat Completions until a 400 names /v1/responses (docs/models.md)."""
    llm_prices: Annotated[dict[str, ModelPrice], NoDecode] = Field(default_factory=dict)
    """Prices of models (JSON keyed by model name) for `cost_usd` and USD budgets; docs/spend.md."""
    key_budgets: Annotated[dict[str, KeyBudget], NoDecode] = Field(default_factory=dict)
    """Budgets of API keys (JSON keyed by key name); a key without one is unbounded."""
    budget_completion_tokens: int = Field(4096, ge=16)
    """The most a round under a budget may produce, reserved before it is sent."""
    usage_retention_days: int = Field(400, gt=0, le=3650)
    """How long the usage kept per key and day lives (it outlives the turns it counts)."""
    llm_queue_timeout_s: float = Field(600.0, gt=0)
    """How long a model round may wait for model capacity before its turn fails (ECAPACITY)."""
    llm_owner_weights: Annotated[dict[str, PositiveFloat], NoDecode] = Field(default_factory=dict)
    """Fair-share weights of API keys (by key name) in the model capacity queue; default 1."""
    llm_burst_s: float = Field(1.0, ge=0)
    """How far ahead of its steady pace a model's requests may run (GCRA's burst)."""
    llm_lease_ttl_s: float = Field(60.0, gt=0)
    """A stream slot (`streams`) whose llm worker stopped renewing it comes back after this."""
    llm_breaker_failures: int = Field(5, ge=1)
    """Failures in a row (5xx, refused connections, stalls) that take a deployment out."""
    llm_breaker_cooldown_s: float = Field(30.0, gt=0)
    """How long a failing deployment is skipped, fleet-wide, before one request probes it."""
    llm_background_every: int = Field(0, ge=0)
    """N: one background round in every N grants while both wait; 0: interactive ones first."""
    llm_max_retries: int = Field(2, ge=0, le=10)
    """Retries of a model round on a zero-chunk stall, 429 or 5xx."""
    llm_request_timeout_s: float = Field(60.0, gt=0)
    """Transport timeout of the HTTP request, and of each read while the watchdog is off."""

    tools: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Comma-separated modules imported for their @tool definitions."""
    tool_timeout_s: float = Field(120.0, ge=0, allow_inf_nan=False)
    """Default hard limit of a tool; 0 means no limit."""
    tool_budget_s: float = Field(10.0, ge=0, allow_inf_nan=False)
    """Default advisory budget of a tool."""
    tool_grace_s: float = Field(5.0, ge=0, allow_inf_nan=False)
    """After a call's hard limit, how long the turn waits before settling it as lost."""
    tool_queue_timeout_s: float = Field(300.0, gt=0)
    """How long a call may wait in the queue for a free worker before it is settled as lost."""
    abort_kill_grace_s: float = Field(2.0, ge=0)
    """Between SIGTERM and SIGKILL when an aborted turn's tasks are terminated."""
    progress_interval_s: float = Field(5.0, gt=0)
    """How often the worker running a call publishes tool_progress for it."""
    io_capacity: int = Field(2000, ge=1)
    """Calls or model streams one event-loop process holds; the broker keeps the rest."""
    llm_processes: int = Field(0, ge=0, le=64)
    """Event-loop processes of `agentq worker llm` (`--processes`); 0: one per CPU, at most 4."""
    io_processes: int = Field(0, ge=0, le=64)
    """Event-loop processes of `agentq worker io` (`--processes`); 0: one."""
    loop_lag_warn_ms: int = Field(100, ge=1)
    """An event loop blocked this long is logged, with the call that blocked it."""

    llm_delta_interval_ms: int = Field(250, ge=0)
    """How often at most a round's `llm_delta` is sent (the first chunk at once); 0: each chunk."""
    llm_quiet_delta_interval_ms: int = Field(2000, ge=0)
    """`llm_delta_interval_ms` for a turn nobody follows, until one does; 0: as if followed."""

    stream_idle_timeout_ms: int = 120_000
    """Longest silence between two model chunks; <= 0 disables the watchdog."""
    stream_duration_s: float = Field(60.0, gt=0)
    """Model streaming time allowed per round-trip, tool time excluded."""

    max_calls_per_turn: int = Field(50, ge=1)
    """Tool calls a turn may make before it is told to stop."""
    loop_threshold: int = Field(3, ge=2)
    """The same call (tool and arguments) this many times in a turn stops the loop."""
    max_result_bytes: int = Field(64 * 1024, ge=256)
    """A tool result longer than this is cut, with a marker."""
    max_arguments_bytes: int = Field(1024 * 1024, ge=256)
    """A tool call's arguments longer than this settle as an error."""
    max_prompt_bytes: int = Field(1024 * 1024, ge=256)
    """A prompt longer than this is refused."""

    turn_lease_s: float = Field(10.0, gt=0)
    """A stream worker's claim on a round, renewed every third of it; lapsed, it is resent."""
    step_lock_s: float = Field(10.0, gt=0)
    """Longest a step may hold its turn; a step that died mid-way is taken over after this."""
    sweep_interval_s: float = Field(0.25, gt=0)
    """Longest gap between a turn worker's sweeps (a sooner deadline gets one, 20 ms apart)."""
    health_file: str | None = None
    """A file a consuming worker touches every few seconds, for a container's healthcheck."""
    task_events: bool = False
    """Always send Celery task events (Flower turns them on itself); each costs 3 publishes."""
    log_format: Literal["text", "json"] = "text"
    """`json`: every log line of the workers and the gateway is one JSON object."""
    task_received_logs: bool = False
    """Celery's `Task ... received` INFO line for every task; off: it carries no turn id."""
    otel: bool | None = None
    """OpenTelemetry traces on or off; unset follows the standard `OTEL_*` variables."""
    otel_spans_file: str | None = None
    """For tests: every span as a JSON line in this file (tracing on, no collector)."""
    metrics_flush_s: float = Field(5.0, gt=0)
    """How often a process adds its step durations to the fleet's totals in Redis."""
    event_log_maxlen: int = Field(10_000, ge=100)
    """Approximate cap of each turn's replay log."""
    turn_retention_s: int = Field(
        7 * 24 * 3600,
        gt=0,
        validation_alias=AliasChoices(
            "AGENTQ_TURN_RETENTION_S", "AGENTQ_STATE_TTL_S", "turn_retention_s", "state_ttl_s"
        ),
    )
    """How long a finished turn's keys are kept; `AGENTQ_STATE_TTL_S`, its old name, works."""
    flower_url: str | None = None
    """Flower's address for the console's links; default: this host at `flower_port`."""

    approval_timeout_s: float = Field(120.0, gt=0)
    password_timeout_s: float = Field(120.0, gt=0)
    confirm_timeout_s: float = Field(60.0, gt=0)
    input_timeout_s: float = Field(300.0, gt=0)
    """How long a question for the user (`input`, `ask_user`) waits for its answer."""

    waitpoint_max_timeout_s: float = Field(7 * 24 * 3600.0, gt=0)
    """The longest `timeout_s` a tool's Waitpoint may ask for; a longer one settles `error`."""
    waitpoint_secret: SecretStr | None = None
    """HMAC key of waitpoint tokens; unset: a random key made once for the fleet, in Redis."""
    public_url: str = ""
    """Where outside systems reach the gateway: the prefix of a waitpoint's `callback_url`."""

    gateway_host: str = "127.0.0.1"
    gateway_port: int = Field(8000, ge=0, le=65535)
    flower_port: int = Field(5555, ge=0, le=65535)
    flower_basic_auth: SecretStr | None = None
    """`user:password` for Flower; required by the compose files."""

    api_keys: SecretStr | None = None
    """Gateway keys, `name=key` or `name=sha256:<hex>`, comma-separated; a turn belongs to its
    key's name. Unset (and no admin keys): no key needed, loopback only."""
    admin_keys: SecretStr | None = None
    """Like `api_keys`, for keys that read, abort and answer every turn and read /metrics."""
    metrics_token: SecretStr | None = None
    """A bearer token that reads /metrics only (for a Prometheus scraper), besides admin keys."""
    cors_origins: Annotated[list[str], NoDecode] = Field(default_factory=list)
    """Comma-separated origins whose pages may call the gateway; `*` is refused."""
    max_active_turns_per_key: int = Field(100, ge=1)
    """Running turns one key (or, without keys, one client address) may have at once."""
    start_rate_per_s: float = Field(10.0, gt=0)
    """Sustained turn starts per second allowed to one key (or client address)."""
    start_burst: int = Field(50, ge=1)
    """Turn starts one key may make at once before `start_rate_per_s` applies."""
    max_conversation_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    """A conversation's stored history plus a request's new messages may not pass this."""

    webhook_secret: SecretStr | None = None
    """Signs webhooks: `whsec_` + base64 of 24 to 64 bytes; unset: webhooks are refused."""
    webhook_urls: Annotated[dict[str, str], NoDecode] = Field(default_factory=dict)
    """Default webhook URL of a key's turns (JSON by key name); a turn's own one wins."""
    webhook_allow_private: bool = False
    """Deliver to private, loopback and link-local addresses (tests, private networks)."""
    webhook_allow_http: bool = False
    """Deliver to http:// URLs, not only https://."""
    webhook_timeout_s: float = Field(10.0, gt=0, le=60)
    """Bound of one delivery attempt (connect, send, first byte of the answer)."""
    webhook_retry_base_s: float = Field(5.0, gt=0)
    """Wait before the first retry; each next one waits twice as long (with jitter)."""
    webhook_retry_max_s: float = Field(3600.0, gt=0)
    """Longest wait between two attempts."""
    webhook_max_age_s: float = Field(24 * 3600.0, gt=0)
    """A delivery not accepted this long after it was queued fails for good."""
    webhook_sweep_interval_s: float = Field(1.0, gt=0)
    """How often a webhook worker looks for due retries and turns whose delivery was lost."""
    beat_max_interval_s: float = Field(5.0, gt=0)
    """Longest sleep of `agentq beat`; a second beat takes over five of these after one dies."""
    mcp_servers: str | None = None
    """MCP servers whose tools the models may call (JSON keyed by server name; docs/mcp.md)."""
    mcp_tools_ttl_s: float = Field(300.0, gt=0)
    """How long an MCP server's tool listing is used (`tools/list_changed` ends it at once)."""

    @field_validator(
        "llm_prices", "key_budgets", "llm_owner_weights", "webhook_urls", mode="before"
    )
    @classmethod
    def _json_object(cls, v: Any) -> Any:
        """A JSON setting's text as the object it holds (a dict passes as it is)."""
        if v is None or v == "":
            return {}
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as exc:
                raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(v, dict):
            raise ValueError("must be a JSON object keyed by name")
        return v

    @field_validator("webhook_secret")
    @classmethod
    def _whsec(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            webhook_key_bytes(v.get_secret_value())
        return v

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str) -> str:
        if not v.startswith(REDIS_SCHEMES):
            raise ValueError("must be a redis://, rediss://, unix:// or sentinel:// URL")
        return v

    @field_validator("broker_url")
    @classmethod
    def _broker_scheme(cls, v: str | None) -> str | None:
        schemes = ("redis://", "rediss://", "sentinel://", "amqp://", "amqps://", "pyamqp://")
        if v and not v.startswith(schemes):
            raise ValueError("must be a redis://, sentinel:// or amqp:// URL")
        return v

    @field_validator("tools", "cors_origins", mode="before")
    @classmethod
    def _comma_separated(cls, v: Any) -> Any:
        return [i.strip() for i in v.split(",") if i.strip()] if isinstance(v, str) else v

    @field_validator("cors_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        for origin in v:
            scheme, sep, rest = origin.partition("://")
            if scheme not in ("http", "https") or not sep or not rest or "/" in rest:
                raise ValueError(f"{origin!r} is not an origin like https://app.example.com")
        return [o.lower() for o in v]

    @model_validator(mode="after")
    def _redis_topology(self) -> Settings:
        if self.redis_cluster_nodes:
            parse_cluster_nodes(self.redis_cluster_nodes)
            if self.redis_min_replicas_acked:
                # WAIT counts the writes of its own connection, and a Cluster client
                # spreads a turn's writes over pooled connections.
                raise ConfigError(
                    "AGENTQ_REDIS_MIN_REPLICAS_ACKED",
                    "a Redis Cluster takes no WAIT in this version; leave it unset "
                    "(see docs/operations.md, 'One Redis or a Cluster')",
                )
        for setting, url in (
            ("AGENTQ_REDIS_URL", self.redis_url),
            ("AGENTQ_BROKER_URL", self.broker_url),
        ):
            if url and is_sentinel(url):
                parse_sentinel_url(url, setting)
                if not self.redis_sentinel_master:
                    raise ConfigError(
                        "AGENTQ_REDIS_SENTINEL_MASTER",
                        f"{setting} is a sentinel:// URL: set the name of its master",
                    )
        return self

    @property
    def shard_count(self) -> int:
        """`redis_shards` (never 0), or its default: 16 on a Cluster, else 1."""
        return self.redis_shards or (k.DEFAULT_CLUSTER_SHARDS if self.redis_cluster_nodes else 1)

    @property
    def replicas_acked(self) -> int:
        """`redis_min_replicas_acked`, or its default for the kind of Redis URL."""
        if self.redis_min_replicas_acked is not None:
            return self.redis_min_replicas_acked
        return int(is_sentinel(self.redis_url) and not self.redis_cluster_nodes)

    @property
    def broker(self) -> str:
        return self.broker_url or self.redis_url


def load_settings(**overrides: object) -> Settings:
    """Read settings from the environment, turning validation errors into a ConfigError."""
    try:
        return Settings(**overrides)  # type: ignore[arg-type]
    except ValidationError as exc:
        path, msg = field_errors(exc, "settings")[0]
        field, _, entry = path.partition(".")
        name = field.upper()
        msg = f"{entry}: {msg}" if entry else msg
        raise ConfigError(name if name.startswith("AGENTQ_") else f"AGENTQ_{name}", msg) from None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once."""
    return load_settings()
