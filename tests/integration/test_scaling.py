"""A real MNIST job scaled 2 -> 4 -> 1 trainers mid-run.

``elasticps train --trainers 1:4 --initial-trainers 2`` runs the CNN example in
sync mode; the test scales it with ``elasticps scale`` (which finds the job's
etcd in ``OUTPUT/run.json``), waiting each time until etcd shows the wanted
number of registered trainers and the job is not finished yet. At the end the
ledger audit of every pass must say each record was trained exactly once, and
the test accuracy must be >= 0.93.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from elasticps.cli import main
from elasticps.coord.store import JobStore
from elasticps.errors import ElasticPSError
from elasticps.security import output_etcd_tls
from elasticps.testing import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(280)]

CNN = Path(__file__).resolve().parents[2] / "examples" / "mnist_cnn.py"
EPOCHS = 8
JOB_TIMEOUT_S = 240.0
# Starting a trainer (torch import, model, PS hello) takes seconds on a busy machine.
START_TIMEOUT_S = 90.0


def scale(job: str, output: Path, trainers: int, capsys: pytest.CaptureFixture[str]) -> None:
    """``elasticps scale JOB --trainers N --output OUTPUT``, in this process.

    In-process, because starting a Python process takes seconds on a busy
    machine, and the job must not finish before the test scaled it.
    """
    capsys.readouterr()
    code = main(["scale", job, "--trainers", str(trainers), "--output", str(output)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert json.loads(captured.out)["trainers_wanted"] == trainers


def read_json(path: Path) -> dict[str, object] | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def kill_leftovers(pids_file: Path) -> list[str]:
    alive = []
    for name, pid in (read_json(pids_file) or {}).items():
        assert isinstance(pid, int)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
            alive.append(f"{name}:{pid}")
    return alive


def test_mnist_sync_job_scaled_from_2_to_4_to_1_trains_every_record_exactly_once(
    mnist_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = f"scale-{uuid.uuid4().hex[:8]}"
    output = tmp_path / "out"
    stdout_path, stderr_path = tmp_path / "train.stdout", tmp_path / "train.stderr"
    command = [
        sys.executable, "-m", "elasticps", "train", "--job", job,
        "--model", str(CNN), "--data", str(mnist_dir), "--output", str(output),
        "--trainers", "1:4", "--initial-trainers", "2", "--ps", "2", "--mode", "sync",
        "--epochs", str(EPOCHS), "--records-per-task", "250", "--lease-ttl-s", "2",
        "--no-progress",
    ]  # fmt: skip
    with stdout_path.open("wb") as out, stderr_path.open("wb") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL)
    seen: list[int] = []
    try:
        wait_for(
            lambda: isinstance((read_json(output / "run.json") or {}).get("etcd"), str),
            "the launcher to publish its etcd endpoint in run.json",
            timeout_s=60,
        )
        endpoint = str((read_json(output / "run.json") or {})["etcd"])
        with JobStore(endpoint, job, tls=output_etcd_tls(output)) as store:

            def registered() -> int:
                with contextlib.suppress(ElasticPSError):
                    seen.append(len(store.live_trainers()[0]))
                    return seen[-1]
                return -1

            def unfinished() -> bool:
                meta = store.get_json(store.keys.queue_meta)
                return meta is None or meta.get("finished") is not True

            def training() -> bool:
                tasks, _ = store.get_prefix_json(store.keys.tasks_prefix)
                return any(t.get("state") != "todo" for t in tasks.values())

            wait_for(lambda: registered() == 2, "2 trainers", START_TIMEOUT_S, 0.1)
            wait_for(training, "the first task to be dispatched", START_TIMEOUT_S, 0.1)
            scale(job, output, 4, capsys)
            wait_for(lambda: registered() == 4, "4 trainers after scale 4", START_TIMEOUT_S, 0.1)
            assert unfinished(), "the job finished before the scale down; raise EPOCHS"
            scale(job, output, 1, capsys)
            wait_for(lambda: registered() == 1, "1 trainer after scale 1", 60, 0.1)
            assert unfinished(), "the job finished before it ran on 1 trainer; raise EPOCHS"
        proc.wait(timeout=JOB_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        leftovers = kill_leftovers(output / "pids.json")
    stderr = stderr_path.read_text()
    assert proc.returncode == 0, stderr[-4000:]
    assert not leftovers, f"processes left running after the job: {leftovers}"

    record = read_json(output / "run.json")
    assert record is not None and record["state"] == "finished"
    passes = record["passes"]
    assert isinstance(passes, list) and len(passes) == EPOCHS, passes
    for audit in passes:
        assert isinstance(audit, dict)
        assert audit["exactly_once"] is True, audit
        assert audit["failed"] == 0, audit
    line = json.loads(stdout_path.read_text().strip().splitlines()[-1])
    assert float(line["accuracy"]) >= 0.93, line

    # The manager created trainer-0..3 and deleted the three newest, newest first.
    scaling = record["scaling"]
    assert isinstance(scaling, list)
    created = [r["name"] for r in scaling if r["action"] == "create" and r["result"] == "ok"]
    deleted = [r["name"] for r in scaling if r["action"] == "delete"]
    assert created == ["trainer-0", "trainer-1", "trainer-2", "trainer-3"], scaling
    assert deleted == ["trainer-3", "trainer-2", "trainer-1"], scaling
    # No trainer failed: the deleted ones stopped on SIGTERM after their mini-batch.
    assert "exited with status" not in stderr


def test_scale_without_a_running_job_is_a_one_line_user_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "elasticps", "scale", "nojob", "--trainers", "3",
         "--output", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("elasticps: error: no --etcd given and cannot read"), done.stderr
    assert "Traceback" not in done.stderr
