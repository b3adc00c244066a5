"""The run record of a job started from Python, as ``status`` and ``list`` read it (no job runs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elasticps import jobs
from elasticps.api.record import RunRecord
from elasticps.errors import ConfigError, JobFailedError, OutputInUseError

pytestmark = pytest.mark.timeout(30)

DECISION = {"at": 1.0, "role": "trainer", "name": "trainer-0", "happened": "exit 1",
            "decided": "fail (exit 1): trainers keep failing"}  # fmt: skip


def _record(output: Path) -> dict[str, object]:
    return dict(json.loads((output / "run.json").read_text()))


def test_a_running_job_reads_running_then_finished(tmp_path: Path) -> None:
    output = tmp_path / "out"
    with RunRecord(output, "j1", "python-api", passes=3) as record:
        run = jobs.read_run(output)
        assert run is not None and (run.state, run.job, run.alive) == ("running", "j1", True)
        record.running("127.0.0.1:2379", lambda: [DECISION])
        assert _record(output)["etcd"] == "127.0.0.1:2379"
        assert [r.output for r in jobs.list_runs()].count(output.resolve()) == 1
    run = jobs.read_run(output)
    assert run is not None and run.state == "finished"  # the caller lives on
    record_json = _record(output)
    assert record_json["exit_code"] == 0 and record_json["decisions"] == [DECISION]
    assert record_json["launcher"] == "python-api"
    assert jobs.run_summary(run)["state"] == "finished"


def test_a_failed_job_reads_failed_with_its_error_and_decisions(tmp_path: Path) -> None:
    output = tmp_path / "out"
    with pytest.raises(JobFailedError), RunRecord(output, "j2", "dist_train"):
        raise JobFailedError("trainers keep failing", decisions=(DECISION,))
    record = _record(output)
    assert (record["state"], record["exit_code"]) == ("failed", 1)
    assert record["decisions"] == [DECISION]
    assert "trainers keep failing" in str(record["error"])
    run = jobs.read_run(output)
    assert run is not None and jobs.run_status(run)["state"] == "failed"


def test_a_user_error_exits_2_and_an_interrupt_reads_interrupted(tmp_path: Path) -> None:
    with pytest.raises(ConfigError), RunRecord(tmp_path / "a", "j", "python-api"):
        raise ConfigError("bad value")
    assert _record(tmp_path / "a")["exit_code"] == 2
    with pytest.raises(KeyboardInterrupt), RunRecord(tmp_path / "b", "j", "python-api"):
        raise KeyboardInterrupt
    assert _record(tmp_path / "b")["state"] == "interrupted"


def test_a_second_job_cannot_take_a_held_output(tmp_path: Path) -> None:
    output = tmp_path / "out"
    with RunRecord(output, "j", "python-api"):
        with pytest.raises(OutputInUseError), RunRecord(output, "k", "python-api"):
            pass
        assert _record(output)["job"] == "j"


def test_a_previous_python_record_is_replaced_a_cli_run_refused(tmp_path: Path) -> None:
    output = tmp_path / "out"
    with RunRecord(output, "first", "python-api"):
        pass
    with RunRecord(output, "second", "python-api"):
        pass
    assert _record(output)["job"] == "second"
    cli_run = tmp_path / "cli"
    cli_run.mkdir()
    (cli_run / "run.json").write_text(json.dumps({"job": "x", "state": "finished"}))
    with pytest.raises(ConfigError, match="holds a run of `elasticps train`"):
        RunRecord(cli_run, "j", "python-api").__enter__()
    assert json.loads((cli_run / "run.json").read_text())["job"] == "x"


def test_stop_refuses_a_job_started_from_python(tmp_path: Path) -> None:
    output = tmp_path / "out"
    with RunRecord(output, "j", "python-api"):
        run = jobs.read_run(output)
        assert run is not None
        with pytest.raises(ConfigError, match="started from Python"):
            jobs.request_stop(run, timeout_s=1.0)
    assert not (output / ".stop").exists()
