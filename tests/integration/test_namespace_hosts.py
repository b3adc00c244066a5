"""Test hosts in network namespaces (:mod:`elasticps.testing.hosts`): what jobs across hosts need.

Three hosts, each with its own hostname, address and sshd; ssh with a
checked host key; TCP between hosts and from this machine; a host's death
(every process killed) and a cut link, each undone. Skipped where network
namespaces cannot be made (no root, no CAP_NET_ADMIN, no sshd).
"""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from elasticps.testing import pid_gone, wait_for
from elasticps.testing.hosts import NamespaceHosts, unavailable

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

WHY_NOT = unavailable()
if WHY_NOT is not None:
    pytestmark.append(pytest.mark.skip(reason=WHY_NOT))

# Connects to ADDRESS:PORT (timeout 2 s) and prints what it reads.
CLIENT = """
import socket, sys
print(socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).recv(64).decode())
"""

# Accepts one connection on ADDRESS:PORT and answers with the host's name.
SERVER = """
import socket, sys
s = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
conn, _ = s.accept()
conn.sendall(socket.gethostname().encode())
conn.close()
"""


@pytest.fixture(scope="module")
def hosts() -> Iterator[NamespaceHosts]:
    with NamespaceHosts(3) as made:
        yield made


def serve_once(
    hosts: NamespaceHosts, name: str, tmp_path: Path, port: int
) -> subprocess.Popen[str]:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    address = hosts.hosts[name].address
    proc = subprocess.Popen(
        hosts.ssh_argv(name, shlex.join([sys.executable, str(script), address, str(port)])),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "listening"
    return proc


def connect_from(
    hosts: NamespaceHosts, name: str, tmp_path: Path, address: str, port: int
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "client.py"
    script.write_text(CLIENT)
    return hosts.ssh(name, shlex.join([sys.executable, str(script), address, str(port)]))


def test_each_host_has_its_own_name_and_address_and_checks_its_host_key(
    hosts: NamespaceHosts,
) -> None:
    for name, host in hosts.hosts.items():
        done = hosts.ssh(name, "hostname; hostname -I")
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [name, host.address]
    config = hosts.ssh_config.read_text()
    assert "StrictHostKeyChecking yes" in config and "StrictHostKeyChecking no" not in config
    # A host key that is not the known one is refused.
    known = hosts.workdir / "keys" / "known_hosts"
    saved = known.read_text()
    try:
        lines = saved.splitlines()
        known.write_text("\n".join([lines[1].replace(lines[1].split()[0], lines[0].split()[0])]))
        refused = hosts.ssh("h1", "true")
        assert refused.returncode != 0
        assert "host key" in refused.stderr.lower() or "verification failed" in refused.stderr
    finally:
        known.write_text(saved)


def test_tcp_between_hosts_and_from_this_machine(hosts: NamespaceHosts, tmp_path: Path) -> None:
    server = serve_once(hosts, "h2", tmp_path, 7101)
    done = connect_from(hosts, "h0", tmp_path, hosts.hosts["h2"].address, 7101)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "h2"
    server.wait(timeout=10)
    server = serve_once(hosts, "h1", tmp_path, 7102)
    with socket.create_connection((hosts.hosts["h1"].address, 7102), timeout=5) as conn:
        assert conn.recv(64) == b"h1"
    server.wait(timeout=10)


def test_a_killed_host_loses_every_process_and_comes_back_when_revived(
    hosts: NamespaceHosts,
) -> None:
    sleeper = subprocess.Popen(hosts.in_host("h1", ["sleep", "300"]))
    try:
        wait_for(lambda: sleeper.pid in hosts.pids("h1"), "sleep in h1", 10)
        killed = hosts.kill_host("h1")
        assert sleeper.pid in killed
        sleeper.wait(timeout=10)
        assert hosts.ssh("h1", "true", timeout_s=20).returncode != 0  # its sshd died too
        hosts.revive("h1")
        assert hosts.ssh("h1", "hostname").stdout.strip() == "h1"
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
        sleeper.wait()
    assert pid_gone(sleeper.pid)


def test_a_cut_link_stops_traffic_and_restoring_it_brings_it_back(
    hosts: NamespaceHosts, tmp_path: Path
) -> None:
    hosts.cut_link("h2")
    try:
        with pytest.raises(OSError):
            socket.create_connection((hosts.hosts["h2"].address, 2222), timeout=1)
        cut = connect_from(hosts, "h0", tmp_path, hosts.hosts["h2"].address, 2222)
        assert cut.returncode != 0
    finally:
        hosts.restore_link("h2")
    wait_for(lambda: hosts.ssh("h2", "true").returncode == 0, "h2 reachable again", 20)
