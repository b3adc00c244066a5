"""TLS 1.3 on the job's TCP connections: the tensor plane and the master's gRPC service.

Every role of a job run with authentication on holds a certificate from the
job's CA (:mod:`elasticps.jobca`), whose subject alternative name is
``<role>.elasticps.internal`` (:func:`role_host`). With TLS on (the default,
``--tls on``), every TCP connection of the tensor plane and of gRPC is TLS
1.3 with certificates on both sides:

- the server shows its role's certificate and asks for the client's; a
  client whose certificate the job's CA did not sign is refused during the
  handshake, before anything else is read;
- the client checks the server's certificate against the job's CA and
  against the name of the role it dials (a parameter server must present a
  ``ps`` certificate, the master a ``master`` one), not against the address,
  so a parameter server can move between hosts without a new certificate.

The job secret's challenge-response (:mod:`elasticps.wire.auth`) and the
gRPC token still run inside the TLS stream. AF_UNIX and shared-memory
connections (same host, peer uid checked) are not encrypted.

A role finds its credential through :data:`TLS_CACERT_ENV`,
:data:`TLS_CERT_ENV` and :data:`TLS_KEY_ENV` (the launcher sets them; see
:func:`elasticps.security.role_credential_env`); :data:`TLS_OFF_ENV` set
means the job runs with ``--tls off``.

Python's :mod:`ssl` (OpenSSL) makes the contexts; gRPC uses its own
(BoringSSL) with the same files.
"""

from __future__ import annotations

import functools
import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

from elasticps.errors import AuthenticationError, ConfigError
from elasticps.jobca import Credential

if TYPE_CHECKING:
    import grpc

__all__ = [
    "ROLE_DOMAIN",
    "TLS_CACERT_ENV",
    "TLS_CERT_ENV",
    "TLS_KEY_ENV",
    "TLS_NAMES",
    "TLS_OFF_ENV",
    "TLS_OFF_WARNING",
    "JobTLS",
    "env_files",
    "is_refusal",
    "role_host",
    "tls_from_env",
]

TLS_CACERT_ENV: Final = "ELASTICPS_TLS_CACERT"
"""The variable that names the job's CA certificate (PEM), which a role trusts."""
TLS_CERT_ENV: Final = "ELASTICPS_TLS_CERT"
"""The variable that names the role's certificate (PEM)."""
TLS_KEY_ENV: Final = "ELASTICPS_TLS_KEY"
"""The variable that names the role's private key (PEM, mode 0600)."""
TLS_NAMES: Final = (TLS_CACERT_ENV, TLS_CERT_ENV, TLS_KEY_ENV)
"""The variables that name a process's job CA, certificate and key files."""
TLS_OFF_ENV: Final = "ELASTICPS_TLS_OFF"
"""Set (to ``1``) in every process of a job run with ``--tls off``."""

TLS_OFF_WARNING: Final = (
    "TLS is off (--tls off): the tensor plane and gRPC between hosts travel in clear text, "
    "and a peer is known only by the job secret; use this on a trusted network only"
)
"""What a job run with ``--tls off`` writes in its log and its ``run.json``."""

ROLE_DOMAIN: Final = "elasticps.internal"
"""The domain of the names in the roles' certificates."""


def role_host(role: str) -> str:
    """The name in the certificate of ``role`` (``ps`` -> ``ps.elasticps.internal``)."""
    return f"{role}.{ROLE_DOMAIN}"


def is_refusal(exc: OSError) -> bool:
    """Whether ``exc``, raised on a TLS connection, is the peer refusing this side's
    certificate or this side refusing the peer's (not a connection that broke)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True
    if isinstance(exc, ssl.SSLError) and not isinstance(exc, ssl.SSLEOFError):
        reason = str(exc.reason or "")
        return "ALERT" in reason or "CERTIFICATE" in reason
    return False


@dataclass(frozen=True)
class JobTLS:
    """One process's TLS setup for the job's TCP connections.

    Attributes:
        ca: the CA certificate file (PEM).
        cert: this role's certificate file (PEM).
        key: its private key file (PEM, mode 0600).
    """

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def from_dir(cls, directory: Path) -> JobTLS:
        """The credential :meth:`elasticps.jobca.Credential.write` wrote into ``directory``.

        Raises:
            ConfigError: a file is missing or unreadable, or the key is readable by others.
        """
        directory = Path(directory)
        tls = cls(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
        tls.credential()
        return tls

    def credential(self) -> Credential:
        """The three files' contents.

        Raises:
            ConfigError: a file is missing or unreadable, or the key is readable by others.
        """
        return Credential.read(self.ca, self.cert, self.key)

    def server_context(self) -> ssl.SSLContext:
        """A TLS 1.3 server context that requires a client certificate from the job's CA.

        Raises:
            ConfigError: the files cannot be loaded.
        """
        return _context(self, server=True)

    def client_context(self) -> ssl.SSLContext:
        """A TLS 1.3 client context that checks the server against the job's CA and
        shows this role's certificate.

        Raises:
            ConfigError: the files cannot be loaded.
        """
        return _context(self, server=False)

    def wrap_client(self, sock: socket.socket, role: str, timeout_s: float) -> ssl.SSLSocket:
        """Run the client's TLS handshake on the connected ``sock``, expecting ``role``'s
        certificate.

        Returns:
            The TLS socket (``sock`` is detached; close the returned one).

        Raises:
            AuthenticationError: ``tls``: a certificate was refused, by either side.
            OSError: the connection broke during the handshake.
        """
        tls = self.client_context().wrap_socket(
            sock, server_hostname=role_host(role), do_handshake_on_connect=False
        )
        try:
            tls.settimeout(timeout_s)
            tls.do_handshake()
        except OSError as exc:
            tls.close()
            if is_refusal(exc):
                raise AuthenticationError("tls", f"TLS handshake refused: {exc}") from exc
            raise
        return tls

    def wrap_server(self, sock: socket.socket, timeout_s: float) -> ssl.SSLSocket:
        """Run the server's TLS handshake on the accepted ``sock``.

        Returns:
            The TLS socket (``sock`` is detached; close the returned one).

        Raises:
            AuthenticationError: ``tls``: the client's certificate was refused, or it
                spoke something other than TLS, or stalled (``timeout_s``).
        """
        tls = self.server_context().wrap_socket(
            sock, server_side=True, do_handshake_on_connect=False
        )
        try:
            tls.settimeout(timeout_s)
            tls.do_handshake()
        except OSError as exc:
            tls.close()
            raise AuthenticationError("tls", f"TLS handshake failed: {exc}") from exc
        return tls

    def grpc_server_credentials(self) -> grpc.ServerCredentials:
        """gRPC server credentials that require a client certificate from the job's CA.

        Raises:
            ConfigError: the files cannot be read.
        """
        import grpc  # not at the top: the launcher's checks run before grpc loads

        cred = self.credential()
        return grpc.ssl_server_credentials(
            [(cred.key_pem, cred.cert_pem)],
            root_certificates=cred.ca_pem,
            require_client_auth=True,
        )

    def grpc_channel_credentials(self) -> grpc.ChannelCredentials:
        """gRPC channel credentials: trust the job's CA, show this role's certificate.

        Raises:
            ConfigError: the files cannot be read.
        """
        import grpc

        cred = self.credential()
        return grpc.ssl_channel_credentials(
            root_certificates=cred.ca_pem,
            private_key=cred.key_pem,
            certificate_chain=cred.cert_pem,
        )


@functools.lru_cache(maxsize=8)
def _cached_context(ca: Path, cert: Path, key: Path, server: bool) -> ssl.SSLContext:
    credential = Credential.read(ca, cert, key)  # checks the key's mode
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.verify_mode = ssl.CERT_REQUIRED
    try:
        ctx.load_verify_locations(cadata=credential.ca_pem.decode("ascii"))
        ctx.load_cert_chain(cert, key)
    except (ssl.SSLError, ValueError, OSError) as exc:
        raise ConfigError(f"cannot load the TLS credential {cert}: {exc}") from exc
    return ctx


def _context(tls: JobTLS, *, server: bool) -> ssl.SSLContext:
    return _cached_context(tls.ca, tls.cert, tls.key, server)


def tls_from_env(env: Mapping[str, str] | None = None) -> JobTLS | None:
    """This process's TLS setup for the job's TCP connections, or None for plain TCP.

    None when :data:`TLS_OFF_ENV` is set or none of :data:`TLS_CACERT_ENV`,
    :data:`TLS_CERT_ENV` and :data:`TLS_KEY_ENV` is (a job run with
    ``--auth off``, or a process outside any job).

    Args:
        env: the environment to read; None: this process's.

    Raises:
        ConfigError: only some of the three are set.
    """
    env = os.environ if env is None else env
    if env.get(TLS_OFF_ENV):
        return None
    files = env_files(env, TLS_NAMES, "TLS")
    return None if files is None else JobTLS(*files)


def env_files(
    env: Mapping[str, str], names: tuple[str, str, str], what: str
) -> tuple[Path, Path, Path] | None:
    """The CA, certificate and key files three variables of ``env`` name, all or none.

    Args:
        env: the environment to read.
        names: the three variables, in that order.
        what: what they are for, in the message (``TLS``, ``etcd TLS``).

    Returns:
        The three paths, or None if none of the variables is set.

    Raises:
        ConfigError: only some of the three are set.
    """
    paths = [env.get(name, "") for name in names]
    if not any(paths):
        return None
    if not all(paths):
        missing = ", ".join(name for name, path in zip(names, paths, strict=True) if not path)
        raise ConfigError(f"{what} needs all of {', '.join(names)}; {missing} not set")
    return Path(paths[0]), Path(paths[1]), Path(paths[2])
