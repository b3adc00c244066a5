"""The job CA, the credentials it issues, and who may write which etcd keys. No sockets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.x509.oid import ExtendedKeyUsageOID

from elasticps.coord.etcd_auth import permits, role_grants
from elasticps.coord.keys import Keys
from elasticps.errors import ConfigError
from elasticps.jobca import Credential, JobCA
from elasticps.security import (
    ETCD_CACERT_ENV,
    ETCD_CERT_ENV,
    ETCD_KEY_ENV,
    ETCD_NAMES,
    ETCD_ROLES,
    ETCD_ROLES_ENV,
    ETCD_SERVER_NAME,
    TLS_NAMES,
    TLS_ROLES_ENV,
    etcd_tls_env,
    etcd_tls_from_env,
    job_credentials,
    role_credential_env,
)
from elasticps.tls import (
    TLS_CACERT_ENV,
    TLS_CERT_ENV,
    TLS_KEY_ENV,
    TLS_OFF_ENV,
    role_host,
    tls_from_env,
)

pytestmark = pytest.mark.timeout(60)


def test_a_credential_is_signed_by_its_ca_and_names_its_role() -> None:
    ca = JobCA.generate("job1")
    credential = ca.issue("trainer", dns_names=("etcd.example",), ips=("10.0.0.1",))
    cert = x509.load_pem_x509_certificate(credential.cert_pem)
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert_pem))
    assert credential.common_name == "trainer"
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.CLIENT_AUTH in usages
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["etcd.example"]
    other = JobCA.generate("job1")
    with pytest.raises((ValueError, InvalidSignature)):
        cert.verify_directly_issued_by(x509.load_pem_x509_certificate(other.cert_pem))
    assert "BEGIN" not in repr(credential) and "BEGIN" not in repr(ca)


def test_a_bad_address_in_a_certificate_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not-an-ip"):
        JobCA.generate("j").issue("etcd", ips=("not-an-ip",))


def test_credential_files_are_private_and_read_back(tmp_path: Path) -> None:
    credential = JobCA.generate("j").issue("ps")
    directory = credential.write(tmp_path / "ps")
    assert directory.stat().st_mode & 0o777 == 0o700
    for name in ("ca.pem", "cert.pem", "key.pem"):
        assert (directory / name).stat().st_mode & 0o777 == 0o600
    back = Credential.read_dir(directory, "name")
    assert back == Credential(credential.ca_pem, credential.cert_pem, credential.key_pem, "name")
    os.chmod(directory / "key.pem", 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        Credential.read_dir(directory)
    with pytest.raises(ConfigError, match="cannot read"):
        Credential.read_dir(tmp_path / "missing")


def test_the_environment_names_all_three_files_or_none(tmp_path: Path) -> None:
    assert etcd_tls_from_env({}) is None
    directory = JobCA.generate("j").issue("trainer").write(tmp_path / "t")
    env = etcd_tls_env(directory)
    credential = etcd_tls_from_env(env)
    assert credential is not None
    assert credential.common_name == "trainer"
    assert credential.server_name == ETCD_SERVER_NAME
    with pytest.raises(ConfigError, match=ETCD_KEY_ENV):
        etcd_tls_from_env({k: v for k, v in env.items() if k != ETCD_KEY_ENV})


def test_each_role_gets_its_own_credential_and_no_other() -> None:
    roles = "/out/security/tls"
    launcher = {
        ETCD_ROLES_ENV: roles,
        TLS_ROLES_ENV: roles,
        **etcd_tls_env(Path(roles) / "root"),
        TLS_CERT_ENV: f"{roles}/root/cert.pem",
        "OTHER": "1",
    }
    ps = role_credential_env(launcher, "ps-3")
    assert ps[ETCD_CERT_ENV] == ps[TLS_CERT_ENV] == f"{roles}/ps/cert.pem"
    assert ps[ETCD_CACERT_ENV] == ps[TLS_CACERT_ENV] == f"{roles}/ps/ca.pem"
    assert ETCD_ROLES_ENV not in ps and TLS_ROLES_ENV not in ps and ps["OTHER"] == "1"
    assert role_credential_env(launcher, "trainer-0")[ETCD_KEY_ENV].endswith("/trainer/key.pem")
    assert role_credential_env(launcher, "master")[TLS_KEY_ENV].endswith("/master/key.pem")
    fork = role_credential_env(launcher, "fork-server")
    assert not {*ETCD_NAMES, *TLS_NAMES} & set(fork)
    # A job without certificates passes the environment through, and so are etcd
    # credentials a user brought for a job whose etcd is not its own.
    assert role_credential_env({"A": "1"}, "ps-0") == {"A": "1"}
    own = {ETCD_CERT_ENV: "/mine/cert.pem", TLS_ROLES_ENV: roles}
    assert role_credential_env(own, "ps-0")[ETCD_CERT_ENV] == "/mine/cert.pem"


def test_job_credentials_write_one_credential_per_role(tmp_path: Path) -> None:
    ca = JobCA.generate("j")
    with job_credentials(tmp_path, auth=True, ca=ca, etcd_tls=True):
        root = etcd_tls_from_env()
        assert root is not None and root.common_name == "root"
        tls = tls_from_env()
        assert tls is not None and tls.credential().common_name == "root"
        roles = Path(os.environ[ETCD_ROLES_ENV])
        assert os.environ[TLS_ROLES_ENV] == str(roles)
    assert ETCD_CERT_ENV not in os.environ and ETCD_ROLES_ENV not in os.environ
    assert TLS_CERT_ENV not in os.environ
    for role in ETCD_ROLES:
        cert = x509.load_pem_x509_certificate(Credential.read_dir(roles / role).cert_pem)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert names.get_values_for_type(x509.DNSName) == [role_host(role)]
    assert (tmp_path / "security" / "ca-key.pem").stat().st_mode & 0o777 == 0o600


def test_tls_off_and_an_etcd_of_its_own_are_said_in_the_environment(tmp_path: Path) -> None:
    with job_credentials(tmp_path, auth=True, tls=False):
        assert os.environ[TLS_OFF_ENV] == "1" and tls_from_env() is None
        assert etcd_tls_from_env() is None and ETCD_ROLES_ENV not in os.environ
        assert TLS_ROLES_ENV not in os.environ
    with job_credentials(tmp_path / "off", auth=False):
        assert tls_from_env() is None and TLS_CERT_ENV not in os.environ
    with pytest.raises(ConfigError, match=TLS_KEY_ENV):
        tls_from_env({TLS_CACERT_ENV: "a", TLS_CERT_ENV: "b"})


def test_no_role_but_the_master_writes_the_ledger_or_the_lock() -> None:
    keys = Keys("job1")
    grants = role_grants(keys)
    assert set(grants) == set(ETCD_ROLES) - {"root"}
    master, ps, trainer = grants["master"], grants["ps"], grants["trainer"]
    for key in (keys.task(7), keys.master_lock, keys.queue_meta, keys.job_state):
        assert permits(master, key, write=True)
        assert not permits(ps, key, write=True)
        assert not permits(trainer, key, write=True)
        assert permits(trainer, key, write=False)
    assert permits(ps, keys.ps(0), write=True) and not permits(trainer, keys.ps(0), write=True)
    assert permits(ps, keys.restore(0, 5), write=True)
    assert permits(ps, keys.health(1), write=True) and not permits(
        trainer, keys.health(1), write=True
    )
    assert permits(trainer, keys.kvstore_prefix + "barrier/init/0", write=True)
    assert permits(trainer, keys.trainer("t1"), write=True)
    assert not permits(ps, keys.trainer("t1"), write=True)
    # Another job's keys: nobody.
    other = Keys("job2")
    for role_grants_ in grants.values():
        assert not permits(role_grants_, other.task(0), write=False)
        assert not permits(role_grants_, "/elasticps/job1", write=False)


def _rsa_ca(directory: Path, *, ca: bool = True) -> None:
    """An RSA CA of the user's own (or, with ``ca`` False, a certificate that is not one)."""
    import datetime

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "my CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(1)
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True)
    (directory / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    (directory / "ca-key.pem").write_bytes(key_pem)
    (directory / "ca-key.pem").chmod(0o600)


def test_a_users_rsa_ca_issues_the_jobs_certificates_and_keeps_its_key(tmp_path: Path) -> None:
    _rsa_ca(tmp_path / "mine")
    ca = JobCA.read(tmp_path / "mine", "j")
    issued = ca.issue("ps", dns_names=(role_host("ps"),))
    cert = x509.load_pem_x509_certificate(issued.cert_pem)
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert_pem))
    with job_credentials(tmp_path / "out", auth=True, ca=ca):
        pass
    security = tmp_path / "out" / "security"
    assert (security / "ca.pem").read_bytes() == ca.cert_pem
    assert not (security / "ca-key.pem").exists()  # the user's key stays where it is


def test_a_ca_that_is_not_one_or_whose_key_is_not_its_own_is_refused(tmp_path: Path) -> None:
    _rsa_ca(tmp_path / "leaf", ca=False)
    with pytest.raises(ConfigError, match="not a CA certificate"):
        JobCA.read(tmp_path / "leaf", "j")
    _rsa_ca(tmp_path / "other")
    (tmp_path / "leaf" / "ca.pem").write_bytes((tmp_path / "other" / "ca.pem").read_bytes())
    with pytest.raises(ConfigError, match=r"is not the key of ca\.pem"):
        JobCA.read(tmp_path / "leaf", "j")
    (tmp_path / "other" / "ca-key.pem").chmod(0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        JobCA.read(tmp_path / "other", "j")
    with pytest.raises(ConfigError, match="cannot read"):
        JobCA.read(tmp_path / "missing", "j")
