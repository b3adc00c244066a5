"""A call asking for work while the ended pass is checked is held until the next pass."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest

from elasticps.errors import SteppedDownError
from elasticps.master import service as service_module
from elasticps.master.service import MasterService
from elasticps.master.taskqueue import DataRange, EventKind, QueueConfig, TaskEvent, TaskQueue
from elasticps.proto import master_pb2
from elasticps.testing import wait_for
from elasticps.testing.servicer import ABORTING_CONTEXT as CTX

pytestmark = pytest.mark.timeout(30)


class Journal:
    def __init__(self) -> None:
        self.writes: list[list[EventKind]] = []

    def persist(self, queue: TaskQueue, events: Sequence[TaskEvent]) -> None:
        del queue
        self.writes.append([e.kind for e in events])


def verifying_service(
    num_tasks: int = 2, num_passes: int = 2
) -> tuple[MasterService, Journal, list[int]]:
    ranges = [DataRange("data.parquet", 10 * i, 10 * i + 10) for i in range(num_tasks)]
    queue = TaskQueue(
        ranges,
        QueueConfig(
            task_timeout_s=60.0, max_task_timeouts=2, num_passes=num_passes, verify_passes=True
        ),
    )
    ready: list[int] = []
    journal = Journal()
    return MasterService(queue, journal, on_pass_ready=ready.append), journal, ready


def report_and_ask(
    service: MasterService, task: master_pb2.Task, trainer: str, ask: int = 0
) -> master_pb2.ReportTaskResponse:
    return service.ReportTask(
        master_pb2.ReportTaskRequest(
            trainer_id=trainer, task_id=task.task_id, pass_id=task.pass_id,
            attempt=task.attempt, success=True, samples=10, get_next=True, ask=ask,
        ),
        CTX,
    )  # fmt: skip


def in_thread(call: object) -> tuple[threading.Thread, list[object]]:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)  # type: ignore[operator]
    thread.start()
    return thread, out


def hold_the_last_report(
    service: MasterService, ready: list[int]
) -> tuple[master_pb2.Task, threading.Thread, list[object]]:
    """t0 takes the only task of pass 0 and reports it asking for more: its call
    is held while the pass is checked. Returns the task, the call's thread and
    where its answer goes."""
    task = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0"), CTX).task
    held, out = in_thread(lambda: report_and_ask(service, task, "t0"))
    wait_for(lambda: ready == [0] and len(service._held) == 1)
    return task, held, out


def test_calls_asking_during_the_check_get_the_next_pass_first_tasks() -> None:
    service, journal, ready = verifying_service()
    try:
        a = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0"), CTX).task
        b = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t1"), CTX).task
        # t0 reports its task and asks for the next: nothing todo, one pending.
        first = report_and_ask(service, a, "t0")
        assert first.next.WhichOneof("result") == "wait_s"
        # t1's report ends the pass: its call is held while the pass is checked ...
        held_report, report_out = in_thread(lambda: report_and_ask(service, b, "t1"))
        wait_for(lambda: ready == [0] and len(service._held) == 1)
        # ... as is t0's next ask.
        held_ask, ask_out = in_thread(
            lambda: service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0"), CTX)
        )
        wait_for(lambda: len(service._held) == 2)
        assert not report_out and not ask_out
        service.complete_pass(0, 0, [])
        held_report.join(timeout=10)
        held_ask.join(timeout=10)
        tasks = [report_out[0].next.task, ask_out[0].task]  # type: ignore[attr-defined]
        assert sorted((t.pass_id, t.task_id) for t in tasks) == [(1, 0), (1, 1)]
        assert len(service._held) == 0
        # The pass's completion and both dispatches are one write.
        assert journal.writes[-1] == [
            EventKind.PASS_COMPLETED, EventKind.PASS_STARTED,
            EventKind.DISPATCHED, EventKind.DISPATCHED,
        ]  # fmt: skip
    finally:
        service.stop()


def test_a_held_call_answers_wait_when_the_check_outlasts_the_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(service_module, "HOLD_FOR_NEXT_PASS_S", 0.05)
    service, journal, ready = verifying_service(num_tasks=1)
    try:
        task = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0"), CTX).task
        started = time.monotonic()
        reply = report_and_ask(service, task, "t0")
        assert time.monotonic() - started >= 0.05
        assert reply.next.WhichOneof("result") == "wait_s"
        assert ready == [0]
        assert journal.writes[-1] == [EventKind.DONE, EventKind.PASS_READY]
    finally:
        service.stop()


def test_a_held_call_overtaken_by_its_retry_dispatches_nothing() -> None:
    service, _, ready = verifying_service(num_tasks=2)
    try:
        a = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0", ask=1), CTX).task
        b = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t1"), CTX).task
        report_and_ask(service, b, "t1")
        held, out = in_thread(lambda: report_and_ask(service, a, "t0", ask=2))
        wait_for(lambda: ready == [0] and len(service._held) >= 1)
        # The trainer gave up on the held call and asked again (ask 3); that one
        # is held too. Once the pass starts, only the later call dispatches.
        retry, retry_out = in_thread(
            lambda: service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0", ask=3), CTX)
        )
        wait_for(lambda: len(service._held) >= 2)
        service.complete_pass(0, 0, [])
        held.join(timeout=10)
        retry.join(timeout=10)
        assert out[0].next.WhichOneof("result") == "wait_s"  # type: ignore[attr-defined]
        assert retry_out[0].task.pass_id == 1  # type: ignore[attr-defined]
        status = service.GetJobStatus(master_pb2.GetJobStatusRequest(), CTX)
        assert (status.pass_id, status.tasks_pending) == (1, 1)
    finally:
        service.stop()


def test_no_more_than_max_held_calls_are_held(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(service_module, "MAX_HELD_CALLS", 1)
    service, _, ready = verifying_service(num_tasks=1)
    try:
        _, held, out = hold_the_last_report(service, ready)
        # A second trainer asking now is told to wait at once.
        reply = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t1"), CTX)
        assert reply.WhichOneof("result") == "wait_s"
        service.complete_pass(0, 0, [])
        held.join(timeout=10)
        assert out[0].next.task.pass_id == 1  # type: ignore[attr-defined]
    finally:
        service.stop()


def test_a_held_report_is_answered_with_its_wait_when_the_master_steps_down() -> None:
    """The report was persisted before the hold: a step-down while it is held must
    not turn the call into an error (the trainer would report the task again)."""
    service, journal, ready = verifying_service(num_tasks=1)
    try:
        _, held, out = hold_the_last_report(service, ready)
        service.step_down("lost the lock")
        held.join(timeout=10)
        assert out[0].next.WhichOneof("result") == "wait_s"  # type: ignore[attr-defined]
        assert journal.writes[-1] == [EventKind.DONE, EventKind.PASS_READY]
    finally:
        service.stop()


def test_held_calls_get_nothing_from_a_pass_start_that_was_not_written() -> None:
    """The dispatches made for held calls count only once their write succeeded."""
    service, journal, ready = verifying_service(num_tasks=1)
    try:
        _, held, out = hold_the_last_report(service, ready)

        def fail(queue: TaskQueue, events: Sequence[TaskEvent]) -> None:
            raise OSError("etcd is gone")

        journal.persist = fail  # type: ignore[method-assign]
        with pytest.raises(SteppedDownError):
            service.complete_pass(0, 0, [])
        held.join(timeout=10)
        assert out[0].next.WhichOneof("result") == "wait_s"  # type: ignore[attr-defined]
    finally:
        service.stop()


def test_a_held_call_asks_again_after_a_check_that_reopened_tasks() -> None:
    service, journal, ready = verifying_service(num_tasks=1)
    try:
        task, held, out = hold_the_last_report(service, ready)
        service.reopen({task.task_id: 4})
        held.join(timeout=10)
        again = out[0].next.task  # type: ignore[attr-defined]
        assert (again.pass_id, again.task_id, again.offset) == (0, task.task_id, 4)
        assert journal.writes[-2:] == [[EventKind.REOPENED], [EventKind.DISPATCHED]]
    finally:
        service.stop()


def wait_for_work_while_t1_trains(
    service: MasterService,
) -> tuple[master_pb2.Task, threading.Thread, list[object]]:
    """t0 and t1 take the 2 tasks of pass 0; t0 reports its task (told to wait at
    once without wait_for_work), then asks with wait_for_work: that call is held.
    Returns t1's task, the held call's thread and where its answer goes."""
    a = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0"), CTX).task
    b = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t1"), CTX).task
    first = report_and_ask(service, a, "t0")
    assert first.next.WhichOneof("result") == "wait_s"
    held, out = in_thread(
        lambda: service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0", wait_for_work=True), CTX)
    )
    wait_for(lambda: len(service._held) == 1)
    return b, held, out


def test_a_call_waiting_for_work_is_held_while_the_other_tasks_are_pending() -> None:
    service, journal, ready = verifying_service(num_tasks=2)
    try:
        # t0's call is held through t1's report and the pass's check,
        b, held, out = wait_for_work_while_t1_trains(service)
        in_thread(lambda: report_and_ask(service, b, "t1"))
        wait_for(lambda: ready == [0] and len(service._held) == 2)
        assert not out
        # and answered with the next pass's first task.
        service.complete_pass(0, 0, [])
        held.join(timeout=10)
        assert out[0].task.pass_id == 1  # type: ignore[attr-defined]
        assert journal.writes[-1][:2] == [EventKind.PASS_COMPLETED, EventKind.PASS_STARTED]
    finally:
        service.stop()


def test_a_call_waiting_for_work_gets_a_requeued_task_at_once() -> None:
    service, _, _ = verifying_service(num_tasks=2)
    try:
        b, held, out = wait_for_work_while_t1_trains(service)
        service.trainers_changed({"t0"}, {"t0", "t1"})  # t1 left: its task is todo again
        held.join(timeout=10)
        task = out[0].task  # type: ignore[attr-defined]
        assert (task.pass_id, task.task_id) == (0, b.task_id)
    finally:
        service.stop()


def test_the_check_of_a_ready_pass_starts_before_its_write() -> None:
    """Its first requests only read, so they overlap the ledger write."""
    service, journal, ready = verifying_service(num_tasks=1)
    seen: list[tuple[list[EventKind], list[int]]] = []
    record = journal.persist

    def persist(queue: TaskQueue, events: Sequence[TaskEvent]) -> None:
        seen.append(([e.kind for e in events], list(ready)))
        record(queue, events)

    journal.persist = persist  # type: ignore[method-assign]
    try:
        task = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0"), CTX).task
        service.ReportTask(
            master_pb2.ReportTaskRequest(
                trainer_id="t0", task_id=task.task_id, pass_id=task.pass_id,
                attempt=task.attempt, success=True, samples=10,
            ),
            CTX,
        )  # fmt: skip
        assert seen[-1] == ([EventKind.DONE, EventKind.PASS_READY], [0])
    finally:
        service.stop()
