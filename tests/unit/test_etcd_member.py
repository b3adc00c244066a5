"""The etcd command line of one member of a several-member etcd, and the request that runs it."""

from __future__ import annotations

import io
import json
import sys

import pytest

from elasticps.coord.etcd_member import etcd_command
from elasticps.launcher import remote

pytestmark = pytest.mark.timeout(30)

CLUSTER = "etcd-0=http://10.0.0.1:2380,etcd-1=http://10.0.0.2:2380,etcd-2=http://10.0.0.3:2380"


def test_a_member_listens_and_advertises_on_its_address() -> None:
    argv = etcd_command(
        name="etcd-1", data_dir="/d/etcd-1", address="10.0.0.2", client_port=2379,
        peer_port=2380, initial_cluster=CLUSTER,
    )  # fmt: skip
    flags = dict(zip(argv[1::2], argv[2::2], strict=False))
    assert flags["--name"] == "etcd-1"
    assert flags["--listen-client-urls"] == "http://10.0.0.2:2379"
    assert flags["--advertise-client-urls"] == "http://10.0.0.2:2379"
    assert flags["--listen-peer-urls"] == "http://10.0.0.2:2380"
    assert flags["--initial-cluster"] == CLUSTER
    assert flags["--initial-cluster-state"] == "new"


def test_a_member_not_in_the_cluster_is_refused() -> None:
    with pytest.raises(ValueError, match="not in the initial cluster"):
        etcd_command(
            name="etcd-9", data_dir="/d", address="10.0.0.2", client_port=2379,
            peer_port=2380, initial_cluster=CLUSTER,
        )  # fmt: skip


def test_a_request_for_another_module_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    request = json.dumps({"run": ["x"], "module": "os"}) + "\n"
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(request.encode())))
    assert remote.main() == 2
    assert "module must be one of elasticps, elasticps.coord.etcd_member" in capsys.readouterr().out
