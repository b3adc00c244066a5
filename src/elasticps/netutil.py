"""Small socket helpers shared by the servers and the launcher."""

from __future__ import annotations

import random
import shutil
import socket
import sys

from elasticps.errors import PortInUseError

RUNTIME_DIR_ENV = "ELASTICPS_RUNTIME_DIR"
"""The environment variable naming the directory where a role process on this host
makes its private runtime directory (a parameter server's ``AF_UNIX`` socket).

The local launchers set it to their job's temporary directory, which they
remove at the end of the job, so that a SIGKILLed server leaves nothing behind
in ``/tmp``. Unset, or not a directory: the system's temporary directory."""


def runtime_dir(prefix: str) -> str:
    """Make a private (mode 0700) runtime directory and return its path.

    Under :data:`RUNTIME_DIR_ENV` when it names a directory, else under the
    system's temporary directory. The caller removes it.

    Raises:
        OSError: the directory cannot be made.
    """
    import os
    import tempfile

    parent = os.environ.get(RUNTIME_DIR_ENV) or None
    if parent is not None and not os.path.isdir(parent):
        parent = None
    return tempfile.mkdtemp(prefix=prefix, dir=parent)


LOOPBACK = "127.0.0.1"


#: The lowest port :func:`free_port` picks.
PORT_FLOOR = 10000

_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections, inclusive.

    Linux reads it from ``/proc/sys/net/ipv4/ip_local_port_range`` (32768
    60999 by default); elsewhere, or if unreadable, IANA's dynamic range
    (49152-65535, RFC 6335).
    """
    try:
        with open(_EPHEMERAL_RANGE_FILE) as handle:
            low, high = (int(v) for v in handle.read().split())
        return low, high
    except (OSError, ValueError):
        return 49152, 65535


def free_port(host: str = LOOPBACK) -> int:
    """Return a TCP port on ``host`` that was free at the time of the call.

    The port is picked at random below the kernel's ephemeral range
    (:func:`ephemeral_ports`), from :data:`PORT_FLOOR` up: no outgoing
    connection is ever given it as its source port. So a server that is
    restarted on the ports it had (etcd on its data directory) finds them
    free, unless another server bound them; a port from the ephemeral range
    can be taken by any connection made while the server was down. Where
    that range leaves no room, the kernel picks the port.

    The port is released before returning, so another process may take it; the
    caller binds it promptly and treats ``EADDRINUSE`` as a retryable race.
    """
    low, _high = ephemeral_ports()
    if low - 1 > PORT_FLOOR:
        for _ in range(64):
            port = random.randint(PORT_FLOOR, low - 1)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def check_port_free(port: int, host: str = LOOPBACK, *, what: str = "port") -> None:
    """Raise :class:`PortInUseError` if ``host:port`` cannot be bound now.

    Args:
        port: TCP port number, 1..65535.
        host: interface address to test.
        what: what the port is for, used in the error message (e.g. "--etcd-port").

    Raises:
        PortInUseError: the port is bound by another process.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As servers bind: a port in TIME_WAIT from our own last run is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise PortInUseError(f"{what} {host}:{port} is already in use") from exc


def die_with_parent_prefix() -> list[str]:
    """A command prefix that makes the child get SIGTERM when its parent dies.

    ``setpriv --pdeathsig TERM`` (util-linux) sets ``PR_SET_PDEATHSIG`` and
    then execs the command, so even a SIGKILLed launcher or test runner
    leaves no orphaned etcd or role process behind. This avoids a Python
    ``preexec_fn``, which is unsafe in a process with gRPC threads. Returns
    ``[]`` where ``setpriv`` is missing (the children then rely on their own
    checks, and on being stopped by PID).

    Note that the signal fires when the *thread* that started the child
    exits, so start long-lived children from the main thread.
    """
    setpriv = shutil.which("setpriv")
    if setpriv is None or not sys.platform.startswith("linux"):
        return []
    return [setpriv, "--pdeathsig", "TERM"]
