"""A Slurm cluster on one machine, for tests: munged, slurmctld, and a slurmd on each
of N namespace hosts.

:class:`SlurmCluster` builds on :class:`~elasticps.testing.hosts.NamespaceHosts`:
each host runs a slurmd as node ``hN`` (under ``nsenter --net`` and
``unshare --uts``, not ``ip netns exec``, which hides the cgroup file system
that slurmd reads), and this machine runs munged (with its own key and
socket) and slurmctld on the bridge's address. Everything lives in a
temporary directory: the configuration (used through ``SLURM_CONF``), the
ports, the state and spool directories and the logs. ``SlurmdTimeout`` is
:data:`SLURMD_TIMEOUT_S`, so a dead node is marked down quickly. No accounting.
:meth:`SlurmCluster.close` stops every daemon by PID and the hosts with them.

Needs root, the namespace hosts' tools, and Debian's ``slurmctld``,
``slurmd``, ``slurm-client`` and ``munge``; :func:`unavailable` says why not.

Example::

    with SlurmCluster(3) as cluster:
        subprocess.run(cluster.salloc_argv(3, ["srun", "hostname"]), env=cluster.env())
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from elasticps.netutil import free_port
from elasticps.testing.hosts import NamespaceHosts
from elasticps.testing.hosts import unavailable as hosts_unavailable

__all__ = ["SLURMD_TIMEOUT_S", "SlurmCluster", "unavailable"]

SLURMD_TIMEOUT_S = 6
"""Seconds without an answer after which slurmctld marks a node down."""

CPUS_PER_NODE = 4
"""CPUs each test node declares (its slots in a ``--launcher slurm`` job)."""

_BINARIES = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "salloc", "scontrol",
             "squeue", "scancel", "nsenter", "timeout")  # fmt: skip


def unavailable() -> str | None:
    """Why a test Slurm cluster cannot be made here, or None if it can."""
    why = hosts_unavailable()
    if why is not None:
        return why
    for tool in _BINARIES:
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"a test Slurm cluster needs {tool} (scripts/install-system-packages.sh)"
    return None


def _which(tool: str) -> str:
    return shutil.which(tool) or str(Path("/usr/sbin", tool))


class SlurmCluster:
    """N Slurm nodes on namespace hosts, and the controller on this machine.

    Args:
        count: how many nodes (``h0``..).
        workdir: where everything goes (default: a new temporary directory,
            removed on close).

    Attributes:
        hosts: the namespace hosts (their names are the node names).
        conf: the ``slurm.conf`` file.
        slurmd_port: every node's slurmd port.
    """

    def __init__(self, count: int, workdir: Path | None = None) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="eps-slurm-"))
        self.workdir.chmod(0o711)  # munge checks every directory above its socket
        self.hosts = NamespaceHosts(count, self.workdir / "hosts")
        self.conf = self.workdir / "slurm.conf"
        self.socket = self.workdir / "munge" / "munge.socket"
        self.slurmd_port = 0
        self._pids: dict[str, int] = {}
        self._logs: list[Path] = []

    def __enter__(self) -> SlurmCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- life ------------------------------------------------------------------

    def start(self) -> SlurmCluster:
        """Start the hosts, munged, slurmctld and every slurmd; wait until every node is idle.

        Raises:
            RuntimeError: a daemon did not start, or a node was not idle in 30 s.
        """
        try:
            self.hosts.start()
            self._start_munge()
            self._write_conf()
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            for name in self.hosts.hosts:
                self.start_slurmd(name)
            self.wait_idle(list(self.hosts.hosts), timeout_s=30.0)
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every daemon by PID, then the hosts; remove the work directory if it made it."""
        for name in reversed(list(self._pids)):
            pid = self._pids.pop(name)
            _stop(pid)
        with contextlib.suppress(Exception):
            self.hosts.close()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of a Slurm client of this cluster (``SLURM_CONF`` set)."""
        env = dict(os.environ if base is None else base)
        for key in [k for k in env if k.startswith("SLURM_")]:
            del env[key]
        env["SLURM_CONF"] = str(self.conf)
        return env

    def start_slurmd(self, name: str) -> None:
        """Start node ``name``'s slurmd in its host (again, after :meth:`kill_node`)."""
        host = self.hosts.hosts[name]
        spool = self.workdir / "spool" / name
        spool.mkdir(parents=True, exist_ok=True)
        slurmd = _which("slurmd")
        script = f"hostname {name} && exec {slurmd} -D -N {name} -f {self.conf}"
        self._spawn(
            f"slurmd-{name}",
            ["nsenter", f"--net=/run/netns/{host.netns}", "unshare", "--uts", "--",
             "sh", "-c", script],
        )  # fmt: skip

    def kill_node(self, name: str) -> None:
        """Kill every process of node ``name`` (slurmd and its steps) and set its link down,
        as when the machine dies."""
        self.hosts.cut_link(name)
        self.hosts.kill_host(name)
        pid = self._pids.pop(f"slurmd-{name}", None)
        if pid is not None:
            _stop(pid)

    def revive_node(self, name: str) -> None:
        """Bring node ``name`` back after :meth:`kill_node`: its link up, its slurmd started
        (a rebooted machine); nothing happens to a node that runs."""
        self.hosts.restore_link(name)
        if f"slurmd-{name}" not in self._pids:
            self.start_slurmd(name)

    def node_state(self, name: str) -> str:
        """What ``scontrol show node`` says of node ``name``'s state (``IDLE``, ``DOWN*``...)."""
        done = subprocess.run(
            ["scontrol", "show", "node", "-o", name],
            env=self.env(), capture_output=True, text=True, timeout=15, check=False,
        )  # fmt: skip
        for word in done.stdout.split():
            if word.startswith("State="):
                return word.split("=", 1)[1]
        return ""

    def wait_idle(self, names: Sequence[str], timeout_s: float) -> None:
        """Wait until every node of ``names`` is idle.

        Raises:
            RuntimeError: one was not within ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            states = {n: self.node_state(n) for n in names}
            if all(s.startswith("IDLE") for s in states.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"Slurm nodes not idle after {timeout_s:g} s: {states}; "
                                   f"see {', '.join(map(str, self._logs))}")  # fmt: skip
            time.sleep(0.3)

    # --- building ----------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = self.workdir / f"{name}.out"
        self._logs.append(log)
        with log.open("ab") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(),
                start_new_session=True,
            )
        self._pids[name] = proc.pid

    def _start_munge(self) -> None:
        munge = self.workdir / "munge"
        munge.mkdir(mode=0o711, exist_ok=True)
        munge.chmod(0o711)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn(
            "munged",
            [_which("munged"), "-F", "--force", f"--key-file={key}", f"--socket={self.socket}",
             f"--pid-file={munge / 'munged.pid'}", f"--log-file={munge / 'munged.log'}",
             f"--seed-file={munge / 'munged.seed'}"],
        )  # fmt: skip
        deadline = time.monotonic() + 10.0
        while not self.socket.exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start; see {munge / 'munged.log'}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        gateway = self.hosts.gateway
        self.slurmd_port = free_port(gateway)
        ctl_port = free_port(gateway)
        state = self.workdir / "state"
        state.mkdir(exist_ok=True)
        (self.workdir / "spool").mkdir(exist_ok=True)
        names = ",".join(self.hosts.hosts)
        nodes = [
            f"NodeName={h.name} NodeAddr={h.address} CPUs={CPUS_PER_NODE} State=UNKNOWN"
            for h in self.hosts.hosts.values()
        ]
        lines = [
            "ClusterName=eps",
            f"SlurmctldHost={socket.gethostname().split('.')[0]}({gateway})",
            f"SlurmctldPort={ctl_port}",
            f"SlurmdPort={self.slurmd_port}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={state}",
            f"SlurmdSpoolDir={self.workdir / 'spool'}/%n",
            f"SlurmctldPidFile={self.workdir / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.workdir / 'spool'}/%n/slurmd.pid",
            f"SlurmctldLogFile={self.workdir / 'slurmctld.log'}",
            f"SlurmdLogFile={self.workdir / 'spool'}/%n/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerParameters=batch_sched_delay=0,sched_min_interval=0",
            "SelectType=select/linear",
            "MpiDefault=none",
            "MailProg=/bin/true",
            f"SlurmdTimeout={SLURMD_TIMEOUT_S}",
            "ReturnToService=2",
            "InactiveLimit=0",
            "SlurmdParameters=config_overrides",
            "KillWait=5",
            *nodes,
            f"PartitionName=eps Nodes={names} Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
        self.conf.write_text("\n".join(lines))


def _stop(pid: int) -> None:
    """SIGTERM ``pid``'s process group, then SIGKILL after 5 s; reap it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, 15)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, 9)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
