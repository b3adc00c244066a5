"""One failure schedule through each way of running a job: the same decisions, the same end.

The schedule: every trainer ends with an internal error (status 1 from the
model's ``forward``; an exception there would be a user error), so the
supervision policy replaces the first ones and fails the job once
:data:`~elasticps.launcher.supervisor.MAX_TRAINER_FAILURES` failed in a row
with no task progress in between. Each entry of :data:`PATHS` runs a job
that way and returns what it saw; another backend is one more entry.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from elasticps.launcher.supervisor import MAX_TRAINER_FAILURES
from elasticps.testing import run_elasticps

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
JOB_TIMEOUT_S = 200.0
COMMAND_TIMEOUT_S = 90.0

# The MNIST MLP, whose trainers (never the launcher) end with status 1 in forward.
FAILING_MODEL = (
    (EXAMPLES / "mnist_mlp.py").read_text()
    + """

_Working = Model


class Model(_Working):  # type: ignore[no-redef]
    def forward(self, inputs: Tensor) -> Tensor:
        import os

        if os.environ.get("ELASTICPS_ROLE") == "trainer":
            os._exit(1)  # an internal error: an exception here is the user's (status 2)
        return super().forward(inputs)
"""
)


@dataclass(frozen=True)
class Seen:
    """What one path saw of the job.

    Attributes:
        exit_code: the job's exit status (the command's, or the error's).
        error: the job's one-line error.
        decisions: ``(role, happened, decided)`` of each trainer decision, the
            decision's text cut at its first ``:``.
        state: the job's state as ``elasticps status`` reads it, or None where
            the path leaves no output directory.
        listed: the job's state in ``elasticps list``, or None likewise.
    """

    exit_code: int
    error: str
    decisions: tuple[tuple[str, str, str], ...]
    state: str | None
    listed: str | None


def _cli(tmp_path: Path, data: Path, model: Path) -> Seen:
    output = tmp_path / "out"
    done = run_elasticps(
        ["train", "--model", model, "--data", data, "--output", output, "--no-progress",
         "--trainers", "1", "--ps", "1", "--epochs", "1"],
        timeout_s=JOB_TIMEOUT_S,
        cwd=tmp_path,
    )  # fmt: skip
    record = json.loads((output / "run.json").read_text())
    errors = [line for line in done.stderr.splitlines() if line.startswith("elasticps: ")]
    decisions = tuple(
        (d["role"], d["happened"], d["decided"].split(":")[0])
        for d in record["decisions"]
        if d["role"] == "trainer"
    )
    status = run_elasticps(
        ["status", "--output", output, "--json"], timeout_s=COMMAND_TIMEOUT_S, cwd=tmp_path
    )
    assert status.returncode == 0, status.stderr
    listing = run_elasticps(["list", tmp_path, "--json"], timeout_s=COMMAND_TIMEOUT_S)
    assert listing.returncode == 0, listing.stderr
    rows = [json.loads(line) for line in listing.stdout.splitlines() if line.strip()]
    return Seen(
        done.returncode,
        errors[-1] if errors else done.stderr[-2000:],
        decisions,
        json.loads(status.stdout)["state"],
        rows[0]["state"] if len(rows) == 1 else f"rows: {rows}",
    )


@dataclass(frozen=True)
class JobPath:
    """One way of running a job.

    Attributes:
        name: the test id.
        run: runs the failing job in a fresh directory with the MNIST data
            and the model file; returns what it saw.
        records_decisions: whether ``Seen.decisions`` is filled.
    """

    name: str
    run: Callable[[Path, Path, Path], Seen]
    records_decisions: bool = True


PATHS = [JobPath("cli", _cli)]
"""The ways of running a job. ``Local()``, ``dist_train`` and ssh hosts are
not entries yet: their loops do not write the decision records."""


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_trainers_that_keep_failing_fail_the_job(
    path: JobPath, mnist_dir: Path, tmp_path: Path
) -> None:
    model = tmp_path / "failing_mlp.py"
    model.write_text(FAILING_MODEL)
    seen = path.run(tmp_path, mnist_dir, model)
    assert seen.exit_code == 1, seen.error
    assert "trainers keep failing" in seen.error, seen.error
    if path.records_decisions:
        limit = MAX_TRAINER_FAILURES
        assert seen.decisions[:limit] == (
            *[("trainer", "exit 1", "replace")] * (limit - 1),
            ("trainer", "exit 1", "fail (exit 1)"),
        ), seen.decisions
        assert all(d[2] == "ignore" for d in seen.decisions[limit:]), seen.decisions
    if seen.state is not None:
        assert seen.state == "failed"
    if seen.listed is not None:
        assert seen.listed == "failed"
