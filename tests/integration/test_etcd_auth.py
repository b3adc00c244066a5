"""A job's etcd with client TLS and one user per role, against a real etcd on loopback."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from elasticps.coord.etcd_auth import enable_auth
from elasticps.coord.etcd_server import EtcdServer, EtcdServerConfig
from elasticps.coord.keys import Keys
from elasticps.coord.store import JobStore
from elasticps.errors import CoordinationError
from elasticps.jobca import Credential, JobCA
from elasticps.security import ETCD_SERVER_NAME, write_etcd_server_tls

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


def _credential(ca: JobCA, role: str) -> Credential:
    return dataclasses.replace(ca.issue(role), server_name=ETCD_SERVER_NAME)


def test_roles_hold_across_an_etcd_restart_and_other_cas_are_refused(tmp_path: Path) -> None:
    ca = JobCA.generate("job1")
    tls = write_etcd_server_tls(ca, tmp_path / "tls")
    config = EtcdServerConfig(data_dir=tmp_path / "etcd", client_port=0, tls=tls)
    keys = Keys("job1")
    root, trainer = _credential(ca, "root"), _credential(ca, "trainer")
    with EtcdServer(config) as etcd:
        enable_auth(etcd.endpoint, keys, root)
        enable_auth(etcd.endpoint, keys, root)  # idempotent: the launcher's restart
        with JobStore(etcd.endpoint, "job1", tls=trainer) as store:
            store.put_json(keys.trainer("t1"), {"ok": True})
            with pytest.raises(CoordinationError, match="permission denied"):
                store.put_json(keys.task(0), {"state": "done"})
        etcd.restart()
        with JobStore(etcd.endpoint, "job1", tls=trainer) as store:
            assert store.get_json(keys.trainer("t1")) == {"ok": True}
            with pytest.raises(CoordinationError, match="permission denied"):
                store.put_json(keys.master_lock, {"address": "evil:1"})
        with JobStore(etcd.endpoint, "job1", tls=_credential(ca, "master")) as store:
            store.put_json(keys.task(0), {"state": "todo"})
        # A certificate from another CA, even one that calls itself root, gets no TLS session.
        other = dataclasses.replace(_credential(JobCA.generate("job1"), "root"), ca_pem=ca.cert_pem)
        with pytest.raises(CoordinationError, match="did not answer"):
            JobStore(etcd.endpoint, "job1", tls=other, timeout_s=2.0)
        # And a client that speaks no TLS gets nothing either.
        with pytest.raises(CoordinationError, match="did not answer"):
            JobStore(etcd.endpoint, "job1", timeout_s=2.0)
