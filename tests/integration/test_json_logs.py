"""``--log-format json``: every line of every process of a job one JSON object, on the
launcher's stderr and in the log files, with progress as lines when there is no bar."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from elasticps.testing import run_train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

MLP = Path(__file__).resolve().parents[2] / "examples" / "mnist_mlp.py"
FIELDS = {"time", "level", "logger", "message", "role", "index", "host", "job"}


def json_lines(text: str, where: str) -> list[dict[str, object]]:
    rows = []
    for line in text.splitlines():
        row = json.loads(line)  # every line: a plain line fails here
        assert isinstance(row, dict) and set(row) >= FIELDS, (where, line)
        rows.append(row)
    return rows


def test_every_process_logs_json_lines_and_progress_comes_as_lines(
    mnist_dir: Path, tmp_path: Path
) -> None:
    output = tmp_path / "out"
    _, stderr = run_train(
        ["--model", MLP, "--data", mnist_dir, "--trainers", "2", "--ps", "2", "--epochs", "2",
         "--output", output, "--job", "json-logs", "--chaos", "kill:ps-1@50%"],
        pids_file=output / "pids.json",
        timeout_s=180,
        env={"ELASTICPS_LOG_FORMAT": "json"},
    )  # fmt: skip
    rows = json_lines(stderr, "stderr")
    processes = {(r["role"], r["index"]) for r in rows}
    assert {("launcher", None), ("master", 0), ("ps", 0), ("ps", 1), ("trainer", 0)} <= processes
    assert {r["job"] for r in rows} == {"json-logs"}
    messages = [str(r["message"]) for r in rows]
    assert any(m.startswith("chaos: SIGKILL ps-1") for m in messages), messages
    logs = {
        log.name: json_lines(log.read_text(), log.name) for log in (output / "logs").glob("*.log")
    }
    assert {"launcher.log", "master-0.log", "ps-0.log", "ps-1.log", "trainer-0.log"} <= set(logs)
    # No bar (stderr is a pipe; and --no-progress keeps the lines off it): the
    # launcher's log has progress lines, the last with the totals.
    progress = [str(r["message"]) for r in logs["launcher.log"]]
    progress = [m for m in progress if "progress: " in m]
    # (the samples of the tasks the killed server's restore trained again count too)
    assert progress and "tasks 16/16" in progress[-1], progress
    samples = re.search(r", (\d+) samples", progress[-1])
    assert samples and int(samples[1]) >= 8000, progress
