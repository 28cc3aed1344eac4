"""The embedded Redis for tests; it lives in agentq.local, where ``agentq dev`` uses it."""

from agentq.local.redis_server import (
    LOCAL_HOSTS,
    RedisServer,
    RedisServerError,
    ensure_redis,
    find_free_port,
    find_redis_server,
    ping,
    port_is_free,
)

__all__ = [
    "LOCAL_HOSTS",
    "RedisServer",
    "RedisServerError",
    "ensure_redis",
    "find_free_port",
    "find_redis_server",
    "ping",
    "port_is_free",
]
