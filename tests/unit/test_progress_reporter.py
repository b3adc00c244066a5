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


class CountingMaster:
    """Records progress offsets and when they arrived; answers at once."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.offsets: list[int] = []

    def report_progress(self, request: master_pb2.ReportProgressRequest) -> None:
        with self.cond:
            self.offsets.append(request.offset)
            self.cond.notify_all()


def first_report_sent(
    min_interval_s: float,
) -> tuple[CountingMaster, ProgressReporter, master_pb2.Task]:
    """A reporter whose first update (offset 10, sent at once) the master has received."""
    master = CountingMaster()
    reporter = ProgressReporter(cast(MasterClient, master), "0", min_interval_s=min_interval_s)
    task = master_pb2.Task(task_id=1, pass_id=0, attempt=1)
    reporter.update(task, 10)
    with master.cond:
        assert master.cond.wait_for(lambda: master.offsets == [10], DEADLINE_S)
    return master, reporter, task


def test_updates_within_the_interval_are_coalesced_into_one_report() -> None:
    master, reporter, task = first_report_sent(min_interval_s=600.0)
    for offset in range(20, 100, 10):
        reporter.update(task, offset)  # held back by the interval, each replacing the last
    reporter.close()  # closing sends the latest without waiting out the interval
    assert master.offsets == [10, 90]


def test_discard_drops_an_update_held_back_by_the_interval() -> None:
    master, reporter, task = first_report_sent(min_interval_s=600.0)
    reporter.update(task, 20)
    reporter.discard()
    reporter.close()
    assert master.offsets == [10]


def test_updates_held_back_by_the_interval_wake_the_thread_once_and_the_newest_goes() -> None:
    # A push is acknowledged every step: the reporter thread must not be woken
    # for each one while it waits out its interval, and the newest update
    # still goes when the interval is over.
    master, reporter, task = first_report_sent(min_interval_s=0.3)
    wakeups: list[int] = []
    notify = reporter._cond.notify

    def counting(n: int = 1) -> None:
        wakeups.append(n)
        notify(n)

    reporter._cond.notify = counting  # type: ignore[method-assign]
    for offset in range(20, 100, 10):
        reporter.update(task, offset)
    assert len(wakeups) == 1  # the first of them; the thread then knows there is one
    with master.cond:
        assert master.cond.wait_for(lambda: master.offsets == [10, 90], DEADLINE_S)
    reporter.close()
    assert master.offsets == [10, 90]
