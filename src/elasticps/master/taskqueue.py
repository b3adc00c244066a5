"""The master's task queue: a pure state machine over data ranges.

Modelled on the master of PaddlePaddle's original Go implementation
(``go/master/service.go``): every task is explicitly in one of the states
todo, pending, done or failed, and every dispatch carries a pass id and an
attempt number. A report or a timeout for an attempt that is no longer current
(it timed out and was re-dispatched, or belongs to an earlier pass) is rejected
or ignored, so a task is never counted twice.

This module does no I/O, starts no threads and reads no clock: the caller
passes ``now`` (seconds on a monotonic clock) into every mutation. Every
mutation returns the :class:`TaskEvent` records it caused, so the service shell
can log and persist them before it replies.

Cost: ``get_task``, ``report_task`` and ``trainer_lost`` are O(log n) per task
they touch (heap operations), ``expire`` is O(log n) per entry it pops, and
``stats`` is O(1). The only O(n) step is the reset at the start of a pass,
which happens once per n completed tasks.
"""

from __future__ import annotations

import enum
import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from elasticps.errors import ConfigError, StaleTaskError, UnknownTaskError

__all__ = [
    "MAX_RETRY_AFTER_S",
    "MIN_RETRY_AFTER_S",
    "DataRange",
    "Dispatch",
    "EventKind",
    "Finished",
    "GetTaskResult",
    "QueueConfig",
    "QueueStats",
    "TaskEvent",
    "TaskQueue",
    "TaskState",
    "Wait",
    "split_into_tasks",
]

MAX_RETRY_AFTER_S = 1.0
"""Longest :class:`Wait` hint, in seconds, so idle trainers notice requeues promptly."""

MIN_RETRY_AFTER_S = 0.01
"""Shortest :class:`Wait` hint, in seconds, so a trainer never busy-polls."""


# --- data ranges ---------------------------------------------------------------


@dataclass(frozen=True)
class DataRange:
    """Rows ``[start, end)`` of one Parquet file.

    Attributes:
        file: path of the Parquet file.
        start: first row, inclusive, 0-based.
        end: last row, exclusive.

    Raises:
        ValueError: unless ``0 <= start < end``.
    """

    file: str
    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise ValueError(
                f"DataRange {self.file!r}: need 0 <= start < end, got [{self.start}, {self.end})"
            )

    @property
    def num_rows(self) -> int:
        """Number of rows in the range (``end - start``)."""
        return self.end - self.start


def split_into_tasks(files: Sequence[tuple[str, int]], records_per_task: int) -> list[DataRange]:
    """Cut files into contiguous row ranges of at most ``records_per_task`` rows.

    Ranges follow file order, then row order; a range never spans two files, so
    the last range of a file may be shorter.

    Args:
        files: ``(path, number of rows)`` pairs. Files with 0 rows contribute
            nothing.
        records_per_task: most rows per range, >= 1.

    Returns:
        The ranges, in order. Empty if every file is empty.

    Raises:
        ConfigError: ``records_per_task < 1`` or a negative row count.
    """
    if records_per_task < 1:
        raise ConfigError(f"records_per_task must be >= 1, got {records_per_task}")
    ranges: list[DataRange] = []
    for path, num_rows in files:
        if num_rows < 0:
            raise ConfigError(f"file {path!r} has a negative row count: {num_rows}")
        for start in range(0, num_rows, records_per_task):
            ranges.append(DataRange(path, start, min(start + records_per_task, num_rows)))
    return ranges


# --- states, config, results and events ---------------------------------------


class TaskState(enum.Enum):
    """Where a task is within the current pass."""

    TODO = "todo"
    """Waiting in the todo queue to be dispatched."""
    PENDING = "pending"
    """Dispatched to a trainer; waiting for its report or its deadline."""
    DONE = "done"
    """Reported successful in this pass."""
    FAILED = "failed"
    """Timed out or failed more than ``max_task_timeouts`` times in this pass."""


# The one table of allowed transitions; ``TaskQueue._transition`` enforces it.
# DONE/FAILED -> TODO happens only at the start of a new pass.
_ALLOWED_TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    TaskState.TODO: frozenset({TaskState.PENDING}),
    TaskState.PENDING: frozenset({TaskState.TODO, TaskState.DONE, TaskState.FAILED}),
    TaskState.DONE: frozenset({TaskState.TODO}),
    TaskState.FAILED: frozenset({TaskState.TODO}),
}


@dataclass(frozen=True)
class QueueConfig:
    """Settings of a :class:`TaskQueue`.

    Attributes:
        task_timeout_s: seconds a trainer has to report a dispatched task, > 0.
        max_task_timeouts: how many timeouts or reported failures a task may
            have within one pass, >= 1; one more and it is FAILED for that pass.
        num_passes: how many passes (epochs) over all tasks, >= 1.

    Raises:
        ConfigError: a value is out of range.
    """

    task_timeout_s: float = 60.0
    max_task_timeouts: int = 3
    num_passes: int = 1

    def __post_init__(self) -> None:
        # ``not x > 0`` also rejects NaN.
        if not self.task_timeout_s > 0:
            raise ConfigError(f"task_timeout_s must be > 0, got {self.task_timeout_s}")
        if self.max_task_timeouts < 1:
            raise ConfigError(f"max_task_timeouts must be >= 1, got {self.max_task_timeouts}")
        if self.num_passes < 1:
            raise ConfigError(f"num_passes must be >= 1, got {self.num_passes}")


@dataclass(frozen=True)
class Dispatch:
    """A task handed to a trainer: a lease on one attempt.

    Attributes:
        task_id: index of the task in the queue's ranges, 0-based.
        pass_id: pass (epoch) this attempt belongs to, 0-based.
        attempt: dispatch number of this task, starting at 1 and never reused,
            across passes too. Reports must quote it.
        data: the rows to train on.
        deadline: monotonic time, in seconds, after which the attempt times out.
    """

    task_id: int
    pass_id: int
    attempt: int
    data: DataRange
    deadline: float


@dataclass(frozen=True)
class Wait:
    """Nothing to hand out now: every remaining task is pending elsewhere.

    Attributes:
        retry_after_s: seconds the trainer should wait before asking again, > 0.
    """

    retry_after_s: float


@dataclass(frozen=True)
class Finished:
    """All passes are over; the trainer should stop asking."""


GetTaskResult = Dispatch | Wait | Finished
"""What :meth:`TaskQueue.get_task` hands back."""


class EventKind(enum.Enum):
    """What a :class:`TaskEvent` records."""

    DISPATCHED = "dispatched"
    DONE = "done"
    REQUEUED = "requeued"
    FAILED = "failed"
    PASS_STARTED = "pass_started"
    JOB_FINISHED = "job_finished"


@dataclass(frozen=True)
class TaskEvent:
    """One change of the queue, for the shell to log and persist.

    Attributes:
        kind: what happened.
        task_id: the task concerned; None for PASS_STARTED and JOB_FINISHED.
        pass_id: the pass the event belongs to (the new pass for PASS_STARTED).
        attempt: the task's attempt number after the event; 0 for queue events.
        timeout_count: the task's timeouts and failures in this pass after the
            event; 0 for queue events.
        trainer_id: the trainer holding (or that held) the attempt, if any.
        reason: why a task was requeued or failed: ``"timeout"``,
            ``"trainer lost"`` or ``"reported failure: <message>"``.
    """

    kind: EventKind
    task_id: int | None
    pass_id: int
    attempt: int
    timeout_count: int
    trainer_id: str | None
    reason: str = ""


@dataclass(frozen=True)
class QueueStats:
    """Counters of a :class:`TaskQueue`, for progress reports and health checks.

    Attributes:
        pass_id: current pass, 0-based (the last pass once finished).
        num_passes: configured number of passes.
        total: number of tasks per pass.
        todo: tasks waiting to be dispatched.
        pending: tasks dispatched and not yet reported or timed out.
        done: tasks done in the current pass.
        failed: tasks failed in the current pass.
        finished: True once every pass is over.
    """

    pass_id: int
    num_passes: int
    total: int
    todo: int
    pending: int
    done: int
    failed: int
    finished: bool


# --- the queue ------------------------------------------------------------------


@dataclass
class _Task:
    """Mutable bookkeeping of one task; never leaves this module."""

    data: DataRange
    state: TaskState = TaskState.TODO
    attempt: int = 0
    timeout_count: int = 0
    dispatch: Dispatch | None = None  # set while PENDING
    trainer_id: str | None = None  # set while PENDING


class TaskQueue:
    """Hands out data ranges to trainers, pass after pass, tolerating loss.

    Tasks move TODO -> PENDING on :meth:`get_task`, then to DONE on a
    successful report, or back to the end of TODO on a timeout, a reported
    failure or the loss of their trainer. A task that times out or fails more
    than ``max_task_timeouts`` times in a pass is FAILED for that pass. When no
    task is TODO or PENDING, the next pass starts with every task back in TODO,
    or the job finishes after the last pass.

    Not thread-safe: the shell serialises calls (it holds the master lock).

    Args:
        ranges: the data ranges; task ids are their indices.
        config: timeouts and the number of passes.

    Raises:
        ConfigError: ``ranges`` is empty.
    """

    def __init__(self, ranges: Sequence[DataRange], config: QueueConfig) -> None:
        if not ranges:
            raise ConfigError("a task queue needs at least one data range")
        self._config = config
        self._tasks = [_Task(data=r) for r in ranges]
        self._todo: deque[int] = deque(range(len(self._tasks)))
        # Min-heap of (deadline, task_id, attempt). Entries are not removed
        # when a task is reported or requeued; they are skipped when popped
        # (lazy deletion) because their attempt no longer matches, and the heap
        # is compacted when dead entries outnumber live ones.
        self._deadlines: list[tuple[float, int, int]] = []
        self._by_trainer: dict[str, set[int]] = {}
        self._pass_id = 0
        self._finished = False
        self._num_pending = 0
        self._num_done = 0
        self._num_failed = 0

    # --- queries -----------------------------------------------------------

    def stats(self) -> QueueStats:
        """Return the queue's counters in O(1).

        Returns:
            A snapshot of the counters of the current pass.
        """
        return QueueStats(
            pass_id=self._pass_id,
            num_passes=self._config.num_passes,
            total=len(self._tasks),
            todo=len(self._todo),
            pending=self._num_pending,
            done=self._num_done,
            failed=self._num_failed,
            finished=self._finished,
        )

    def state_of(self, task_id: int) -> TaskState:
        """Return the state of one task in the current pass.

        Args:
            task_id: the task, 0-based.

        Returns:
            Its state.

        Raises:
            UnknownTaskError: no such task.
        """
        return self._task(task_id).state

    def pending_of(self, trainer_id: str) -> list[Dispatch]:
        """Return the attempts a trainer currently holds, by task id.

        Args:
            trainer_id: the trainer; an unknown trainer holds nothing.

        Returns:
            Its pending dispatches, sorted by task id.
        """
        dispatches: list[Dispatch] = []
        for task_id in sorted(self._by_trainer.get(trainer_id, ())):
            dispatch = self._tasks[task_id].dispatch
            if dispatch is not None:
                dispatches.append(dispatch)
        return dispatches

    def next_deadline(self) -> float | None:
        """Return the earliest deadline of a pending attempt, for the shell's timer.

        Returns:
            Monotonic time in seconds, or None if nothing is pending.
        """
        self._drop_dead_heads()
        return self._deadlines[0][0] if self._deadlines else None

    # --- mutations ---------------------------------------------------------

    def get_task(self, trainer_id: str, now: float) -> tuple[GetTaskResult, list[TaskEvent]]:
        """Hand the front of the todo queue to a trainer.

        Does not expire overdue attempts itself; the shell calls
        :meth:`expire` when :meth:`next_deadline` passes.

        Args:
            trainer_id: the trainer asking for work.
            now: current monotonic time, in seconds.

        Returns:
            ``(result, events)``: a :class:`Dispatch` (with a DISPATCHED event),
            a :class:`Wait` if every remaining task is pending elsewhere, or
            :class:`Finished` once all passes are over.
        """
        if self._finished:
            return Finished(), []
        if not self._todo:
            # The pass-transition check after every mutation guarantees that
            # an empty todo queue here means something is pending.
            return Wait(retry_after_s=self._retry_after_s(now)), []
        task_id = self._todo.popleft()
        task = self._tasks[task_id]
        self._transition(task, TaskState.PENDING)
        task.attempt += 1
        dispatch = Dispatch(
            task_id=task_id,
            pass_id=self._pass_id,
            attempt=task.attempt,
            data=task.data,
            deadline=now + self._config.task_timeout_s,
        )
        task.dispatch = dispatch
        task.trainer_id = trainer_id
        self._by_trainer.setdefault(trainer_id, set()).add(task_id)
        heapq.heappush(self._deadlines, (dispatch.deadline, task_id, dispatch.attempt))
        self._compact_deadlines()
        return dispatch, [self._event(EventKind.DISPATCHED, task_id, trainer_id=trainer_id)]

    def report_task(
        self,
        task_id: int,
        pass_id: int,
        attempt: int,
        *,
        success: bool,
        now: float,
        error: str = "",
    ) -> list[TaskEvent]:
        """Record a trainer's report on one attempt.

        A successful report marks the task DONE. A failed report counts like a
        timeout: the task goes to the end of the todo queue, or is FAILED for
        this pass past ``max_task_timeouts``. A report that arrives after the
        deadline but before :meth:`expire` ran is still accepted: the attempt
        is current until it is expired.

        Args:
            task_id: the task, as in the :class:`Dispatch`.
            pass_id: the pass, as in the :class:`Dispatch`.
            attempt: the attempt, as in the :class:`Dispatch`.
            success: whether the trainer finished the range.
            now: current monotonic time, in seconds.
            error: the trainer's failure message, if ``success`` is False.

        Returns:
            The events caused, possibly including PASS_STARTED or JOB_FINISHED.

        Raises:
            UnknownTaskError: no such task.
            StaleTaskError: ``(pass_id, attempt)`` is not the task's current
                pending attempt. Nothing is changed.
        """
        del now  # Reports do not depend on time; kept for a uniform interface.
        task = self._task(task_id)
        if (
            task.state is not TaskState.PENDING
            or pass_id != self._pass_id
            or attempt != task.attempt
        ):
            raise StaleTaskError(
                f"task {task_id}: report for pass {pass_id} attempt {attempt} is stale; "
                f"current is pass {self._pass_id} attempt {task.attempt} "
                f"({task.state.value})"
            )
        if success:
            trainer_id = self._release(task_id, task)
            self._transition(task, TaskState.DONE)
            events = [self._event(EventKind.DONE, task_id, trainer_id=trainer_id)]
        else:
            events = self._count_failure(task_id, task, reason=f"reported failure: {error}")
        events.extend(self._maybe_advance_pass())
        return events

    def expire(self, now: float) -> list[TaskEvent]:
        """Time out every pending attempt whose deadline is ``<= now``.

        Each one goes to the end of the todo queue with its timeout count
        raised (REQUEUED), or is FAILED for this pass once the count exceeds
        ``max_task_timeouts``. Attempts already reported or requeued are skipped.

        Args:
            now: current monotonic time, in seconds.

        Returns:
            The events caused, in deadline order, possibly followed by
            PASS_STARTED or JOB_FINISHED.
        """
        events: list[TaskEvent] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            entry = heapq.heappop(self._deadlines)
            if self._is_live(entry):
                task_id = entry[1]
                events.extend(self._count_failure(task_id, self._tasks[task_id], reason="timeout"))
        events.extend(self._maybe_advance_pass())
        return events

    def trainer_lost(self, trainer_id: str, now: float) -> list[TaskEvent]:
        """Requeue at once every attempt a lost trainer holds.

        The trainer is not at fault for its tasks, so their timeout counts are
        not raised. The tasks go to the end of the todo queue in id order.

        Args:
            trainer_id: the trainer whose lease expired; unknown ids are ignored.
            now: current monotonic time, in seconds.

        Returns:
            One REQUEUED event per task it held (reason ``"trainer lost"``).
        """
        del now  # Kept for a uniform interface.
        events: list[TaskEvent] = []
        for task_id in sorted(self._by_trainer.get(trainer_id, ())):
            task = self._tasks[task_id]
            self._release(task_id, task)
            self._transition(task, TaskState.TODO)
            self._todo.append(task_id)
            events.append(
                self._event(
                    EventKind.REQUEUED, task_id, trainer_id=trainer_id, reason="trainer lost"
                )
            )
        # Requeueing never empties the queue, but keep the check after every
        # mutation so the invariant does not depend on that reasoning.
        events.extend(self._maybe_advance_pass())
        return events

    # --- internals ---------------------------------------------------------

    def _task(self, task_id: int) -> _Task:
        if not 0 <= task_id < len(self._tasks):
            raise UnknownTaskError(
                f"task {task_id} does not exist (tasks are 0..{len(self._tasks) - 1})"
            )
        return self._tasks[task_id]

    def _transition(self, task: _Task, new: TaskState) -> None:
        """Move a task to ``new``, keeping the counters; the only place that sets state."""
        old = task.state
        if new not in _ALLOWED_TRANSITIONS[old]:
            # A bug in this module, not a caller's mistake.
            raise AssertionError(f"illegal task transition {old.value} -> {new.value}")
        for state, delta in ((old, -1), (new, 1)):
            if state is TaskState.PENDING:
                self._num_pending += delta
            elif state is TaskState.DONE:
                self._num_done += delta
            elif state is TaskState.FAILED:
                self._num_failed += delta
        task.state = new

    def _release(self, task_id: int, task: _Task) -> str | None:
        """Forget a pending attempt's lease; return the trainer that held it.

        Its heap entry stays behind and is skipped when popped.
        """
        trainer_id = task.trainer_id
        if trainer_id is not None:
            held = self._by_trainer[trainer_id]
            held.discard(task_id)
            if not held:
                del self._by_trainer[trainer_id]
        task.dispatch = None
        task.trainer_id = None
        return trainer_id

    def _count_failure(self, task_id: int, task: _Task, *, reason: str) -> list[TaskEvent]:
        """Requeue a pending task after a timeout or failure, or fail it past the limit."""
        trainer_id = self._release(task_id, task)
        task.timeout_count += 1
        if task.timeout_count > self._config.max_task_timeouts:
            self._transition(task, TaskState.FAILED)
            kind = EventKind.FAILED
        else:
            self._transition(task, TaskState.TODO)
            self._todo.append(task_id)
            kind = EventKind.REQUEUED
        return [self._event(kind, task_id, trainer_id=trainer_id, reason=reason)]

    def _maybe_advance_pass(self) -> list[TaskEvent]:
        """Start the next pass, or finish the job, once no task is todo or pending."""
        if self._finished or self._todo or self._num_pending:
            return []
        if self._pass_id + 1 >= self._config.num_passes:
            self._finished = True
            return [self._queue_event(EventKind.JOB_FINISHED)]
        self._pass_id += 1
        # Nothing is pending, so every heap entry is dead.
        self._deadlines.clear()
        for task in self._tasks:
            self._transition(task, TaskState.TODO)
            task.timeout_count = 0
        self._todo.extend(range(len(self._tasks)))
        return [self._queue_event(EventKind.PASS_STARTED)]

    def _retry_after_s(self, now: float) -> float:
        deadline = self.next_deadline()
        if deadline is None:  # unreachable: todo and pending are never both empty here
            return MAX_RETRY_AFTER_S
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, deadline - now))

    def _drop_dead_heads(self) -> None:
        heap = self._deadlines
        while heap and not self._is_live(heap[0]):
            heapq.heappop(heap)

    def _is_live(self, entry: tuple[float, int, int]) -> bool:
        """Whether a heap entry is the current attempt of a pending task."""
        _, task_id, attempt = entry
        task = self._tasks[task_id]
        return task.state is TaskState.PENDING and task.attempt == attempt

    def _compact_deadlines(self) -> None:
        # Amortised O(1): rebuild only when dead entries outnumber live ones,
        # so the heap stays O(pending) even if expire() is rarely called.
        if len(self._deadlines) <= 2 * self._num_pending + 16:
            return
        # Filter the heap itself, not all tasks: its size pays for the scan.
        self._deadlines = [entry for entry in self._deadlines if self._is_live(entry)]
        heapq.heapify(self._deadlines)

    def _event(
        self, kind: EventKind, task_id: int, *, trainer_id: str | None, reason: str = ""
    ) -> TaskEvent:
        task = self._tasks[task_id]
        return TaskEvent(
            kind=kind,
            task_id=task_id,
            pass_id=self._pass_id,
            attempt=task.attempt,
            timeout_count=task.timeout_count,
            trainer_id=trainer_id,
            reason=reason,
        )

    def _queue_event(self, kind: EventKind) -> TaskEvent:
        return TaskEvent(
            kind=kind,
            task_id=None,
            pass_id=self._pass_id,
            attempt=0,
            timeout_count=0,
            trainer_id=None,
            reason="",
        )
