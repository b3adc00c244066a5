"""A job's certificate authority and the TLS credentials it issues.

Each job run with authentication on gets its own CA, made by its launcher
with :mod:`cryptography` (ECDSA P-256 keys, SHA-256 signatures, X.509 v3).
The CA signs a certificate for etcd and one client certificate per role;
etcd trusts only this CA and maps each client certificate's common name to
an etcd user (``--client-cert-auth``), so a process holds exactly the etcd
rights of the role whose key it was given.

A :class:`Credential` is what one process needs: the CA certificate to
trust, its own certificate and its own key. On disk it is three PEM
files (``ca.pem``, ``cert.pem``, ``key.pem``), each mode 0600 in a 0700
directory, written through :func:`~elasticps.pserver.atomic.write_atomic`.

Trust comes from the CA alone: a job's CA signs for that job and nothing
else, and its key stays in the launcher's output directory.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from elasticps.errors import ConfigError
from elasticps.pserver.atomic import read_private, write_atomic

__all__ = ["CA_FILE", "CA_KEY_FILE", "CERT_FILE", "KEY_FILE", "Credential", "JobCA"]

CA_FILE: Final = "ca.pem"
"""A credential's CA certificate (the one certificate it trusts)."""
CERT_FILE: Final = "cert.pem"
"""A credential's own certificate."""
KEY_FILE: Final = "key.pem"
"""A credential's private key (PKCS #8, unencrypted: the file's mode protects it)."""
CA_KEY_FILE: Final = "ca-key.pem"
"""A CA's private key, beside its certificate (``ca.pem``)."""

#: How long a job's certificates are valid, from a minute before they are made.
_VALIDITY: Final = datetime.timedelta(days=365)
_CLOCK_SKEW: Final = datetime.timedelta(minutes=5)


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str, job: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, f"elasticps job {job}"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


@dataclass(frozen=True, repr=False)
class Credential:
    """One process's TLS identity: whom it trusts, who it is, and its key.

    Attributes:
        ca_pem: the CA certificate, PEM.
        cert_pem: this identity's certificate, PEM.
        key_pem: this identity's private key, PEM (PKCS #8).
        server_name: the name to check a server's certificate against instead
            of the address dialled; empty: the address.
    """

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes
    server_name: str = ""

    def __repr__(self) -> str:
        return f"Credential(common_name={self.common_name!r})"

    @property
    def common_name(self) -> str:
        """The common name of this identity's certificate (for etcd: the user name)."""
        cert = x509.load_pem_x509_certificate(self.cert_pem)
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        return str(names[0].value) if names else ""

    def write(self, directory: Path) -> Path:
        """Write ``ca.pem``, ``cert.pem`` and ``key.pem`` into ``directory`` (made 0700),
        each mode 0600.

        Returns:
            ``directory``.

        Raises:
            OSError: a file cannot be written.
        """
        directory = Path(directory)
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        for name, data in (
            (CA_FILE, self.ca_pem),
            (CERT_FILE, self.cert_pem),
            (KEY_FILE, self.key_pem),
        ):
            write_atomic(directory / name, data)
            os.chmod(directory / name, 0o600)
        return directory

    @classmethod
    def read(cls, ca: Path, cert: Path, key: Path, server_name: str = "") -> Credential:
        """Read a credential from its three PEM files (as :meth:`write` or ``openssl`` made them).

        Raises:
            ConfigError: a file is missing or unreadable, or the key file may be
                read by others than its owner.
        """
        return cls(
            read_private(ca, "the TLS file", private=False),
            read_private(cert, "the TLS file", private=False),
            read_private(key, "the TLS key"),
            server_name,
        )

    @classmethod
    def read_dir(cls, directory: Path, server_name: str = "") -> Credential:
        """Read the credential :meth:`write` wrote into ``directory``.

        Raises:
            ConfigError: see :meth:`read`.
        """
        directory = Path(directory)
        return cls.read(
            directory / CA_FILE, directory / CERT_FILE, directory / KEY_FILE, server_name
        )


@dataclass(frozen=True, repr=False)
class JobCA:
    """A job's certificate authority.

    Attributes:
        job: the job it signs for (in every certificate's organization).
        cert_pem: the CA's certificate, PEM.
        key_pem: the CA's private key, PEM.
        own: the user's CA (:meth:`read`), not one made for the job: its key is
            never written into the job's files.
    """

    job: str
    cert_pem: bytes
    key_pem: bytes
    own: bool = False

    def __repr__(self) -> str:
        return f"JobCA(job={self.job!r})"

    @classmethod
    def generate(cls, job: str) -> JobCA:
        """A new CA for ``job``: a fresh P-256 key and a self-signed certificate, valid a year."""
        key = ec.generate_private_key(ec.SECP256R1())
        name = _name(f"elasticps job {job} CA", job)
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        return cls(job, cert.public_bytes(serialization.Encoding.PEM), _pem_key(key))

    def issue(
        self,
        common_name: str,
        *,
        dns_names: Sequence[str] = (),
        ips: Sequence[str] = (),
        server_name: str = "",
    ) -> Credential:
        """A certificate signed by this CA for ``common_name``, usable as client and server.

        Args:
            common_name: the identity (for etcd: the user it acts as).
            dns_names: host names the certificate is valid for as a server.
            ips: IP addresses the certificate is valid for as a server.
            server_name: stored in the credential: the name its holder checks
                servers against (see :class:`Credential`).

        Raises:
            ConfigError: an entry of ``ips`` is not an IP address.
        """
        ca_key = _signing_key(self.key_pem, "the job CA's key")
        ca_cert = x509.load_pem_x509_certificate(self.cert_pem)
        key = ec.generate_private_key(ec.SECP256R1())
        try:
            addresses = [ipaddress.ip_address(ip) for ip in ips]
        except ValueError as exc:
            raise ConfigError(f"certificate for {common_name}: {exc}") from exc
        alt_names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
        alt_names += [x509.IPAddress(address) for address in addresses]
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name, self.job))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _CLOCK_SKEW)
            .not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
            )
        )
        if alt_names:
            builder = builder.add_extension(x509.SubjectAlternativeName(alt_names), False)
        cert = builder.sign(ca_key, hashes.SHA256())
        return Credential(
            self.cert_pem,
            cert.public_bytes(serialization.Encoding.PEM),
            _pem_key(key),
            server_name,
        )

    @classmethod
    def read(cls, directory: Path, job: str) -> JobCA:
        """The user's own CA: ``ca.pem`` (its certificate) and ``ca-key.pem`` (its key,
        PEM, unencrypted, mode 0600; ECDSA or RSA) in ``directory``.

        Raises:
            ConfigError: a file is missing, unreadable or readable by others; the
                certificate is not a CA's, or the key is not its key.
        """
        directory = Path(directory)
        credential = Credential.read(
            directory / CA_FILE, directory / CA_FILE, directory / CA_KEY_FILE
        )
        what = f"the CA in {directory}"
        try:
            cert = x509.load_pem_x509_certificate(credential.ca_pem)
        except ValueError as exc:
            raise ConfigError(f"{what}: {CA_FILE} is not a PEM certificate: {exc}") from exc
        key = _signing_key(credential.key_pem, f"{what}: {CA_KEY_FILE}")
        try:
            constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            constraints = None
        if constraints is None or not constraints.ca:
            raise ConfigError(f"{what}: {CA_FILE} is not a CA certificate (basicConstraints)")
        public = serialization.PublicFormat.SubjectPublicKeyInfo
        if key.public_key().public_bytes(
            serialization.Encoding.DER, public
        ) != cert.public_key().public_bytes(serialization.Encoding.DER, public):
            raise ConfigError(f"{what}: {CA_KEY_FILE} is not the key of {CA_FILE}")
        return cls(job, credential.ca_pem, credential.key_pem, own=True)

    def write(self, directory: Path) -> None:
        """Write ``ca.pem`` and (unless :attr:`own`) ``ca-key.pem`` into ``directory``,
        each mode 0600.

        Raises:
            OSError: a file cannot be written.
        """
        directory = Path(directory)
        files = [(CA_FILE, self.cert_pem)]
        if not self.own:
            files.append((CA_KEY_FILE, self.key_pem))
        for name, data in files:
            write_atomic(directory / name, data)
            os.chmod(directory / name, 0o600)


def _signing_key(pem: bytes, what: str) -> ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey:
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{what} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise ConfigError(f"{what} is a {type(key).__name__}; an ECDSA or RSA key is needed")
    return key
