"""A publish the broker refuses becomes BrokerUnavailable, whatever the transport raised."""

from __future__ import annotations

import pytest

from agentq.config import Settings
from agentq.errors import AgentqError, BrokerUnavailable
from agentq.fleet.app import create_app
from agentq.fleet.broker import revoke, send_step
from agentq.local.redis_server import find_free_port


@pytest.mark.parametrize("scheme", ["redis", "amqp"])
def test_a_refused_publish_is_broker_unavailable(scheme: str) -> None:
    port = find_free_port()  # nothing listens there
    url = f"redis://127.0.0.1:{port}/0" if scheme == "redis" else f"amqp://u:p@127.0.0.1:{port}//"
    app = create_app(Settings(redis_url=f"redis://127.0.0.1:{port}/0", broker_url=url))
    app.conf.broker_connection_timeout = 0.5
    with pytest.raises(BrokerUnavailable) as caught:
        send_step(app, "t1")
    assert isinstance(caught.value, AgentqError)
    assert caught.value.what == "the step of turn t1"
    assert "refused" in caught.value.error.lower()
    # A revoke that cannot be sent is not an error: the call is settled already.
    assert revoke(app, ["t1.c1"], terminate=True) is False


def test_a_failover_refusal_is_an_absent_broker() -> None:
    # A Redis broker mid-failover answers READONLY or MASTERDOWN, both ResponseErrors: the
    # step is left to the turn's wakeup, as for a broker that does not answer.
    import redis

    from agentq.fleet.broker import _broker_errors

    errors = _broker_errors(create_app(Settings(redis_url="redis://127.0.0.1:1/0")))
    for failover in (redis.ReadOnlyError, redis.exceptions.MasterDownError, redis.ConnectionError):
        assert any(issubclass(failover, e) for e in errors), failover
