"""Pure parts of elasticps.coord: endpoint parsing, server config, the etcd binary, keys.

Nothing here starts etcd; see tests/integration/test_coord_store.py for that.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elasticps.coord.etcd_server import EtcdServer, EtcdServerConfig, etcd_binary, parse_endpoint
from elasticps.coord.store import Keys
from elasticps.errors import ConfigError, CoordinationError

# --- parse_endpoint ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("127.0.0.1:2379", ("127.0.0.1", 2379)),
        ("http://127.0.0.1:2379", ("127.0.0.1", 2379)),
        ("http://etcd.example:2379/", ("etcd.example", 2379)),
        ("  localhost:1  ", ("localhost", 1)),
        ("[::1]:2379", ("::1", 2379)),
        ("https://etcd.example:2379", ("etcd.example", 2379)),
    ],
)
def test_parse_endpoint_accepts_host_port(endpoint: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(endpoint) == expected


@pytest.mark.parametrize(
    "endpoint",
    ["", "127.0.0.1", ":2379", "host:", "host:port", "host:0", "host:65536", "::1:2379",
     "ftp://host:2379", "host/x:1"],
)  # fmt: skip
def test_parse_endpoint_rejects_malformed_endpoints(endpoint: str) -> None:
    with pytest.raises(ConfigError):
        parse_endpoint(endpoint)


# --- EtcdServerConfig and EtcdServer before start ----------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"client_port": -1},
        {"client_port": 65536},
        {"client_port": 0, "peer_port": 70000},
        {"client_port": 2379, "peer_port": 2379},
        {"client_port": 0, "host": ""},
        {"client_port": 0, "startup_timeout_s": 0.0},
    ],
)
def test_server_config_rejects_invalid_values(kwargs: dict[str, object], tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        EtcdServerConfig(data_dir=tmp_path, **kwargs)  # type: ignore[arg-type]


def test_picked_port_is_unknown_before_start(tmp_path: Path) -> None:
    server = EtcdServer(EtcdServerConfig(data_dir=tmp_path, client_port=0))
    assert server.pid is None
    assert not server.alive()
    with pytest.raises(CoordinationError, match="before start"):
        _ = server.endpoint
    server.stop()  # stopping a server that never ran is a no-op
    server.kill()


def test_requested_port_is_known_before_start(tmp_path: Path) -> None:
    server = EtcdServer(EtcdServerConfig(data_dir=tmp_path, client_port=12379))
    assert server.endpoint == "127.0.0.1:12379"


def test_etcd_binary_is_shipped_and_executable() -> None:
    path = etcd_binary()
    assert path.is_file()
    assert os.access(path, os.X_OK)


# --- Keys ----------------------------------------------------------------------------


def test_keys_follow_the_documented_layout() -> None:
    keys = Keys("job-1.a_b")
    assert keys.root == "/elasticps/job-1.a_b/"
    assert keys.master_lock == "/elasticps/job-1.a_b/master/lock"
    assert keys.trainer("t0") == "/elasticps/job-1.a_b/trainers/t0"
    assert keys.trainer("t0").startswith(keys.trainers_prefix)
    assert keys.ps_desired == "/elasticps/job-1.a_b/ps_desired"
    assert keys.ps(3) == "/elasticps/job-1.a_b/ps/3"
    assert keys.ps(3).startswith(keys.ps_prefix)
    assert not keys.ps_desired.startswith(keys.ps_prefix)
    assert keys.job_state == "/elasticps/job-1.a_b/job/state"


def test_numeric_keys_sort_in_numeric_order() -> None:
    keys = Keys("j")
    assert keys.task(7) == "/elasticps/j/tasks/0000000007"
    assert keys.task(9) < keys.task(10)
    assert keys.checkpoint(9) < keys.checkpoint(10)
    assert keys.checkpoint(10).startswith(keys.checkpoints_prefix)


@pytest.mark.parametrize("job", ["", "a/b", "a b", "..", "jöb", "a:b"])
def test_keys_reject_unsafe_job_names(job: str) -> None:
    with pytest.raises(ConfigError):
        Keys(job)


def test_keys_reject_unsafe_ids() -> None:
    keys = Keys("j")
    with pytest.raises(ConfigError):
        keys.trainer("a/b")
    with pytest.raises(ConfigError):
        keys.ps(-1)
    with pytest.raises(ConfigError):
        keys.task(-1)
    with pytest.raises(ConfigError):
        keys.checkpoint(-1)


def test_parse_endpoints_splits_a_cluster_and_drops_duplicates() -> None:
    from elasticps.coord.client import parse_endpoints

    assert parse_endpoints("10.0.0.1:2379,http://10.0.0.2:2379, [::1]:2379,10.0.0.1:2379") == [
        ("10.0.0.1", 2379),
        ("10.0.0.2", 2379),
        ("::1", 2379),
    ]


def test_parse_endpoints_refuses_an_empty_member() -> None:
    from elasticps.coord.client import parse_endpoints
    from elasticps.errors import ConfigError

    with pytest.raises(ConfigError, match="empty endpoint"):
        parse_endpoints("10.0.0.1:2379,,10.0.0.2:2379")
