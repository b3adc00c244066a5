"""A process without the job's secret attacks a running job, and changes nothing.

The job is the audit job (one counter per record, see
:mod:`elasticps.testing.audit`) run by ``elasticps train`` with its default
security. While it trains, :mod:`elasticps.testing.attack` runs as a separate
process, with none of the job's files, and tries every parameter server's TCP
port and AF_UNIX socket and the master's gRPC service. Every attempt must be
refused, the job must finish with exit 0 and every counter exact, and the
servers must have logged the refusals.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cryptography import x509

from elasticps.coord.store import JobStore
from elasticps.jobca import Credential, JobCA
from elasticps.security import (
    AUTH_OFF_WARNING,
    ETCD_NAMES,
    ETCD_SERVER_NAME,
    SECRET_FILE_ENV,
    TLS_NAMES,
    JobSecret,
    job_tls_dir,
)
from elasticps.snapshot import ControlClient
from elasticps.testing import run_train
from elasticps.testing.audit import check_run, train_args, write_dataset
from elasticps.tls import TLS_OFF_WARNING, JobTLS

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RECORDS = 4000  # the audit model's counters
EPOCHS = 18
# The audit model, a little slower (sleeping, not computing) so that the job runs
# long enough for the attack on a loaded machine.
SLOW_MODEL = """

import time as _time


class SlowModel(Model):
    def forward(self, idx):
        _time.sleep(0.03)
        return super().forward(idx)
"""


def _running(out: Path) -> dict[str, object]:
    """The job's run.json once it runs (etcd is up), else {}."""
    try:
        record = json.loads((out / "run.json").read_text())
    except (OSError, ValueError):
        return {}
    return record if record.get("state") == "running" else {}


class _Attack:
    """On a thread: once the job runs, the attacker process, then the servers' counts.

    The job itself runs on the test's main thread (the command server that
    runs it must live in that thread).
    """

    def __init__(self, out: Path, cwd: Path) -> None:
        self.out = out
        self.cwd = cwd
        self.record: dict[str, object] = {}
        self.attempts: list[dict[str, str]] = []
        self.refused: list[dict[str, int]] = []
        self.running_after = False
        self.checkpointed = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._attack()
        except BaseException as exc:
            self.error = exc

    def _attack(self) -> None:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in (SECRET_FILE_ENV, *ETCD_NAMES, *TLS_NAMES)
        }
        # Started with the job: it waits for the job's run.json and servers itself,
        # so that its imports overlap the job's start. It holds a trainer's etcd
        # credential (stolen), and no job secret.
        attacker = subprocess.run(
            [sys.executable, "-m", "elasticps.testing.attack", "--wait-s", "120",
             "--output", str(self.out),
             "--stolen-trainer", str(job_tls_dir(self.out) / "trainer")],
            check=False, capture_output=True, text=True, timeout=150, env=env, cwd=self.cwd,
        )  # fmt: skip
        assert attacker.returncode == 0, attacker.stderr[-3000:]
        self.attempts = json.loads(attacker.stdout.strip().splitlines()[-1])["attempts"]
        self.record = record = _running(self.out)
        assert record, "the job ended during the attack: make it longer"
        # The servers counted what they refused (asked with the job's own secret).
        secret = JobSecret.read(self.out / "security" / "job-secret")
        root_dir = job_tls_dir(self.out) / "root"
        root = Credential.read_dir(root_dir, ETCD_SERVER_NAME)
        with JobStore(str(record["etcd"]), str(record["job"]), tls=root) as store:
            slots = store.ps_slots()
        for slot in slots.values():
            client = ControlClient(slot.address, secret=secret, tls=JobTLS.from_dir(root_dir))
            try:
                refused = client.request({"op": "stats"})["auth_refused"]
            finally:
                client.close()
            assert isinstance(refused, dict)
            self.refused.append(refused)
        # A client outside the job, given only the job's output directory.
        checkpoint = subprocess.run(
            [sys.executable, "-m", "elasticps", "checkpoint", "--job", str(record["job"]),
             "--etcd", str(record["etcd"]), "--output", str(self.cwd / "ckpt"),
             "--job-output", str(self.out)],
            check=False, capture_output=True, text=True, timeout=120, env=env, cwd=self.cwd,
        )  # fmt: skip
        assert checkpoint.returncode == 0, checkpoint.stderr[-3000:]
        self.checkpointed = (self.cwd / "ckpt" / "manifest.json").is_file()
        self.running_after = bool(_running(self.out))
        assert self.running_after, "the job ended during the attack: make it longer"

    def result(self) -> None:
        self._thread.join(timeout=150)
        if self.error is not None:
            raise self.error


def test_a_process_without_the_secret_is_refused_on_every_plane(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_dataset(data, RECORDS)
    out = tmp_path / "run"
    attack = _Attack(out, tmp_path)
    slow = data / "slow_audit_model.py"
    slow.write_text((data / "audit_model.py").read_text() + SLOW_MODEL)
    args = train_args(data, out, "async", EPOCHS)
    args[args.index("--model") + 1] = str(slow)
    line, stderr = run_train(
        [*args, "--model-class", "SlowModel"], pids_file=out / "pids.json", timeout_s=240
    )
    attack.result()
    assert attack.running_after, "the job ended during the attack: make it longer"
    assert attack.checkpointed  # `elasticps checkpoint --job-output`, from outside the job
    assert attack.record["security"] == {
        "auth": "on",
        "tls": "on",
        "etcd": "tls, one user per role",
        "warnings": [],
    }
    assert (out / "security" / "job-secret").stat().st_mode & 0o777 == 0o600
    attempts = attack.attempts
    holes = [a for a in attempts if a["outcome"] not in ("refused", "open")]
    assert not holes, holes
    targets = {" ".join(a["target"].split()[:2]) for a in attempts}
    assert {"ps-0 tcp", "ps-1 tcp", "ps-0 unix", "ps-1 unix"} <= targets, targets
    # 2 certificates (another CA's, the stolen trainer's) x 2 tokens x 4 calls, and the
    # health check in the clear (refused) and with the stolen certificate (open).
    assert sum(a["target"].startswith("master") for a in attempts) == 18
    assert [a["detail"] for a in attempts if a["outcome"] == "open"] == ["1"]  # SERVING
    tokens = [a for a in attempts if a["target"].startswith("master") and "stolen" in a["attempt"]]
    assert all("token" in a["detail"] for a in tokens if "health" not in a["attempt"]), tokens
    etcd = [a for a in attempts if a["target"].startswith("etcd")]
    assert len(etcd) == 9, etcd  # 4 without a job certificate, 5 with the trainer's
    denied = [a for a in etcd if "stolen trainer" in a["attempt"]]
    assert all(a["detail"].startswith("PERMISSION_DENIED") for a in denied), denied
    # Per PS: 6 raw attempts on each of TCP and AF_UNIX, and 4 clients (2 refused by
    # TLS, 2 by the secret).
    assert [sum(r.values()) >= 16 for r in attack.refused] == [True, True], attack.refused
    assert [r.get("tls", 0) >= 8 for r in attack.refused] == [True, True], attack.refused

    assert line["exactly_once"] is True
    audit = check_run(out)
    assert audit.exactly_once, audit.as_dict()
    assert "refused an unauthenticated connection" in stderr
    assert "refused a call to /elasticps.v1.Master/GetTask without the job's token" in stderr


def test_a_job_run_with_auth_off_says_so(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_dataset(data, 400)
    out = tmp_path / "run"
    args = [*train_args(data, out, "sync", 1), "--auth", "off"]
    line, stderr = run_train(args, pids_file=out / "pids.json", timeout_s=120)
    assert line["exactly_once"] is True
    record = json.loads((out / "run.json").read_text())
    assert record["security"] == {
        "auth": "off",
        "tls": "off",
        "etcd": "plain",
        "warnings": [AUTH_OFF_WARNING],
    }
    assert AUTH_OFF_WARNING in stderr
    assert not (out / "security").exists()


def test_a_job_over_tls_tcp_is_exact_and_tls_off_says_so(tmp_path: Path) -> None:
    data = tmp_path / "data"
    write_dataset(data, RECORDS)
    out = tmp_path / "tls"
    # The user's own CA, and TCP to the parameter servers (not AF_UNIX): every frame
    # inside TLS 1.3, with certificates from that CA.
    mine = tmp_path / "my-ca"
    ca = JobCA.generate("mine")
    mine.mkdir(mode=0o700)
    ca.write(mine)
    args = [*train_args(data, out, "sync", 1), "--ps-transport", "tcp", "--ca", str(mine)]
    line, _ = run_train(args, pids_file=out / "pids.json", timeout_s=120)
    assert line["exactly_once"] is True
    audit = check_run(out)
    assert audit.exactly_once, audit.as_dict()
    record = json.loads((out / "run.json").read_text())
    assert record["security"]["tls"] == "on"
    assert not (out / "security" / "ca-key.pem").exists()
    ps = x509.load_pem_x509_certificate((job_tls_dir(out) / "ps" / "cert.pem").read_bytes())
    ps.verify_directly_issued_by(x509.load_pem_x509_certificate(ca.cert_pem))
    off = tmp_path / "off"
    args = [*train_args(data, off, "sync", 1), "--tls", "off"]
    line, stderr = run_train(args, pids_file=off / "pids.json", timeout_s=120)
    assert line["exactly_once"] is True
    record = json.loads((off / "run.json").read_text())
    assert record["security"] == {
        "auth": "on",
        "tls": "off",
        "etcd": "tls, one user per role",
        "warnings": [TLS_OFF_WARNING],
    }
    assert TLS_OFF_WARNING in stderr
