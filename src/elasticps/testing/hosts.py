"""Test hosts on one machine: Linux network namespaces, each with its own sshd.

:class:`NamespaceHosts` makes N hosts that reach each other, and the machine,
over a bridge, on a /24 subnet of 10.200.0.0/16 that it picks and owns. Each
host has its own network stack (so a link can be cut, and every process of a
host killed, as when a machine dies), its own hostname, and an sshd that
accepts only a key made for this run, with host keys that the client checks.
The file system is the machine's: a host's state goes in its own directory.

It follows the recipe in the project's notes on test servers:

- a switch namespace holds the bridge; each host has a veth pair into it;
- the machine gets a veth into the bridge too, with the subnet's ``.254``,
  and :meth:`NamespaceHosts.start` checks that the route to every host leaves
  through it (never through the default route, off the machine) before any
  traffic is sent;
- sshd runs with ``UsePAM no``, key authentication only, its own port, host
  key and PID file, under ``unshare --uts`` to take the host's name.

Everything is torn down by :meth:`NamespaceHosts.close`: the daemons and
every process left in a host are killed by PID, the namespaces deleted.
Needs root (``CAP_NET_ADMIN``), ``ip`` (iproute2) and ``sshd``
(openssh-server); :func:`unavailable` says why not, for a test to skip.

Example::

    with NamespaceHosts(3) as hosts:
        hosts.ssh("h1", "hostname").stdout  # "h1\\n"
        hosts.cut_link("h2")                 # h2 drops off the network
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

__all__ = ["Host", "NamespaceHosts", "unavailable"]

SSH_PORT = 2222
"""The port each host's sshd listens on."""

_CMD_TIMEOUT_S = 20.0


def unavailable() -> str | None:
    """Why namespace hosts cannot be made here, or None if they can.

    They need root (network namespaces, ``CAP_NET_ADMIN``), ``ip``,
    ``unshare``, ``sshd``, ``ssh`` and ``ssh-keygen``.
    """
    if os.geteuid() != 0:
        return "namespace hosts need root (CAP_NET_ADMIN)"
    for tool in ("ip", "unshare", "ssh", "ssh-keygen"):
        if shutil.which(tool) is None:
            return f"namespace hosts need {tool} (scripts/install-system-packages.sh)"
    if _sshd() is None:
        return "namespace hosts need sshd (openssh-server; scripts/install-system-packages.sh)"
    probe = f"eps-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(
        ["ip", "netns", "add", probe], check=False, capture_output=True, text=True
    )
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, capture_output=True)
    return None


def _sshd() -> str | None:
    return shutil.which("sshd") or next(
        (p for p in ("/usr/sbin/sshd", "/sbin/sshd") if Path(p).exists()), None
    )


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done


@dataclass(frozen=True)
class Host:
    """One test host.

    Attributes:
        name: its hostname and its name in the ssh configuration (``h0``...).
        address: its IPv4 address on the bridge.
        netns: its network namespace.
        veth: its end of the veth pair into the bridge (inside ``netns``).
        home: a directory of its own (the file system is shared).
    """

    name: str
    address: str
    netns: str
    veth: str
    home: Path


class NamespaceHosts:
    """N hosts in network namespaces, with an sshd each, reachable from this machine.

    Args:
        count: how many hosts, 1..250.
        workdir: where the keys, configurations and hosts' directories go
            (default: a new temporary directory, removed on close).

    Attributes:
        hosts: the hosts, by name (``h0``, ``h1``...).
        gateway: this machine's address on the bridge (the subnet's ``.254``).
        ssh_config: an ssh client configuration naming every host, with its
            address, port, key and known host key (``ssh -F ssh_config h1``).
    """

    def __init__(self, count: int, workdir: Path | None = None) -> None:
        if not 1 <= count <= 250:
            raise ValueError(f"count must be in 1..250, got {count}")
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="eps-hosts-"))
        tag = uuid.uuid4().hex[:6]
        self._tag = tag
        self._subnet = _free_subnet()
        self.gateway = f"{self._subnet}.254"
        self._switch = f"eps-{tag}-sw"
        self._bridge = "br0"
        self._root_veth = f"eps{tag}r"
        self.hosts = {
            f"h{i}": Host(
                name=f"h{i}",
                address=f"{self._subnet}.{i + 1}",
                netns=f"eps-{tag}-h{i}",
                veth="eth0",
                home=self.workdir / f"h{i}",
            )
            for i in range(count)
        }
        self.ssh_config = self.workdir / "ssh_config"
        self._sshd_pids: dict[str, int] = {}
        self._made_netns: list[str] = []
        self._root_link = False

    # --- life ---------------------------------------------------------------

    def __enter__(self) -> NamespaceHosts:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def start(self) -> NamespaceHosts:
        """Make the network, check the route to it, start every sshd and wait for them.

        Raises:
            RuntimeError: a command failed, the route to a host would leave
                the machine, or an sshd did not answer in time.
        """
        try:
            self._make_network()
            self._check_routes()
            self._make_keys()
            for host in self.hosts.values():
                self._start_sshd(host)
            self._write_ssh_config()
            for host in self.hosts.values():
                self._wait_ssh(host)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill every process of every host, delete the namespaces and the work directory."""
        for name in list(self.hosts):
            with contextlib.suppress(Exception):
                self.kill_host(name)
        for pid in self._sshd_pids.values():
            _kill_and_reap(pid)
        self._sshd_pids.clear()
        if self._root_link:
            _run("ip", "link", "del", self._root_veth, check=False)
            self._root_link = False
        for netns in reversed(self._made_netns):
            _run("ip", "netns", "del", netns, check=False)
        self._made_netns.clear()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    # --- faults ---------------------------------------------------------------

    def pids(self, name: str) -> list[int]:
        """The PIDs of every process running in host ``name``."""
        listed = _run("ip", "netns", "pids", self.hosts[name].netns, check=False).stdout
        return [int(text) for text in listed.split()]

    def kill_host(self, name: str) -> list[int]:
        """SIGKILL every process running in host ``name``, its sshd too, as its death would.

        The host stays off until :meth:`revive`; its network is untouched.

        Returns:
            The PIDs killed.
        """
        killed = []
        for pid in self.pids(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        sshd = self._sshd_pids.pop(name, None)
        if sshd is not None:
            _kill_and_reap(sshd)
        return killed

    def revive(self, name: str) -> None:
        """Start host ``name``'s sshd again after :meth:`kill_host` (a rebooted machine).

        Raises:
            RuntimeError: its sshd did not answer in time.
        """
        if name not in self._sshd_pids:
            host = self.hosts[name]
            self._start_sshd(host)
            self._wait_ssh(host)

    def cut_link(self, name: str) -> None:
        """Take host ``name`` off the network (its link down); its processes keep running."""
        host = self.hosts[name]
        _run("ip", "-n", host.netns, "link", "set", host.veth, "down")

    def restore_link(self, name: str) -> None:
        """Bring host ``name``'s link back up, with its address and route."""
        host = self.hosts[name]
        _run("ip", "-n", host.netns, "link", "set", host.veth, "up")

    # --- use ------------------------------------------------------------------

    def ssh_argv(self, name: str, command: str) -> list[str]:
        """``ssh`` with this run's configuration, to run ``command`` on host ``name``."""
        return ["ssh", "-F", str(self.ssh_config), name, command]

    def ssh(
        self, name: str, command: str, timeout_s: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``command`` on host ``name`` over ssh and return what it did (not checked)."""
        argv = self.ssh_argv(name, command)
        return subprocess.run(argv, check=False, capture_output=True, text=True, timeout=timeout_s)

    def in_host(self, name: str, argv: list[str]) -> list[str]:
        """``argv`` prefixed to run in host ``name``'s network namespace (no ssh)."""
        return ["ip", "netns", "exec", self.hosts[name].netns, *argv]

    # --- building ----------------------------------------------------------------

    def _netns(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made_netns.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _make_network(self) -> None:
        sw, br = self._switch, self._bridge
        self._netns(sw)
        _run("ip", "-n", sw, "link", "add", br, "type", "bridge")
        _run("ip", "-n", sw, "link", "set", br, "up")
        for i, host in enumerate(self.hosts.values()):
            self._netns(host.netns)
            port = f"p{i}"
            _run("ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name",
                 host.veth, "netns", host.netns)  # fmt: skip
            _run("ip", "-n", sw, "link", "set", port, "master", br, "up")
            _run("ip", "-n", host.netns, "addr", "add", f"{host.address}/24", "dev", host.veth)
            _run("ip", "-n", host.netns, "link", "set", host.veth, "up")
            host.home.mkdir(parents=True, exist_ok=True)
        # This machine's own port on the bridge: the only route to the hosts.
        _run("ip", "link", "add", self._root_veth, "type", "veth", "peer", "name", "up0",
             "netns", sw)  # fmt: skip
        self._root_link = True
        _run("ip", "-n", sw, "link", "set", "up0", "master", br, "up")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self._root_veth)
        _run("ip", "link", "set", self._root_veth, "up")

    def _check_routes(self) -> None:
        """Refuse to go on unless traffic to every host leaves through our own veth."""
        for host in self.hosts.values():
            route = _run("ip", "route", "get", host.address).stdout.split()
            dev = route[route.index("dev") + 1] if "dev" in route else ""
            if dev != self._root_veth or "via" in route:
                raise RuntimeError(
                    f"the route to test host {host.address} is {' '.join(route)!r}, not through "
                    f"{self._root_veth}: refusing to send traffic off the machine"
                )

    def _make_keys(self) -> None:
        keys = self.workdir / "keys"
        keys.mkdir(parents=True, exist_ok=True)
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "client"))
        (keys / "authorized_keys").write_text((keys / "client.pub").read_text())
        known = []
        for host in self.hosts.values():
            key = host.home / "ssh_host_ed25519_key"
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
            public = (key.with_suffix(".pub")).read_text().split()
            known.append(f"[{host.address}]:{SSH_PORT} {public[0]} {public[1]}")
        (keys / "known_hosts").write_text("\n".join(known) + "\n")

    def _start_sshd(self, host: Host) -> None:
        keys = self.workdir / "keys"
        config = host.home / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"Port {SSH_PORT}",
                    f"ListenAddress {host.address}",
                    f"HostKey {host.home / 'ssh_host_ed25519_key'}",
                    f"PidFile {host.home / 'sshd.pid'}",
                    f"AuthorizedKeysFile {keys / 'authorized_keys'}",
                    "PermitRootLogin prohibit-password",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "UsePAM no",
                    "StrictModes no",
                    "AcceptEnv ELASTICPS_*",
                    "",
                ]
            )
        )
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        sshd = _sshd()
        assert sshd is not None
        log = (host.home / "sshd.log").open("ab")
        try:
            proc = subprocess.Popen(
                self.in_host(host.name, ["unshare", "--uts", "--", "sh", "-c",
                             f"hostname {host.name} && exec {sshd} -D -e -f {config}"]),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )  # fmt: skip
        finally:
            log.close()
        self._sshd_pids[host.name] = proc.pid

    def _write_ssh_config(self) -> None:
        keys = self.workdir / "keys"
        blocks = []
        for host in self.hosts.values():
            blocks.append(
                "\n".join(
                    [
                        f"Host {host.name}",
                        f"  HostName {host.address}",
                        f"  Port {SSH_PORT}",
                        "  User root",
                        f"  IdentityFile {keys / 'client'}",
                        "  IdentitiesOnly yes",
                        f"  UserKnownHostsFile {keys / 'known_hosts'}",
                        "  StrictHostKeyChecking yes",
                        "  BatchMode yes",
                        "  ConnectTimeout 5",
                        "  ServerAliveInterval 2",
                        "  ServerAliveCountMax 3",
                        "  LogLevel ERROR",
                    ]
                )
            )
        self.ssh_config.write_text("\n\n".join(blocks) + "\n")

    def _wait_ssh(self, host: Host, timeout_s: float = 20.0) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            done = self.ssh(host.name, "true", timeout_s=10.0)
            if done.returncode == 0:
                return
            last = done.stderr.strip()
            time.sleep(0.1)
        raise RuntimeError(f"sshd of test host {host.name} did not answer: {last}")


def _free_subnet() -> str:
    """A ``10.200.X`` prefix that no interface of this machine uses (X random)."""
    used = _run("ip", "-4", "-o", "addr", "show").stdout
    choices = [x for x in range(1, 251) if f" 10.200.{x}." not in used]
    if not choices:
        raise RuntimeError("every 10.200.X.0/24 subnet is in use on this machine")
    return f"10.200.{random.choice(choices)}"


def _kill_and_reap(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
