"""A JobStore given every member of a three-member etcd keeps working when its member dies."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticps.coord.etcd_server import _TUNING_FLAGS, etcd_binary
from elasticps.coord.store import JobStore
from elasticps.errors import CoordinationError
from elasticps.netutil import free_port
from elasticps.testing import wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], str]]]:
    """Three etcd members on loopback: name -> (process, client endpoint)."""
    ports = {f"m{i}": (free_port(), free_port()) for i in range(3)}
    initial = ",".join(f"{n}=http://127.0.0.1:{peer}" for n, (_, peer) in ports.items())
    members = {}
    try:
        for name, (client, peer) in ports.items():
            log = (tmp_path / f"{name}.log").open("wb")
            proc = subprocess.Popen(
                [str(etcd_binary()), "--name", name, "--data-dir", str(tmp_path / name),
                 "--listen-client-urls", f"http://127.0.0.1:{client}",
                 "--advertise-client-urls", f"http://127.0.0.1:{client}",
                 "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--log-level", "warn", *_TUNING_FLAGS],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            members[name] = (proc, f"127.0.0.1:{client}")
        yield members
    finally:
        for proc, _ in members.values():
            proc.kill()
            proc.wait(timeout=10)


def _put(store: JobStore, key: str, value: str) -> bool:
    try:
        store.put_json(key, {"v": value})
        return True
    except CoordinationError:
        return False  # the caller's retry goes to another member


def test_store_fails_over_to_another_member(
    cluster: dict[str, tuple[subprocess.Popen[bytes], str]],
) -> None:
    endpoints = ",".join(endpoint for _, endpoint in cluster.values())
    with JobStore(endpoints, "failover", timeout_s=10.0) as store:
        wait_for(lambda: _put(store, "/elasticps/failover/k", "before"), "a quorum", timeout_s=60)
        used = store._client.endpoint_in_use.netloc  # the member this client talks to
        victim = next(proc for proc, endpoint in cluster.values() if endpoint == used)
        victim.kill()
        victim.wait(timeout=10)
        wait_for(lambda: _put(store, "/elasticps/failover/k", "after"), "failover", timeout_s=30)
        assert store._client.endpoint_in_use.netloc != used
        assert store.get_json("/elasticps/failover/k") == {"v": "after"}
    # A new store starts on a live member although one of those listed is dead.
    with JobStore(endpoints, "failover", timeout_s=10.0) as store:
        assert store.get_json("/elasticps/failover/k") == {"v": "after"}
