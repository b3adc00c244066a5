"""Slurm: the PS and trainers of a job as job steps of the Slurm allocation it runs in.

``elasticps train --launcher slurm ...`` inside an allocation (``salloc``, or
an ``sbatch`` script: see :mod:`elasticps.launcher.slurm_jobs`) runs each PS
and trainer as one ``srun --overlap -N1 -n1 -w NODE`` step of that allocation,
through the same remote entry as the ssh launcher
(:mod:`elasticps.launcher.remote`: the role's request on the step's standard
input, its output the step's). etcd and the master stay on the launching node.
The nodes are the allocation's (``SLURM_JOB_NODELIST``, expanded by
``scontrol show hostnames``), each with as many slots as CPUs it was given
(``SLURM_JOB_CPUS_PER_NODE``); placement, restarts and fencing are the host
spawner's (:class:`~elasticps.launcher.ssh.SshSpawner`), with a
:class:`SlurmTransport` instead of ssh.

A node is up while its slurmd accepts TCP connections on its address
(``NodeAddr`` of ``scontrol show node``) and port (``SlurmdPort`` of
``scontrol show config``). The spawner probes every node that runs a role
each :attr:`SlurmTransport.watch_s` seconds; a node that fails is left out of
placement and its steps' ``srun`` clients are killed, so that its trainers
are re-placed on the nodes left and its PS restarted on another node from its
checkpoint. Short commands (the preflight) run under ``timeout``: ``srun``
against a broken node can block for good.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticps.errors import ConfigError
from elasticps.launcher.hostfile import HostSpec
from elasticps.launcher.remote import route_address

if TYPE_CHECKING:
    from elasticps.config import JobConfig
    from elasticps.launcher.ssh import JobHosts

__all__ = [
    "DEFAULT_SLURMD_PORT",
    "LAUNCHERS",
    "SlurmAllocation",
    "SlurmTransport",
    "allocation",
    "job_hosts",
    "parse_cpus_per_node",
    "parse_nodes",
    "parse_slurmd_port",
]

LAUNCHERS = ("local", "slurm")
"""The choices of ``train --launcher``."""

DEFAULT_SLURMD_PORT = 6818
"""slurmd's port when the configuration names none."""

_PROBE_TIMEOUT_S = 1.0
_SCONTROL_TIMEOUT_S = 15.0
_CPUS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_cpus_per_node(text: str, nodes: int) -> list[int]:
    """``SLURM_JOB_CPUS_PER_NODE`` (``4(x2),2``) as one CPU count a node.

    Args:
        text: the variable's value; empty: one CPU a node.
        nodes: how many nodes the allocation has.

    Raises:
        ConfigError: the text is malformed or counts other than ``nodes`` nodes.
    """
    if not text.strip():
        return [1] * nodes
    counts: list[int] = []
    for part in text.strip().split(","):
        match = _CPUS.match(part.strip())
        if match is None:
            raise ConfigError(f"SLURM_JOB_CPUS_PER_NODE: {part!r} is not N or N(xM)")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    if len(counts) != nodes:
        raise ConfigError(
            f"SLURM_JOB_CPUS_PER_NODE {text!r} counts {len(counts)} node(s), the node list {nodes}"
        )
    return counts


def parse_slurmd_port(text: str) -> int:
    """``SlurmdPort`` of ``scontrol show config``'s output (:data:`DEFAULT_SLURMD_PORT`
    without it).

    Raises:
        ConfigError: the port is not a number in 1..65535.
    """
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "SlurmdPort":
            try:
                port = int(value.strip())
            except ValueError:
                port = 0
            if not 1 <= port <= 65535:
                raise ConfigError(f"scontrol show config: SlurmdPort {value.strip()!r} is no port")
            return port
    return DEFAULT_SLURMD_PORT


def parse_nodes(text: str) -> dict[str, dict[str, str]]:
    """``scontrol show node -o``'s output: node name -> its ``KEY=VALUE`` fields.

    Values with spaces (``Reason=...``) keep only their first word; the
    fields used here (``NodeAddr``, ``State``) have none.
    """
    nodes: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        name = fields.get("NodeName")
        if name:
            nodes[name] = fields
    return nodes


@dataclass(frozen=True)
class SlurmTransport:
    """Roles as ``srun`` steps of allocation ``job_id`` (a
    :class:`~elasticps.launcher.transport.Transport`).

    Attributes:
        job_id: the allocation's job id (``SLURM_JOB_ID``).
        addresses: ``(node, address)`` of each node: where its slurmd listens.
        slurmd_port: slurmd's TCP port on every node.
        remote_python: the interpreter on the nodes; empty: the launcher's path.
        alive_interval_s: seconds between ``PING`` lines to each step.
        silence_s: a role stops after this many seconds without a line.
        watch_s: seconds between probes of the nodes that run roles.
    """

    job_id: str
    addresses: tuple[tuple[str, str], ...]
    slurmd_port: int = DEFAULT_SLURMD_PORT
    remote_python: str = ""
    alive_interval_s: float = 1.0
    silence_s: float = 30.0
    watch_s: float = 1.0

    def __post_init__(self) -> None:
        if not self.job_id.strip() or not self.job_id.replace("_", "").isdigit():
            raise ConfigError(f"SLURM_JOB_ID {self.job_id!r} is not a Slurm job id")
        if self.alive_interval_s <= 0 or self.watch_s <= 0:
            raise ConfigError("the Slurm ping and watch intervals must be > 0 s")
        if self.silence_s < 2 * self.alive_interval_s:
            raise ConfigError("the silence before a role stops must be >= 2 alive intervals")

    def address(self, node: str) -> str:
        """Where ``node``'s slurmd listens (the node name itself when unknown)."""
        return dict(self.addresses).get(node, node)

    def argv(
        self, host: HostSpec, *command: str, connect_timeout_s: float | None = None
    ) -> list[str]:
        """``srun`` of one task on node ``host`` in this allocation, running ``command``
        (a shell command line); under ``timeout`` when ``connect_timeout_s`` is given."""
        argv = [
            "srun", "--overlap", "--unbuffered", "--quiet", "-N1", "-n1",
            "-w", host.name, "--jobid", self.job_id, "--kill-on-bad-exit=0",
            "--", "/bin/sh", "-c", " ".join(command),
        ]  # fmt: skip
        if connect_timeout_s is None:
            return argv
        limit = f"{max(1.0, connect_timeout_s):g}"
        return ["timeout", "--kill-after=5", limit, *argv]

    def command_name(self) -> str:
        """``srun``."""
        return "srun"

    def python(self) -> str:
        """The interpreter to run on the nodes."""
        return self.remote_python or sys.executable

    def probe(self, host: HostSpec) -> bool:
        """Whether ``host``'s slurmd accepts a TCP connection within 1 s."""
        try:
            with socket.create_connection(
                (self.address(host.name).strip("[]"), self.slurmd_port), timeout=_PROBE_TIMEOUT_S
            ):
                return True
        except OSError:
            return False

    def lost(self, returncode: int) -> bool:
        """Any failure: ``srun``'s own failures and the role's share statuses, and a probe
        is cheap."""
        return returncode != 0


@dataclass(frozen=True)
class SlurmAllocation:
    """The allocation a ``--launcher slurm`` job runs in.

    Attributes:
        job_id: ``SLURM_JOB_ID``.
        nodes: the node names, in the node list's order.
        cpus: CPUs of each node, in the same order.
        addresses: each node's slurmd address, by name.
        slurmd_port: slurmd's port.
    """

    job_id: str
    nodes: tuple[str, ...]
    cpus: tuple[int, ...]
    addresses: Mapping[str, str]
    slurmd_port: int

    def hosts(self) -> tuple[HostSpec, ...]:
        """One host a node, a slot a CPU, every role allowed."""
        return tuple(
            HostSpec(n, None, max(1, c)) for n, c in zip(self.nodes, self.cpus, strict=True)
        )


def _scontrol(*args: str) -> str:
    argv = ["scontrol", *args]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=_SCONTROL_TIMEOUT_S, check=False
        )
    except FileNotFoundError:
        raise ConfigError("--launcher slurm needs Slurm's scontrol on the PATH") from None
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"{shlex.join(argv)}: {exc}") from None
    if done.returncode != 0:
        why = " ".join(done.stderr.split())[:300] or f"exit {done.returncode}"
        raise ConfigError(f"{shlex.join(argv)}: {why}")
    return done.stdout


def allocation(env: Mapping[str, str] | None = None) -> SlurmAllocation:
    """The allocation of this process's environment, asked of ``scontrol``.

    Raises:
        ConfigError: not inside an allocation (no ``SLURM_JOB_ID`` or
            ``SLURM_JOB_NODELIST``), no ``scontrol``, or what it says is malformed.
    """
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "")
    nodelist = env.get("SLURM_JOB_NODELIST", "")
    if not job_id or not nodelist:
        raise ConfigError(
            "--launcher slurm runs inside a Slurm allocation (salloc, or an sbatch script; "
            "see elasticps submit --backend slurm): SLURM_JOB_ID and SLURM_JOB_NODELIST are unset"
        )
    nodes = tuple(_scontrol("show", "hostnames", nodelist).split())
    if not nodes:
        raise ConfigError(f"SLURM_JOB_NODELIST {nodelist!r} names no node")
    cpus = parse_cpus_per_node(env.get("SLURM_JOB_CPUS_PER_NODE", ""), len(nodes))
    port = parse_slurmd_port(_scontrol("show", "config"))
    fields = parse_nodes(_scontrol("show", "node", "-o", nodelist))
    addresses = {n: fields.get(n, {}).get("NodeAddr") or n for n in nodes}
    return SlurmAllocation(job_id, nodes, tuple(cpus), addresses, port)


def _address_of(name: str) -> str:
    try:
        return str(socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)[0][4][0])
    except OSError as exc:
        raise ConfigError(f"Slurm node address {name} does not resolve: {exc}") from None


def job_hosts(config: JobConfig, env: Mapping[str, str] | None = None) -> JobHosts:
    """The nodes of the allocation as the hosts of a ``--launcher slurm`` job.

    The advertise address (where the nodes reach etcd and the master) is
    ``config.advertise_address``, else this machine's address on its route to
    the first node.

    Raises:
        ConfigError: see :func:`allocation`; or no route to the first node.
    """
    from elasticps.launcher.ssh import JobHosts

    alloc = allocation(env)
    addresses = {n: _address_of(a) for n, a in alloc.addresses.items()}
    transport = SlurmTransport(
        alloc.job_id,
        tuple(addresses.items()),
        alloc.slurmd_port,
        config.remote_python,
    )
    advertise = config.advertise_address
    if not advertise:
        first = addresses[alloc.nodes[0]]
        try:
            advertise = route_address(first)
        except OSError as exc:
            raise ConfigError(f"no route to Slurm node {alloc.nodes[0]} ({first}): {exc}") from None
    return JobHosts(alloc.hosts(), transport, advertise)
