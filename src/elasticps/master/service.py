"""The master's gRPC service: a thin shell around the pure :class:`TaskQueue`.

The service translates messages, holds the queue's lock, runs the timer that
expires overdue tasks, and turns trainer deaths seen in etcd into
``trainer_lost`` calls. Every decision is the queue's.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import grpc

from elasticps.errors import StaleTaskError, UnknownTaskError
from elasticps.master.taskqueue import (
    Dispatch,
    EventKind,
    Finished,
    TaskEvent,
    TaskQueue,
    Wait,
)
from elasticps.proto import master_pb2, master_pb2_grpc

log = logging.getLogger(__name__)


class MasterService(master_pb2_grpc.MasterServicer):
    """Serves ``GetTask`` / ``ReportTask`` / ``GetJobStatus`` from a :class:`TaskQueue`.

    Args:
        queue: the task queue; the service owns it from now on.
        task_timeout_s: sent to trainers with each task, seconds.
        clock: monotonic clock in seconds (injected for tests).
        on_finished: called once when the last pass is over.
    """

    def __init__(
        self,
        queue: TaskQueue,
        task_timeout_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_finished: Callable[[], None] | None = None,
    ) -> None:
        self._queue = queue
        self._timeout_s = task_timeout_s
        self._clock = clock
        self._on_finished = on_finished
        self._lock = threading.Condition()
        self._samples_done = 0
        self._last_loss = math.nan
        self._done_all_passes = 0
        self._stop = threading.Event()
        self._timer = threading.Thread(target=self._expire_loop, name="task-timer", daemon=True)
        self._timer.start()

    # --- gRPC methods ----------------------------------------------------------

    def GetTask(  # noqa: N802 (gRPC method name)
        self, request: master_pb2.GetTaskRequest, context: grpc.ServicerContext
    ) -> master_pb2.GetTaskResponse:
        """Hand a task to ``request.trainer_id``, or say wait / finished."""
        with self._lock:
            result, events = self._queue.get_task(request.trainer_id, self._clock())
            self._lock.notify_all()  # the timer may need an earlier wake-up
        self._log_events(events)
        if isinstance(result, Dispatch):
            return master_pb2.GetTaskResponse(
                task=master_pb2.Task(
                    task_id=result.task_id,
                    pass_id=result.pass_id,
                    attempt=result.attempt,
                    file=result.data.file,
                    start=result.data.start,
                    end=result.data.end,
                    timeout_s=self._timeout_s,
                )
            )
        if isinstance(result, Wait):
            return master_pb2.GetTaskResponse(wait_s=result.retry_after_s)
        assert isinstance(result, Finished)
        return master_pb2.GetTaskResponse(finished=True)

    def ReportTask(  # noqa: N802
        self, request: master_pb2.ReportTaskRequest, context: grpc.ServicerContext
    ) -> master_pb2.ReportTaskResponse:
        """Record the outcome of a task attempt.

        A stale attempt is answered with FAILED_PRECONDITION, an unknown task
        with NOT_FOUND; neither changes anything.
        """
        try:
            with self._lock:
                events = self._queue.report_task(
                    request.task_id,
                    request.pass_id,
                    request.attempt,
                    success=request.success,
                    now=self._clock(),
                    error=request.error,
                )
                if request.success:
                    self._samples_done += request.samples
                    self._done_all_passes += 1
                    if request.samples:
                        self._last_loss = request.mean_loss
        except StaleTaskError as exc:
            log.info("rejected report from %s: %s", request.trainer_id, exc)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except UnknownTaskError as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        self._log_events(events)
        return master_pb2.ReportTaskResponse()

    def GetJobStatus(  # noqa: N802
        self, request: master_pb2.GetJobStatusRequest, context: grpc.ServicerContext
    ) -> master_pb2.JobStatus:
        """Progress counters of the job."""
        with self._lock:
            s = self._queue.stats()
            return master_pb2.JobStatus(
                pass_id=s.pass_id,
                num_passes=s.num_passes,
                tasks_total=s.total,
                tasks_todo=s.todo,
                tasks_pending=s.pending,
                tasks_done=s.done,
                tasks_failed=s.failed,
                finished=s.finished,
                samples_done=self._samples_done,
                last_loss=self._last_loss,
                tasks_done_all_passes=self._done_all_passes,
            )

    # --- membership ------------------------------------------------------------

    def trainers_changed(self, live: set[str], previous: set[str]) -> None:
        """Requeue at once the pending tasks of trainers that left etcd."""
        for trainer_id in sorted(previous - live):
            with self._lock:
                events = self._queue.trainer_lost(trainer_id, self._clock())
            log.info("trainer %s left; %d task(s) requeued", trainer_id, len(events))
            self._log_events(events)

    def stop(self) -> None:
        """Stop the timer thread."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        self._timer.join(timeout=5)

    # --- internals ---------------------------------------------------------------

    def _expire_loop(self) -> None:
        # Sleeps until the earliest pending deadline (or until woken because a
        # new task was dispatched), then expires what is overdue.
        while not self._stop.is_set():
            with self._lock:
                deadline = self._queue.next_deadline()
                now = self._clock()
                if deadline is None or deadline > now:
                    self._lock.wait(timeout=1.0 if deadline is None else min(1.0, deadline - now))
                    continue
                events = self._queue.expire(now)
            self._log_events(events)

    def _log_events(self, events: list[TaskEvent]) -> None:
        for e in events:
            if e.kind is EventKind.FAILED:
                log.warning(
                    "task %s failed in pass %d after %d timeouts/failures (%s)",
                    e.task_id,
                    e.pass_id,
                    e.timeout_count,
                    e.reason,
                )
            elif e.kind is EventKind.REQUEUED:
                log.info("task %s requeued (%s), timeouts=%d", e.task_id, e.reason, e.timeout_count)
            elif e.kind is EventKind.PASS_STARTED:
                log.info("pass %d started", e.pass_id)
            elif e.kind is EventKind.JOB_FINISHED:
                log.info("all passes finished")
                if self._on_finished is not None:
                    self._on_finished()
