"""Declarative fault injection: a schedule of SIGKILLs and pauses (pure: no I/O).

A schedule is a comma-separated list of ``kill:<target>@<when>`` and
``pause:<target>@<when>:<seconds>s`` (SIGSTOP, then SIGCONT that many seconds
later: a process cut off from everything, as by a network partition or a
long garbage-collection pause, which comes back after its lease expired),
and ``lose:ps-<i>@<when>`` (delete that parameter server's own checkpoint
files, then SIGKILL it: a shard lost together with its checkpoints, which no
recovery can undo; the job must say what was lost):

- ``target``: ``trainer``, ``ps`` or ``master`` (one live process of that
  role: the highest-numbered trainer, the first PS, the *active* master),
  ``trainer-<i>`` / ``ps-<i>`` (that one), or ``etcd``.
- ``when``: ``<seconds>s`` after training started (the first task
  dispatched), or ``<percent>%`` of all task dispatches of all passes done.

Example: ``--chaos "kill:trainer@20s,kill:ps@40%,kill:master@60s"``. The
launcher evaluates the schedule as the job runs and SIGKILLs the chosen
processes; the tests and ``benchmarks/recovery.py`` use it, and users can use
it to test their own jobs (Horovod's elastic tests use the same idea).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from elasticps.errors import ConfigError

_ITEM = re.compile(
    r"^(?P<action>kill|pause|lose):(?P<target>[a-z]+(?:-\d+)?)@(?P<value>\d+(?:\.\d+)?)(?P<unit>s|%)"
    r"(?::(?P<duration>\d+(?:\.\d+)?)s)?$"
)
_ROLES = ("trainer", "ps", "master", "etcd")


@dataclass(frozen=True)
class ChaosEvent:
    """One scheduled kill.

    Attributes:
        target: ``trainer``, ``trainer-1``, ``ps``, ``ps-0``, ``master`` or ``etcd``.
        at_s: seconds after training started, or None.
        at_fraction: fraction (0..1) of all task dispatches done, or None.
        action: ``"kill"`` (SIGKILL), ``"pause"`` (SIGSTOP, SIGCONT later) or
            ``"lose"`` (delete a PS's checkpoints, then SIGKILL it).
        duration_s: how long a pause lasts, seconds.
    """

    target: str
    at_s: float | None = None
    at_fraction: float | None = None
    action: str = "kill"
    duration_s: float = 0.0

    @property
    def role(self) -> str:
        """The role of the target (``trainer``, ``ps``, ``master`` or ``etcd``)."""
        return self.target.split("-", 1)[0]

    def due(self, elapsed_s: float, fraction_done: float) -> bool:
        """Whether the kill is due, ``elapsed_s`` after training started."""
        if self.at_s is not None:
            return elapsed_s >= self.at_s
        assert self.at_fraction is not None
        return fraction_done >= self.at_fraction


def parse_chaos(spec: str) -> tuple[ChaosEvent, ...]:
    """Parse a schedule such as ``"kill:trainer@20s,kill:ps@40%"``.

    Returns:
        The events, in the order given ("" gives none).

    Raises:
        ConfigError: a malformed item, an unknown role, or a percentage over 100.
    """
    events = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        m = _ITEM.match(item)
        if m is None or (m["action"] == "pause") != (m["duration"] is not None):
            raise ConfigError(
                f"--chaos item {item!r} is not of the form kill:<target>@<seconds>s, "
                "kill:<target>@<percent>% or pause:<target>@<when>:<seconds>s"
            )
        target, value, unit = m["target"], float(m["value"]), m["unit"]
        action = m["action"]
        duration = float(m["duration"]) if m["duration"] is not None else 0.0
        role = target.split("-", 1)[0]
        if action == "lose" and role != "ps":
            raise ConfigError(f"--chaos item {item!r}: only a parameter server can be lost")
        if role not in _ROLES or (role in ("master", "etcd") and "-" in target):
            raise ConfigError(
                f"--chaos target {target!r} must be trainer, trainer-<i>, ps, ps-<i>, "
                "master or etcd"
            )
        if unit == "%":
            if value > 100:
                raise ConfigError(f"--chaos item {item!r}: a percentage must be <= 100")
            events.append(ChaosEvent(target, None, value / 100, action, duration))
        else:
            events.append(ChaosEvent(target, value, None, action, duration))
    return tuple(events)
