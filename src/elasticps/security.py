"""The job secret and the job's certificates: what every process of a job proves it holds
before the others serve it.

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

Beside the secret, :func:`job_credentials` writes the job's CA and one
certificate per role (:mod:`elasticps.jobca`), used for TLS on the job's TCP
connections (:mod:`elasticps.tls`) and, where the job runs its own etcd,
as each role's etcd identity (:mod:`elasticps.coord.etcd_auth`);
:func:`role_credential_env` gives each role process its own.

A job run with ``--auth off`` has no secret and no certificates: its roles
find :data:`AUTH_OFF_ENV` set, serve anyone, and say so in their logs.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from elasticps.errors import ConfigError
from elasticps.jobca import CA_FILE, CERT_FILE, KEY_FILE, Credential, JobCA
from elasticps.pserver.atomic import read_private, write_atomic
from elasticps.tls import (
    TLS_CACERT_ENV,
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    TLS_NAMES,
    TLS_OFF_ENV,
    TLS_OFF_WARNING,
    JobTLS,
    env_files,
    role_host,
)

__all__ = [
    "AUTH_OFF_ENV",
    "AUTH_OFF_WARNING",
    "CREDENTIALS_FILE",
    "ETCD_CACERT_ENV",
    "ETCD_CERT_ENV",
    "ETCD_KEY_ENV",
    "ETCD_NAMES",
    "ETCD_PLAIN_WARNING",
    "ETCD_ROLES",
    "ETCD_ROLES_ENV",
    "ETCD_SERVER_NAME",
    "ETCD_SERVER_NAME_ENV",
    "SECRET_BYTES",
    "SECRET_FILE_ENV",
    "SECRET_FILE_NAME",
    "TLS_NAMES",
    "TLS_ROLES_ENV",
    "JobSecret",
    "Refusals",
    "credential_env",
    "etcd_tls_env",
    "etcd_tls_from_env",
    "job_credentials",
    "job_tls_dir",
    "output_credentials",
    "output_etcd_tls",
    "output_secret",
    "output_tls",
    "role_credential_env",
    "role_env",
    "secret_from_env",
    "secret_or_env",
    "secret_path",
    "write_etcd_server_tls",
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

ETCD_PLAIN_WARNING: Final = (
    "etcd speaks plain TCP and checks no client: "
    "any process that reaches its port can read and write the job's keys"
)
"""What a job with authentication on but its etcd without TLS writes in ``run.json``."""

ETCD_CACERT_ENV: Final = "ELASTICPS_ETCD_CACERT"
"""The variable that names the CA certificate (PEM) a process trusts etcd by."""
ETCD_CERT_ENV: Final = "ELASTICPS_ETCD_CERT"
"""The variable that names the client certificate (PEM) a process shows etcd."""
ETCD_KEY_ENV: Final = "ELASTICPS_ETCD_KEY"
"""The variable that names that certificate's private key (PEM, mode 0600)."""
ETCD_SERVER_NAME_ENV: Final = "ELASTICPS_ETCD_SERVER_NAME"
"""The variable that names the host name etcd's certificate is checked against, if not
the address dialled."""
ETCD_ROLES_ENV: Final = "ELASTICPS_ETCD_TLS_ROLES"
"""Set in a launcher only, when the job's own etcd trusts the job's CA: the directory
with one credential per role."""
TLS_ROLES_ENV: Final = "ELASTICPS_TLS_ROLES"
"""Set in a launcher only, with TLS on: the directory with one credential per role."""

ETCD_ROLES: Final = ("root", "master", "ps", "trainer")
"""The etcd users of a job: ``root`` (the launcher) and one per role."""

ETCD_SERVER_NAME: Final = "etcd.elasticps.internal"
"""The name in the certificate of a job's own etcd, that its clients check."""

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
        data = read_private(path, "the job secret", limit=4 * SECRET_BYTES)
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


ETCD_NAMES: Final = (ETCD_CACERT_ENV, ETCD_CERT_ENV, ETCD_KEY_ENV)
"""The variables that name a process's etcd CA, certificate and key files."""


def credential_env(names: tuple[str, str, str], directory: Path) -> dict[str, str]:
    """The variables ``names`` naming the CA, certificate and key files in ``directory``."""
    files = (directory / CA_FILE, directory / CERT_FILE, directory / KEY_FILE)
    return dict(zip(names, (str(path) for path in files), strict=True))


_CREDENTIAL_ENV: Final = (
    SECRET_FILE_ENV,
    AUTH_OFF_ENV,
    ETCD_ROLES_ENV,
    ETCD_CACERT_ENV,
    ETCD_CERT_ENV,
    ETCD_KEY_ENV,
    ETCD_SERVER_NAME_ENV,
    TLS_ROLES_ENV,
    TLS_CACERT_ENV,
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    TLS_OFF_ENV,
)


@contextlib.contextmanager
def job_credentials(
    output: Path,
    *,
    auth: bool,
    tls: bool = True,
    ca: JobCA | None = None,
    etcd_tls: bool = False,
    job: str = "elasticps",
) -> Iterator[JobSecret | None]:
    """Make a job's secret and certificates, and give them to this process and every
    role it starts.

    With ``auth``, a new secret is written to ``output/security/job-secret``
    (mode 0600, the directory 0700) and this process's environment names it
    (:data:`SECRET_FILE_ENV`) until the block ends, so that the role
    processes the launcher starts inherit it, and the launcher's own clients
    (checkpoints, status) use it. The job's CA (``ca``, or a new one) is
    written beside it (``ca.pem``, and ``ca-key.pem`` unless it is the user's
    own), and one credential per
    :data:`ETCD_ROLES` entry under ``output/security/tls/<role>``
    (:func:`job_tls_dir`), each naming :func:`elasticps.tls.role_host` of its
    role. This process uses the ``root`` one; :func:`role_credential_env`
    gives each role its own, for TLS on the tensor plane and gRPC (unless
    ``tls`` is False: then :data:`~elasticps.tls.TLS_OFF_ENV` is set and
    :data:`~elasticps.tls.TLS_OFF_WARNING` goes to the log) and, with
    ``etcd_tls``, for etcd; :data:`CREDENTIALS_FILE` records which, for the
    job's clients outside it (:func:`output_credentials`). Without ``auth``,
    :data:`AUTH_OFF_ENV` is set instead, no certificate is made, and
    :data:`AUTH_OFF_WARNING` goes to the log. The environment is restored at
    the end; one job at a time per process.

    Args:
        output: the job's output directory (a local path).
        auth: whether the job asks for its secret (``--auth on``).
        tls: whether its TCP connections use TLS (``--tls on``); needs ``auth``.
        ca: the CA to issue the certificates from (the one the job's etcd
            trusts, or the user's ``--ca``); None: a new one.
        etcd_tls: the job's etcd runs with TLS from ``ca``; False: plain.
        job: the job's name, in a new CA's certificates.

    Yields:
        The secret, or None without ``auth``.

    Raises:
        OSError: a file cannot be written.
    """
    saved = {name: os.environ.get(name) for name in _CREDENTIAL_ENV}
    secret: JobSecret | None = None
    if auth:
        path = secret_path(output)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        secret = JobSecret.generate()
        secret.write(path)
        variables = role_env(path.resolve())
        ca = ca if ca is not None else JobCA.generate(job)
        ca.write(path.parent)
        roles_dir = job_tls_dir(output).resolve()
        for role in ETCD_ROLES:
            ca.issue(role, dns_names=(role_host(role),)).write(roles_dir / role)
        uses = {"tls": tls, "etcd_tls": etcd_tls}
        write_atomic(path.parent / CREDENTIALS_FILE, json.dumps(uses).encode())
        if etcd_tls:
            variables[ETCD_ROLES_ENV] = str(roles_dir)
            variables.update(etcd_tls_env(roles_dir / "root"))
        if tls:
            variables[TLS_ROLES_ENV] = str(roles_dir)
            variables.update(credential_env(TLS_NAMES, roles_dir / "root"))
        else:
            log.warning("%s", TLS_OFF_WARNING)
            variables[TLS_OFF_ENV] = "1"
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


def etcd_tls_env(directory: Path, server_name: str = ETCD_SERVER_NAME) -> dict[str, str]:
    """The variables that give a process the etcd credential in ``directory``."""
    return {**credential_env(ETCD_NAMES, Path(directory)), ETCD_SERVER_NAME_ENV: server_name}


def etcd_tls_from_env(env: Mapping[str, str] | None = None) -> Credential | None:
    """The TLS identity this process shows etcd, or None to speak plain TCP.

    Read from the files :data:`ETCD_CACERT_ENV`, :data:`ETCD_CERT_ENV` and
    :data:`ETCD_KEY_ENV` name (all three, or none); the peer's certificate is
    checked against :data:`ETCD_SERVER_NAME_ENV` if set, else against the
    address dialled.

    Args:
        env: the environment to read; None: this process's.

    Raises:
        ConfigError: only some of the three are set, or a file cannot be read.
    """
    env = os.environ if env is None else env
    files = env_files(env, ETCD_NAMES, "etcd TLS")
    return None if files is None else Credential.read(*files, env.get(ETCD_SERVER_NAME_ENV, ""))


def role_credential_env(env: Mapping[str, str], role: str) -> dict[str, str]:
    """``env`` for a role process: with its role's certificate, where the job made them.

    A launcher's environment names the directory of every role's credential
    (:data:`TLS_ROLES_ENV` for the tensor plane and gRPC, :data:`ETCD_ROLES_ENV`
    for an etcd that trusts the job's CA); the role gets only its own (``ps-3``
    the ``ps`` one), and a process of no role (a fork server) none. Variables
    the launcher did not set this way (etcd credentials a user brought) pass
    through unchanged.

    Args:
        env: the launcher's environment.
        role: the process's name (``master``, ``ps-0``, ``trainer-3``, ...).
    """
    out = dict(env)
    kind = role.split("-", maxsplit=1)[0]
    own = kind in ETCD_ROLES and kind != "root"
    for roles_env, names in ((ETCD_ROLES_ENV, ETCD_NAMES), (TLS_ROLES_ENV, TLS_NAMES)):
        roles_dir = out.pop(roles_env, "")
        if not roles_dir:
            continue
        for name in names:
            out.pop(name, None)
        if own:
            out.update(credential_env(names, Path(roles_dir) / kind))
    return out


def job_tls_dir(output: Path) -> Path:
    """The directory of the certificates of the job whose output is ``output``: one
    sub-directory per :data:`ETCD_ROLES` entry."""
    return Path(output) / "security" / "tls"


CREDENTIALS_FILE: Final = "credentials.json"
"""In ``OUTPUT/security``: what the job's certificates are used for,
``{"tls": bool, "etcd_tls": bool}``."""


def _uses(output: Path) -> dict[str, bool]:
    try:
        record = json.loads((Path(output) / "security" / CREDENTIALS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(record, dict):
        return {}
    return {name: record.get(name) is True for name in ("tls", "etcd_tls")}


def output_etcd_tls(output: Path) -> Credential | None:
    """The ``root`` etcd credential of the job whose output is ``output``, None if its
    etcd has no TLS (or the job made no certificates: then the caller's environment's).

    Raises:
        ConfigError: the files are there but unreadable.
    """
    if not _uses(output).get("etcd_tls"):
        return None
    return Credential.read_dir(job_tls_dir(output) / "root", ETCD_SERVER_NAME)


def output_tls(output: Path) -> JobTLS | None:
    """The ``root`` TLS setup of the job whose output is ``output``, for its tensor plane
    and master; None if it runs without TLS.

    Raises:
        ConfigError: the files are there but unreadable.
    """
    if not _uses(output).get("tls"):
        return None
    return JobTLS.from_dir(job_tls_dir(output) / "root")


@contextlib.contextmanager
def output_credentials(output: Path) -> Iterator[None]:
    """Give this process, for the block, what a client of the running job whose output
    is ``output`` needs: its secret and its ``root`` certificate for the planes that
    use one (``elasticps checkpoint --job-output``). Nothing changes for a job
    without them. Not thread-safe: it sets the environment.

    Raises:
        ConfigError: the files are there but unreadable.
    """
    variables: dict[str, str] = {}
    if secret_path(output).exists():
        variables[SECRET_FILE_ENV] = str(secret_path(output).resolve())
    root = job_tls_dir(output).resolve() / "root"
    if output_etcd_tls(output) is not None:
        variables.update(etcd_tls_env(root))
    if output_tls(output) is not None:
        variables.update(credential_env(TLS_NAMES, root))
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def write_etcd_server_tls(ca: JobCA, directory: Path, ips: tuple[str, ...] = ()) -> Path:
    """Issue etcd's own certificate and write it into ``directory``.

    The certificate names :data:`ETCD_SERVER_NAME`, ``localhost``, the
    loopback addresses and ``ips``.

    Returns:
        ``directory``.

    Raises:
        OSError: a file cannot be written.
        ConfigError: an entry of ``ips`` is not an IP address.
    """
    addresses = tuple(dict.fromkeys(("127.0.0.1", "::1", *ips)))
    credential = ca.issue("etcd", dns_names=(ETCD_SERVER_NAME, "localhost"), ips=addresses)
    return credential.write(directory)
