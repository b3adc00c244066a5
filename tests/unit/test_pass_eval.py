"""PassEvaluator's bookkeeping of passes, without etcd or parameter servers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from elasticps.launcher import pass_eval
from elasticps.launcher.pass_eval import PassEvaluation, PassEvaluator
from elasticps.model_file import in_process_spec

pytestmark = pytest.mark.timeout(60)


class _Store:
    """A job store whose watch delivers the passes it is told to, and no more."""

    def __init__(self) -> None:
        self.written: dict[int, dict[str, object]] = {}
        self.on_change: Callable[[dict[int, dict[str, object]]], None] | None = None

    def watch_pass_summaries(
        self, on_change: Callable[[dict[int, dict[str, object]]], None]
    ) -> _Store:
        self.on_change = on_change
        return self

    def cancel(self) -> None:
        self.on_change = None

    def pass_summaries(self) -> dict[int, dict[str, object]]:
        return dict(self.written)


def test_close_evaluates_the_pass_the_watch_had_not_delivered_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The job's last pass ends as the job does: its watch event may come after
    the launcher closes the evaluator. It is evaluated all the same, once."""
    taken: list[int] = []
    lock = threading.Lock()

    def snapshot(self: PassEvaluator, pass_id: int) -> pass_eval._Snapshot:
        with lock:
            taken.append(pass_id)
        return pass_eval._Snapshot(pass_id, pass_id + 1, 0.0, {}, None)

    def evaluate(self: PassEvaluator, snap: pass_eval._Snapshot) -> PassEvaluation:
        return PassEvaluation(snap.pass_id, snap.version, snap.taken, 0.0, 1.0, 0.0, 1)

    monkeypatch.setattr(PassEvaluator, "_snapshot", snapshot)
    monkeypatch.setattr(PassEvaluator, "_evaluate", evaluate)
    store = _Store()
    spec = in_process_spec(nn.Linear(2, 1), lambda out, y: torch.mean((out - y) ** 2))
    evaluator = PassEvaluator(store, spec, 0, tmp_path / "test.parquet", tmp_path)  # type: ignore[arg-type]
    evaluator.start()
    store.written[0] = {}
    assert store.on_change is not None
    store.on_change(dict(store.written))  # pass 0: delivered by the watch
    store.written[1] = {}  # pass 1: written, but its event not delivered
    results = evaluator.close()
    assert [r.pass_id for r in results] == [0, 1]
    assert sorted(taken) == [0, 1]
