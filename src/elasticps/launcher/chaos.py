"""Declarative fault injection: a schedule of SIGKILLs and pauses (pure: no I/O).

A schedule is a comma-separated list of ``kill:<target>@<when>`` and
``pause:<target>@<when>:<seconds>s`` (SIGSTOP, then SIGCONT that many seconds
later: a process cut off from everything, as by a network partition or a
long garbage-collection pause, which comes back after its lease expired),
``lose:ps-<i>@<when>`` (SIGKILL that parameter server, then delete its
own checkpoint files once it is dead: a shard lost together with its
checkpoints, which no recovery can undo; the job must say what was lost),
and ``damage:ps-<i>@<when>[:<n>]`` / ``drop:ps-<i>@<when>[:<n>]`` (SIGKILL
that parameter server, then flip 64 bytes in the middle of, or delete, its
``n`` newest checkpoint files, 1 by default: bit rot or a torn write, or a
checkpoint deleted or never finished; the restarted server falls back to an
older one):

- ``target``: ``trainer``, ``ps`` or ``master`` (one live process of that
  role: the highest-numbered trainer, the first PS, the *active* master),
  ``trainer-<i>`` / ``ps-<i>`` (that one), or ``etcd``.
- ``when``: ``<seconds>s`` after training started (the first task
  dispatched), or ``<percent>%`` of all task dispatches of all passes done.

Example: ``--chaos "kill:trainer@20s,kill:ps@40%,kill:master@60s"``. The
launcher evaluates the schedule as the job runs and SIGKILLs the chosen
processes; the tests and ``benchmarks/recovery.py`` use it, and users can use
it to test their own jobs (Horovod's elastic tests use the same idea).

Random kills, for soak tests:
``random:every=0.75-2.25s,roles=trainer+ps+master+standby+etcd,seed=1``
(:class:`RandomChaos`, which may follow scheduled items) SIGKILLs one random
process of one of ``roles`` (``trainer``, ``ps``, ``master``: the active one,
``standby``: a standby master, ``etcd``) at a random moment ``every`` after
the job recovered from the previous kill, for as long as the job trains;
``kills=N`` stops after N kills, ``after=S`` starts S seconds after training
started, and ``damage=P`` also damages, with probability ``P``, the newest
checkpoint file of a killed parameter server (as ``damage:ps-<i>``). The
launcher draws the moments, the victims and the damage from
``random.Random(seed)``.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from elasticps.errors import ConfigError

_ITEM = re.compile(
    r"^(?P<action>kill|pause|lose|damage|drop):(?P<target>[a-z]+(?:-\d+)?)"
    r"@(?P<value>\d+(?:\.\d+)?)(?P<unit>s|%)"
    r"(?::(?P<duration>\d+(?:\.\d+)?)s|:(?P<count>[1-9]\d*))?$"
)
_ROLES = ("trainer", "ps", "master", "etcd")


@dataclass(frozen=True)
class ChaosEvent:
    """One scheduled kill.

    Attributes:
        target: ``trainer``, ``trainer-1``, ``ps``, ``ps-0``, ``master`` or ``etcd``.
        at_s: seconds after training started, or None.
        at_fraction: fraction (0..1) of all task dispatches done, or None.
        action: ``"kill"`` (SIGKILL), ``"pause"`` (SIGSTOP, SIGCONT later),
            ``"lose"`` (SIGKILL a PS, then delete its checkpoints), ``"damage"``
            or ``"drop"`` (SIGKILL a PS, then damage or delete its ``count``
            newest checkpoint files).
        duration_s: how long a pause lasts, seconds.
        count: the files ``damage`` and ``drop`` spoil, >= 1.
    """

    target: str
    at_s: float | None = None
    at_fraction: float | None = None
    action: str = "kill"
    duration_s: float = 0.0
    count: int = 1

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


RANDOM_ROLES = ("trainer", "ps", "master", "standby", "etcd")
"""What :class:`RandomChaos` can kill; ``standby`` is a master waiting on the lock."""


@dataclass(frozen=True)
class RandomChaos:
    """SIGKILLs of random roles at random moments (a soak test).

    Attributes:
        every_s: ``(low, high)``: after the job recovered from the previous
            kill (every server process runs again and a task progressed), the
            next comes after a delay drawn uniformly from ``[low, high]``
            seconds.
        roles: the roles to choose from (see :data:`RANDOM_ROLES`).
        seed: seed of the launcher's ``random.Random``.
        max_kills: stop after this many kills; None: until training ends.
        after_s: seconds after training started before the first kill.
        damage: probability, in ``[0, 1]``, that a killed parameter server's
            newest checkpoint file is then damaged (64 bytes flipped).

    Raises:
        ConfigError: a value is out of range or a role is unknown.
    """

    every_s: tuple[float, float] = (0.75, 2.25)
    roles: tuple[str, ...] = RANDOM_ROLES
    seed: int = 0
    max_kills: int | None = None
    after_s: float = 0.0
    damage: float = 0.0

    def __post_init__(self) -> None:
        low, high = self.every_s
        if not 0 <= low <= high:
            raise ConfigError(f"--chaos random: every must be LOW-HIGH with 0 <= LOW <= HIGH, "
                              f"got {low:g}-{high:g}")  # fmt: skip
        unknown = [r for r in self.roles if r not in RANDOM_ROLES]
        if unknown or not self.roles:
            raise ConfigError(
                f"--chaos random: roles must be some of {'+'.join(RANDOM_ROLES)}, "
                f"got {'+'.join(self.roles) or 'none'}"
            )
        if self.max_kills is not None and self.max_kills < 0:
            raise ConfigError(f"--chaos random: kills must be >= 0, got {self.max_kills}")
        if self.after_s < 0:
            raise ConfigError(f"--chaos random: after must be >= 0 s, got {self.after_s:g}")
        if not 0 <= self.damage <= 1:
            raise ConfigError(f"--chaos random: damage must be in [0, 1], got {self.damage:g}")

    def delay_s(self, rng: random.Random) -> float:
        """The delay before the next kill, seconds, drawn from ``rng``."""
        return rng.uniform(*self.every_s)

    def damages(self, rng: random.Random, role: str) -> bool:
        """Whether the newest checkpoint file of the process just killed is damaged too
        (a parameter server only; draws from ``rng`` only if ``damage`` > 0)."""
        return role == "ps" and self.damage > 0 and rng.random() < self.damage

    def choose(self, rng: random.Random, available: Sequence[str]) -> str | None:
        """The role to kill next, among ``available`` ones (those with a live
        process of that role), drawn from ``rng``; None if none is available."""
        candidates = [r for r in self.roles if r in available]
        return rng.choice(candidates) if candidates else None


def _seconds(value: str, what: str) -> float:
    try:
        return float(value.removesuffix("s"))
    except ValueError:
        raise ConfigError(f"--chaos random: {what} must be seconds, got {value!r}") from None


def _split(spec: str) -> tuple[list[str], list[str]]:
    """The scheduled items, and the ``random:`` item with its ``key=value`` parameters."""
    scheduled: list[str] = []
    rand: list[str] = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        if item.startswith("random:"):
            if rand:
                raise ConfigError("--chaos: at most one random: item")
            rand.append(item.removeprefix("random:"))
        elif rand and "=" in item and ":" not in item:
            rand.append(item)
        else:
            scheduled.append(item)
    return scheduled, rand


def parse_random_chaos(spec: str) -> RandomChaos | None:
    """Parse the ``random:`` part of a ``--chaos`` value, if there is one.

    Example: ``"random:every=0.75-2.25s,roles=trainer+ps+master+etcd,seed=1,kills=50"``.

    Returns:
        The random chaos, or None if ``spec`` has no ``random:`` item.

    Raises:
        ConfigError: a malformed or unknown parameter.
    """
    _, params = _split(spec)
    if not params:
        return None
    fields: dict[str, object] = {}
    for param in params:
        if not param:
            continue
        key, sep, value = param.partition("=")
        if not sep:
            raise ConfigError(f"--chaos random: {param!r} is not key=value")
        if key == "every":
            low, dash, high = value.removesuffix("s").partition("-")
            fields["every_s"] = (
                _seconds(low, "every"),
                _seconds(high if dash else low, "every"),
            )
        elif key == "roles":
            fields["roles"] = tuple(r for r in value.split("+") if r)
        elif key in ("seed", "kills"):
            if not value.isdigit():
                raise ConfigError(f"--chaos random: {key} must be an integer, got {value!r}")
            fields["seed" if key == "seed" else "max_kills"] = int(value)
        elif key == "after":
            fields["after_s"] = _seconds(value, "after")
        elif key == "damage":
            try:
                fields["damage"] = float(value)
            except ValueError:
                raise ConfigError(
                    f"--chaos random: damage must be a number, got {value!r}"
                ) from None
        else:
            raise ConfigError(
                "--chaos random: unknown parameter "
                f"{key!r} (every, roles, seed, kills, after, damage)"
            )
    return RandomChaos(**fields)  # type: ignore[arg-type]


def parse_chaos(spec: str) -> tuple[ChaosEvent, ...]:
    """Parse a schedule such as ``"kill:trainer@20s,kill:ps@40%"``.

    A ``random:`` item and its parameters are skipped (see :func:`parse_random_chaos`).

    Returns:
        The events, in the order given ("" gives none).

    Raises:
        ConfigError: a malformed item, an unknown role, or a percentage over 100.
    """
    events = []
    for raw in _split(spec)[0]:
        item = raw.strip()
        if not item:
            continue
        m = _ITEM.match(item)
        spoils = m is not None and m["action"] in ("damage", "drop")
        if (
            m is None
            or (m["action"] == "pause") != (m["duration"] is not None)
            or (m["count"] is not None and not spoils)
        ):
            raise ConfigError(
                f"--chaos item {item!r} is not of the form kill:<target>@<seconds>s, "
                "kill:<target>@<percent>%, pause:<target>@<when>:<seconds>s or "
                "damage|drop:ps-<i>@<when>[:<files>]"
            )
        target, value, unit = m["target"], float(m["value"]), m["unit"]
        action = m["action"]
        duration = float(m["duration"]) if m["duration"] is not None else 0.0
        count = int(m["count"]) if m["count"] is not None else 1
        role = target.split("-", 1)[0]
        if action == "lose" and role != "ps":
            raise ConfigError(f"--chaos item {item!r}: only a parameter server can be lost")
        if spoils and not (role == "ps" and "-" in target):
            raise ConfigError(
                f"--chaos item {item!r}: {action} needs a parameter server by index (ps-<i>)"
            )
        if role not in _ROLES or (role in ("master", "etcd") and "-" in target):
            raise ConfigError(
                f"--chaos target {target!r} must be trainer, trainer-<i>, ps, ps-<i>, "
                "master or etcd"
            )
        if unit == "%":
            if value > 100:
                raise ConfigError(f"--chaos item {item!r}: a percentage must be <= 100")
            events.append(ChaosEvent(target, None, value / 100, action, duration, count))
        else:
            events.append(ChaosEvent(target, value, None, action, duration, count))
    return tuple(events)
