"""Whole jobs run by ``elasticps train`` as real local processes.

Each test starts the launcher (``python -m elasticps train``), which starts
etcd, the master, the parameter servers and the trainers. The launcher must
stop every one of them by itself, whatever the outcome; the fixture finalizer
only backs that up, killing by PID anything in ``pids.json`` still running
when a test failed midway.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from elasticps.evaluate import evaluate
from elasticps.model_file import load_model_file
from elasticps.testing import pid_gone, run_elasticps, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MLP = EXAMPLES / "mnist_mlp.py"
TRAIN_ROWS = 4000
# A small job takes about 10 s on two cores; this bounds a hung one.
JOB_TIMEOUT_S = 150.0
# The launcher reaps its children before exiting, but the kernel may take a
# moment to release a PID (etcd's, for example).
GONE_DEADLINE_S = 5.0

# Trains like examples/mnist_mlp.py's logistic-regression cousin, but its
# batch_to_tensors fails on every call after the first.
FAILING_MODEL = """
import numpy as np
import torch
import torch.nn.functional as F

COLUMNS = ("pixels", "label")
_calls = 0


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(784, 10)

    def forward(self, inputs):
        return self.linear(inputs)


def loss(outputs, targets):
    return F.cross_entropy(outputs, targets)


def batch_to_tensors(batch):
    global _calls
    _calls += 1
    if _calls > 1:
        raise RuntimeError("boom")
    pixels = batch.column("pixels").combine_chunks().flatten().to_numpy()
    images = pixels.reshape(batch.num_rows, 784).astype(np.float32) / 255.0
    labels = batch.column("label").to_numpy().astype(np.int64)
    return torch.from_numpy(images), torch.from_numpy(labels)
"""


def is_ours(pid: int) -> bool:
    """Whether ``pid`` still runs an elasticps role or etcd (and not a reused PID)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"elasticps" in cmdline or b"etcd" in cmdline


@dataclass
class Job:
    """One ``elasticps train`` launcher process and its files."""

    proc: subprocess.Popen[bytes]
    output: Path
    stdout_path: Path
    stderr_path: Path

    @property
    def pids_path(self) -> Path:
        return self.output / "pids.json"

    def pids(self) -> dict[str, int]:
        return {role: int(pid) for role, pid in json.loads(self.pids_path.read_text()).items()}

    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait(self, timeout_s: float = JOB_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the job did not finish in {timeout_s} s; stderr:\n{self.stderr()[-4000:]}"
            )

    def result_line(self) -> dict[str, object]:
        lines = self.stdout().splitlines()
        assert lines, f"no result line on stdout; stderr:\n{self.stderr()[-4000:]}"
        result: dict[str, object] = json.loads(lines[-1])
        return result

    def assert_every_process_gone(self) -> None:
        pids = self.pids()
        for role in ("etcd", "master", "ps-", "trainer-"):
            assert any(name.startswith(role) for name in pids), (role, pids)
        wait_for(
            lambda: all(pid_gone(pid) for pid in pids.values()),
            f"every process of the job to be gone: {pids}",
            GONE_DEADLINE_S,
        )


@contextlib.contextmanager
def _sigint_not_ignored() -> Iterator[None]:
    """As from a terminal, SIGINT interrupts a job started in the block.

    A test runner's worker may ignore SIGINT, and an ignored signal stays
    ignored in the children it starts (as in any background job); a handled
    one is reset to its default action in them.
    """
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if previous is signal.SIG_IGN:
            signal.signal(signal.SIGINT, previous)


@pytest.fixture
def start_job(tmp_path: Path) -> Iterator[Callable[..., Job]]:
    """Start ``elasticps train`` jobs; kill by PID whatever is left of them afterwards."""
    jobs: list[Job] = []

    def start(*args: str | Path, name: str = "out") -> Job:
        output = tmp_path / name
        stdout_path, stderr_path = tmp_path / f"{name}.stdout", tmp_path / f"{name}.stderr"
        command = [sys.executable, "-m", "elasticps", "train", "--output", str(output)]
        command += ["--no-progress", *map(str, args)]
        with stdout_path.open("wb") as out, stderr_path.open("wb") as err, _sigint_not_ignored():
            proc = subprocess.Popen(
                command,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                cwd=tmp_path,
            )
        job = Job(proc, output, stdout_path, stderr_path)
        jobs.append(job)
        return job

    try:
        yield start
    finally:
        for job in jobs:
            if job.proc.poll() is None:
                job.proc.kill()
                job.proc.wait()
            if job.pids_path.exists():
                for pid in job.pids().values():
                    if is_ours(pid):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def untrained_accuracy(mnist_dir: Path) -> float:
    """Test accuracy of the MLP with the initial parameters every trainer starts from."""
    spec = load_model_file(MLP)
    model = spec.instantiate(0)
    return evaluate(spec, model.state_dict(), mnist_dir / "test.parquet")["accuracy"]


def small_job_args(mnist_dir: Path, *extra: str) -> list[str | Path]:
    return [
        "--model", MLP,
        "--data", mnist_dir,
        "--trainers", "2",
        "--ps", "2",
        "--epochs", "1",
        "--records-per-task", "500",
        "--lease-ttl-s", "2",
        *extra,
    ]  # fmt: skip


def evaluate_checkpoint(checkpoint: Path, data: Path) -> dict[str, float]:
    done = run_elasticps(
        ["evaluate", "--model", MLP, "--output", checkpoint, "--data", data], timeout_s=60
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_sync_job_trains_one_pass_beats_the_untrained_model_and_leaves_no_process(
    start_job: Callable[..., Job], mnist_dir: Path, untrained_accuracy: float
) -> None:
    job = start_job(*small_job_args(mnist_dir, "--mode", "sync"))

    assert job.wait() == 0, job.stderr()[-4000:]

    line = job.result_line()
    assert line["samples_trained"] == TRAIN_ROWS
    assert line["test_samples"] == 1000
    accuracy = float(line["accuracy"])  # type: ignore[arg-type]
    assert accuracy >= 0.8
    assert accuracy >= untrained_accuracy + 0.3
    for name in ("model.safetensors", "manifest.json", "run.json", "pids.json"):
        assert (job.output / name).is_file(), name
    assert "fork-server" in job.pids()  # the default: --spawn fork
    assert Path(str(line["checkpoint"])).resolve() == job.output.resolve()
    job.assert_every_process_gone()

    evaluated = evaluate_checkpoint(job.output, mnist_dir / "test.parquet")
    assert evaluated["accuracy"] == pytest.approx(accuracy, abs=1e-9)
    assert evaluated["loss"] == pytest.approx(float(line["loss"]), rel=1e-6)  # type: ignore[arg-type]


def test_async_job_with_push_and_pull_intervals_trains_to_good_accuracy(
    start_job: Callable[..., Job], mnist_dir: Path
) -> None:
    job = start_job(
        *small_job_args(mnist_dir, "--mode", "async", "--push-every", "2", "--pull-every", "3")
    )

    assert job.wait() == 0, job.stderr()[-4000:]

    line = job.result_line()
    assert line["samples_trained"] == TRAIN_ROWS
    # One pass of 4,000 rows with gradients summed over 2 mini-batches and
    # parameters 3 mini-batches old: 0.75-0.9 depending on how the two trainers
    # interleave on a loaded machine (untrained: about 0.1).
    assert float(line["accuracy"]) >= 0.7  # type: ignore[arg-type]
    job.assert_every_process_gone()


def test_every_pass_is_evaluated_while_training_with_exec_spawned_processes(
    start_job: Callable[..., Job], mnist_dir: Path
) -> None:
    # --spawn exec: the path without the fork server stays covered by a whole job.
    job = start_job(
        *small_job_args(
            mnist_dir, "--mode", "sync", "--epochs", "3", "--eval-each-pass", "--spawn", "exec"
        )
    )

    assert job.wait() == 0, job.stderr()[-4000:]

    line = job.result_line()
    evaluations = json.loads((job.output / "run.json").read_text())["pass_evaluations"]
    assert [e["pass_id"] for e in evaluations] == [0, 1, 2]
    versions = [e["version"] for e in evaluations]
    assert versions == sorted(versions) and versions[0] > 0
    for e in evaluations:
        assert 0.0 <= e["accuracy"] <= 1.0 and e["samples"] == 1000
        assert e["snapshot_time"] <= e["time"]
    # The last pass ends the training: its snapshot is the final model.
    assert evaluations[-1]["accuracy"] == line["accuracy"]
    assert evaluations[-1]["loss"] == pytest.approx(float(line["loss"]), rel=1e-6)  # type: ignore[arg-type]
    assert "fork-server" not in job.pids()
    job.assert_every_process_gone()


def test_sigint_to_the_launcher_stops_every_process_and_exits_130(
    start_job: Callable[..., Job], mnist_dir: Path
) -> None:
    job = start_job(*small_job_args(mnist_dir, "--mode", "sync", "--epochs", "50"))

    def training_under_way() -> bool:
        assert job.proc.poll() is None, f"the job ended early:\n{job.stderr()[-4000:]}"
        # The master logs "pass 1 started" once every task of pass 0 was dispatched and done.
        return job.pids_path.exists() and "pass 1 started" in job.stderr()

    wait_for(training_under_way, "the first pass to finish", timeout_s=90)
    pids = job.pids()
    assert not any(pid_gone(pid) for pid in pids.values()), pids

    job.proc.send_signal(signal.SIGINT)

    assert job.wait(timeout_s=20) == 130, job.stderr()[-4000:]
    assert "interrupted" in job.stderr()
    job.assert_every_process_gone()


def test_a_model_file_that_raises_fails_the_job_with_one_line_and_leaves_no_process(
    start_job: Callable[..., Job], mnist_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "failing_model.py"
    model.write_text(textwrap.dedent(FAILING_MODEL))
    args = small_job_args(mnist_dir, "--mode", "sync")
    args[args.index(MLP)] = model
    job = start_job(*args)

    code = job.wait()

    # A bad record (--bad-records fail): a user error, one line, the
    # traceback in the trainer's log only.
    stderr = job.stderr()
    assert code == 2, stderr[-4000:]
    assert "Traceback" not in stderr, stderr[-4000:]
    errors = [line for line in stderr.splitlines() if line.startswith("elasticps: error:")]
    assert len(errors) == 1, stderr[-4000:]
    assert f"model file {model}, line 27, in batch_to_tensors: RuntimeError: boom" in errors[0]
    trainer = errors[0].removeprefix("elasticps: error: ").split(":", 1)[0]
    log = (job.output / "logs" / f"{trainer}.log").read_text()
    assert "Traceback" in log and "RuntimeError: boom" in log
    assert not (job.output / "model.safetensors").exists()
    job.assert_every_process_gone()


TWO_PARAMETER_MODEL = '''"""One linear layer: 2 parameters; hash placement leaves a PS empty."""

import numpy as np
import torch
import torch.nn.functional as F

COLUMNS = ("pixels", "label")


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(784, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(outputs, targets)


def batch_to_tensors(batch):
    pixels = np.stack(batch.column("pixels").to_numpy(zero_copy_only=False))
    inputs = torch.from_numpy(pixels.astype("float32") / 255.0)
    return inputs, torch.tensor(batch.column("label").to_pylist())
'''


def test_a_parameter_server_holding_no_parameter_does_not_hold_up_the_job(
    start_job: Callable[..., Job], mnist_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "two_parameters.py"
    model.write_text(TWO_PARAMETER_MODEL)
    args = small_job_args(mnist_dir, "--ps", "3", "--epochs", "2")
    args[args.index(MLP)] = model

    job = start_job(*args)

    assert job.wait() == 0, job.stderr()[-4000:]
    line = job.result_line()
    assert line["samples_trained"] == 2 * TRAIN_ROWS and line["exactly_once"] is True, line
    job.assert_every_process_gone()
