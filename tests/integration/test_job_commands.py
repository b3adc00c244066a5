"""A local job seen and stopped from another process, and repeated from its job file.

``elasticps train --config job.toml`` runs as its own process (the launcher);
``elasticps status``, ``logs``, ``list`` and ``stop`` run as further
processes, as a user in a second terminal would. The first job of the
job-file test runs as a core-only install would (the extras' packages
unimportable in every process of the job: ``tests/core_only``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elasticps.launcher.spawn import terminate, wait_or_kill
from elasticps.testing import pid_gone, run_elasticps, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
CORE_ONLY = ROOT / "tests" / "core_only"
COMMAND_TIMEOUT_S = 120.0
JOB_TIMEOUT_S = 150.0


def elasticps(
    *args: str | Path, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    if env is None:
        return run_elasticps(args, timeout_s=COMMAND_TIMEOUT_S, cwd=cwd)
    # A new interpreter: the environment may change what it can import.
    return subprocess.run(
        [sys.executable, "-m", "elasticps", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )


def json_of(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


class Command:
    """``elasticps`` commands run as the user runs them: a process of their own.

    (They import no torch, so each costs well under a second of CPU; run in the
    test's own process instead, the etcd and gRPC clients share that process
    with everything the tests before them left in it.)
    """

    def __call__(self, *args: str | Path, cwd: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "elasticps", *map(str, args)],
            cwd=cwd,
            capture_output=True,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=60,
            check=False,
        )


def write_job_file(path: Path, data: Path, **values: object) -> Path:
    lines = [f'data = "{data}"', "no-progress = true"]
    for key, value in values.items():
        lines.append(f"{key} = {json.dumps(value)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def kill_leftovers(output: Path) -> None:
    """SIGKILL, by PID, any process of a job that a failed test left running."""
    with contextlib.suppress(OSError, ValueError):
        for pid in json.loads((output / "pids.json").read_text()).values():
            cmdline = b""
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"elasticps" in cmdline or b"etcd" in cmdline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)


@pytest.fixture
def running_job(mnist_dir: Path, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A long job (many passes of the paced MLP, which leaves the CPU to the commands
    under test) started by ``train --config``; stopped by PID after."""
    output = tmp_path / "runs" / "long"
    job_file = write_job_file(
        tmp_path / "job.toml",
        mnist_dir,
        model=str(Path(__file__).with_name("paced_mlp.py")),
        job="long",
        output=str(output),
        epochs=200,
        trainers=1,
        ps=1,
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "elasticps", "train", "--config", str(job_file)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=(tmp_path / "long.stderr").open("w"),
        text=True,
    )
    try:
        yield proc, output
    finally:
        terminate([proc])
        wait_or_kill([proc], 30)
        kill_leftovers(output)


def test_status_logs_list_and_stop_a_running_local_job(
    running_job: tuple[subprocess.Popen[str], Path],
    tmp_path: Path,
) -> None:
    proc, output = running_job
    stderr = tmp_path / "long.stderr"
    command = Command()

    last: list[subprocess.CompletedProcess[str]] = []

    def training() -> bool:
        assert proc.poll() is None, stderr.read_text()[-4000:]
        done = command("status", "long", "--json", cwd=tmp_path)
        last[:] = [done]
        return done.returncode == 0 and json.loads(done.stdout).get("tasks_done_all_passes", 0) > 0

    try:
        wait_for(training, "the job to report a finished task", timeout_s=90, interval_s=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the last status said: {last}") from None

    status = json_of(command("status", "--output", output, "--json", cwd=tmp_path))
    assert status["state"] == "running"
    assert status["passes"] == 200
    assert status["wanted_trainers"] == 1
    running = {p["name"] for p in status["processes"] if p["state"] == "running"}
    assert {"etcd", "master-0", "ps-0", "trainer-0"} <= running
    text = command("status", "long", cwd=tmp_path)
    assert text.returncode == 0, text.stderr
    first, *rows = text.stdout.splitlines()
    assert first.startswith(f"job long (output {output}): running, pass ")
    assert any(row.split()[:3] == ["master-0", "Running", "running"] for row in rows)

    (listed,) = [
        json.loads(line)
        for line in json_lines(command("list", "--json", cwd=tmp_path))
        if json.loads(line)["job"] == "long"
    ]
    assert listed["state"] == "running"
    assert listed["started"] and listed["output"] == str(output)
    scanned = json_lines(command("list", tmp_path / "runs", "--json", cwd=tmp_path))
    assert [json.loads(line)["job"] for line in scanned] == ["long"]

    logs = command("logs", "long", "--role", "master", "--tail", "3", cwd=tmp_path)
    assert logs.returncode == 0, logs.stderr
    assert logs.stdout.splitlines() and all(
        line.startswith("[master-0] ") for line in logs.stdout.splitlines()
    )
    follow = subprocess.Popen(
        [sys.executable, "-m", "elasticps", "logs", "long", "-f", "--role", "launcher"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        stopped = json_of(command("stop", "long", cwd=tmp_path))
        # logs -f ends by itself once the job has ended.
        follow_out, _ = follow.communicate(timeout=COMMAND_TIMEOUT_S)
    finally:
        if follow.poll() is None:
            follow.kill()
            follow.wait()
    assert follow.returncode == 0
    assert "[launcher] " in follow_out and "stop requested" in follow_out

    assert stopped["state"] == "stopped"
    assert proc.wait(timeout=JOB_TIMEOUT_S) == 0, stderr.read_text()[-4000:]
    assert proc.stdout is not None
    line = json.loads(proc.stdout.read().splitlines()[-1])
    assert line["state"] == "stopped"
    assert line["accuracy"] > 0.5

    record = json.loads((output / "run.json").read_text())
    assert record["state"] == "stopped"
    assert record["epochs"] == 200
    assert 1 <= record["progress"]["pass"] < 200
    assert record["evaluation"]["accuracy"] == line["accuracy"]
    assert record["samples"] > 0 and record["pids"]
    assert (output / "snapshot" / "manifest.json").is_file()
    assert (output / "model.safetensors").is_file()
    assert not (output / ".stop").exists()
    pids = json.loads((output / "pids.json").read_text())
    wait_for(lambda: all(pid_gone(p) for p in pids.values()), "every process gone", 10.0)

    listed_after = json_lines(command("list", output, "--json", cwd=tmp_path))
    summary = json.loads(listed_after[0])
    assert summary["state"] == "stopped"
    assert summary["accuracy"] == line["accuracy"]
    assert summary["pass"] == f"{record['progress']['pass']}/200"
    again = command("stop", "--output", output, cwd=tmp_path)
    assert again.returncode == 2
    assert "not running (state stopped)" in again.stderr

    # The stopped job's snapshot resumes, from the job file with flags overriding it.
    resumed_output = tmp_path / "runs" / "resumed"
    resumed = elasticps(
        "train", "--config", output / "config.toml", "--output", resumed_output,
        "--resume", output / "snapshot", "--epochs", "1", cwd=tmp_path,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert json.loads(resumed.stdout.splitlines()[-1])["accuracy"] >= line["accuracy"] - 0.05
    config = tomllib.loads((resumed_output / "config.toml").read_text())
    assert (config["epochs"], config["resume"]) == (1, str(output / "snapshot"))


def json_lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_a_run_repeats_from_the_config_file_it_wrote(mnist_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "runs" / "cnn"
    job_file = write_job_file(
        tmp_path / "job.toml",
        mnist_dir,
        model=str(ROOT / "examples" / "mnist_cnn.py"),
        output=str(output),
        epochs=1,
        trainers=2,
        ps=2,
        mode="sync",
    )
    # As a core-only install would: no package of an extra importable in any process.
    path = os.pathsep.join(p for p in (str(CORE_ONLY), os.environ.get("PYTHONPATH", "")) if p)
    core_only = dict(os.environ, PYTHONPATH=path)
    try:
        first = elasticps("train", "--config", job_file, "--seed", "3", cwd=tmp_path, env=core_only)
        assert first.returncode == 0, first.stderr[-4000:]
        assert json.loads(first.stdout.splitlines()[-1])["accuracy"] > 0.5
        written = (output / "config.toml").read_text()
        config = tomllib.loads(written)
        assert config["seed"] == 3  # the command line overrides the file
        assert (config["epochs"], config["trainers"], config["ps"]) == (1, "2", 2)
        assert config["model"] == str(ROOT / "examples" / "mnist_cnn.py")
        assert "overwrite" not in config and "config" not in config

        again = elasticps("train", "--config", output / "config.toml", "--overwrite", cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-4000:]
        assert tomllib.loads((output / "config.toml").read_text()) == config
    finally:
        kill_leftovers(output)
