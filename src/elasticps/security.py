"""The job secret: what every process of a job proves it holds before the others serve it.

Each job gets 32 random bytes (:func:`secrets.token_bytes`), made by its
launcher and written to ``<output>/security/job-secret`` (hex text, mode
0600, through :func:`~elasticps.pserver.atomic.write_atomic`). The roles find
the file through :data:`SECRET_FILE_ENV`, which names the file, never its
content, so the secret appears on no command line and in no log. How the
file reaches a role depends on the launcher: the local launcher's children
read it where it is; the ssh and Slurm launchers send it in the role's
request on the session's standard input, and the host writes it into the
role's private directory; on Kubernetes it is a Secret mounted into the pods.

What the secret protects (the README's Security section has the whole picture):

- the tensor plane: a connection is served only after a challenge-response
  on a key derived from the secret (:mod:`elasticps.wire.auth`);
- the master's gRPC service: every call carries a token derived from the
  secret (:meth:`JobSecret.grpc_token`); the health service stays open.

The keys derived for each plane are HMAC-SHA256 of the secret and a label
(RFC 2104; the label separates the planes), so a token seen on one plane is
no use on another.

A job run with ``--auth off`` has no secret: its roles find
:data:`AUTH_OFF_ENV` set, serve anyone, and say so in their logs.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from elasticps.errors import ConfigError
from elasticps.pserver.atomic import write_atomic

__all__ = [
    "AUTH_OFF_ENV",
    "AUTH_OFF_WARNING",
    "SECRET_BYTES",
    "SECRET_FILE_ENV",
    "SECRET_FILE_NAME",
    "JobSecret",
    "Refusals",
    "job_credentials",
    "output_secret",
    "role_env",
    "secret_from_env",
    "secret_or_env",
    "secret_path",
]

log = logging.getLogger(__name__)

SECRET_FILE_ENV: Final = "ELASTICPS_JOB_SECRET_FILE"
"""The variable that names a role's job-secret file."""

AUTH_OFF_ENV: Final = "ELASTICPS_AUTH_OFF"
"""Set to ``1`` in the roles of a job run with ``--auth off``."""

SECRET_FILE_NAME: Final = "job-secret"
"""The secret's file name, in the ``security`` directory of a job's output."""

SECRET_BYTES: Final = 32
"""Length of a job secret, bytes (256 bits, the HMAC-SHA256 key length)."""

AUTH_OFF_WARNING: Final = (
    "authentication is off (--auth off): any process that reaches this job's ports "
    "can push gradients, pull parameters and take tasks"
)
"""What a job run with ``--auth off`` writes in its log and its ``run.json``."""

_TENSOR_PLANE_LABEL: Final = b"elasticps tensor plane v1"
_GRPC_LABEL: Final = b"elasticps master grpc v1"


@dataclass(frozen=True, repr=False)
class JobSecret:
    """A job's secret (its ``repr`` never shows it).

    Attributes:
        key: the secret, :data:`SECRET_BYTES` bytes.

    Raises:
        ConfigError: ``key`` is not :data:`SECRET_BYTES` bytes long.
    """

    key: bytes

    def __post_init__(self) -> None:
        if len(self.key) != SECRET_BYTES:
            raise ConfigError(f"a job secret is {SECRET_BYTES} bytes, got {len(self.key)}")

    def __repr__(self) -> str:
        return "JobSecret(<hidden>)"

    @classmethod
    def generate(cls) -> JobSecret:
        """A new random secret, from the operating system's CSPRNG."""
        return cls(secrets.token_bytes(SECRET_BYTES))

    def tensor_plane_key(self) -> bytes:
        """The HMAC key of the tensor plane's challenge-response, 32 bytes."""
        return hmac.new(self.key, _TENSOR_PLANE_LABEL, hashlib.sha256).digest()

    def grpc_token(self) -> str:
        """The bearer token every call to the master carries: 64 hex characters."""
        return hmac.new(self.key, _GRPC_LABEL, hashlib.sha256).hexdigest()

    def write(self, path: Path) -> None:
        """Write the secret to ``path`` as hex text, mode 0600, atomically and durably.

        Raises:
            OSError: the file cannot be written.
        """
        write_atomic(Path(path), self.key.hex().encode("ascii") + b"\n")
        os.chmod(path, 0o600)

    @classmethod
    def read(cls, path: Path) -> JobSecret:
        """Read a secret written by :meth:`write`.

        Raises:
            ConfigError: the file cannot be read, others than its owner may
                read or write it, or it does not hold a secret.
        """
        path = Path(path)
        try:
            with path.open("rb") as handle:
                mode = os.fstat(handle.fileno()).st_mode
                data = handle.read(4 * SECRET_BYTES)
        except OSError as exc:
            raise ConfigError(f"cannot read the job secret {path}: {exc.strerror}") from exc
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(
                f"the job secret {path} is readable by others (mode {stat.filemode(mode)}); "
                "it must be 0600"
            )
        try:
            key = bytes.fromhex(data.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise ConfigError(f"{path} does not hold a job secret (hex text)") from None
        if len(key) != SECRET_BYTES:
            raise ConfigError(f"{path} does not hold a job secret ({SECRET_BYTES} bytes of hex)")
        return cls(key)


def secret_from_env(env: Mapping[str, str] | None = None) -> JobSecret | None:
    """The job secret this process was given, or None if its job runs with ``--auth off``.

    Args:
        env: the environment to read; None: this process's.

    Returns:
        The secret of the file :data:`SECRET_FILE_ENV` names; None if that
        variable is unset (with :data:`AUTH_OFF_ENV` set, silently; without
        it, with a warning in the log: the process was started by hand).

    Raises:
        ConfigError: the file cannot be read or holds no secret.
    """
    env = os.environ if env is None else env
    path = env.get(SECRET_FILE_ENV, "")
    if path:
        return JobSecret.read(Path(path))
    if env.get(AUTH_OFF_ENV) != "1":
        log.warning("no job secret (%s is not set): %s", SECRET_FILE_ENV, AUTH_OFF_WARNING)
    return None


def secret_or_env(secret: JobSecret | None) -> JobSecret | None:
    """``secret`` if given, else this process's (:func:`secret_from_env`): what a client uses.

    Raises:
        ConfigError: the variable names a file that holds no secret.
    """
    return secret if secret is not None else secret_from_env()


def secret_path(output: Path) -> Path:
    """Where the secret of the job whose output directory is ``output`` lives."""
    return Path(output) / "security" / SECRET_FILE_NAME


def output_secret(output: Path) -> JobSecret | None:
    """The secret of the job whose output directory is ``output``, or None if it has none.

    Raises:
        ConfigError: the file is there but unreadable or not a secret.
    """
    path = secret_path(output)
    return JobSecret.read(path) if path.exists() else None


class Refusals:
    """What one server refused, by reason, and when to say so in its log.

    Thread-safe. :meth:`add` asks for a log line at the 1st, 2nd, 4th, 8th...
    refusal, so a flood of attempts writes about ``log2(n)`` lines for ``n``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def add(self, reason: str) -> int | None:
        """Count one refusal; return the total so far if it is time to log it, else None."""
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
            total = sum(self._counts.values())
        return total if total & (total - 1) == 0 else None

    def counts(self) -> dict[str, int]:
        """The refusals so far, by reason."""
        with self._lock:
            return dict(self._counts)


def role_env(secret_file: Path | None) -> dict[str, str]:
    """The variables that give a role its job's secret (or say that the job has none).

    Args:
        secret_file: the secret's file, or None for a job run with ``--auth off``.
    """
    if secret_file is None:
        return {AUTH_OFF_ENV: "1"}
    return {SECRET_FILE_ENV: str(secret_file)}


@contextlib.contextmanager
def job_credentials(output: Path, *, auth: bool) -> Iterator[JobSecret | None]:
    """Make a job's secret and give it to this process and every role it starts.

    With ``auth``, a new secret is written to ``output/security/job-secret``
    (mode 0600, the directory 0700) and this process's environment names it
    (:data:`SECRET_FILE_ENV`) until the block ends, so that the role
    processes the launcher starts inherit it, and the launcher's own clients
    (checkpoints, status) use it. Without ``auth``, :data:`AUTH_OFF_ENV` is
    set instead and :data:`AUTH_OFF_WARNING` goes to the log. The environment
    is restored at the end; one job at a time per process.

    Args:
        output: the job's output directory (a local path).
        auth: whether the job asks for its secret (``--auth on``).

    Yields:
        The secret, or None without ``auth``.

    Raises:
        OSError: the secret cannot be written.
    """
    saved = {name: os.environ.get(name) for name in (SECRET_FILE_ENV, AUTH_OFF_ENV)}
    secret: JobSecret | None = None
    if auth:
        path = secret_path(output)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        secret = JobSecret.generate()
        secret.write(path)
        variables = role_env(path.resolve())
    else:
        log.warning("%s", AUTH_OFF_WARNING)
        variables = role_env(None)
    for name in saved:
        os.environ.pop(name, None)
    os.environ.update(variables)
    try:
        yield secret
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
