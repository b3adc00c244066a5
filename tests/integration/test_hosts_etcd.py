"""``--etcd-replicas 3``: the job's etcd as three members on three namespace hosts.

The host that runs the etcd leader dies mid-job (its link set down, every
process SIGKILLed): the other two members keep a quorum, every client of the
job fails over to them, and the job finishes with exit 0 and every counter of
the audit model exact. Skipped where network namespaces cannot be made.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticps.coord.client import connect
from elasticps.testing import kill_leftovers, wait_for
from elasticps.testing.audit import check_run, train_args, write_dataset
from elasticps.testing.hosts import NamespaceHosts, unavailable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

WHY_NOT = unavailable()
if WHY_NOT is not None:
    pytestmark.append(pytest.mark.skip(reason=WHY_NOT))

RECORDS = 4000
JOB_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def hosts() -> Iterator[NamespaceHosts]:
    with NamespaceHosts(3) as made:
        yield made


def _leader_host(endpoints: str, hosts: NamespaceHosts) -> str | None:
    """The namespace host whose etcd member leads, or None while there is no leader."""
    try:
        client = connect(endpoints, timeout_s=3.0)
    except Exception:
        return None
    try:
        leader = client.status().leader
        if leader is None:
            return None
        url = leader.client_urls[0]
    except Exception:
        return None
    finally:
        client.close()
    return next((n for n, h in hosts.hosts.items() if f"//{h.address}:" in url), None)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_losing_the_etcd_leader_host_costs_no_update(
    hosts: NamespaceHosts, tmp_path: Path, mode: str
) -> None:
    audit = tmp_path / "audit"
    write_dataset(audit, RECORDS)
    host_file = tmp_path / "hosts.txt"
    host_file.write_text("".join(f"{name} slots=4\n" for name in hosts.hosts))
    out = tmp_path / "run"
    epochs = 100
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticps", "train", *train_args(audit, out, mode, epochs),
         "--hosts", str(host_file), "--ssh-config", str(hosts.ssh_config),
         "--etcd-replicas", "3", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    victim = None
    try:
        wait_for(
            lambda: any((out / "ps-checkpoints").glob("ps-*/shard-*.safetensors")),
            "a first shard checkpoint",
            timeout_s=120,
            interval_s=0.1,
        )
        endpoints = json.loads((out / "run.json").read_text())["etcd"]
        assert endpoints.count(",") == 2, endpoints  # three members
        found: list[str] = []
        wait_for(
            lambda: bool(found.append(_leader_host(endpoints, hosts) or "") or found[-1]),
            "an etcd leader",
            timeout_s=30,
        )
        victim = found[-1]
        hosts.cut_link(victim)
        assert hosts.kill_host(victim)
        stdout, stderr = proc.communicate(timeout=JOB_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        kill_leftovers(out / "pids.json")
        if victim is not None:
            hosts.restore_link(victim)
            hosts.revive(victim)
    assert proc.returncode == 0, stderr[-4000:]
    line = json.loads(stdout.strip().splitlines()[-1])
    assert line["exactly_once"] is True, line
    assert line["samples_trained"] == RECORDS * epochs, line
    result = check_run(out)
    assert result.exactly_once, result.as_dict()
    assert result.exact == RECORDS
    # The members were stopped and their data removed on the hosts left.
    for name in hosts.hosts:
        if name != victim:
            wait_for(
                lambda name=name: "etcd" not in " ".join(_cmdlines(hosts, name)),
                f"no etcd member left on {name}",
                timeout_s=30,
            )


def _cmdlines(hosts: NamespaceHosts, name: str) -> list[str]:
    lines = []
    for pid in hosts.pids(name):
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return lines
