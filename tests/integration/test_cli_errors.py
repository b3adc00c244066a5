"""User mistakes on the command line: one line on stderr, exit status 2, nothing started.

Every case runs ``python -m elasticps`` as a real subprocess. ``train`` must
reject the mistake while validating its inputs, before it starts any role
process, so no ``pids.json`` may appear in the output directory. The job's etcd
may have started (it starts while torch is imported): it must be stopped, and
its temporary directory removed, by the time the command exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from elasticps.netutil import LOOPBACK

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MLP = EXAMPLES / "mnist_mlp.py"
# A failing command imports torch and pyarrow at most; it never trains.
COMMAND_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Outcome:
    returncode: int
    stdout: str
    stderr: str


def elasticps(*args: str | Path, cwd: Path, tmpdir: Path | None = None) -> Outcome:
    """Run ``python -m elasticps ARGS`` to completion (killed by subprocess.run on timeout),
    with ``TMPDIR`` set to ``tmpdir`` if given."""
    env = None if tmpdir is None else {**os.environ, "TMPDIR": str(tmpdir)}
    done = subprocess.run(
        [sys.executable, "-m", "elasticps", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        cwd=cwd,
        check=False,
        env=env,
    )
    return Outcome(done.returncode, done.stdout, done.stderr)


def assert_user_error(outcome: Outcome, *mentions: str) -> str:
    """Exit 2 with one ``elasticps: error:`` line naming the problem; return that line."""
    lines = outcome.stderr.splitlines()
    assert outcome.returncode == 2, outcome
    assert "Traceback" not in outcome.stderr, outcome.stderr
    assert len(lines) == 1, outcome.stderr
    assert lines[0].startswith("elasticps: error: "), lines[0]
    for mention in mentions:
        assert mention in lines[0], lines[0]
    assert outcome.stdout == ""
    return lines[0]


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``elasticps data mnist`` run once for this module."""
    out = tmp_path_factory.mktemp("mnist")
    done = elasticps("data", "mnist", "--output", out, cwd=out)
    assert done.returncode == 0, done
    assert (out / "train.parquet").is_file()
    assert (out / "test.parquet").is_file()
    return out


@pytest.fixture
def output(tmp_path: Path) -> Iterator[Path]:
    """The job's output directory; after the test, it must hold no pids.json, and the
    command's temporary directory (``TMPDIR``, see :func:`train`) must be empty with no
    process using it.

    Should ``train`` have started a job after all, every process it lists is
    killed by PID before the test is failed.
    """
    out = tmp_path / "out"
    (tmp_path / "tmp").mkdir()
    yield out
    scratch = tmp_path / "tmp"
    users = [pid for pid in running_pids() if str(scratch).encode() in cmdline_of(pid)]
    for pid in users:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert not users, f"processes left running in the job's temporary directory: {users}"
    assert list(scratch.iterdir()) == [], "the job's temporary directory was not removed"
    pids_path = out / "pids.json"
    if pids_path.exists():
        pids = json.loads(pids_path.read_text())
        for pid in pids.values():
            with contextlib.suppress(ProcessLookupError):
                if is_ours(int(pid)):
                    os.kill(int(pid), signal.SIGKILL)
        pytest.fail(f"train started processes before rejecting its input: {pids}")


def running_pids() -> list[int]:
    return [int(entry.name) for entry in Path("/proc").iterdir() if entry.name.isdigit()]


def cmdline_of(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def is_ours(pid: int) -> bool:
    """Whether ``pid`` still runs an elasticps role or etcd (and not a reused PID)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"elasticps" in cmdline or b"etcd" in cmdline


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port with a listening socket on it for the whole test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def train(*args: str | Path, data: Path, output: Path, model: Path = MLP) -> Outcome:
    return elasticps(
        "train",
        "--model",
        model,
        "--data",
        data,
        "--output",
        output,
        "--no-progress",
        *args,
        cwd=output.parent,
        tmpdir=output.parent / "tmp",
    )


def test_train_with_a_missing_data_directory_fails_naming_it(tmp_path: Path, output: Path) -> None:
    missing = tmp_path / "no-such-data"
    assert_user_error(train(data=missing, output=output), "not found", str(missing))


def test_train_with_a_data_directory_without_train_parquet_fails_naming_the_file(
    tmp_path: Path, output: Path
) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_user_error(train(data=empty, output=output), "not found", "train.parquet")


def test_train_with_a_model_class_the_file_lacks_fails_listing_its_classes(
    mnist_dir: Path, output: Path
) -> None:
    line = assert_user_error(
        train("--model-class", "Nope", data=mnist_dir, output=output), "'Nope'"
    )
    assert "Model" in line  # the classes the file does define


def test_train_with_a_missing_model_file_fails_naming_it(
    mnist_dir: Path, tmp_path: Path, output: Path
) -> None:
    missing = tmp_path / "no_model.py"
    assert_user_error(
        train(data=mnist_dir, output=output, model=missing), "model file", str(missing)
    )


def test_train_with_zero_trainers_fails_naming_the_flag(mnist_dir: Path, output: Path) -> None:
    assert_user_error(train("--trainers", "0", data=mnist_dir, output=output), "--trainers")


def test_train_on_parquet_without_the_model_columns_fails_naming_them(
    tmp_path: Path, output: Path
) -> None:
    data = tmp_path / "wrong.parquet"
    pq.write_table(pa.table({"x": pa.array([1.0, 2.0]), "y": pa.array([0, 1])}), data)

    line = assert_user_error(train(data=data, output=output), "'pixels'", "'label'", str(data))
    assert "'x'" in line  # and the columns the file does have


@pytest.mark.parametrize("flag", ["--etcd-port", "--master-port"])
def test_train_on_a_port_already_in_use_fails_naming_the_flag_and_port(
    mnist_dir: Path, output: Path, held_port: int, flag: str
) -> None:
    outcome = train(flag, str(held_port), data=mnist_dir, output=output)
    assert_user_error(outcome, flag, str(held_port), "in use")


def test_unknown_flag_fails_with_one_line(mnist_dir: Path, output: Path) -> None:
    assert_user_error(train("--no-such-flag", data=mnist_dir, output=output), "--no-such-flag")


def test_evaluate_with_a_missing_checkpoint_fails_naming_it(
    mnist_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "no-checkpoint"
    outcome = elasticps(
        "evaluate",
        "--model",
        MLP,
        "--output",
        missing,
        "--data",
        mnist_dir / "test.parquet",
        cwd=tmp_path,
    )
    assert_user_error(outcome, "checkpoint", str(missing))
