"""The etcd StatefulSet's command lines, run by the real etcd binary: three members on loopback.

``submit`` renders etcd's pods as a StatefulSet template; no cluster runs them
here. This test runs what the kubelet would run for each member, with the
kubelet's ``$(VAR)`` expansion applied, each member's claim a directory, and
the cluster's network mapped onto loopback (every member's DNS name becomes
127.0.0.1, its ports 2379/2380 free ports of its own). Then it plays a lost
node: one member is SIGKILLed, the two others keep serving writes, and the
member started again on its data directory (the StatefulSet re-creating the pod
on its claim) rejoins and has them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kubernetes")

from elasticps.config import KubernetesConfig
from elasticps.coord.etcd_server import etcd_binary
from elasticps.coord.store import JobStore
from elasticps.errors import CoordinationError
from elasticps.launcher.kubernetes import (
    ETCD_PEER_PORT,
    ETCD_PORT,
    etcd_peer_host,
    etcd_statefulset,
    to_manifests,
)
from elasticps.launcher.spawn import terminate, wait_or_kill
from elasticps.netutil import LOOPBACK, free_port
from elasticps.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

JOB, NS, MEMBERS = "kjob", "ml", 3


def member_command(
    statefulset: dict[str, Any], ordinal: int, ports: dict[int, tuple[int, int]], data: Path
) -> tuple[list[str], dict[str, str]]:
    """The argv and environment the kubelet would give member ``ordinal``, on loopback."""
    container = statefulset["spec"]["template"]["spec"]["containers"][0]
    pod = f"{statefulset['metadata']['name']}-{ordinal}"
    fields = {"metadata.name": pod}
    env = {v["name"]: fields[v["valueFrom"]["fieldRef"]["fieldPath"]] for v in container["env"]}
    (mount,) = [m["mountPath"] for m in container["volumeMounts"] if m["name"] == "data"]
    argv = []
    for raw in container["command"]:
        arg = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], raw)  # the kubelet's expansion
        for member, (client, peer) in ports.items():
            host = etcd_peer_host(JOB, member, NS)
            arg = arg.replace(f"{host}:{ETCD_PORT}", f"{LOOPBACK}:{client}")
            arg = arg.replace(f"{host}:{ETCD_PEER_PORT}", f"{LOOPBACK}:{peer}")
        client, peer = ports[ordinal]
        arg = arg.replace(f"0.0.0.0:{ETCD_PORT}", f"{LOOPBACK}:{client}")
        arg = arg.replace(f"0.0.0.0:{ETCD_PEER_PORT}", f"{LOOPBACK}:{peer}")
        argv.append(arg.replace(mount, str(data)))  # the claim, mounted
    assert argv[0] == "etcd", argv
    argv[0] = str(etcd_binary())
    return argv, env


def healthy(client_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{client_port}/health", timeout=2) as r:
            return bool(json.loads(r.read()).get("health") == "true")
    except OSError:
        return False


@pytest.fixture
def members(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """Start the three members; every process is stopped by PID at the end."""
    statefulset = to_manifests([etcd_statefulset(JOB, KubernetesConfig(namespace=NS), MEMBERS)])[0]
    ports = {i: (free_port(), free_port()) for i in range(MEMBERS)}
    procs: dict[int, subprocess.Popen[bytes]] = {}
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}

    def start(ordinal: int) -> None:
        argv, env = member_command(statefulset, ordinal, ports, tmp_path / f"claim-{ordinal}")
        log = (tmp_path / f"etcd-{ordinal}.log").open("ab")
        procs[ordinal] = subprocess.Popen(
            argv, env={**base_env, **env}, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()

    for ordinal in range(MEMBERS):
        start(ordinal)
    try:
        yield {"ports": ports, "procs": procs, "start": start, "logs": tmp_path}
    finally:
        terminate(list(procs.values()))
        wait_or_kill(list(procs.values()), 10.0)


def test_three_members_from_the_statefulset_keep_serving_while_one_is_lost(
    members: dict[str, Any],
) -> None:
    ports, procs = members["ports"], members["procs"]
    for ordinal, (client, _) in ports.items():
        wait_for(lambda c=client: healthy(c), f"etcd member {ordinal} healthy", timeout_s=60)
    with JobStore(f"{LOOPBACK}:{ports[0][0]}", "k8s-etcd") as store:
        store.set_job_state("before")
    # A lost node: member 1 dies at once (perhaps the leader: the others elect a new one).
    procs[1].send_signal(signal.SIGKILL)
    procs[1].wait(10)
    for ordinal in (0, 2):
        wait_for(lambda o=ordinal: healthy(ports[o][0]), f"member {ordinal} has a leader")

    def write_after() -> bool:
        try:
            with JobStore(f"{LOOPBACK}:{ports[2][0]}", "k8s-etcd") as store:
                store.set_job_state("after")  # two of three: a quorum
        except CoordinationError:
            return False  # an election under way
        return True

    wait_for(write_after, "a write with two members of three", timeout_s=30)
    # The StatefulSet re-creates the member on its claim: same command, same data directory.
    members["start"](1)
    wait_for(lambda: healthy(ports[1][0]), "etcd member 1 healthy again", timeout_s=30)
    with JobStore(f"{LOOPBACK}:{ports[1][0]}", "k8s-etcd") as store:
        wait_for(lambda: store.job_state() == "after", "member 1 caught up", timeout_s=15)
    log = (members["logs"] / "etcd-1.log").read_text()
    assert "conflicting environment variable" not in log
