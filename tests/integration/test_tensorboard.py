"""TensorBoard scalars written by a job's launcher, read back with TensorBoard's own
event reader: one curve each across a master and a parameter-server restart."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elasticps.testing import run_train

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "examples" / "mnist_mlp.py"
EPOCHS = 4


def test_the_scalars_are_one_curve_each_across_a_master_and_a_ps_restart(
    mnist_dir: Path, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, logs = tmp_path / "run", tmp_path / "tb"
    args = [
        "--model", MLP, "--data", mnist_dir, "--output", out, "--trainers", "2", "--ps", "2",
        "--epochs", str(EPOCHS), "--records-per-task", "250", "--lease-ttl-s", "2",
        "--eval-each-pass", "--tensorboard", logs, "--mode", "async",
        "--chaos", "kill:master@30%,kill:ps@60%",
    ]  # fmt: skip
    line, _ = run_train(args, pids_file=out / "pids.json", timeout_s=200)
    record = json.loads((out / "run.json").read_text())
    restarted = {name.split("-")[0] for name in record["restarts"]}
    assert {"master", "ps"} <= restarted, record["restarts"]

    files = list(logs.glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # one writer for the whole job
    events = EventAccumulator(str(logs))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/samples_per_s", "pass/records_trained", "test/accuracy",
            "train/staleness"} <= tags  # fmt: skip
    staleness = events.Scalars("train/staleness")
    assert [e.step for e in staleness] == sorted(e.step for e in staleness)
    assert all(e.value >= 0 for e in staleness)

    loss = events.Scalars("train/loss")
    steps = [e.step for e in loss]
    assert steps == sorted(set(steps)), "train/loss goes back: the curve forked"
    assert steps[-1] >= int(line["samples_trained"]) * 0.9  # type: ignore[arg-type]
    assert all(e.value > 0 for e in loss)
    rates = [e.value for e in events.Scalars("train/samples_per_s")]
    assert rates and all(r >= 0 for r in rates)

    passes = events.Scalars("pass/records_trained")
    assert [e.step for e in passes] == list(range(1, EPOCHS + 1))
    assert {e.value for e in passes} == {4000.0}  # every training record, each pass
    accuracy = events.Scalars("test/accuracy")
    # One point per pass evaluated: as run.json's, which skips a pass whose snapshot
    # failed (a PS killed under it, say); the last pass's is the final model's.
    evaluated = [e["pass_id"] + 1 for e in record["pass_evaluations"]]
    assert evaluated[-1] == EPOCHS, evaluated
    assert [e.step for e in accuracy] == evaluated
    assert accuracy[-1].value == pytest.approx(float(line["accuracy"]), abs=1e-6)  # type: ignore[arg-type]
