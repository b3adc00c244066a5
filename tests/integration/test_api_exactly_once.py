"""Exactly-once through the Python API: ``train(cluster=Local(...))`` with a PS SIGKILLed.

The same audit model as ``test_exactly_once.py`` (:mod:`elasticps.testing.audit`:
one float32 counter per record, +1 per applied gradient with SGD at lr 1,
one push per mini-batch and a summed sync step), trained by
:func:`elasticps.train` on local servers (real etcd, master and parameter
server processes; trainer threads). The counters are sliced over both
parameter servers. Mid-job, one parameter server is SIGKILLed by PID; the
servers' supervision restarts it, it reloads its checkpoint, and the job
recovers what it lacked. Every counter must end at exactly the number of
passes, in sync and in async mode.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Iterator

import psutil
import pytest

import elasticps
from elasticps import events
from elasticps.api.cluster import Parquet
from elasticps.errors import JobFailedError
from elasticps.testing import child_pids, wait_for
from elasticps.testing.audit import Model, check_counters, model_file, write_dataset
from elasticps.testing.audit import loss as audit_loss

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

RECORDS = 1000
BATCH = 10
PASSES = 3


@pytest.fixture(scope="module")
def audit_data(tmp_path_factory: pytest.TempPathFactory) -> Parquet:
    out = tmp_path_factory.mktemp("audit")
    write_dataset(out, RECORDS)
    return Parquet.from_model_file(
        out / "train.parquet", model_file(), batch_size=BATCH, records_per_task=100
    )


@pytest.fixture(autouse=True)
def _check_children() -> Iterator[None]:
    yield
    wait_for(lambda: not child_pids(), what="every process of the job to be stopped", timeout_s=10)


def _ps_pids() -> list[int]:
    """PIDs of this process's parameter-server children (``python -m elasticps ps ...``)."""
    out = []
    for pid in child_pids():
        try:
            cmdline = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        if "elasticps" in cmdline and "ps" in cmdline and "--claim-timeout-s" in cmdline:
            out.append(pid)
    return sorted(out)


class _KillAPS:
    """An event handler that SIGKILLs one parameter server once ``at`` iterations ended."""

    def __init__(self, at: int) -> None:
        self.at = at
        self.iterations = 0
        self.killed: int | None = None
        self.lock = threading.Lock()

    def __call__(self, event: events.TrainingEvent) -> None:
        if not isinstance(event, events.EndIteration):
            return
        with self.lock:
            self.iterations += 1
            if self.killed is not None or self.iterations < self.at:
                return
            pids = _ps_pids()
            assert len(pids) == 2, pids
            self.killed = pids[-1]
        os.kill(self.killed, signal.SIGKILL)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_parameter_server_killed_mid_job_loses_no_update(
    audit_data: Parquet, mode: str, caplog: pytest.LogCaptureFixture
) -> None:
    total = PASSES * RECORDS // BATCH
    killer = _KillAPS(at=int(total * 0.4))
    caplog.set_level(logging.WARNING, logger="elasticps.api.servers")

    result = elasticps.train(
        Model(RECORDS),
        audit_loss,
        audit_data,
        updater=elasticps.updater.SGD(lr=1.0),
        event_handler=killer,
        num_passes=PASSES,
        cluster=elasticps.Local(
            trainers=2,
            ps=2,
            mode=mode,
            big_array_bound=RECORDS // 4,  # the counters are sliced over both PS
            lease_ttl_s=2.0,
            checkpoint_every_s=1.0,
            sync_reduction="sum",
        ),
    )

    assert killer.killed is not None, "no parameter server was killed"
    restarts = [r.getMessage() for r in caplog.records if "restarting it" in r.getMessage()]
    assert any(f"(pid {killer.killed})" in m for m in restarts), restarts
    audit = check_counters(result["counter"], PASSES)
    assert audit.exactly_once, audit.as_dict()


def test_a_parameter_server_killed_with_no_restarts_left_fails_the_job(
    audit_data: Parquet,
) -> None:
    with pytest.raises(JobFailedError, match=r"ps-\d died \(signal 9\).*no restarts left"):
        elasticps.train(
            Model(RECORDS),
            audit_loss,
            audit_data,
            updater=elasticps.updater.SGD(lr=1.0),
            event_handler=_KillAPS(at=20),
            num_passes=PASSES,
            cluster=elasticps.Local(
                trainers=1, ps=2, mode="async", lease_ttl_s=2.0, max_restarts=0
            ),
        )
