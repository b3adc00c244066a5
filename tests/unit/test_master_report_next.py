"""ReportTask with ``get_next``: the report and the next dispatch are one mutation, one write."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
import pytest

from elasticps.master.service import MasterService
from elasticps.master.taskqueue import DataRange, EventKind, QueueConfig, TaskEvent, TaskQueue
from elasticps.proto import master_pb2
from elasticps.testing.servicer import ABORTING_CONTEXT, AbortedError

pytestmark = pytest.mark.timeout(30)


class RecordingJournal:
    """Keeps the event kinds of each persisted mutation."""

    def __init__(self) -> None:
        self.writes: list[list[EventKind]] = []

    def persist(self, queue: TaskQueue, events: Sequence[TaskEvent]) -> None:
        del queue
        self.writes.append([e.kind for e in events])


CTX = ABORTING_CONTEXT


def service_of(num_tasks: int) -> tuple[MasterService, RecordingJournal]:
    ranges = [DataRange("data.parquet", 10 * i, 10 * i + 10) for i in range(num_tasks)]
    journal = RecordingJournal()
    queue = TaskQueue(ranges, QueueConfig(task_timeout_s=60.0, max_task_timeouts=2))
    return MasterService(queue, journal), journal


def report(
    service: MasterService, task: master_pb2.Task, *, get_next: bool, success: bool = True
) -> master_pb2.ReportTaskResponse:
    return service.ReportTask(
        master_pb2.ReportTaskRequest(
            trainer_id="t0",
            task_id=task.task_id,
            pass_id=task.pass_id,
            attempt=task.attempt,
            success=success,
            samples=10,
            get_next=get_next,
        ),
        CTX,
    )


def test_a_report_with_get_next_dispatches_the_next_task_in_one_write() -> None:
    service, journal = service_of(2)
    try:
        first = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0"), CTX).task
        journal.writes.clear()
        reply = report(service, first, get_next=True)
        assert reply.HasField("next") and reply.next.WhichOneof("result") == "task"
        second = reply.next.task
        assert (second.task_id, second.attempt, second.offset) == (1, 1, 0)
        assert second.timeout_s == 60.0
        assert journal.writes == [[EventKind.DONE, EventKind.DISPATCHED]]
        # The last report of the job answers "finished" the same way.
        last = report(service, second, get_next=True)
        assert last.next.WhichOneof("result") == "finished"
        status = service.GetJobStatus(master_pb2.GetJobStatusRequest(), CTX)
        assert (status.tasks_done, status.samples_done, status.finished) == (2, 20, True)
    finally:
        service.stop()


def test_a_rejected_report_dispatches_nothing_and_a_retry_falls_back_to_get_task() -> None:
    service, journal = service_of(3)
    try:
        first = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0"), CTX).task
        second = report(service, first, get_next=True).next.task
        # The answer was lost: the retry is stale and changes nothing ...
        writes = len(journal.writes)
        with pytest.raises(AbortedError) as caught:
            report(service, first, get_next=True)
        assert caught.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert len(journal.writes) == writes
        # ... and the GetTask that follows requeues the dispatch never received.
        again = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0"), CTX).task
        assert again.task_id == 2
        status = service.GetJobStatus(master_pb2.GetJobStatusRequest(), CTX)
        assert (status.tasks_done, status.tasks_pending, status.tasks_todo) == (1, 1, 1)
        assert second.task_id == 1
        # Without get_next, and with a failure report, nothing is dispatched.
        assert not report(service, again, get_next=False).HasField("next")
        retried = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0"), CTX).task
        assert (retried.task_id, retried.attempt) == (1, 2)
        assert not report(service, retried, get_next=True, success=False).HasField("next")
        status = service.GetJobStatus(master_pb2.GetJobStatusRequest(), CTX)
        assert (status.tasks_done, status.tasks_pending, status.tasks_todo) == (2, 0, 1)
    finally:
        service.stop()
