"""Every Redis client agentq makes: from one URL, plain Redis or a master behind Sentinel
(Celery's `sentinel://h1:26379;sentinel://h2:26379/0` with a master name), or for turn
state and events a Redis Cluster (`cluster_client`).

A Sentinel client asks for the master on every new connection and drops one to a demoted
master (`READONLY`), so a failover costs the commands in flight a reconnect, no more.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, cast

import redis
import redis.asyncio as aioredis
from redis._parsers.base import BaseParser
from redis.asyncio.retry import Retry as AsyncRetry
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ClusterDownError, TryAgainError
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection

from agentq.config import REDIS_SCHEMES, is_sentinel, parse_cluster_nodes, parse_sentinel_url
from agentq.errors import REDIS_ERRORS, ConfigError

REDIS_MAX_CONNECTIONS = 10_000
"""Redis's own default `maxclients`."""
REDIS_RETRIES = 20
"""With the backoff below, about 16 s of reconnect attempts before a command fails: long
enough for a restart or a Sentinel failover (a few seconds with default timeouts)."""


class NoReplicasError(redis.ConnectionError):
    """`NOREPLICAS`: behind Sentinel, a master whose replica was just promoted; the write is
    retried on the new master like a lost connection."""


class MasterChangedError(redis.ConnectionError):
    """`UNBLOCKED ... instance state changed`: a blocked command (a broker's BRPOP, a
    WAIT) on a master that was just demoted; the caller reconnects to the new master."""


_parse_error = BaseParser.parse_error.__func__  # type: ignore[attr-defined]


def _parse_failover_errors(cls: type[BaseParser], response: str) -> redis.RedisError:
    """redis-py's error parsing, plus the answers of a master being replaced: a script's
    write on a demoted master (`... -READONLY`) becomes a ReadOnlyError, so the Sentinel
    connection reconnects; Celery's BRPOP's `UNBLOCKED` would otherwise stop the worker."""
    if response.startswith("UNBLOCKED"):
        return MasterChangedError(response)
    if response.startswith(("ERR Error running script", "Error running script")):
        if "-READONLY " in response:
            return redis.ReadOnlyError(response)
        if "-NOREPLICAS " in response:
            return NoReplicasError(response)
    if response.startswith(("ERR WAIT cannot be used with replica", "WAIT cannot be used")):
        return redis.ReadOnlyError(response)
    return cast(redis.RedisError, _parse_error(cls, response))


# Older redis-py (5, 6) reconnects through `connect`, which asks Sentinel already.
_connect_check_health = getattr(SentinelManagedConnection, "connect_check_health", None)


def _connect_to_master(
    self: SentinelManagedConnection, check_health: bool = True, retry_socket_connect: bool = True
) -> None:
    """Reconnect to the master Sentinel names now: redis-py 8's `connect_check_health`
    skips `connect`'s lookup, so every retry after a failover went to the demoted master."""
    if not self._sock and self.connection_pool.is_master:
        self.host, self.port = self.connection_pool.get_master_address()
    assert _connect_check_health is not None
    _connect_check_health(self, check_health, retry_socket_connect)


# Process-wide: every client (ours, kombu's, Celery's backend) parses errors here and
# reconnects through Sentinel.
if _connect_check_health is not None:
    SentinelManagedConnection.connect_check_health = _connect_to_master  # type: ignore[method-assign,assignment]
BaseParser.EXCEPTION_CLASSES["NOREPLICAS"] = NoReplicasError
BaseParser.parse_error = classmethod(_parse_failover_errors)  # type: ignore[method-assign,assignment]

RETRY_ON = [redis.ConnectionError, redis.TimeoutError]
"""READONLY (as SentinelManagedConnection raises it) and NOREPLICAS are ConnectionErrors
too, so both are retried on the new master."""


def _backoff() -> ExponentialBackoff:
    """The wait between reconnect attempts of every client: 50 ms doubling up to 1 s."""
    return ExponentialBackoff(cap=1.0, base=0.05)


def redis_client(
    url: str,
    master_name: str | None = None,
    *,
    retries: int = REDIS_RETRIES,
    **kwargs: Any,
) -> redis.Redis:
    """A client for `url` (for a Sentinel URL, of `master_name`'s master) whose `retries`
    ride out a restart or failover; `retries=0` is for probes that must answer quickly."""
    return cast(redis.Redis, _client(False, url, master_name, retries, kwargs))


def _client(aio: bool, url: str, master_name: str | None, retries: int, kwargs: Any) -> Any:
    """`redis_client`, sync or asyncio; sentinels are asked with its timeouts, or 2 s."""
    retry = (AsyncRetry if aio else Retry)(_backoff(), max(retries, 0))
    options = {"retry": retry, "retry_on_error": RETRY_ON if retries > 0 else [], **kwargs}
    if not is_sentinel(url):
        return (aioredis.Redis if aio else redis.Redis).from_url(url, **options)
    if not master_name:
        raise ConfigError(
            "AGENTQ_REDIS_SENTINEL_MASTER", "a sentinel:// URL needs the master's name"
        )
    parsed = parse_sentinel_url(url)
    sentinel = (AsyncSentinel if aio else Sentinel)(
        parsed.sentinels,
        sentinel_kwargs={
            name: options.get(name) or 2.0 for name in ("socket_timeout", "socket_connect_timeout")
        },
        db=parsed.db,
        username=parsed.username,
        password=parsed.password,
        **options,
    )
    return sentinel.master_for(master_name)


CLUSTER_REINITIALIZE_STEPS = 1
"""A MOVED answer refreshes the client's slot map at once: after a failover the next
command goes to the promoted replica, not again to the lost master."""


class BackoffCluster(RedisCluster):
    """A RedisCluster whose commands outlast a failover: redis-py spends its retries in
    milliseconds, while a replica takes a node timeout or two to be promoted, so here each
    retry waits first, with `redis_client`'s backoff."""

    def __init__(self, *args: Any, retries: int = REDIS_RETRIES, **kwargs: Any) -> None:
        # Set first: the base class sends commands while it starts.
        self._backoff = Retry(
            _backoff(), retries, supported_errors=(*RETRY_ON, ClusterDownError, TryAgainError)
        )
        super().__init__(*args, **kwargs)

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return self._backoff.call_with_retry(
            lambda: super(BackoffCluster, self).execute_command(*args, **kwargs),  # type: ignore[no-untyped-call]
            lambda _exc: None,
        )


def cluster_client(nodes: str, *, retries: int = REDIS_RETRIES, **kwargs: Any) -> RedisCluster:
    """A BackoffCluster for the Cluster some of whose nodes `nodes` names (`host:port,...`)."""
    startup = [ClusterNode(host, port) for host, port in parse_cluster_nodes(nodes)]  # type: ignore[no-untyped-call]
    return BackoffCluster(
        startup_nodes=startup,
        retries=retries,
        # redis-py's own retries go at once (8.2 waits by this backoff): the waits are
        # BackoffCluster's, or each of its retries would wait through all of these.
        retry=Retry(NoBackoff(), max(retries, 0)),
        reinitialize_steps=CLUSTER_REINITIALIZE_STEPS,
        **kwargs,
    )


def async_cluster_client(nodes: str) -> aioredis.RedisCluster:
    """The asyncio twin of `cluster_client`."""
    startup = [aioredis.cluster.ClusterNode(h, p) for h, p in parse_cluster_nodes(nodes)]
    return aioredis.RedisCluster(
        startup_nodes=startup,
        retry=AsyncRetry(_backoff(), REDIS_RETRIES),
        reinitialize_steps=CLUSTER_REINITIALIZE_STEPS,
    )


def async_node_client(nodes: str, attempt: int) -> aioredis.Redis:
    """A plain asyncio client of a Cluster's node (the next on each `attempt`): a plain
    channel's messages reach every node's subscribers."""
    startup = parse_cluster_nodes(nodes)
    host, port = startup[attempt % len(startup)]
    return aioredis.Redis(host=host, port=port)


def async_redis_client(url: str, master_name: str | None = None, **kwargs: Any) -> aioredis.Redis:
    """The asyncio twin of `redis_client`, with the same retries."""
    return cast(aioredis.Redis, _client(True, url, master_name, REDIS_RETRIES, kwargs))


def transport_options(url: str, master_name: str | None) -> dict[str, Any]:
    """What kombu's and Celery's Sentinel transports need besides the URL."""
    if not is_sentinel(url):
        return {}
    return {
        "master_name": master_name,
        "sentinel_kwargs": {"socket_timeout": 2.0, "socket_connect_timeout": 2.0},
    }


def probe_cluster(nodes: str, timeout_s: float = 3.0) -> str | None:
    """None when the Cluster `nodes` names answers; else why not (as `probe`)."""
    return _ping(partial(cluster_client, nodes), timeout_s)


def probe(url: str, master_name: str | None = None, timeout_s: float = 3.0) -> str | None:
    """None when the Redis at `url` (or Sentinel's master, or a kombu broker) answers; else
    why not, `refused: ...` for one that answered but will not serve us, `bad URL: ...`."""
    if url.startswith(REDIS_SCHEMES):
        return _ping(partial(redis_client, url, master_name), timeout_s)
    from kombu import Connection  # type: ignore[attr-defined]

    try:
        with Connection(url, connect_timeout=timeout_s) as conn:  # type: ignore[no-untyped-call]
            conn.ensure_connection(max_retries=1, interval_start=0, timeout=timeout_s)
    except Exception as exc:
        return str(exc) or type(exc).__name__
    return None


def _ping(connect: Callable[..., Any], timeout_s: float) -> str | None:
    client = None
    try:
        client = connect(retries=0, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        client.ping()
    except ValueError as exc:
        return f"bad URL: {exc}"
    except (redis.AuthenticationError, redis.ResponseError) as exc:
        return f"refused: {exc}"
    except (*REDIS_ERRORS, OSError) as exc:  # type: ignore[misc]
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    finally:
        if client is not None:
            client.close()
    return None
