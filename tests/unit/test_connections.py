"""Sentinel URLs and Cluster nodes: parsing, validation naming the setting, redaction,
failover errors."""

from __future__ import annotations

import pytest
import redis
from redis._parsers.base import BaseParser

from agentq.config import load_settings, parse_cluster_nodes, parse_sentinel_url, redact
from agentq.errors import ConfigError
from agentq.fleet.app import create_app
from agentq.fleet.connections import MasterChangedError, NoReplicasError, redis_client

URL = "sentinel://:pw@h1:26379;sentinel://h2;sentinel://h3:26381/2"


def test_a_sentinel_url_list_is_parsed_as_celery_does() -> None:
    parsed = parse_sentinel_url(URL)
    assert parsed.sentinels == [("h1", 26379), ("h2", 26379), ("h3", 26381)]
    assert parsed.db == 0  # from the first part, like Celery
    assert parsed.password == "pw"
    assert parse_sentinel_url("sentinel://h1/3").db == 3


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("sentinel://h1;redis://h2", "starts with sentinel://"),
        ("sentinel://h1:notaport", "bad port"),
        ("sentinel://h1/zero", "must be a number"),
    ],
)
def test_bad_sentinel_urls_name_the_setting(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        load_settings(redis_url=url, redis_sentinel_master="m")
    assert info.value.setting == "AGENTQ_REDIS_URL"


def test_a_sentinel_url_without_its_master_name_fails_naming_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(redis_url="sentinel://h1:26379/0")
    assert info.value.setting == "AGENTQ_REDIS_SENTINEL_MASTER"
    with pytest.raises(ConfigError) as info:
        load_settings(broker_url="sentinel://h1:26379")
    assert "AGENTQ_BROKER_URL" in str(info.value)
    with pytest.raises(ConfigError):
        redis_client("sentinel://h1:26379", None)


def test_celery_gets_the_master_name_for_broker_and_backend() -> None:
    s = load_settings(redis_url=URL, redis_sentinel_master="agentq")
    app = create_app(s)
    assert app.conf.broker_transport_options["master_name"] == "agentq"
    assert app.conf.result_backend_transport_options["master_name"] == "agentq"
    assert s.replicas_acked == 1
    assert load_settings(redis_url="redis://h:6379/0").replicas_acked == 0
    assert (
        load_settings(
            redis_url=URL, redis_sentinel_master="m", redis_min_replicas_acked=0
        ).replicas_acked
        == 0
    )


def test_redact_hides_every_password_of_a_list() -> None:
    assert redact(URL) == "sentinel://:**@h1:26379;sentinel://h2;sentinel://h3:26381/2"
    assert redact("sentinel://u:a@h1;sentinel://u:b@h2") == "sentinel://u:**@h1;sentinel://u:**@h2"


@pytest.mark.parametrize(
    ("reply", "kind"),
    [
        (
            "UNBLOCKED force unblock from blocking operation, instance state changed",
            MasterChangedError,
        ),
        (
            "Error running script (call to f_1): @user_script:7: -READONLY You can't write",
            redis.ReadOnlyError,
        ),
        ("NOREPLICAS Not enough good replicas to write.", NoReplicasError),
        ("ERR WAIT cannot be used with replica instances.", redis.ReadOnlyError),
        ("READONLY You can't write against a read only replica.", redis.ReadOnlyError),
        ("ERR unknown command", redis.ResponseError),
    ],
)
def test_failover_answers_become_errors_that_reconnect(reply: str, kind: type) -> None:
    err = BaseParser.parse_error(reply)
    assert type(err) is kind, err
    if kind in (MasterChangedError, NoReplicasError):
        assert isinstance(err, redis.ConnectionError)


def test_cluster_nodes_are_host_port_pairs_and_bad_ones_name_the_setting() -> None:
    assert parse_cluster_nodes("10.0.0.5:7000, r2:7001,[::1]:7002") == [
        ("10.0.0.5", 7000),
        ("r2", 7001),
        ("::1", 7002),
    ]
    for bad in ("r1", "r1:", ":7000", "r1:70000", "r1:7000,r2:x", " , "):
        with pytest.raises(ConfigError) as info:
            load_settings(redis_cluster_nodes=bad)
        assert info.value.setting == "AGENTQ_REDIS_CLUSTER_NODES", bad
