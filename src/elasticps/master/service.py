"""The master's gRPC service: a thin shell around the pure :class:`TaskQueue`.

The service translates messages, runs the timer that expires overdue tasks, and
turns trainer deaths seen in etcd into ``trainer_lost`` calls. Every decision is
the queue's.

Persist before replying: each mutation of the queue and the ledger write of the
records it changed happen in one critical section, and the reply is sent only
after the write succeeded. So the ledger sees mutations in the queue's order,
and a trainer never holds a dispatch (or a "done") that the ledger does not
have. If the write fails, the in-memory queue may be ahead of the ledger, so the
master *steps down*: it answers UNAVAILABLE from then on and calls
``on_stepped_down``; a standby restores the queue from the ledger.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import grpc

from elasticps import metrics
from elasticps.errors import (
    ConfigError,
    CoordinationError,
    ServiceUnavailableError,
    StaleTaskError,
    SteppedDownError,
    UnknownTaskError,
    UnknownTrainerError,
)
from elasticps.master.ledger import Journal
from elasticps.master.taskqueue import (
    DataRange,
    Dispatch,
    EventKind,
    Finished,
    GetTaskResult,
    QueueStats,
    TaskEvent,
    TaskQueue,
    Wait,
)
from elasticps.proto import master_pb2, master_pb2_grpc

log = logging.getLogger(__name__)

_R = TypeVar("_R")

#: Longest a call asking for work is held while the pass that just ended is
#: checked on the parameter servers, or (``wait_for_work``) while the pass's
#: last tasks are trained by others (seconds). The check takes 10-15 ms on one
#: machine; a trainer told to wait would otherwise sleep through its first
#: poll interval and more (measured in ``benchmarks/README.md``).
HOLD_FOR_NEXT_PASS_S = 0.5

#: Most calls held at once, so that the master's 16 gRPC threads always have
#: some left for reports and progress (held calls beyond it are told to wait).
MAX_HELD_CALLS = 8


class MasterService(master_pb2_grpc.MasterServicer):
    """Serves ``GetTask`` / ``ReportTask`` / ``ReportProgress`` / ``GetJobStatus``.

    Args:
        queue: the task queue; the service owns it from now on.
        journal: makes each mutation durable before the reply (the
            :class:`~elasticps.master.ledger.Ledger`).
        clock: monotonic clock in seconds (injected for tests).
        on_finished: called once when the last pass is over.
        on_stepped_down: called once, with the reason, when the service stops
            serving because a ledger write failed (or :meth:`step_down` was
            called).
        on_pass_ready: called with the pass id when every task of a pass is
            done or failed and the pass waits to be checked on the parameter
            servers (``QueueConfig.verify_passes``).
        is_registered: if given, ``GetTask``, ``ReportTask`` and
            ``ReportProgress`` answer only trainer ids it confirms hold a live
            registration in etcd (``trainers/<id>``), others with
            PERMISSION_DENIED, so that a made-up id is handed no task. The
            ids of :meth:`trainers_changed`'s ``live`` are taken without asking.
    """

    def __init__(
        self,
        queue: TaskQueue,
        journal: Journal,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_finished: Callable[[], None] | None = None,
        on_stepped_down: Callable[[str], None] | None = None,
        on_pass_ready: Callable[[int], None] | None = None,
        is_registered: Callable[[str], bool] | None = None,
    ) -> None:
        self._queue = queue
        self._is_registered = is_registered
        self._live: frozenset[str] = frozenset()  # registered, as etcd's watch said last
        self._on_pass_ready = on_pass_ready
        self._journal = journal
        self._timeout_s = queue.config.task_timeout_s
        self._dispatched_any = False
        self._clock = clock
        self._on_finished = on_finished
        self._on_stepped_down = on_stepped_down
        self._lock = threading.Condition()
        self._samples_done = 0
        self._records_skipped = 0
        self._last_loss = math.nan
        self._stepped_down: str | None = None  # the reason, once stepped down
        self._asks: dict[str, int] = {}  # trainer id -> last ``ask`` taken (see _take_ask)
        self._held: list[_HeldCall] = []  # calls held for work (_hold_for_next_pass)
        self._stop = threading.Event()
        self._timer = threading.Thread(target=self._expire_loop, name="task-timer", daemon=True)
        self._timer.start()

    # --- gRPC methods ----------------------------------------------------------

    def GetTask(  # noqa: N802 (gRPC method name)
        self, request: master_pb2.GetTaskRequest, context: grpc.ServicerContext
    ) -> master_pb2.GetTaskResponse:
        """Hand a task to ``request.trainer_id``, or say wait / finished.

        While the pass that just ended is checked on the parameter servers,
        the call is held until the next pass starts (at most
        :data:`HOLD_FOR_NEXT_PASS_S`), and answered with its first task; with
        ``wait_for_work``, also while every task left is pending elsewhere.
        """

        def get_task(now: float) -> tuple[Dispatch | Wait | Finished, list[TaskEvent]]:
            self._take_ask(request.trainer_id, request.ask)
            return self._queue.get_task(request.trainer_id, now, holding=request.holding)

        with _rpc_errors(context, request.trainer_id):
            self._admit(request.trainer_id)
            result = self._mutate(get_task)
            result = self._hold_for_next_pass(
                result, request.trainer_id, request.ask, request.holding, request.wait_for_work
            )
        return self._task_reply(result)

    def _hold_for_next_pass(
        self,
        result: Dispatch | Wait | Finished,
        trainer_id: str,
        ask: int,
        holding: Sequence[int],
        wait_for_work: bool = False,
    ) -> Dispatch | Wait | Finished:
        """A Wait answered while the ended pass is checked: wait for the next pass, ask again.

        A trainer told to wait sleeps for its own poll interval, which at a
        pass's end is mostly longer than the check; holding the call instead
        has the trainer start the next pass as soon as it begins. The held
        calls are served by the mutation that starts the pass, in its ledger
        write (:meth:`complete_pass`); one that pass did not serve (it ended
        in re-opened tasks instead) asks again once woken. With
        ``wait_for_work`` (an async trainer with nothing to do), a call is
        also held while every task left is pending elsewhere, and asks again
        as soon as one is todo (requeued) or the pass ends. Holds at most
        :data:`MAX_HELD_CALLS` calls at once, each for at most
        :data:`HOLD_FOR_NEXT_PASS_S` (or the Wait's own ``retry_after_s``).
        If a later call of the same trainer was taken meanwhile (a retry),
        the held one dispatches nothing and answers its Wait.
        """
        if not isinstance(result, Wait):
            return result
        deadline = time.monotonic() + min(HOLD_FOR_NEXT_PASS_S, result.retry_after_s)
        call = _HeldCall(trainer_id, ask, tuple(holding))
        queue = self._queue

        def held() -> bool:
            return queue.awaiting_verification or (wait_for_work and queue.only_pending)

        with self._lock:
            if not held() or len(self._held) >= MAX_HELD_CALLS:
                return result
            self._held.append(call)
            try:
                while (
                    call.served is None
                    and held()
                    and self._stepped_down is None
                    and not self._stop.is_set()
                ):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return result
                    self._lock.wait(timeout=left)
            finally:
                self._held.remove(call)
            if call.served is not None:
                return call.served

        def again(now: float) -> tuple[Dispatch | Wait | Finished, list[TaskEvent]]:
            if self._overtaken(call):
                return result, []
            return self._queue.get_task(trainer_id, now, holding=holding)

        try:
            return self._mutate(again)
        except SteppedDownError:
            # The call's own mutation (a report) is durable: answer its Wait,
            # and the trainer's next call finds the new master.
            return result

    def _overtaken(self, call: _HeldCall) -> bool:
        """Whether a later call of the held call's trainer was taken (lock held)."""
        return bool(call.ask) and self._asks.get(call.trainer_id, 0) != call.ask

    def _serve_held(
        self, now: float
    ) -> tuple[list[tuple[_HeldCall, GetTaskResult]], list[TaskEvent]]:
        """Answer every held call that no later call overtook, in the mutation that
        started a pass (lock held); the answers are handed over once it is durable."""
        served: list[tuple[_HeldCall, GetTaskResult]] = []
        events: list[TaskEvent] = []
        for call in self._held:
            if call.served is None and not self._overtaken(call):
                result, more = self._queue.get_task(call.trainer_id, now, holding=call.holding)
                served.append((call, result))
                events.extend(more)
        return served, events

    def _take_ask(self, trainer_id: str, ask: int) -> None:
        """Refuse a call that may dispatch if a later one of its trainer was taken.

        A trainer numbers every such call it sends, retries included
        (``ask``). A retried call that the master takes after the retry that
        replaced it would otherwise requeue the task the retry dispatched (as
        never received, though the trainer is training it) and dispatch
        another to nobody. Called under the lock, before any mutation.

        Raises:
            StaleTaskError: ``ask`` is not above the last one taken from
                ``trainer_id``; nothing is changed. ``ask`` 0 is not checked.
        """
        if not ask:
            return
        last = self._asks.get(trainer_id, 0)
        if ask <= last:
            raise StaleTaskError(
                f"trainer {trainer_id}: call {ask} was overtaken by its call {last}"
            )
        self._asks[trainer_id] = ask

    def _task_reply(self, result: Dispatch | Wait | Finished) -> master_pb2.GetTaskResponse:
        """The GetTask answer for what :meth:`TaskQueue.get_task` returned."""
        if isinstance(result, Dispatch):
            if not self._dispatched_any:
                # Marks the end of a recovery in logs (benchmarks/recovery.py reads it).
                self._dispatched_any = True
                log.info("first task dispatched by this master: task %d", result.task_id)
            return master_pb2.GetTaskResponse(
                task=master_pb2.Task(
                    task_id=result.task_id,
                    pass_id=result.pass_id,
                    attempt=result.attempt,
                    file=result.data.file,
                    start=result.data.start,
                    end=result.data.end,
                    timeout_s=self._timeout_s,
                    offset=result.offset,
                    skip_budget=self._skip_budget(result.task_id, result.pass_id),
                )
            )
        if isinstance(result, Wait):
            return master_pb2.GetTaskResponse(wait_s=result.retry_after_s)
        assert isinstance(result, Finished)
        return master_pb2.GetTaskResponse(finished=True)

    def ReportTask(  # noqa: N802
        self, request: master_pb2.ReportTaskRequest, context: grpc.ServicerContext
    ) -> master_pb2.ReportTaskResponse:
        """Record the outcome of a task attempt; with ``get_next``, hand out the next task.

        A stale attempt is answered with FAILED_PRECONDITION, an unknown task
        with NOT_FOUND; neither changes anything (nor dispatches). With
        ``get_next`` and ``success``, the report and the :meth:`GetTask` that
        follows it are one mutation and one ledger write, answered in
        ``next``; a retry after a lost answer is rejected as stale (the task is
        done), and the caller's GetTask then requeues the dispatch it never
        received, as after any lost GetTask answer.
        """
        get_next = request.get_next and request.success

        def report(now: float) -> tuple[Dispatch | Wait | Finished | None, list[TaskEvent]]:
            if get_next:
                self._take_ask(request.trainer_id, request.ask)
            events = self._queue.report_task(
                request.task_id,
                request.pass_id,
                request.attempt,
                success=request.success,
                now=now,
                error=request.error,
                skipped=request.skipped,
                skipped_batches=request.skipped_batches,
            )
            self._records_skipped += request.skipped
            metrics.MASTER_TASK_REPORTS.labels("succeeded" if request.success else "failed").inc()
            if request.success:
                self._samples_done += request.samples
                if request.samples:
                    self._last_loss = request.mean_loss
            if not get_next:
                return None, events
            result, more = self._queue.get_task(request.trainer_id, now, holding=request.holding)
            return result, events + more

        with _rpc_errors(context, request.trainer_id):
            self._admit(request.trainer_id)
            result = self._mutate(report)
            if result is not None:
                result = self._hold_for_next_pass(
                    result, request.trainer_id, request.ask, request.holding, request.wait_for_work
                )
        if result is None:
            return master_pb2.ReportTaskResponse()
        return master_pb2.ReportTaskResponse(next=self._task_reply(result))

    def ReportProgress(  # noqa: N802
        self, request: master_pb2.ReportProgressRequest, context: grpc.ServicerContext
    ) -> master_pb2.ReportProgressResponse:
        """Record progress inside a task attempt and renew its deadline.

        A stale attempt (or an offset beyond the task's end) is answered with
        FAILED_PRECONDITION, an unknown task with NOT_FOUND; neither changes
        anything.
        """
        with _rpc_errors(context, request.trainer_id):
            self._admit(request.trainer_id)
            self._mutate(
                lambda now: (
                    None,
                    self._queue.report_progress(
                        request.task_id,
                        request.pass_id,
                        request.attempt,
                        request.offset,
                        now,
                        skipped=request.skipped,
                    ),
                )
            )
        return master_pb2.ReportProgressResponse()

    def queue_stats(self) -> QueueStats:
        """The task queue's counters now (for the metrics, read at each scrape)."""
        with self._lock:
            return self._queue.stats()

    def GetJobStatus(  # noqa: N802
        self, request: master_pb2.GetJobStatusRequest, context: grpc.ServicerContext
    ) -> master_pb2.JobStatus:
        """Progress counters of the job."""
        with _rpc_errors(context, trainer_id=""), self._lock:
            if self._stepped_down is not None:
                raise SteppedDownError(self._stepped_down)
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
                tasks_done_all_passes=s.done_all_passes,
                records_skipped=self._records_skipped,
            )

    # --- membership and lifecycle ------------------------------------------------

    def reopen(self, rewinds: dict[int, int]) -> None:
        """Re-open tasks of the current pass at the given records (task id -> record).

        Raises:
            SteppedDownError: the ledger write failed.
        """

        def mutate(now: float) -> list[TaskEvent]:
            events: list[TaskEvent] = []
            for task_id, offset in sorted(rewinds.items()):
                events.extend(self._queue.rewind(task_id, offset, now))
            return events

        self._mutate_events(mutate)

    def open_repairs(self, pass_id: int, rewinds: dict[int, int]) -> bool:
        """Re-open records of sealed pass ``pass_id`` for the servers that lack them
        (``TaskQueue.open_repairs``); returns whether any repair was opened.

        Raises:
            SteppedDownError: the service has stepped down.
        """
        return bool(self._mutate_events(lambda now: self._queue.open_repairs(pass_id, rewinds)))

    def add_tasks(self, ranges: Sequence[DataRange]) -> None:
        """Add a stream's new tasks, persisted before they can be dispatched.

        Raises:
            SteppedDownError: the ledger write failed.
            ConfigError: the queue is not a stream's, or it is sealed.
        """
        self._mutate_events(lambda now: self._queue.add_tasks(ranges))

    def seal(self) -> None:
        """End a stream: its pass ends once every task added so far is done.

        Raises:
            SteppedDownError: the ledger write failed.
        """
        self._mutate_events(lambda now: self._queue.seal())

    def stream_state(self) -> tuple[dict[str, int], bool]:
        """Each partition's next offset to cut from (``TaskQueue.stream_ends``), and
        whether the stream is sealed."""
        with self._lock:
            return self._queue.stream_ends(), self._queue.sealed

    def task_records(self) -> dict[int, int]:
        """Task id -> records in the task, for every task so far."""
        with self._lock:
            return self._queue.task_records()

    def untrained_from(self) -> dict[str, tuple[int, int | None]]:
        """``TaskQueue.untrained_from``: per task file, the first untrained record."""
        with self._lock:
            return self._queue.untrained_from()

    def complete_pass(self, pass_id: int, records_lost: int, passes_lost: Sequence[int]) -> None:
        """Complete a pass the parameter servers were shown to hold (see ``TaskQueue``).

        The calls held for the next pass get its first tasks in the same
        mutation and ledger write.

        Raises:
            SteppedDownError: the ledger write failed.
        """

        def complete(now: float) -> tuple[list[tuple[_HeldCall, GetTaskResult]], list[TaskEvent]]:
            events = self._queue.complete_pass(
                pass_id, records_lost=records_lost, passes_lost=passes_lost
            )
            if not events:
                return [], events
            served, more = self._serve_held(now)
            return served, events + more

        self._mutate(complete, commit=_hand_over)

    def awaiting_verification(self) -> int | None:
        """The pass waiting to be checked on the parameter servers, or None."""
        with self._lock:
            if self._queue.awaiting_verification:
                return self._queue.stats().pass_id
            return None

    def done_tasks(self) -> list[int]:
        """The tasks done in the current pass."""
        with self._lock:
            return self._queue.done_tasks()

    def pending_trainers(self) -> set[str]:
        """Return the trainers that hold pending attempts (after a restore, too)."""
        with self._lock:
            return self._queue.trainers()

    def trainers_changed(self, live: set[str], previous: set[str]) -> None:
        """Requeue at once the pending tasks of trainers that left etcd.

        Args:
            live: the trainers registered in etcd now.
            previous: the trainers known before; those not in ``live`` are lost.
        """
        self._live = frozenset(live)
        for trainer_id in sorted(previous - live):
            try:
                events = self._mutate_events(
                    functools.partial(self._queue.trainer_lost, trainer_id)
                )
            except SteppedDownError:
                return
            log.info("trainer %s left; %d task(s) requeued", trainer_id, len(events))

    @property
    def stepped_down(self) -> bool:
        """Whether the service stopped serving because it lost the master lock."""
        with self._lock:
            return self._stepped_down is not None

    def step_down(self, reason: str) -> None:
        """Stop serving: every call is answered UNAVAILABLE from now on. Idempotent.

        Args:
            reason: logged, and passed to ``on_stepped_down``.
        """
        with self._lock:
            first = self._mark_stepped_down(reason)
        if first:
            self._announce_step_down(reason)

    def stop(self) -> None:
        """Stop the timer thread."""
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        self._timer.join(timeout=5)

    # --- internals ---------------------------------------------------------------

    def _admit(self, trainer_id: str) -> None:
        """Refuse a call of a trainer id with no live registration (see ``is_registered``).

        Raises:
            UnknownTrainerError: etcd holds no registration of it.
            ServiceUnavailableError: etcd could not be asked (the caller retries).
        """
        if self._is_registered is None or trainer_id in self._live:
            return
        try:
            registered = self._is_registered(trainer_id)
        except ConfigError:
            registered = False  # not even a well-formed trainer id
        except CoordinationError as exc:
            raise ServiceUnavailableError(f"cannot check trainer {trainer_id!r}: {exc}") from exc
        if not registered:
            raise UnknownTrainerError(
                f"trainer {trainer_id!r} holds no live registration in etcd; "
                "a trainer registers before it asks for work"
            )

    def _skip_budget(self, task_id: int, pass_id: int) -> int:
        """The task's skip budget, read right after its dispatch (the lock is free again)."""
        with self._lock:
            return self._queue.skip_budget(task_id, pass_id)

    def _mutate(
        self,
        mutate: Callable[[float], tuple[_R, list[TaskEvent]]],
        commit: Callable[[_R], None] | None = None,
    ) -> _R:
        """Apply one queue mutation and persist its events, in one critical section.

        ``commit(result)`` runs in that section too, once the write succeeded.

        Raises:
            SteppedDownError: the service has stepped down, or does now because
                the ledger write failed.
            StaleTaskError / UnknownTaskError: from the queue; nothing changed.
        """
        with self._lock:
            if self._stepped_down is not None:
                raise SteppedDownError(self._stepped_down)
            result, events = mutate(self._clock())
            self._check_ready_passes(events)
            try:
                self._journal.persist(self._queue, events)
            except Exception as exc:
                # The queue is now ahead of the ledger; only a restore from the
                # ledger is safe. Any failure counts, not only the fence.
                reason = str(exc) if isinstance(exc, SteppedDownError) else repr(exc)
                first = self._mark_stepped_down(reason)
                failure: Exception | None = exc
            else:
                failure = None
                if commit is not None:
                    commit(result)
                if events:
                    self._lock.notify_all()  # the timer, held calls
        if failure is not None:
            if first:
                self._announce_step_down(reason)
            raise SteppedDownError(reason) from failure
        self._after(events)
        return result

    def _check_ready_passes(self, events: list[TaskEvent]) -> None:
        """Start the check of a pass that became ready (lock held, its write not done yet).

        The check's first requests only read (etcd's slot claims, each
        shard's coverage), so they overlap the ledger write; what it reads
        from the queue waits for this lock, so for the write. A check that
        goes on after a failed write (the master steps down) can only seal
        a pass every shard was shown to hold, which stays true.
        """
        if self._on_pass_ready is None:
            return
        for e in events:
            if e.kind is EventKind.PASS_READY:
                self._on_pass_ready(e.pass_id)

    def _mark_stepped_down(self, reason: str) -> bool:
        """Record the step-down (lock held); return whether it is the first."""
        if self._stepped_down is not None:
            return False
        self._stepped_down = reason
        self._lock.notify_all()
        return True

    def _announce_step_down(self, reason: str) -> None:
        log.error("master stepping down: %s", reason)
        if self._on_stepped_down is not None:
            self._on_stepped_down(reason)

    def _mutate_events(self, mutate: Callable[[float], list[TaskEvent]]) -> list[TaskEvent]:
        events: list[TaskEvent] = []

        def wrapped(now: float) -> tuple[None, list[TaskEvent]]:
            events.extend(mutate(now))
            return None, events

        self._mutate(wrapped)
        return events

    def _expire_loop(self) -> None:
        # Sleeps until the earliest pending deadline (or until woken because a
        # new deadline was set), then expires what is overdue.
        while not self._stop.is_set():
            with self._lock:
                if self._stepped_down is not None:
                    return
                deadline = self._queue.next_deadline()
                now = self._clock()
                if deadline is None or deadline > now:
                    self._lock.wait(timeout=1.0 if deadline is None else min(1.0, deadline - now))
                    continue
            try:
                self._mutate_events(self._queue.expire)
            except SteppedDownError:
                return

    def _after(self, events: list[TaskEvent]) -> None:
        """Log what happened (outside the lock) and signal the end of the job."""
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
                log.info(
                    "task %s attempt %d requeued at offset %d (%s), timeouts=%d",
                    e.task_id,
                    e.attempt,
                    e.offset,
                    e.reason,
                    e.timeout_count,
                )
            elif e.kind is EventKind.PASS_COMPLETED and e.summary is not None:
                s = e.summary
                log.log(
                    logging.INFO if s.exactly_once else logging.ERROR,
                    "pass %d completed: %d/%d tasks done, %d failed, %d records trained, "
                    "%d skipped, exactly once on every shard: %s (checked on the servers: %s; "
                    "ledger duplicated %d, missing %d; re-opened %d; repaired %d of passes %s; "
                    "lost %d of passes %s)",
                    s.pass_id,
                    s.done,
                    s.tasks,
                    s.failed,
                    s.records_trained,
                    s.records_skipped,
                    s.exactly_once,
                    s.shards_checked,
                    s.duplicated_records,
                    s.missing_records,
                    s.records_reopened,
                    s.records_repaired,
                    list(s.passes_repaired),
                    s.records_lost,
                    list(s.passes_lost),
                )
            elif e.kind is EventKind.PASS_STARTED:
                log.info("pass %d started", e.pass_id)
            elif e.kind is EventKind.PASS_READY:
                log.info("pass %d: every task reported; checking the parameter servers", e.pass_id)
            elif e.kind is EventKind.REOPENED:
                log.info("task %s re-opened at record %d: %s", e.task_id, e.offset, e.reason)
            elif e.kind is EventKind.REPAIR:
                log.info("repair of task %s of pass %d, attempt %d, at record %d: %s",
                         e.task_id, e.pass_id, e.attempt, e.offset, e.reason)  # fmt: skip
            elif e.kind is EventKind.JOB_FINISHED:
                log.info("all passes finished")
                if self._on_finished is not None:
                    self._on_finished()


@dataclasses.dataclass
class _HeldCall:
    """A call asking for work, held while the ended pass is checked (or, with
    ``wait_for_work``, while the pass's last tasks are trained by others).

    Attributes:
        trainer_id / ask / holding: the call's (see :meth:`MasterService.GetTask`).
        served: its answer, once the mutation that started the next pass
            gave it one and that mutation is durable; None until then (a call
            woken without one asks again).
    """

    trainer_id: str
    ask: int
    holding: tuple[int, ...]
    served: GetTaskResult | None = None


def _hand_over(served: list[tuple[_HeldCall, GetTaskResult]]) -> None:
    """Give the held calls their answers (lock held, the write done)."""
    for call, result in served:
        call.served = result


@contextlib.contextmanager
def _rpc_errors(context: grpc.ServicerContext, trainer_id: str) -> Iterator[None]:
    """Translate the errors of a mutation into gRPC status codes (the one mapping)."""
    try:
        yield
    except StaleTaskError as exc:
        log.info("rejected report from trainer %s: %s", trainer_id, exc)
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
    except UnknownTaskError as exc:
        context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
    except UnknownTrainerError as exc:
        log.warning("refused a call of trainer %r: no live registration", trainer_id[:64])
        context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
    except ServiceUnavailableError as exc:
        context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
    except SteppedDownError as exc:
        context.abort(
            grpc.StatusCode.UNAVAILABLE,
            f"this master stepped down ({exc}); ask etcd for the new one",
        )
