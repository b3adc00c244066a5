"""A three-member etcd on the hosts of a ``--hosts`` job (``--etcd-replicas 3``).

With one etcd on the launching machine, the job's coordination state lives on
one machine. With ``--etcd-replicas 3`` it lives in a raft cluster whose three
members run on three different hosts, each as an ssh session of the job's
:class:`~elasticps.launcher.ssh.SshSpawner` running
:mod:`elasticps.coord.etcd_member`; losing any one host keeps a quorum of
two, so nothing acknowledged is lost and the job goes on (every client of the
job is given the three endpoints and fails over, see
:func:`elasticps.coord.client.connect`).

A member whose session ends (its host died, or was cut off) is started again
on the same host, on its data directory, as soon as that host answers ssh
again; that is this class's own business, one member at a time, and needs no
restart budget. Only the loss of the quorum (two members down at once) is
reported to the launcher's supervision policy, through :meth:`alive`, as
etcd's death is on one machine.

Each member's data directory is ``/tmp/elasticps-etcd-<token>/<member>`` on
its host (host-local disk, as etcd wants), removed by :meth:`stop`.

With the job's CA, each member gets a certificate of its own (naming its
address and :data:`~elasticps.security.ETCD_SERVER_NAME`), sent in its
request: the members then take clients over TLS only, each known by its
certificate as one etcd user (:mod:`elasticps.coord.etcd_auth`), and speak
TLS to each other.
"""

from __future__ import annotations

import logging
import shlex
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from elasticps.coord.client import ETCD_ERRORS, connect
from elasticps.errors import ConfigError, CoordinationError, ElasticPSError
from elasticps.jobca import JobCA
from elasticps.launcher.ssh import SshProcess, SshSpawner
from elasticps.security import ETCD_SERVER_NAME, credential_env
from elasticps.tls import TLS_NAMES

__all__ = ["MEMBERS", "HostsEtcd"]

log = logging.getLogger(__name__)

MEMBERS = 3
"""Members of the cluster (``--etcd-replicas``): a quorum survives one lost host."""

DEFAULT_CLIENT_PORT = 2379
"""The members' client port when ``--etcd-port`` is 0 (etcd's registered port); peers use +1."""

_WATCH_S = 1.0


@dataclass
class _Member:
    name: str
    host: str
    address: str
    proc: SshProcess | None = None
    env: dict[str, str] | None = None


class HostsEtcd:
    """The job's etcd as three members on three hosts, with the launcher's etcd interface.

    Args:
        spawner: the job's ssh spawner (members are its sessions).
        hosts: the host file's host names, in order; the members go on the first three.
        addresses: each host's address on its route to the launching machine
            (from :func:`elasticps.launcher.ssh.preflight`).
        token: a name unique to this run (its data directories).
        client_port: the members' client port; 0 for :data:`DEFAULT_CLIENT_PORT`.
        startup_timeout_s: how long :meth:`start` and :meth:`restart` wait
            for a quorum, seconds.
        ca: the job's CA, to issue each member's certificate from; None: the
            members speak plain TCP and check no client.
        tls_dir: where the members' certificates are written (one directory
            each), on this machine; needed with ``ca``.

    Raises:
        ConfigError: fewer than three hosts, or a host without an address.
    """

    def __init__(
        self,
        spawner: SshSpawner,
        hosts: Sequence[str],
        addresses: dict[str, str],
        token: str,
        *,
        client_port: int = 0,
        startup_timeout_s: float = 60.0,
        ca: JobCA | None = None,
        tls_dir: Path | None = None,
    ) -> None:
        if len(hosts) < MEMBERS:
            raise ConfigError(
                f"--etcd-replicas {MEMBERS} needs {MEMBERS} hosts in the host file, "
                f"it has {len(hosts)}"
            )
        self._spawner = spawner
        self._port = client_port or DEFAULT_CLIENT_PORT
        self._data_root = f"/tmp/elasticps-etcd-{token}"
        self._timeout_s = startup_timeout_s
        self._members = []
        for i, host in enumerate(hosts[:MEMBERS]):
            address = addresses.get(host, "")
            if not address:
                raise ConfigError(f"host {host} gave no address for its etcd member")
            member = _Member(f"etcd-{i}", host, address)
            if ca is not None:
                if tls_dir is None:
                    raise ConfigError("the etcd members' certificates need a directory")
                issued = ca.issue("etcd", dns_names=(ETCD_SERVER_NAME,), ips=(address,))
                member.env = credential_env(TLS_NAMES, issued.write(tls_dir / member.name))
            self._members.append(member)
        self._scheme = "https" if ca is not None else "http"
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None
        self._last_code: int | None = None

    # --- the launcher's etcd interface --------------------------------------------

    @property
    def endpoint(self) -> str:
        """Every member's client endpoint, comma-separated (``--etcd`` of every role)."""
        return ",".join(f"{self._netloc(m.address)}:{self._port}" for m in self._members)

    @property
    def members(self) -> dict[str, str]:
        """Each member's host, by member name."""
        return {m.name: m.host for m in self._members}

    @property
    def pid(self) -> int | None:
        """The local ssh client PID of a running member, or None."""
        with self._lock:
            for member in self._members:
                if member.proc is not None and member.proc.poll() is None:
                    return member.proc.pid
        return None

    @property
    def returncode(self) -> int | None:
        """The exit status of the last member session that ended, while the quorum is lost."""
        return None if self.alive() else self._last_code

    def alive(self) -> bool:
        """Whether a quorum of members runs (not whether it answers)."""
        with self._lock:
            running = sum(self._running(m) for m in self._members)
        return running > MEMBERS // 2

    def spawn(self) -> None:
        """Start every member and return at once; :meth:`start` then waits for a quorum."""
        with self._lock:
            for member in self._members:
                if not self._running(member):
                    self._start_member(member)
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="etcd-members", daemon=True)
            self._watcher.start()

    def start(self) -> None:
        """Start the members (unless :meth:`spawn` did) and wait until the cluster answers.

        Raises:
            CoordinationError: no quorum answered within ``startup_timeout_s``.
        """
        self.spawn()
        deadline = time.monotonic() + self._timeout_s
        last = ""
        while time.monotonic() < deadline:
            try:
                client = connect(self.endpoint, timeout_s=5.0)
                try:
                    client.put("/elasticps-health", "ok")  # a write needs a leader
                    return
                finally:
                    client.close()
            except (CoordinationError, *ETCD_ERRORS) as exc:
                last = " ".join(str(exc).split())[:200]
                time.sleep(0.2)
        raise CoordinationError(
            f"the etcd members on {', '.join(m.host for m in self._members)} formed no "
            f"quorum within {self._timeout_s:g} s: {last}"
        )

    def restart(self) -> None:
        """Start the members that are down, and wait for a quorum (after the quorum was lost).

        Raises:
            CoordinationError: no quorum within ``startup_timeout_s``.
        """
        self.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop every member (SIGTERM, SIGKILL after ``timeout_s``) and remove the data.

        Idempotent.
        """
        self._stopping.set()
        with self._lock:
            procs = [m.proc for m in self._members if m.proc is not None]
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
        for member in self._members:
            self._remove_data(member)

    def kill(self) -> None:
        """SIGKILL every member (fault injection)."""
        with self._lock:
            for member in self._members:
                if member.proc is not None:
                    member.proc.kill()

    # --- members ------------------------------------------------------------------------

    def _running(self, member: _Member) -> bool:
        return member.proc is not None and member.proc.poll() is None

    def _initial_cluster(self) -> str:
        return ",".join(
            f"{m.name}={self._scheme}://{self._netloc(m.address)}:{self._port + 1}"
            for m in self._members
        )

    def _start_member(self, member: _Member) -> None:
        """Start ``member``'s session (the lock is held)."""
        args = [
            "--name", member.name,
            "--data-dir", f"{self._data_root}/{member.name}",
            "--client-port", str(self._port),
            "--peer-port", str(self._port + 1),
            "--initial-cluster", self._initial_cluster(),
        ]  # fmt: skip
        try:
            member.proc = self._spawner.run_on(
                member.host, args, member.env or {}, module="elasticps.coord.etcd_member"
            )
        except ElasticPSError as exc:
            log.warning("etcd member %s on %s did not start: %s", member.name, member.host, exc)
            member.proc = None

    def _watch(self) -> None:
        """Start a member again on its host once the host answers (its data is there)."""
        while not self._stopping.wait(_WATCH_S):
            with self._lock:
                down = [m for m in self._members if not self._running(m)]
                for member in down:
                    if member.proc is not None:
                        self._last_code = member.proc.poll()
                        log.warning(
                            "etcd member %s on %s ended (exit %s)",
                            member.name, member.host, self._last_code,
                        )  # fmt: skip
                        member.proc = None
            for member in down:
                if self._stopping.is_set() or not self._spawner.host_up(member.host):
                    continue
                with self._lock:
                    if not self._running(member) and not self._stopping.is_set():
                        log.info("restarting etcd member %s on %s", member.name, member.host)
                        self._start_member(member)

    def _remove_data(self, member: _Member) -> None:
        options = self._spawner.options
        host = self._spawner.host_spec(member.host)
        command = shlex.join(["rm", "-rf", "--", f"{self._data_root}/{member.name}"])
        command += " ; " + shlex.join(["rmdir", "--ignore-fail-on-non-empty", self._data_root])
        try:
            subprocess.run(
                options.argv(host, command, connect_timeout_s=3),
                capture_output=True, timeout=15, check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            log.warning("could not remove etcd data %s on %s", self._data_root, member.host)

    @staticmethod
    def _netloc(address: str) -> str:
        return f"[{address}]" if ":" in address else address
