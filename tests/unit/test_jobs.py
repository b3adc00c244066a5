"""Local runs as their output directories show them (no job runs here)."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from elasticps import jobs
from elasticps.errors import ConfigError


def make_run(
    output: Path, record: dict[str, object] | None, pid: int | None = None, job: str = "j"
) -> Path:
    """An output directory as a launcher leaves it: run.json, .lock, logs."""
    output.mkdir(parents=True)
    if record is not None:
        (output / "run.json").write_text(json.dumps({"job": job, **record}))
    if pid is not None:
        lock = {"host": socket.gethostname(), "pid": pid, "started": "2026-01-02T03:04:05+00:00",
                "started_unix_s": 1767322245.0}  # fmt: skip
        (output / ".lock").write_text(json.dumps(lock))
    (output / "logs").mkdir()
    for name in ("master-0", "trainer-0", "trainer-1", "launcher"):
        (output / "logs" / f"{name}.log").write_text(f"{name} one\n{name} two\n")
    return output


@pytest.fixture
def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_states_from_run_json_and_the_launcher(tmp_path: Path, dead_pid: int) -> None:
    alive = make_run(tmp_path / "a", {"state": "running"}, os.getpid())
    crashed = make_run(tmp_path / "b", {"state": "running"}, dead_pid)
    stopped = make_run(
        tmp_path / "c",
        {"state": "stopped", "progress": {"pass": 2, "passes": 5},
         "evaluation": {"accuracy": 0.9}},
        dead_pid,
    )  # fmt: skip
    assert make_run(tmp_path / "d", None) and jobs.read_run(tmp_path / "d") is None
    states = {r.output.name: r.state for r in jobs.list_runs([tmp_path])}
    assert states == {"a": "running", "b": "failed", "c": "stopped"}
    summary = jobs.run_summary(jobs.read_run(stopped))  # type: ignore[arg-type]
    assert summary["pass"] == "2/5" and summary["accuracy"] == 0.9
    assert summary["started"] == "2026-01-02T03:04:05+00:00"
    assert jobs.read_run(alive).etcd is None  # type: ignore[union-attr]
    assert jobs.read_run(crashed).alive is False  # type: ignore[union-attr]


def test_registry_finds_runs_by_name_and_drops_gone_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dead_pid: int
) -> None:
    monkeypatch.setenv(jobs.STATE_DIR_ENV, str(tmp_path / "state"))
    old = make_run(tmp_path / "old", {"state": "finished"}, dead_pid, job="x")
    new = make_run(tmp_path / "new", {"state": "running"}, os.getpid(), job="x")
    gone = tmp_path / "gone"
    for output in (old, new, gone):
        jobs.register_run(output, "x")
    assert len(list((tmp_path / "state" / "runs").glob("*.json"))) == 3
    assert {r.output for r in jobs.list_runs()} == {old, new}
    assert len(list((tmp_path / "state" / "runs").glob("*.json"))) == 2
    assert jobs.find_run("x", None).output == new  # the running one
    assert jobs.find_run(None, old).output == old
    with pytest.raises(ConfigError, match="no local run of job 'y'"):
        jobs.find_run("y", None)
    with pytest.raises(ConfigError, match="holds job 'x', not 'y'"):
        jobs.find_run("y", old)
    with pytest.raises(ConfigError, match="holds no run"):
        jobs.find_run(None, gone)


def test_logs_of_a_role_are_prefixed_by_process(tmp_path: Path, dead_pid: int) -> None:
    run = jobs.read_run(make_run(tmp_path / "r", {"state": "finished"}, dead_pid))
    assert run is not None
    out = io.StringIO()
    jobs.print_logs(run, "trainer", 1, out)
    assert out.getvalue() == "[trainer-0] trainer-0 two\n[trainer-1] trainer-1 two\n"
    out = io.StringIO()
    jobs.follow_logs(run, "master", None, out, poll_s=0.01)  # the launcher is gone: returns
    assert out.getvalue() == "[master-0] master-0 one\n[master-0] master-0 two\n"


def test_stop_refuses_a_run_that_is_not_running(tmp_path: Path, dead_pid: int) -> None:
    run = jobs.read_run(make_run(tmp_path / "r", {"state": "finished"}, dead_pid))
    assert run is not None
    with pytest.raises(ConfigError, match="not running"):
        jobs.request_stop(run, timeout_s=1)
    assert not (tmp_path / "r" / ".stop").exists()


def test_table_aligns_columns() -> None:
    rows = [{"job": "a", "state": "running", "accuracy": None},
            {"job": "long-name", "state": "x", "accuracy": 0.5}]  # fmt: skip
    assert list(jobs.iter_table(rows, ["job", "state", "accuracy"])) == [
        "JOB        STATE    ACCURACY",
        "a          running  -",
        "long-name  x        0.5",
    ]
