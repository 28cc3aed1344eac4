"""The installed kombu still has every private member of its Redis channel that
agentq.fleet.kombu_redis wraps or calls: an upgrade that changes one fails here."""

from __future__ import annotations

from typing import Any

import kombu
import pytest
from kombu.transport import redis as kombu_redis

from agentq.errors import IncompatibleDependency
from agentq.fleet.kombu_redis import REACHED, READ, check_channel, patch_redis_transport


def test_the_installed_kombu_has_what_agentq_reaches_for() -> None:
    check_channel(kombu_redis.Channel)
    check_channel(kombu_redis.SentinelChannel)


def test_the_app_wraps_the_channel_once() -> None:
    patch_redis_transport()
    wrapped = {name: getattr(kombu_redis.Channel, name) for name in REACHED}
    patch_redis_transport()
    assert kombu_redis.Channel.agentq_patched is True  # type: ignore[attr-defined]
    assert {name: getattr(kombu_redis.Channel, name) for name in REACHED} == wrapped


@pytest.mark.parametrize("name", sorted(REACHED))
def test_a_kombu_without_a_member_is_refused_by_name(name: str) -> None:
    members: dict[str, Any] = {n: getattr(kombu_redis.Channel, n) for n in (*REACHED, *READ)}
    del members[name]
    with pytest.raises(IncompatibleDependency) as info:
        check_channel(type("Channel", (), members))
    assert info.value.package == "kombu" and info.value.version == kombu.__version__
    assert f"Channel.{name} is gone" in str(info.value)


def test_a_member_that_takes_other_parameters_is_refused() -> None:
    members: dict[str, Any] = {n: getattr(kombu_redis.Channel, n) for n in (*REACHED, *READ)}
    members["_restore"] = lambda self, payload, leftmost=False: None
    with pytest.raises(IncompatibleDependency, match=r"Channel\._restore\('self', 'payload'"):
        check_channel(type("Channel", (), members))
