"""ProgressReporter (elasticps.trainer.worker): progress reports never trail the task's report."""

from __future__ import annotations

import threading
from typing import cast

import pytest

from elasticps.master.client import MasterClient
from elasticps.proto import master_pb2
from elasticps.trainer.worker import ProgressReporter

pytestmark = pytest.mark.timeout(30)

DEADLINE_S = 10.0


class BlockingMaster:
    """Records progress offsets; each report waits until the test releases it."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.offsets: list[int] = []

    def report_progress(self, request: master_pb2.ReportProgressRequest) -> None:
        self.entered.set()
        self.release.wait(DEADLINE_S)
        self.offsets.append(request.offset)


def test_discard_waits_for_the_report_in_flight_and_drops_the_unsent_one() -> None:
    master = BlockingMaster()
    reporter = ProgressReporter(cast(MasterClient, master), "0")
    task = master_pb2.Task(task_id=1, pass_id=0, attempt=1)
    reporter.update(task, 10)
    assert master.entered.wait(DEADLINE_S)
    reporter.update(task, 20)  # queued behind the one in flight
    discarded = threading.Event()
    threading.Thread(target=lambda: (reporter.discard(), discarded.set()), daemon=True).start()

    # The task's own report must wait: offset 10 is still on its way.
    assert not discarded.wait(0.2)
    master.release.set()
    assert discarded.wait(DEADLINE_S)

    reporter.close()
    assert master.offsets == [10]  # 20 was dropped, never sent after the task's report


def test_discard_with_nothing_in_flight_returns_at_once() -> None:
    master = BlockingMaster()
    master.release.set()
    reporter = ProgressReporter(cast(MasterClient, master), "0")
    reporter.discard()
    reporter.close()
    assert master.offsets == []
