"""How the launcher reaches the hosts of a job across machines: the seam between the
host spawner and ssh or Slurm.

:class:`~elasticps.launcher.ssh.SshSpawner` places the PS and trainers on
hosts, restarts a lost host's roles on the hosts left and stops them; what it
needs of the way a host is reached is a :class:`Transport`: the command line
that runs a shell command on a host (a session whose standard input and
output are the role's), whether a host answers (:meth:`Transport.probe`), and
whether a session's exit status says that its host was lost
(:meth:`Transport.lost`). :class:`~elasticps.launcher.ssh.SshOptions` is the
ssh one; :class:`~elasticps.launcher.slurm.SlurmTransport` runs each session
as an ``srun`` step of a Slurm allocation.

A transport whose sessions do not end by themselves when their host stops
answering (``srun`` against a dead node may block) asks the spawner to watch:
with :attr:`Transport.watch_s` > 0, every host that runs a session is probed
that often, and the sessions of a host that fails its probe are ended, so that
the launcher restarts their roles elsewhere.
"""

from __future__ import annotations

from typing import Protocol

from elasticps.launcher.hostfile import HostSpec

__all__ = ["Transport"]


class Transport(Protocol):
    """The host-specific part of running roles on hosts (see the module docstring)."""

    @property
    def alive_interval_s(self) -> float:
        """Seconds between the launcher's ``PING`` lines to each session."""
        ...

    @property
    def silence_s(self) -> float:
        """Seconds without a line after which a role on a host stops by itself."""
        ...

    @property
    def watch_s(self) -> float:
        """Seconds between probes of the hosts that run sessions; 0: no watch."""
        ...

    def argv(
        self, host: HostSpec, *command: str, connect_timeout_s: float | None = None
    ) -> list[str]:
        """The local command line that runs ``command`` (a shell command line) on ``host``,
        giving up after ``connect_timeout_s`` seconds to reach it (None: the default)."""
        ...

    def python(self) -> str:
        """The interpreter to run on the hosts."""
        ...

    def command_name(self) -> str:
        """The local command that reaches a host (``ssh``, ``srun``), for log lines."""
        ...

    def probe(self, host: HostSpec) -> bool:
        """Whether ``host`` answers now (a bounded check: a few seconds at most)."""
        ...

    def lost(self, returncode: int) -> bool:
        """Whether a session that ended with ``returncode`` may have lost its host (then
        the host is probed before it takes another role)."""
        ...
