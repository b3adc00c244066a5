"""The hosts of a job across machines: the host file, and where each role goes (pure).

A host file has one host a line::

    # comments and blank lines are ignored
    10.0.0.5                       # a plain address, as MXNet's launch.py takes
    gpu-node-1:2222 slots=4        # an ssh port, and how many roles it may run
    cpu-node-2 slots=8 roles=trainer

``HOST[:SSHPORT] [slots=N] [roles=ps,trainer,...]``: ``slots`` defaults to 1
and ``roles`` to every role that runs on hosts (``ps`` and ``trainer``). A
host named twice is refused, as is any other word.

:func:`place` spreads the roles over the hosts' slots, parameter servers
first: each role goes to the host that allows it, has a free slot and runs
the fewest roles of its kind, ties broken by the most free slots, then by
the file's order; a PS takes a slot a trainer could use only while the trainers
still fit in the rest. So PS land on different hosts while hosts remain,
and trainers fill what is left. It is also how the roles of a lost host are
re-placed on the hosts left: give it the roles already placed elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from elasticps.errors import ConfigError

__all__ = ["HOST_ROLES", "HostSpec", "parse_hostfile", "place"]

HOST_ROLES = ("ps", "trainer")
"""The roles that run on the hosts of a host file (etcd and the master run on the
launching machine by default)."""

_HOST = re.compile(r"^(?P<name>\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+)(?::(?P<port>\d+))?$")


@dataclass(frozen=True)
class HostSpec:
    """One line of a host file.

    Attributes:
        name: the host as ssh reaches it: a name of the ssh configuration, a
            DNS name or an address (an IPv6 one in brackets).
        ssh_port: its ssh port, or None for the ssh configuration's.
        slots: how many role processes it may run, >= 1.
        roles: the roles it may run, a subset of :data:`HOST_ROLES`.
    """

    name: str
    ssh_port: int | None = None
    slots: int = 1
    roles: tuple[str, ...] = HOST_ROLES

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ConfigError(f"host {self.name}: slots must be >= 1, got {self.slots}")
        unknown = sorted(set(self.roles) - set(HOST_ROLES))
        if unknown or not self.roles:
            raise ConfigError(
                f"host {self.name}: roles must be some of {', '.join(HOST_ROLES)}, "
                f"got {','.join(self.roles) or '(none)'}"
            )
        if self.ssh_port is not None and not 1 <= self.ssh_port <= 65535:
            raise ConfigError(f"host {self.name}: ssh port {self.ssh_port} is out of range")


def parse_hostfile(text: str, source: str = "the host file") -> tuple[HostSpec, ...]:
    """The hosts of a host file, in its order.

    Args:
        text: the file's text.
        source: how to name the file in errors.

    Returns:
        One :class:`HostSpec` a host line.

    Raises:
        ConfigError: a line is not ``HOST[:SSHPORT] [slots=N] [roles=...]``,
            a host is named twice, or no host is named; the message names the
            file and the line.
    """
    hosts: list[HostSpec] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}, line {number}"
        first, *options = line.split()
        match = _HOST.match(first)
        if match is None:
            raise ConfigError(f"{where}: {first!r} is not HOST or HOST:SSHPORT")
        name = match.group("name")
        port = int(match.group("port")) if match.group("port") else None
        fields: dict[str, str] = {}
        for option in options:
            key, sep, value = option.partition("=")
            if not sep or key not in ("slots", "roles") or not value:
                raise ConfigError(
                    f"{where}: {option!r} is not slots=N or roles=ROLE,ROLE... "
                    f"(roles: {', '.join(HOST_ROLES)})"
                )
            if key in fields:
                raise ConfigError(f"{where}: {key} is given twice")
            fields[key] = value
        if name in seen:
            raise ConfigError(f"{where}: host {name} is named again (first on line {seen[name]})")
        seen[name] = number
        try:
            slots = int(fields.get("slots", "1"))
        except ValueError:
            raise ConfigError(
                f"{where}: slots must be a whole number, got {fields['slots']!r}"
            ) from None
        roles = tuple(fields["roles"].split(",")) if "roles" in fields else HOST_ROLES
        try:
            hosts.append(HostSpec(name, port, slots, roles))
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    if not hosts:
        raise ConfigError(f"{source} names no host")
    return tuple(hosts)


def _kind(role: str) -> str:
    """``ps-3`` -> ``ps``."""
    kind = role.rsplit("-", 1)[0]
    if kind not in HOST_ROLES:
        raise ConfigError(f"role {role!r} does not run on the hosts ({', '.join(HOST_ROLES)})")
    return kind


def place(
    hosts: Sequence[HostSpec],
    roles: Iterable[str],
    placed: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Where each role runs: role name -> host name.

    Args:
        hosts: the hosts that can take roles (a lost host left out).
        roles: the roles to place, such as ``ps-0``, ``ps-1``, ``trainer-0``;
            PS are placed before trainers, each kind in the order given.
        placed: roles already running, role -> host: they keep their hosts
            and their slots (their hosts must be among ``hosts``).

    Returns:
        Every role of ``placed`` and of ``roles``, with its host.

    Raises:
        ConfigError: a role has no host that allows it with a free slot (the
            message counts the slots), a role is placed twice, or ``placed``
            names a host not in ``hosts``.
    """
    out = dict(placed or {})
    names = [h.name for h in hosts]
    free = {h.name: h.slots for h in hosts}
    count: dict[tuple[str, str], int] = {}
    for role, host in out.items():
        if host not in free:
            raise ConfigError(f"role {role} is placed on {host}, which is not among the hosts")
        free[host] -= 1
        count[(host, _kind(role))] = count.get((host, _kind(role)), 0) + 1
    todo = list(roles)
    twice = sorted({r for r in todo if r in out or todo.count(r) > 1})
    if twice:
        raise ConfigError(f"role(s) {', '.join(twice)} placed twice")
    todo.sort(key=lambda r: HOST_ROLES.index(_kind(r)))  # stable: PS first, in order
    trainers_left = sum(1 for r in todo if _kind(r) == "trainer")
    for role in todo:
        kind = _kind(role)
        allowed = [h for h in hosts if kind in h.roles and free[h.name] > 0]
        if kind == "ps":
            # A PS takes a slot that a trainer could use only while the
            # trainers still to place fit in the rest.
            room = sum(free[h.name] for h in hosts if "trainer" in h.roles)
            if room - 1 < trainers_left:
                allowed = [h for h in allowed if "trainer" not in h.roles]
        else:
            trainers_left -= 1
        if not allowed:
            total = sum(h.slots for h in hosts if kind in h.roles)
            raise ConfigError(
                f"no host has a free slot for {role}: the hosts that may run a {kind} have "
                f"{total} slot(s), and {len(out)} role(s) hold slots already"
            )
        best = min(
            allowed,
            key=lambda h: (count.get((h.name, kind), 0), -free[h.name], names.index(h.name)),
        )
        out[role] = best.name
        free[best.name] -= 1
        count[(best.name, kind)] = count.get((best.name, kind), 0) + 1
    return out
