"""User mistakes that used to surface after a job started, as real ``elasticps train`` runs.

Each mistake ends with exit status 2, exactly one line on stderr starting with
``elasticps: error:``, and no traceback on the terminal. A mistake that can be
seen from metadata (a null in the data, an output path below a file, a
truncated ``--resume`` shard, an output directory in use or holding a previous
run) is refused before any role process starts: no ``pids.json`` and no
``logs/launcher.log`` appear (or, for a directory that held a finished run,
they are left as they were). Bad records met during training (``--bad-records
fail|skip``) and the one-job-per-output lock are checked on whole jobs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elasticps.testing import pid_gone, run_elasticps, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CNN = EXAMPLES / "mnist_cnn.py"
MLP = EXAMPLES / "mnist_mlp.py"
PACED_MLP = Path(__file__).with_name("paced_mlp.py")
TRAIN_ROWS = 4000
ROW_GROUP_ROWS = 256  # as `elasticps data mnist` writes them
JOB_TIMEOUT_S = 200.0
# A refused command imports torch and pyarrow at most; it never trains.
REFUSAL_TIMEOUT_S = 90.0
GONE_DEADLINE_S = 30.0
# Passes of the --bad-records skip comparison (clean and skipping jobs alike).
SKIP_EPOCHS = 3


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str


def train(
    *args: str | Path,
    model: Path = MLP,
    data: Path,
    output: Path,
    timeout_s: float = JOB_TIMEOUT_S,
) -> Outcome:
    """Run ``elasticps train`` to completion; whatever it left running is killed afterwards."""
    command = ["train", "--model", str(model)]
    command += ["--data", str(data), "--output", str(output), "--no-progress", *map(str, args)]
    try:
        done = run_elasticps(
            command, timeout_s=timeout_s, cwd=output.parent if output.parent.is_dir() else None
        )
    finally:
        kill_leftovers(output)
    return Outcome(done.returncode, done.stdout, done.stderr)


def is_ours(pid: int) -> bool:
    """Whether ``pid`` still runs an elasticps role or etcd (and not a reused PID)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"elasticps" in cmdline or b"etcd" in cmdline


def job_pids(output: Path) -> dict[str, int]:
    path = output / "pids.json"
    if not path.is_file():
        return {}
    return {role: int(pid) for role, pid in json.loads(path.read_text()).items()}


def kill_leftovers(output: Path) -> None:
    """SIGKILL every process of ``pids.json`` still running (a back-up for failed tests)."""
    for pid in job_pids(output).values():
        if is_ours(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def assert_user_error(outcome: Outcome, *mentions: str) -> str:
    """Exit 2, one ``elasticps: error:`` line naming ``mentions``, no traceback; return the line."""
    assert outcome.returncode == 2, outcome.stderr[-4000:]
    assert "Traceback" not in outcome.stderr, outcome.stderr[-4000:]
    errors = [line for line in outcome.stderr.splitlines() if line.startswith("elasticps: error:")]
    assert len(errors) == 1, outcome.stderr[-4000:]
    for mention in mentions:
        assert mention in errors[0], errors[0]
    assert outcome.stdout == ""
    return errors[0]


def assert_refused_before_launch(outcome: Outcome, output: Path, *mentions: str) -> str:
    """A user error reported before anything started: stderr is that one line only."""
    line = assert_user_error(outcome, *mentions)
    assert outcome.stderr.splitlines() == [line], outcome.stderr
    assert not (output / "pids.json").exists()
    assert not (output / "logs" / "launcher.log").exists()
    return line


def with_labels(mnist_dir: Path, out: Path, labels: dict[int, int | None]) -> Path:
    """A copy of the MNIST data directory whose train.parquet has ``labels`` (row -> label)."""
    table = pq.read_table(mnist_dir / "train.parquet")
    values = table.column("label").to_pylist()
    for row, label in labels.items():
        values[row] = label
    index = table.schema.get_field_index("label")
    table = table.set_column(index, "label", pa.array(values, type=pa.int64()))
    out.mkdir(parents=True)
    pq.write_table(table, out / "train.parquet", row_group_size=ROW_GROUP_ROWS)
    (out / "test.parquet").symlink_to(mnist_dir / "test.parquet")
    return out


@pytest.fixture(scope="module")
def finished_run(mnist_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The output directory of a small finished job (its snapshot is a ``--resume`` source)."""
    output = tmp_path_factory.mktemp("finished") / "out"
    done = train("--trainers", "1", "--ps", "2", "--epochs", "1", data=mnist_dir, output=output)
    assert done.returncode == 0, done.stderr[-4000:]
    return output


# --- mistakes seen before launch -------------------------------------------------------


def test_a_null_label_is_refused_before_launch_naming_file_column_and_count(
    mnist_dir: Path, tmp_path: Path
) -> None:
    data = with_labels(mnist_dir, tmp_path / "data", {1234: None})
    output = tmp_path / "out"

    outcome = train(model=CNN, data=data, output=output, timeout_s=REFUSAL_TIMEOUT_S)

    assert_refused_before_launch(
        outcome, output, str(data / "train.parquet"), "1 null in column 'label'", "--bad-records"
    )


def test_an_output_below_a_file_is_refused_before_launch(mnist_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "results"
    blocker.write_text("not a directory")
    output = blocker / "mnist"

    outcome = train(model=CNN, data=mnist_dir, output=output, timeout_s=REFUSAL_TIMEOUT_S)

    assert_refused_before_launch(outcome, output, str(blocker), "is a file, not a directory")


def test_a_resume_checkpoint_with_a_truncated_shard_is_refused_before_launch(
    mnist_dir: Path, finished_run: Path, tmp_path: Path
) -> None:
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for source in (finished_run / "snapshot").iterdir():
        (snapshot / source.name).write_bytes(source.read_bytes())
    shard = snapshot / "shard-1.safetensors"
    size = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(size // 2)
    output = tmp_path / "out"

    outcome = train(
        "--ps", "2", "--resume", snapshot, data=mnist_dir, output=output,
        timeout_s=REFUSAL_TIMEOUT_S,
    )  # fmt: skip

    assert_refused_before_launch(outcome, output, str(shard), "truncated", str(size))


def test_resuming_from_a_jobs_output_directory_names_its_snapshot(
    mnist_dir: Path, finished_run: Path, tmp_path: Path
) -> None:
    output = tmp_path / "out"

    outcome = train(
        "--resume", finished_run, data=mnist_dir, output=output, timeout_s=REFUSAL_TIMEOUT_S
    )

    assert_refused_before_launch(outcome, output, str(finished_run / "snapshot"))


def test_rerunning_a_finished_job_without_overwrite_is_refused_and_changes_nothing(
    mnist_dir: Path, finished_run: Path
) -> None:
    before = {p: p.stat().st_mtime_ns for p in finished_run.rglob("*") if p.name != ".lock"}

    outcome = train(
        "--epochs", "1", data=mnist_dir, output=finished_run, timeout_s=REFUSAL_TIMEOUT_S
    )

    line = assert_user_error(outcome, str(finished_run), "previous run", "--overwrite", "--resume")
    assert outcome.stderr.splitlines() == [line], outcome.stderr
    after = {p: p.stat().st_mtime_ns for p in finished_run.rglob("*") if p.name != ".lock"}
    assert after == before  # nothing started, nothing written, pids.json untouched


# --- bad records during training -----------------------------------------------------------


def test_a_label_out_of_range_stops_the_job_with_one_line_naming_the_model_line_and_rows(
    mnist_dir: Path, tmp_path: Path
) -> None:
    data = with_labels(mnist_dir, tmp_path / "data", {5: 10})
    output = tmp_path / "out"

    outcome = train(
        "--trainers", "2", "--ps", "1", "--epochs", "1", "--records-per-task", "500",
        model=CNN, data=data, output=output,
    )  # fmt: skip

    line = assert_user_error(
        outcome,
        f"model file {CNN}, line",
        "in loss: IndexError: Target 10 is out of bounds",
        f"rows [0, 32) of {data / 'train.parquet'}",
        "task 0: rows [0, 500), pass 0",
    )
    trainer = line.removeprefix("elasticps: error: ").split(":", 1)[0]
    assert trainer.startswith("trainer-"), line
    log = (output / "logs" / f"{trainer}.log").read_text()
    assert "Traceback" in log and "Target 10 is out of bounds" in log
    # run.json names the first fault: that trainer, its exit status and its error line.
    cause = json.loads((output / "run.json").read_text())["root_cause"]
    assert (cause["worker"], cause["happened"]) == (trainer, "exit 2"), cause
    assert "Target 10 is out of bounds" in cause["message"] and cause["host"], cause
    pids = job_pids(output)
    assert any(role.startswith("trainer-") for role in pids), pids
    wait_for(lambda: all(pid_gone(p) for p in pids.values()), "every process gone", GONE_DEADLINE_S)


def skipped_records_per_pass(
    labels: Sequence[int | None], records_per_task: int, batch_size: int
) -> int:
    """Rows of the mini-batches holding a null label, as trainers cut tasks into mini-batches."""
    skipped = 0
    for start in range(0, len(labels), records_per_task):
        end = min(start + records_per_task, len(labels))
        for lo in range(start, end, batch_size):
            hi = min(lo + batch_size, end)
            if any(label is None for label in labels[lo:hi]):
                skipped += hi - lo
    return skipped


def test_skip_trains_within_a_point_of_clean_data_and_counts_skipped_records_exactly(
    mnist_dir: Path, tmp_path: Path
) -> None:
    rng = random.Random(7)
    bad_rows = rng.sample(range(TRAIN_ROWS), TRAIN_ROWS // 100)  # 1 % null labels
    data = with_labels(mnist_dir, tmp_path / "data", dict.fromkeys(bad_rows))
    # One trainer: the sync job is then deterministic, so the comparison is too.
    # A task has 512 / 16 = 32 mini-batches; the budget never sets one aside.
    flags = ["--trainers", "1", "--ps", "1", "--mode", "sync", "--epochs", str(SKIP_EPOCHS),
             "--batch-size", "16", "--max-task-timeouts", "32"]  # fmt: skip

    clean = train(*flags, data=mnist_dir, output=tmp_path / "clean")
    skip = train(*flags, "--bad-records", "skip", data=data, output=tmp_path / "skip")

    assert clean.returncode == 0, clean.stderr[-4000:]
    assert skip.returncode == 0, skip.stderr[-4000:]
    assert "Traceback" not in skip.stderr
    clean_line, skip_line = json.loads(clean.stdout), json.loads(skip.stdout)
    assert skip_line["accuracy"] >= clean_line["accuracy"] - 0.01, (clean_line, skip_line)

    values = pq.read_table(data / "train.parquet").column("label").to_pylist()
    per_pass = skipped_records_per_pass(values, 512, 16)
    assert per_pass > 0
    record = json.loads((tmp_path / "skip" / "run.json").read_text())
    assert record["bad_records"] == "skip"
    assert record["records_skipped"] == skip_line["records_skipped"] == SKIP_EPOCHS * per_pass
    assert len(record["passes"]) == SKIP_EPOCHS
    for audit in record["passes"]:
        assert audit["records_skipped"] == per_pass, audit
        assert audit["records_trained"] == TRAIN_ROWS - per_pass, audit
        assert audit["failed"] == 0 and audit["exactly_once"], audit
    assert (
        record["samples"] == skip_line["samples_trained"] == SKIP_EPOCHS * (TRAIN_ROWS - per_pass)
    )


def test_skip_sets_a_task_aside_after_max_task_timeouts_skipped_mini_batches(
    mnist_dir: Path, tmp_path: Path
) -> None:
    # Three bad mini-batches in task 0 (rows 0-15, 32-47, 80-95 with 16-row
    # mini-batches), one more than a budget of 2: the task is set aside as
    # failed after its third, at row 96; every other task trains.
    data = with_labels(mnist_dir, tmp_path / "data", {3: 10, 40: 10, 90: 10})

    outcome = train(
        "--trainers", "1", "--ps", "1", "--epochs", "1", "--batch-size", "16",
        "--records-per-task", "512", "--max-task-timeouts", "2", "--bad-records", "skip",
        data=data, output=tmp_path / "out",
    )  # fmt: skip

    assert outcome.returncode == 0, outcome.stderr[-4000:]
    assert "Traceback" not in outcome.stderr
    assert "skipped 3 mini-batches, more than its budget of 2" in outcome.stderr
    (audit,) = json.loads((tmp_path / "out" / "run.json").read_text())["passes"]
    assert audit["failed"] == 1 and audit["done"] == audit["tasks"] - 1, audit
    assert audit["records_skipped"] == 3 * 16, audit
    assert audit["records_trained"] == (TRAIN_ROWS - 512) + (96 - 3 * 16), audit


# --- one job per output directory -----------------------------------------------------------


@dataclass
class Background:
    """A job started in the background."""

    proc: subprocess.Popen[bytes]
    output: Path
    stderr_path: Path

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")


@pytest.fixture
def background(tmp_path: Path) -> Iterator[list[Background]]:
    """Jobs started in the background; whatever is left of them is killed by PID."""
    jobs: list[Background] = []
    yield jobs
    for job in jobs:
        if job.proc.poll() is None:
            job.proc.kill()
            job.proc.wait()
        kill_leftovers(job.output)


def start_long_job(mnist_dir: Path, output: Path, jobs: list[Background]) -> Background:
    """A job of many passes of the paced MLP (which leaves the CPU to the tests beside it)."""
    stderr_path = output.parent / f"{output.name}.stderr"
    command = [
        sys.executable, "-m", "elasticps", "train", "--model", str(PACED_MLP),
        "--data", str(mnist_dir),
        "--output", str(output), "--no-progress", "--trainers", "1", "--ps", "1",
        "--epochs", "200",
    ]  # fmt: skip
    with stderr_path.open("wb") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
    job = Background(proc, output, stderr_path)
    jobs.append(job)

    def training() -> bool:
        assert proc.poll() is None, f"the job ended early:\n{job.stderr()[-4000:]}"
        return "trainer-0" in job_pids(output) and "pass 1 started" in job.stderr()

    wait_for(training, "the first job to train", timeout_s=120)
    return job


def test_a_second_job_on_an_output_in_use_refuses_and_a_killed_jobs_output_can_be_taken(
    mnist_dir: Path,
    finished_run: Path,
    tmp_path: Path,
    background: list[Background],
) -> None:
    """The killed job's output is taken with ``--resume``. ``--overwrite`` takes the
    lock the same way; a run over a previous one with it is in test_job_commands.py."""
    output = tmp_path / "shared"
    first = start_long_job(mnist_dir, output, background)
    first_pids = job_pids(output)

    second = train("--epochs", "1", data=mnist_dir, output=output, timeout_s=REFUSAL_TIMEOUT_S)

    line = assert_user_error(
        second, str(output), "in use by another job", f"pid {first.proc.pid}", socket.gethostname()
    )
    assert second.stderr.splitlines() == [line], second.stderr
    assert job_pids(output) == first_pids  # the second job started nothing

    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(timeout=30)
    kill_leftovers(output)  # its role processes stop on their own, not always at once
    third = train(
        "--ps", "2", "--epochs", "1", "--resume", finished_run / "snapshot",
        data=mnist_dir, output=output,
    )  # fmt: skip

    assert third.returncode == 0, third.stderr[-4000:]
    record = json.loads((output / "run.json").read_text())
    assert record["state"] == "finished" and len(record["passes"]) == 1
    assert set(job_pids(output).values()).isdisjoint(first_pids.values())


def test_two_jobs_started_at_once_on_one_output_train_once(
    mnist_dir: Path, tmp_path: Path, background: list[Background]
) -> None:
    output = tmp_path / "shared"
    # The paced MLP: a job of 2 passes trains for about 5 s, so the second one
    # finds it running (an unpaced job may end before the other has started).
    command = [
        sys.executable, "-m", "elasticps", "train", "--model", str(PACED_MLP),
        "--data", str(mnist_dir),
        "--output", str(output), "--no-progress", "--trainers", "1", "--ps", "1", "--epochs", "2",
    ]  # fmt: skip
    jobs = []
    for name in ("a", "b"):
        stderr_path = tmp_path / f"{name}.stderr"
        with stderr_path.open("wb") as err:
            proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
        jobs.append(Background(proc, output, stderr_path))
        background.append(jobs[-1])

    for job in jobs:
        job.proc.wait(timeout=JOB_TIMEOUT_S)
    winner, loser = sorted(jobs, key=lambda job: job.proc.returncode)

    assert (winner.proc.returncode, loser.proc.returncode) == (0, 2), [
        job.stderr()[-2000:] for job in jobs
    ]
    (line,) = loser.stderr().splitlines()
    assert line.startswith("elasticps: error:"), line
    assert "Traceback" not in loser.stderr()
    assert f"in use by another job (host {socket.gethostname()}, pid {winner.proc.pid}," in (
        loser.stderr()
    )
    record = json.loads((output / "run.json").read_text())
    assert len(record["passes"]) == 2 and all(p["exactly_once"] for p in record["passes"])


# --- internal failures ----------------------------------------------------------------------


def test_an_internal_failure_exits_1_with_one_line_naming_the_log(
    mnist_dir: Path, tmp_path: Path
) -> None:
    output = tmp_path / "out"

    outcome = train(
        "--trainers", "1", "--ps", "1", "--epochs", "3", "--max-restarts", "0",
        "--chaos", "kill:ps@30%", data=mnist_dir, output=output,
    )  # fmt: skip

    assert outcome.returncode == 1, outcome.stderr[-4000:]
    assert "Traceback" not in outcome.stderr, outcome.stderr[-4000:]
    lines = [line for line in outcome.stderr.splitlines() if line.startswith("elasticps: ")]
    assert len(lines) == 1, outcome.stderr[-4000:]
    assert lines[0].startswith("elasticps: internal error: ps-0"), lines[0]
    assert "no restarts left" in lines[0]
    launcher_log = output / "logs" / "launcher.log"
    assert str(launcher_log.resolve()) in lines[0]
    assert "Traceback" in launcher_log.read_text()
    # run.json names the first fault: the PS's SIGKILL, not what the trainer did after.
    record = json.loads((output / "run.json").read_text())
    cause = record["root_cause"]
    assert (cause["worker"], cause["happened"]) == ("ps-0", "signal 9"), record["decisions"]
    assert cause["host"] == socket.gethostname()
    assert all(c["at"] >= cause["at"] for c in record["consequences"])


def test_an_etcd_that_cannot_be_restarted_is_the_root_cause_not_the_roles_that_lost_it(
    mnist_dir: Path, tmp_path: Path
) -> None:
    output = tmp_path / "out"

    outcome = train(
        "--trainers", "2", "--ps", "1", "--epochs", "3", "--max-restarts", "0",
        "--chaos", "kill:etcd@30%", data=mnist_dir, output=output,
    )  # fmt: skip

    assert outcome.returncode == 1, outcome.stderr[-4000:]
    record = json.loads((output / "run.json").read_text())
    cause = record["root_cause"]
    assert (cause["worker"], cause["happened"]) == ("etcd", "signal 9"), record["decisions"]
    assert all(c["at"] >= cause["at"] for c in record["consequences"])
    assert all(c["worker"] != "etcd" or c["at"] > cause["at"] for c in record["consequences"])
    # The failing process is the root cause: the closing line says it once.
    assert "the first fault" not in record["error"], record["error"]


# --- a full disk ----------------------------------------------------------------------------


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A 48 MiB tmpfs (root only; skipped elsewhere), unmounted afterwards."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)


def fill(directory: Path) -> None:
    """Write into ``directory`` until its file system is full."""
    block = b"\0" * (1 << 20)
    with contextlib.suppress(OSError), (directory / "filler").open("wb") as out:
        while True:
            out.write(block)
            out.flush()


def test_a_full_disk_stops_the_job_after_the_grace_period_and_the_parameters_are_recoverable(
    mnist_dir: Path, small_filesystem: Path, tmp_path: Path, background: list[Background]
) -> None:
    output = small_filesystem / "out"
    fallback = tmp_path / "fallback"
    grace_s = 3.0
    stderr_path = tmp_path / "job.stderr"
    command = [
        sys.executable, "-m", "elasticps", "train", "--model", str(MLP), "--data", str(mnist_dir),
        "--output", str(output), "--no-progress", "--trainers", "1", "--ps", "1",
        "--epochs", "200", "--mode", "async", "--checkpoint-every-s", "0.5",
        "--checkpoint-failures-fatal-after-s", str(grace_s), "--fallback-output", str(fallback),
    ]  # fmt: skip
    with stderr_path.open("wb") as err:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
    job = Background(proc, output, stderr_path)
    background.append(job)

    def checkpointed() -> bool:
        assert proc.poll() is None, f"the job ended early:\n{job.stderr()[-4000:]}"
        return any((output / "ps-checkpoints").rglob("*.safetensors"))

    wait_for(checkpointed, "a first shard checkpoint", timeout_s=120)
    fill(small_filesystem)

    returncode = proc.wait(timeout=120)

    stderr = job.stderr()
    assert returncode == 2, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
    assert "WARNING: ps-0 cannot write its checkpoint" in stderr, stderr[-4000:]
    errors = [line for line in stderr.splitlines() if line.startswith("elasticps: error:")]
    assert len(errors) == 1, stderr[-4000:]
    assert "ps-0 has failed to write checkpoints" in errors[0], errors[0]
    assert f"its trained parameters are in {fallback.resolve()}" in errors[0], errors[0]
    # The documented route: the fallback holds the model and a snapshot to resume from.
    assert (fallback / "model.safetensors").is_file() and (fallback / "snapshot").is_dir()
    record = json.loads((fallback / "run.json").read_text())
    assert record["state"] == "failed" and record["checkpoint_health"]["ok"] is False
    evaluated = run_elasticps(
        ["evaluate", "--model", MLP, "--checkpoint", fallback,
         "--data", mnist_dir / "test.parquet"],
        timeout_s=120,
    )  # fmt: skip
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    assert json.loads(evaluated.stdout.strip().splitlines()[-1])["accuracy"] > 0.5
