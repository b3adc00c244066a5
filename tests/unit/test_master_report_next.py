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


def test_a_trainer_holding_a_task_reports_the_one_before_and_gets_the_one_after() -> None:
    service, journal = service_of(4)
    try:
        first = service.GetTask(master_pb2.GetTaskRequest(trainer_id="t0"), CTX).task
        ahead = service.GetTask(
            master_pb2.GetTaskRequest(trainer_id="t0", holding=[first.task_id]), CTX
        ).task
        assert (first.task_id, ahead.task_id) == (0, 1)
        # The report of the first names the held one: it stays the trainer's,
        # and the answer is the task after it, in one write.
        journal.writes.clear()
        request = master_pb2.ReportTaskRequest(
            trainer_id="t0", task_id=0, pass_id=0, attempt=1, success=True, samples=10,
            get_next=True, holding=[ahead.task_id],
        )  # fmt: skip
        after = service.ReportTask(request, CTX).next.task
        assert after.task_id == 2
        assert journal.writes == [[EventKind.DONE, EventKind.DISPATCHED]]
        status = service.GetJobStatus(master_pb2.GetJobStatusRequest(), CTX)
        assert (status.tasks_done, status.tasks_pending, status.tasks_todo) == (1, 2, 1)
        # A report that does not name it gives it back, as never received.
        request = master_pb2.ReportTaskRequest(
            trainer_id="t0", task_id=1, pass_id=0, attempt=1, success=True, samples=10,
            get_next=True,
        )  # fmt: skip
        assert service.ReportTask(request, CTX).next.task.task_id == 3
        status = service.GetJobStatus(master_pb2.GetJobStatusRequest(), CTX)
        assert (status.tasks_done, status.tasks_pending, status.tasks_todo) == (2, 1, 1)
    finally:
        service.stop()


def ask(service: MasterService, number: int, trainer: str = "t0") -> master_pb2.GetTaskResponse:
    return service.GetTask(master_pb2.GetTaskRequest(trainer_id=trainer, ask=number), CTX)


def test_a_call_overtaken_by_its_retry_changes_nothing() -> None:
    # A GetTask is slow; the trainer gives up and retries (ask 2), and the
    # master takes the retry first. The first call, taken last, must not
    # requeue task 0 (the trainer is training it) nor dispatch another.
    service, journal = service_of(3)
    try:
        first = ask(service, 2).task
        assert (first.task_id, first.attempt) == (0, 1)
        writes = len(journal.writes)
        for overtaken in (1, 2):
            with pytest.raises(AbortedError) as caught:
                ask(service, overtaken)
            assert caught.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert len(journal.writes) == writes
        # Another trainer's numbers are its own.
        assert ask(service, 1, trainer="t1").task.task_id == 1
        # Task 0 is still the trainer's: its report is taken.
        service.ReportTask(
            master_pb2.ReportTaskRequest(
                trainer_id="t0", task_id=0, pass_id=0, attempt=1, success=True, samples=10,
                get_next=True, ask=4,
            ),
            CTX,
        )  # fmt: skip
        # A report-and-ask overtaken the same way is refused whole: nothing
        # dispatched, nothing reported twice.
        writes = len(journal.writes)
        with pytest.raises(AbortedError):
            service.ReportTask(
                master_pb2.ReportTaskRequest(
                    trainer_id="t0", task_id=0, pass_id=0, attempt=1, success=True,
                    samples=10, get_next=True, ask=3,
                ),
                CTX,
            )  # fmt: skip
        assert len(journal.writes) == writes
        status = service.GetJobStatus(master_pb2.GetJobStatusRequest(), CTX)
        assert (status.tasks_done, status.tasks_pending, status.tasks_todo) == (1, 2, 0)
    finally:
        service.stop()


def test_the_client_numbers_every_attempt_of_a_call_that_may_dispatch() -> None:
    from elasticps.master.client import MasterClient

    seen: list[tuple[str, int]] = []

    class Stub:
        def GetTask(  # noqa: N802
            self, request: master_pb2.GetTaskRequest, timeout: float, metadata: object = ()
        ) -> object:
            seen.append(("GetTask", request.ask))
            if len(seen) == 1:
                raise _Unavailable()
            return master_pb2.GetTaskResponse(wait_s=1.0)

        def ReportTask(  # noqa: N802
            self, request: master_pb2.ReportTaskRequest, timeout: float, metadata: object = ()
        ) -> object:
            seen.append(("ReportTask", request.ask))
            return master_pb2.ReportTaskResponse()

    client = MasterClient("127.0.0.1:1", retry_s=5.0)
    client._stub_now = Stub  # type: ignore[assignment,method-assign]
    client._forget = lambda stub: None  # type: ignore[assignment,method-assign]
    client.get_task("t0")
    client.report_task(master_pb2.ReportTaskRequest(trainer_id="t0", get_next=True))
    client.report_task(master_pb2.ReportTaskRequest(trainer_id="t0", get_next=False))
    asks = [number for _, number in seen]
    assert [name for name, _ in seen] == ["GetTask", "GetTask", "ReportTask", "ReportTask"]
    assert asks[0] < asks[1] < asks[2] and asks[3] == 0


class _Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "down"
