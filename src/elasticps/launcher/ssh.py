"""Hosts over ssh: a spawner that runs the PS and trainers on the hosts of a host file.

:class:`SshSpawner` is a :class:`~elasticps.launcher.spawn.Spawner`, so the
local launcher runs a job across hosts with the supervision, recovery and
stop sequence it uses on one machine. etcd and the master stay on the
launching machine (started by the local spawner it wraps), reached at the
*advertise address*: the launching machine's address on its route to the
hosts (:func:`advertise_address`), or ``--advertise-address``.

Each PS and trainer is one ``ssh HOST python -m elasticps.launcher.remote``
session (:mod:`elasticps.launcher.remote`): the role's arguments, its
environment and the model file travel as one JSON line on the session's
standard input, never on a command line. The session's output is the role's
output, its exit status the role's. Stopping the role is a control line on
the same input (:class:`SshProcess`), and the end of the session (the
launcher stopped or died) stops the role on the host.

Placement (:func:`~elasticps.launcher.hostfile.place`): each new role goes
to a host that allows it and has a free slot, PS first, spreading each kind.
A session that ends with ssh's own status 255 (the connection failed or was
lost: ``ServerAliveInterval`` x ``ServerAliveCountMax`` seconds without an
answer) makes its host *suspect*; the next placement probes it with
``ssh HOST true`` and leaves it out for :data:`DOWN_RETRY_S` seconds if that
fails. So a lost host's roles are re-placed on the hosts left, when the
launcher restarts them: a PS from its checkpoint, a trainer as a new one. A
PS finds no free slot only if every host is full: it then shares the least
loaded host that allows PS (with a warning), since the job cannot go on
without it. A trainer with no free slot raises
:class:`~elasticps.errors.UnschedulableError`, and the worker manager tries
again later.

ssh settings come from the user's ssh configuration (``~/.ssh/config``), or
from ``--ssh-config FILE`` alone; host keys are checked as that configuration
says (``BatchMode yes`` is added, so ssh never prompts). Only the environment
variables that configure a role travel (:data:`FORWARDED_ENV`).

What is ssh-specific is :class:`SshOptions`, a
:class:`~elasticps.launcher.transport.Transport`; the spawner, its placement
and its recovery take any transport (:mod:`elasticps.launcher.slurm` runs the
same roles as Slurm job steps).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING

from elasticps.errors import ConfigError, ElasticPSError, UnschedulableError
from elasticps.launcher.hostfile import HostSpec, parse_hostfile, place
from elasticps.launcher.remote import FILES_TOKEN, route_address
from elasticps.launcher.spawn import ProcessHandle, Spawner
from elasticps.launcher.transport import Transport
from elasticps.netutil import die_with_parent_prefix
from elasticps.security import ETCD_NAMES, SECRET_FILE_ENV, TLS_NAMES
from elasticps.storage import is_url

if TYPE_CHECKING:
    from elasticps.config import JobConfig

__all__ = [
    "DOWN_RETRY_S",
    "FORWARDED_ENV",
    "HOST_ROLES",
    "JobHosts",
    "SshOptions",
    "SshProcess",
    "SshSpawner",
    "advertise_address",
    "preflight",
    "resolve_host",
]

log = logging.getLogger(__name__)

HOST_ROLES = ("ps", "trainer")
"""The roles placed on the hosts by slots; the others run here (the master) or are
placed by hand and take no slot (:meth:`SshSpawner.run_on`, an etcd member)."""

DOWN_RETRY_S = 30.0
"""Seconds a host that failed its probe is left out of placement before it is probed again."""

FORWARDED_ENV = (
    "ELASTICPS_",
    "MALLOC_",
    "JE_ARROW_",
    "OMP_",
    "MKL_",
    "AWS_",
    "PYTHONUNBUFFERED",
    "PYTHONHASHSEED",
)
"""Prefixes of the launcher's environment variables that reach the roles on the hosts
(storage credentials included, so that URLs read the same on every host). The
launcher's own ``ELASTICPS_PARENT_PID``, ``ELASTICPS_RUNTIME_DIR`` and
``ELASTICPS_HOST`` are replaced on each host."""

_LOCAL_ONLY_ENV = ("ELASTICPS_PARENT_PID", "ELASTICPS_RUNTIME_DIR", "ELASTICPS_HOST")

_SSH_STATUS = 255  # ssh's own error: the connection failed or was lost
_KILL_GRACE_S = 2.0  # after a KILL line, the ssh client itself is killed
_PROBE_TIMEOUT_S = 3  # ConnectTimeout of the probe of a suspect host, seconds


@dataclass(frozen=True)
class SshOptions:
    """How the launcher reaches the hosts.

    Attributes:
        config: an ssh configuration file used instead of the user's (``ssh -F``);
            None: the user's own.
        remote_python: the interpreter on the hosts that has elasticps installed;
            empty: the launcher's own path (a shared file system, or one image).
        alive_interval_s: ssh's ``ServerAliveInterval``, seconds.
        alive_count: ssh's ``ServerAliveCountMax``: a host that answers nothing for
            ``alive_interval_s * alive_count`` seconds is lost.
        connect_timeout_s: ssh's ``ConnectTimeout``, seconds.
        silence_s: a role on a host stops after this many seconds without a word
            from the launcher (which writes to each session every
            ``alive_interval_s``): a host cut off from the launching machine
            stops its roles after that long, so that none outlives its job.
    """

    config: Path | None = None
    remote_python: str = ""
    alive_interval_s: float = 1.0
    alive_count: int = 3
    connect_timeout_s: float = 5.0
    silence_s: float = 30.0

    def __post_init__(self) -> None:
        if self.alive_interval_s < 1 or self.alive_count < 1 or self.connect_timeout_s < 1:
            raise ConfigError("ssh intervals must be >= 1 s and the alive count >= 1")
        if self.silence_s < 2 * self.alive_interval_s:
            raise ConfigError("the silence before a role stops must be >= 2 alive intervals")

    def argv(
        self, host: HostSpec, *command: str, connect_timeout_s: float | None = None
    ) -> list[str]:
        """``ssh`` with these options, to run ``command`` (a shell command line) on ``host``;
        ``connect_timeout_s`` replaces :attr:`connect_timeout_s` for this command."""
        timeout_s = self.connect_timeout_s if connect_timeout_s is None else connect_timeout_s
        argv = ["ssh"]
        if self.config is not None:
            argv += ["-F", str(self.config)]
        argv += [
            "-o", "BatchMode=yes",
            "-o", f"ServerAliveInterval={max(1, round(self.alive_interval_s))}",
            "-o", f"ServerAliveCountMax={self.alive_count}",
            "-o", f"ConnectTimeout={max(1, round(timeout_s))}",
        ]  # fmt: skip
        if host.ssh_port is not None:
            argv += ["-p", str(host.ssh_port)]
        return [*argv, host.name.strip("[]"), *command]

    def command_name(self) -> str:
        """``ssh``."""
        return "ssh"

    def python(self) -> str:
        """The interpreter to run on the hosts."""
        return self.remote_python or sys.executable

    @property
    def watch_s(self) -> float:
        """0: ssh's keepalives end the session of a lost host by themselves."""
        return 0.0

    def probe(self, host: HostSpec) -> bool:
        """Whether ``ssh HOST true`` succeeds within :data:`_PROBE_TIMEOUT_S` seconds to connect."""
        argv = self.argv(host, "true", connect_timeout_s=_PROBE_TIMEOUT_S)
        try:
            done = subprocess.run(
                argv, capture_output=True, timeout=_PROBE_TIMEOUT_S + 5, check=False
            )
        except (OSError, subprocess.TimeoutExpired):
            return False
        return done.returncode == 0

    def lost(self, returncode: int) -> bool:
        """ssh's own status 255: the connection failed or was lost."""
        return returncode == _SSH_STATUS


def resolve_host(host: HostSpec, options: SshOptions) -> str:
    """The address ssh connects to for ``host`` (its ``HostName`` in the ssh configuration).

    Raises:
        ConfigError: ssh cannot read its configuration for it, or the name
            does not resolve.
    """
    argv = options.argv(host)
    argv.insert(1, "-G")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"ssh cannot read its configuration for {host.name}: {exc}") from exc
    lines = done.stdout.splitlines()
    name = next((line.split(None, 1)[1] for line in lines if line.startswith("hostname ")), "")
    if done.returncode != 0 or not name:
        why = " ".join(done.stderr.split())[:200] or f"exit {done.returncode}"
        raise ConfigError(f"ssh cannot read its configuration for {host.name}: {why}")
    try:
        return str(socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)[0][4][0])
    except OSError as exc:
        raise ConfigError(f"host {host.name} ({name}) does not resolve: {exc}") from exc


def advertise_address(hosts: Sequence[HostSpec], options: SshOptions) -> str:
    """This machine's address on its route to the first host, where the hosts reach etcd
    and the master.

    Raises:
        ConfigError: the host does not resolve, or there is no route to it.
    """
    address = resolve_host(hosts[0], options)
    try:
        return route_address(address)
    except OSError as exc:
        raise ConfigError(f"no route to host {hosts[0].name} ({address}): {exc}") from exc


def preflight(
    hosts: Sequence[HostSpec],
    options: Transport,
    *,
    read: Sequence[str] = (),
    write: Sequence[str] = (),
    connect: Sequence[str] = (),
    route_to: str = "",
    timeout_s: float = 60.0,
) -> dict[str, str]:
    """Check over ssh (or ``options``'s transport), on every host at once, what the job
    needs there.

    Each host must answer ssh, run ``remote_python -m elasticps.launcher.remote``,
    read ``read`` (data, a checkpoint to resume), write ``write`` (the
    directory of the PS checkpoints), and reach ``connect`` (etcd).

    Returns:
        Each host's address on its route to ``route_to`` (empty strings
        without it), by host name.

    Raises:
        ConfigError: what failed, one line per host.
    """
    request = json.dumps({"check": {"read": list(read), "write": list(write),
                                    "connect": list(connect)},
                          "route_to": route_to})  # fmt: skip
    command = shlex.join([options.python(), "-m", "elasticps.launcher.remote"])
    procs = {
        host.name: subprocess.Popen(
            options.argv(host, command),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in hosts
    }
    problems = []
    addresses: dict[str, str] = {}
    for name, proc in procs.items():
        try:
            out, err = proc.communicate(request + "\n", timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            problems.append(f"{name}: no answer in {timeout_s:g} s")
            continue
        answer: object = None
        with contextlib.suppress(ValueError):
            answer = json.loads(out.strip().splitlines()[-1]) if out.strip() else None
        if proc.returncode != 0 or not isinstance(answer, dict):
            why = " ".join((err or out).split())[-300:] or f"exit {proc.returncode}"
            hint = (
                " (is elasticps installed at that path? see --remote-python)"
                if proc.returncode in (126, 127) or "No module named" in why
                else ""
            )
            problems.append(f"{name}: {why}{hint}")
            continue
        problems += [f"{name}: {p}" for p in answer.get("problems", [])]
        addresses[name] = str(answer.get("address") or "")
    if problems:
        raise ConfigError("the hosts cannot run this job:\n  " + "\n  ".join(problems))
    return addresses


@dataclass(frozen=True)
class JobHosts:
    """The hosts of one ``--hosts`` job, and how to reach them.

    Attributes:
        hosts: the host file's hosts, in its order.
        options: the ssh settings (or another transport).
        advertise: this machine's address that the hosts reach etcd and the master at.
    """

    hosts: tuple[HostSpec, ...]
    options: Transport
    advertise: str

    @classmethod
    def of(cls, config: JobConfig) -> JobHosts:
        """The hosts of ``config.hosts_file`` (no ssh connection is made yet).

        Raises:
            ConfigError: the file cannot be read or is malformed, or ssh cannot
                resolve its first host (without ``advertise_address``).
        """
        path = config.hosts_file
        if path is None:
            raise ConfigError("this job has no host file (--hosts)")
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"--hosts {path}: {exc.strerror or exc}") from None
        hosts = parse_hostfile(text, str(path))
        if config.ssh_config is not None and not config.ssh_config.is_file():
            raise ConfigError(f"--ssh-config {config.ssh_config} is not a file")
        options = SshOptions(
            config.ssh_config.resolve() if config.ssh_config else None, config.remote_python
        )
        advertise = config.advertise_address or advertise_address(hosts, options)
        return cls(hosts, options, advertise)

    def check(self, config: JobConfig, etcd_endpoint: str | None) -> dict[str, str]:
        """:func:`preflight` for ``config``: every host reads the data and a checkpoint to
        resume, writes the output (the PS checkpoints), and reaches etcd.

        Raises:
            ConfigError: what a host cannot do.
        """
        read = []
        data = str(config.data)
        if not config.stream and not is_url(data):
            read.append(str(_glob_root(Path(data)).resolve()))
        if config.resume is not None and not is_url(str(config.resume)):
            read.append(str(Path(config.resume).resolve()))
        write = [] if config.output_url else [str(config.output.resolve())]
        connect = [etcd_endpoint] if etcd_endpoint else []
        return preflight(
            self.hosts, self.options, read=read, write=write, connect=connect,
            route_to=self.advertise,
        )  # fmt: skip

    def spawner(self, local: Spawner) -> SshSpawner:
        """The spawner of this job's roles; ``local`` starts those that run here."""
        return SshSpawner(self.hosts, self.options, local, self.advertise)


def _glob_root(path: Path) -> Path:
    """The directory above a glob's first pattern part (the path itself when it has none)."""
    parts = path.parts
    for i, part in enumerate(parts):
        if any(c in part for c in "*?["):
            return Path(*parts[:i]) if i else Path(".")
    return path


class SshProcess:
    """A role on a host: the local ``ssh`` client, with the methods the launchers use.

    ``pid`` is the ssh client's; SIGTERM and SIGINT are sent as control lines
    that the host's end relays to the role; SIGKILL too, and the ssh client is
    killed :data:`_KILL_GRACE_S` seconds later if it has not ended (a host that
    no longer answers). Other signals go to the ssh client.

    Attributes:
        host: the host's name in the host file.
    """

    def __init__(self, proc: subprocess.Popen[bytes], host: str) -> None:
        self._proc = proc
        self.pid = proc.pid
        self.host = host
        self.stdout: IO[bytes] | None = proc.stdout
        self.returncode: int | None = None
        """The exit status once seen (the role's, or 255 for a lost connection)."""
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        """The exit status if the session has ended, else None."""
        self.returncode = self._proc.poll()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the session to end; raises :class:`subprocess.TimeoutExpired`."""
        self.returncode = self._proc.wait(timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Stop (TERM, INT) or kill (KILL) the role, or signal the ssh client (others)."""
        if self._proc.poll() is not None:
            return
        word = {signal.SIGTERM: b"TERM\n", signal.SIGINT: b"INT\n", signal.SIGKILL: b"KILL\n"}
        line = word.get(signal.Signals(sig))
        if line is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(sig)
            return
        self._write(line)
        if sig == signal.SIGKILL:
            timer = threading.Timer(_KILL_GRACE_S, self.kill_client)
            timer.daemon = True
            timer.start()

    def kill(self) -> None:
        """Kill the role, and the ssh client if it has not ended in 2 s."""
        self.send_signal(signal.SIGKILL)

    def ping(self) -> None:
        """Tell the host's end that the launcher is there."""
        self._write(b"PING\n")

    def write_request(self, request: str) -> None:
        """Send the role's request (one JSON line)."""
        self._write(request.encode() + b"\n")

    def _write(self, data: bytes) -> None:
        stdin = self._proc.stdin
        if stdin is None:
            return
        with self._lock, contextlib.suppress(OSError, ValueError):
            stdin.write(data)
            stdin.flush()

    def kill_client(self) -> None:
        """Kill the local client itself (its host no longer answers control lines)."""
        if self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()


@dataclass
class _Live:
    kind: str
    host: str
    proc: SshProcess


class SshSpawner:
    """Starts the master locally and each PS and trainer on a host over ssh.

    Args:
        hosts: the host file's hosts.
        options: how to reach them (:class:`SshOptions`, or another transport).
        local: the spawner of the roles that run on the launching machine (the master).
        advertise: the launching machine's address that the hosts reach
            (:func:`advertise_address`); the master listens on it.
    """

    def __init__(
        self,
        hosts: Sequence[HostSpec],
        options: Transport,
        local: Spawner,
        advertise: str,
    ) -> None:
        if not hosts:
            raise ConfigError("the host file names no host")
        self._hosts = tuple(hosts)
        self._by_name = {h.name: h for h in hosts}
        self._options = options
        self._via = options.command_name()
        self._local = local
        self._advertise = advertise
        self._lock = threading.Lock()
        self._live: dict[int, _Live] = {}
        self._suspect: set[str] = set()
        self._down_until: dict[str, float] = {}
        self._next_id = 0
        self._pinger: threading.Thread | None = None
        self.placements: list[tuple[str, str]] = []
        """``(kind, host)`` of every role started on a host, in order (for the run record)."""

    @property
    def hosts(self) -> tuple[HostSpec, ...]:
        """The hosts of the host file."""
        return self._hosts

    @property
    def options(self) -> Transport:
        """How the hosts are reached."""
        return self._options

    def host_spec(self, name: str) -> HostSpec:
        """Host ``name`` of the host file.

        Raises:
            KeyError: no such host.
        """
        return self._by_name[name]

    def pids(self) -> dict[str, int]:
        """The local spawner's own processes."""
        return self._local.pids()

    def host_of(self, pid: int) -> str | None:
        """The host that runs the session with local pid ``pid``, or None."""
        with self._lock:
            for live in self._live.values():
                if live.proc.pid == pid:
                    return live.host
        return None

    def start(self, args: Sequence[str], env: Mapping[str, str]) -> ProcessHandle:
        """Start ``elasticps <args>``: locally for the master, else on a host.

        Raises:
            UnschedulableError: a trainer finds no host with a free slot.
            ElasticPSError: no host is up for a PS, or ssh cannot be started.
        """
        kind = args[0] if args else ""
        if kind not in HOST_ROLES:
            local_env = dict(env)
            local_env["ELASTICPS_HOST"] = self._advertise
            return self._local.start(args, local_env)
        request = self._request(args, env)
        with self._lock:
            host = self._choose(kind)
            handle = self._open(host, kind, request)
        log.info("started %s on %s (%s pid %d)", kind, host, self._via, handle.pid)
        return handle

    def run_on(
        self, host: str, args: Sequence[str], env: Mapping[str, str], *, module: str
    ) -> SshProcess:
        """Run ``python -m module args`` on ``host`` itself, outside placement (an etcd member).

        Args:
            host: a host of the host file.
            args: the module's arguments.
            env: the environment; only :data:`FORWARDED_ENV` variables travel.
            module: one of :data:`elasticps.launcher.remote.MODULES`.

        Raises:
            ElasticPSError: ssh cannot be started.
        """
        request = self._request(args, env, module=module)
        with self._lock:
            handle = self._open(host, module.rsplit(".", 1)[-1], request)
        log.info("started %s on %s (%s pid %d)", module, host, self._via, handle.pid)
        return handle

    def host_up(self, name: str) -> bool:
        """Whether host ``name`` may take roles now (a suspect host is probed first)."""
        with self._lock:
            self._prune()
            return self._is_up(name)

    def _open(self, host: str, kind: str, request: str) -> SshProcess:
        """Start one session on ``host`` and send it ``request`` (the lock is held)."""
        command = shlex.join([self._options.python(), "-m", "elasticps.launcher.remote"])
        try:
            proc = subprocess.Popen(
                [*die_with_parent_prefix(), *self._options.argv(self._by_name[host], command)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise ElasticPSError(f"could not start a session on {host}: {exc}") from exc
        handle = SshProcess(proc, host)
        handle.write_request(request)  # first: before the pinger sees the session
        self._live[self._next_id] = _Live(kind, host, handle)
        self._next_id += 1
        self.placements.append((kind, host))
        if self._pinger is None:
            self._pinger = threading.Thread(target=self._ping, name="ssh-ping", daemon=True)
            self._pinger.start()
        return handle

    def _ping(self) -> None:
        """Write a line to every live session each ``alive_interval_s`` (see ``silence_s``),
        and probe the hosts of the live sessions each ``watch_s`` when the transport asks."""
        watched = time.monotonic()
        while True:
            time.sleep(self._options.alive_interval_s)
            with self._lock:
                live = [entry.proc for entry in self._live.values()]
            for proc in live:
                if proc.poll() is None:
                    proc.ping()
            watch_s = self._options.watch_s
            if watch_s > 0 and time.monotonic() - watched >= watch_s:
                watched = time.monotonic()
                self.watch_once()

    def watch_once(self) -> list[str]:
        """Probe each host that runs a live session; end the sessions of those that fail.

        A host that fails is left out of placement for :data:`DOWN_RETRY_S`
        seconds, and its sessions' clients are killed, so that the launcher sees
        their roles end and restarts them on the hosts left.

        Returns:
            The hosts found lost, in host file order.
        """
        with self._lock:
            busy = {e.host for e in self._live.values() if e.proc.poll() is None}
        lost = [h.name for h in self._hosts if h.name in busy and not self._probe(h.name)]
        if not lost:
            return []
        with self._lock:
            for name in lost:
                log.warning("host %s stopped answering; its roles go elsewhere", name)
                self._down_until[name] = time.monotonic() + DOWN_RETRY_S
                self._suspect.discard(name)
            ended = [e.proc for e in self._live.values() if e.host in lost]
        for proc in ended:
            proc.kill_client()
        return lost

    # --- placement --------------------------------------------------------------

    def _choose(self, kind: str) -> str:
        """The host for a new ``kind`` role (the lock is held)."""
        self._prune()
        up = [h for h in self._hosts if self._is_up(h.name)]
        up_names = {h.name for h in up}
        placed = {f"{live.kind}-{i}": live.host for i, live in self._live.items()
                  if live.host in up_names and live.kind in HOST_ROLES}  # fmt: skip
        try:
            return place(up, [f"{kind}-new"], placed)[f"{kind}-new"]
        except ConfigError as exc:
            allowed = [h for h in up if kind in h.roles]
            if kind == "ps" and allowed:
                load = {h.name: 0 for h in allowed}
                for live in self._live.values():
                    if live.host in load and live.kind in HOST_ROLES:
                        load[live.host] += 1
                host = min(allowed, key=lambda h: load[h.name] - h.slots).name
                log.warning("no host has a free slot for a PS: it shares %s", host)
                return host
            if kind == "ps":
                raise ElasticPSError(f"no host that may run a PS answers ssh: {exc}") from exc
            raise UnschedulableError(str(exc)) from exc

    def _prune(self) -> None:
        """Forget ended sessions; a session lost by ssh makes its host suspect."""
        for key, live in list(self._live.items()):
            code = live.proc.poll()
            if code is None:
                continue
            del self._live[key]
            if self._options.lost(code):
                self._suspect.add(live.host)

    def _is_up(self, name: str) -> bool:
        until = self._down_until.get(name)
        if until is not None:
            if time.monotonic() < until:
                return False
            del self._down_until[name]
            self._suspect.add(name)
        if name in self._suspect:
            self._suspect.discard(name)
            if not self._probe(name):
                log.warning("host %s does not answer; its roles go elsewhere", name)
                self._down_until[name] = time.monotonic() + DOWN_RETRY_S
                return False
        return True

    def _probe(self, name: str) -> bool:
        return self._options.probe(self._by_name[name])

    # --- the request ------------------------------------------------------------

    def _request(
        self, args: Sequence[str], env: Mapping[str, str], module: str = "elasticps"
    ) -> str:
        files: dict[str, str] = {}

        def copy(path: str) -> str:
            name = f"{len(files)}-{os.path.basename(path)}"
            files[name] = base64.b64encode(Path(path).read_bytes()).decode("ascii")
            return f"{FILES_TOKEN}/{name}"

        out = list(args)
        for i, arg in enumerate(out[:-1]):
            value = out[i + 1]
            if arg in ("--model", "--kafka-config") and os.path.isfile(value):
                out[i + 1] = copy(value)
            elif arg == "--model-args":
                out[i + 1] = _copy_named_files(value, copy)
        forwarded = {
            k: v for k, v in env.items() if k.startswith(FORWARDED_ENV) and k not in _LOCAL_ONLY_ENV
        }
        for name in (SECRET_FILE_ENV, *ETCD_NAMES, *TLS_NAMES):
            if forwarded.get(name):
                # The secret's content and the role's keys travel in the request, on
                # the ssh session's stdin; the host writes them into the role's private
                # directory (mode 0600).
                forwarded[name] = copy(forwarded[name])
        return json.dumps(
            {
                "run": out,
                "module": module,
                "env": forwarded,
                "files": files,
                "cwd": os.getcwd(),
                "route_to": self._advertise,
                "silence_s": self._options.silence_s,
            }
        )


def _copy_named_files(text: str, copy: Callable[[str], str]) -> str:
    """``--model-args`` with each string value that names a file replaced by its copy's path."""
    try:
        model_args = json.loads(text)
    except ValueError:
        return text
    if not isinstance(model_args, dict):
        return text
    changed = False
    for key, value in model_args.items():
        if isinstance(value, str) and value and os.path.isfile(value):
            model_args[key] = copy(value)
            changed = True
    return json.dumps(model_args) if changed else text
