"""Fault injection on whole jobs: SIGKILL real trainers, PS, masters and etcd.

Every scenario runs ``elasticps train`` with a ``--chaos`` schedule and
checks three things against a run without faults (same seed and config):

- the job finishes every pass;
- the master's ledger audit shows every record trained exactly once in
  every pass (``passes`` in ``run.json``, from ``/elasticps/<job>/passes/<n>``);
- the final test accuracy is within 1.5 points (async) or 2.5 points (sync) of
  the fault-free run.

Afterwards every process the job ever started (restarts included) is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from elasticps.testing import run_elasticps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mnist_mlp.py"
# Four passes, not two: after two passes the MLP is still on the steep part of
# its learning curve. Async runs also anneal the learning rate (x0.1 from model
# version 375 of about 560, i.e. from late in pass 3): without it, the last
# iterate of a fault-free async run is noisy (push order depends on thread
# timing): 20 fault-free runs ranged 0.896-0.932 (sd 0.008), so one fault-free
# run and one trainer-kill run (20 runs: 0.902-0.919, same mean within 0.2
# points) differed by more than 1.5 points about once in 10. With the
# annealing, 11 fault-free and 10 trainer-kill runs ranged 0.914-0.922 and
# 0.913-0.920 (sd 0.0026 and 0.0024). Baseline and faulty runs use the same
# flags, as the comparison requires.
# Sync runs are not annealed: a killed trainer changes the number of sync steps
# (about 196 fault-free, 213 with the four kills), so a schedule keyed on the
# model version anneals the two runs at different points of the data (8
# annealed fault-free runs 0.909-0.917, 7 four-kill runs 0.903-0.910: a
# systematic gap). Unannealed, 6 fault-free runs ranged 0.894-0.904 and 6
# four-kill runs 0.892-0.901 (sd 0.004 each, same mean within 0.2 points); a
# difference of 0.016 was seen once in CI, about 3 sd of the difference. The
# sync tolerance is 2.5 points (4.7 sd); a shard restored wrong costs far more.
EPOCHS = 4
ACCURACY_TOLERANCE = {"async": 0.015, "sync": 0.025}
TRAIN_ROWS = 4000
JOB_TIMEOUT_S = 180.0
ASYNC_LR_SCHEDULE = '{"kind": "piecewise", "boundaries": [375], "factors": [1.0, 0.1]}'


@dataclass(frozen=True)
class JobRun:
    """What one ``elasticps train`` run left behind."""

    returncode: int
    line: dict[str, object]
    record: dict[str, object]
    stderr: str


def _kill_leftovers(pids_file: Path) -> list[int]:
    """SIGKILL every still-running pid of ``pids.json``; return the ones that were alive."""
    alive = []
    if not pids_file.exists():
        return alive
    for pid in json.loads(pids_file.read_text()).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            alive.append(pid)
    return alive


def _all_gone(pids: dict[str, int], timeout_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for role, pid in pids.items():
            try:
                os.kill(pid, 0)
                left.append(f"{role}:{pid}")
            except ProcessLookupError:
                pass
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


def run_job(mnist_dir: Path, out: Path, mode: str, *extra: str) -> JobRun:
    """Run one job to the end and check that it left no process behind."""
    cmd = [
        "train", "--model", str(MLP), "--data", str(mnist_dir), "--output", str(out),
        "--trainers", "3", "--ps", "2", "--mode", mode, "--epochs", str(EPOCHS),
        "--records-per-task", "200", "--lease-ttl-s", "2", "--seed", "0",
        "--checkpoint-every-s", "1", "--no-progress", *extra,
    ]  # fmt: skip
    if mode == "async":
        cmd += ["--lr-schedule", ASYNC_LR_SCHEDULE]
    try:
        proc = run_elasticps(cmd, timeout_s=JOB_TIMEOUT_S)
    finally:
        leftovers = _kill_leftovers(out / "pids.json")
    assert not leftovers, f"processes left running after the job: {leftovers}"
    pids = json.loads((out / "pids.json").read_text())
    assert not _all_gone(pids), "some processes of the job are still alive"
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    record = json.loads((out / "run.json").read_text())
    return JobRun(proc.returncode, line, record, proc.stderr)


def assert_exactly_once(run: JobRun) -> None:
    passes = run.record["passes"]
    assert isinstance(passes, list)
    assert len(passes) == EPOCHS, passes
    for audit in passes:
        assert isinstance(audit, dict)
        assert audit["exactly_once"] is True, audit
        assert audit["failed"] == 0, audit
    # Counted from the ledger, so a master's death does not lose any.
    assert run.line["samples_trained"] == EPOCHS * TRAIN_ROWS, run.line


@pytest.fixture(scope="module")
def baselines(mnist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, JobRun]:
    """Fault-free runs, one per mode."""
    out = tmp_path_factory.mktemp("baseline")
    return {mode: run_job(mnist_dir, out / mode, mode) for mode in ("sync", "async")}


def check_against_baseline(run: JobRun, baseline: JobRun, mode: str) -> None:
    assert_exactly_once(run)
    accuracy, reference = float(run.line["accuracy"]), float(baseline.line["accuracy"])
    # Accuracies are multiples of 1/1000 (the test set): compare in thousandths,
    # so that 0.915 - 0.900 is not 0.015000000000000013.
    assert round(abs(accuracy - reference), 6) <= ACCURACY_TOLERANCE[mode], (
        accuracy,
        reference,
    )


def test_baselines_train_every_record_exactly_once(baselines: dict[str, JobRun]) -> None:
    for run in baselines.values():
        assert_exactly_once(run)
        assert float(run.line["accuracy"]) >= 0.85


def test_async_job_survives_a_trainer_killed_mid_pass(
    mnist_dir: Path, tmp_path: Path, baselines: dict[str, JobRun]
) -> None:
    run = run_job(mnist_dir, tmp_path / "out", "async", "--chaos", "kill:trainer@30%")
    chaos = run.record["chaos"]
    assert isinstance(chaos, list) and chaos and chaos[0]["pid"], chaos
    check_against_baseline(run, baselines["async"], "async")


def test_sync_job_survives_a_trainer_a_server_the_active_master_and_etcd_killed_in_turn(
    mnist_dir: Path, tmp_path: Path, baselines: dict[str, JobRun]
) -> None:
    """One SIGKILL of each role in one job, each after the job recovered from the one
    before: the replacement trainer joins, PS 0 restarts from its checkpoint, the
    standby master takes over, etcd restarts; the accuracy is the fault-free one's.
    (The audited tests of ``test_exactly_once.py`` kill each role alone, the only
    master included, and check every record's update on the parameters.)"""
    chaos = "kill:trainer@15%,kill:ps@35%,kill:master@55%,kill:etcd@75%"
    run = run_job(mnist_dir, tmp_path / "out", "sync", "--standby-masters", "1", "--chaos", chaos)
    events = run.record["chaos"]
    assert isinstance(events, list) and len(events) == 4, events
    assert all(event["pid"] for event in events), events
    restarts = run.record["restarts"]
    # The PS holding slot 0 was killed (whichever process claimed it) and restarted once.
    assert isinstance(restarts, dict), restarts
    assert [n for role, n in restarts.items() if role.startswith("ps-")] == [1], restarts
    assert "standby" in run.stderr
    assert run.record["etcd_restarts"] == 1
    check_against_baseline(run, baselines["sync"], "sync")
