"""The etcd command line of one member of a several-member etcd, and the request that runs it."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

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


def test_a_member_with_a_certificate_takes_tls_clients_and_peers_only() -> None:
    tls = (Path("/r/ca.pem"), Path("/r/cert.pem"), Path("/r/key.pem"))
    argv = etcd_command(
        name="etcd-1", data_dir="/d/etcd-1", address="10.0.0.2", client_port=2379,
        peer_port=2380, initial_cluster=CLUSTER.replace("http:", "https:"), tls=tls,
    )  # fmt: skip

    def flag(name: str) -> str:
        return argv[argv.index(name) + 1]

    assert flag("--listen-client-urls") == "https://10.0.0.2:2379"
    assert flag("--listen-peer-urls") == "https://10.0.0.2:2380"
    assert flag("--trusted-ca-file") == flag("--peer-trusted-ca-file") == "/r/ca.pem"
    assert flag("--cert-file") == flag("--peer-cert-file") == "/r/cert.pem"
    assert "--client-cert-auth" in argv and "--peer-client-cert-auth" in argv


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


def test_a_member_with_half_a_certificate_is_refused_not_served_plain(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from elasticps.coord import etcd_member

    monkeypatch.setenv("ELASTICPS_HOST", "10.0.0.1")
    monkeypatch.setenv(etcd_member.TLS_CACERT_ENV, str(tmp_path / "ca.pem"))
    monkeypatch.setenv(etcd_member.TLS_CERT_ENV, str(tmp_path / "cert.pem"))
    monkeypatch.delenv(etcd_member.TLS_KEY_ENV, raising=False)
    argv = ["--name", "m0", "--data-dir", str(tmp_path / "d"), "--client-port", "2379",
            "--peer-port", "2380", "--initial-cluster", "m0=https://10.0.0.1:2380"]  # fmt: skip
    assert etcd_member.main(argv) == 2
    assert f"{etcd_member.TLS_KEY_ENV} not set" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
