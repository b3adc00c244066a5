"""The master's task queue: a pure state machine over data ranges.

Modelled on the master of PaddlePaddle's original Go implementation
(``go/master/service.go``): every task is explicitly in one of the states
todo, pending, done or failed, and every dispatch carries a pass id and an
attempt number. A report or a timeout for an attempt that is no longer current
(it timed out and was re-dispatched, or belongs to an earlier pass) is rejected
or ignored, so a task is never counted twice.

Trainers report progress inside a task (:meth:`TaskQueue.report_progress`): the
queue keeps each task's *offset* (records trained in the current pass) and the
*segments* ``(attempt, from, to)`` that trained them, so a re-dispatched task
resumes where the last attempt stopped, and the end of each pass is audited: the
segments of every done task must tile its range exactly once
(:class:`PassSummary`).

With ``QueueConfig.verify_passes`` (what the master runs), a pass whose tasks
are all done or failed does not complete by itself: the queue announces it
(PASS_READY) and waits. The shell then checks what the parameter servers
actually applied (:mod:`elasticps.master.verify`) and either re-opens the
records some shard lacks (:meth:`TaskQueue.rewind`) or completes the pass
(:meth:`TaskQueue.complete_pass`) with the shards' verdict in its summary.

Skipped records (``--bad-records skip``: the model file raised on their
mini-batch) are covered by their attempt's segment, so the audit still sees
every record once, but each segment also counts how many of its records were
skipped, and the pass audit reports them as skipped, never as trained. A
skipped mini-batch counts like a timeout against its task
(:meth:`TaskQueue.skip_budget`).

This module does no I/O, starts no threads and reads no clock: the caller
passes ``now`` (seconds on a monotonic clock) into every mutation. Every
mutation returns the :class:`TaskEvent` records it caused, so the service shell
can log and persist them before it replies.

Persistence. The queue's durable state is one JSON-ready record per task
(:meth:`TaskQueue.record`) plus one small ``meta`` record
(:meth:`TaskQueue.meta`); :meth:`TaskQueue.restore` rebuilds the queue from
them. After a mutation, the records to write are those of the tasks named by
its events, plus ``meta`` if a queue event (PASS_COMPLETED, PASS_STARTED,
JOB_FINISHED) occurred. A pass transition therefore writes O(1) records: each
record carries the pass it belongs to, and a record of an earlier pass *is*, by
definition, a task still todo in the current pass with zero counts (a lazy
reset, applied in memory when the task is next dispatched).

Cost: ``get_task``, ``report_task``, ``report_progress`` and ``trainer_lost``
are O(log n) per task they touch (heap operations; the audit of a done task is
O(its segments), at most one per attempt), ``expire`` is O(log n) per entry it
pops, ``stats`` and pass transitions are O(1). ``restore`` is O(n).
"""

from __future__ import annotations

import dataclasses
import enum
import heapq
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from elasticps.errors import (
    ConfigError,
    InvalidRecordError,
    StaleTaskError,
    UnknownTaskError,
)
from elasticps.master.repairs import RepairAttempt, RepairEvent, Repairs

__all__ = [
    "DISPATCH_NOT_RECEIVED",
    "MAX_RETRY_AFTER_S",
    "MIN_RETRY_AFTER_S",
    "QUEUE_EVENTS",
    "QUEUE_FORMAT",
    "REOPENED_LACKING",
    "TRAINER_LOST",
    "DataRange",
    "Dispatch",
    "EventKind",
    "Finished",
    "GetTaskResult",
    "InvalidRecordError",
    "PassSummary",
    "QueueConfig",
    "QueueStats",
    "Segment",
    "TaskEvent",
    "TaskQueue",
    "TaskState",
    "Wait",
    "split_into_tasks",
]

MAX_RETRY_AFTER_S = 0.25
"""Longest :class:`Wait` hint, in seconds, so idle trainers notice requeues promptly."""

MAX_HELD = 2
"""Most attempts one trainer holds: the task it trains and the one it trains next."""

MIN_RETRY_AFTER_S = 0.01
"""Shortest :class:`Wait` hint, in seconds, so a trainer never busy-polls."""

QUEUE_FORMAT = 1
"""Version of the record and meta layout; :meth:`TaskQueue.restore` refuses others."""


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


# The one table of allowed transitions within a pass; ``TaskQueue._transition``
# enforces it. DONE and FAILED are final for the pass: a task becomes TODO again
# only through the lazy reset of a later pass (``TaskQueue._begin_pass``).
#
# DONE -> TODO is the one way back: :meth:`TaskQueue.rewind` re-opens a done
# task whose records some parameter server does not hold.
_ALLOWED_TRANSITIONS: dict[TaskState, frozenset[TaskState]] = {
    TaskState.TODO: frozenset({TaskState.PENDING}),
    TaskState.PENDING: frozenset({TaskState.TODO, TaskState.DONE, TaskState.FAILED}),
    TaskState.DONE: frozenset({TaskState.TODO}),
    TaskState.FAILED: frozenset(),
}


@dataclass(frozen=True)
class QueueConfig:
    """Settings of a :class:`TaskQueue`.

    Attributes:
        task_timeout_s: seconds a trainer has to report a dispatched task (or
            its progress), > 0.
        max_task_timeouts: how many timeouts or reported failures a task may
            have within one pass, >= 1; one more and it is FAILED for that pass.
        num_passes: how many passes (epochs) over all tasks, >= 1.
        verify_passes: a pass with every task done or failed waits for
            :meth:`TaskQueue.complete_pass` (after the shell checked the
            parameter servers) instead of completing by itself.
        streaming: the data is a stream: the queue may start empty, the shell
            adds tasks as records arrive (:meth:`TaskQueue.add_tasks`), and the
            one pass cannot end before :meth:`TaskQueue.seal`. Each task's
            record then carries its range. Needs ``num_passes == 1``.

    Raises:
        ConfigError: a value is out of range.
    """

    task_timeout_s: float = 60.0
    max_task_timeouts: int = 3
    num_passes: int = 1
    verify_passes: bool = False
    streaming: bool = False

    def __post_init__(self) -> None:
        if self.streaming and self.num_passes != 1:
            raise ConfigError(f"a stream has one pass, got num_passes={self.num_passes}")
        # ``not x > 0`` also rejects NaN.
        if not self.task_timeout_s > 0:
            raise ConfigError(f"task_timeout_s must be > 0, got {self.task_timeout_s}")
        if self.max_task_timeouts < 1:
            raise ConfigError(f"max_task_timeouts must be >= 1, got {self.max_task_timeouts}")
        if self.num_passes < 1:
            raise ConfigError(f"num_passes must be >= 1, got {self.num_passes}")


@dataclass(frozen=True)
class Segment:
    """Records ``[start, end)`` of a task (relative to its first row) trained by one attempt.

    Attributes:
        attempt: the attempt that trained them.
        start: first record, relative to the task's start, inclusive.
        end: last record, exclusive.
        skipped: how many of them the attempt skipped rather than trained
            (``--bad-records skip``), ``0 <= skipped <= end - start``.
    """

    attempt: int
    start: int
    end: int
    skipped: int = 0


@dataclass(frozen=True)
class Dispatch:
    """A task handed to a trainer: a lease on one attempt.

    Attributes:
        task_id: index of the task in the queue's ranges, 0-based.
        pass_id: pass (epoch) this attempt belongs to, 0-based.
        attempt: dispatch number of this task, starting at 1 and never reused,
            across passes too. Reports must quote it.
        data: the rows of the whole task.
        deadline: monotonic time, in seconds, after which the attempt times out
            unless the trainer reports progress (which renews it).
        offset: records of the task already trained in this pass by earlier
            attempts; the attempt trains rows ``[data.start + offset, data.end)``.
    """

    task_id: int
    pass_id: int
    attempt: int
    data: DataRange
    deadline: float
    offset: int = 0


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


@dataclass(frozen=True)
class PassSummary:
    """The audit of one completed pass.

    Attributes:
        pass_id: the pass, 0-based.
        tasks: number of tasks.
        records: records in all tasks.
        done: tasks done in the pass.
        failed: tasks failed in the pass.
        records_trained: records in every segment of the pass (failed tasks'
            partial progress included), minus the skipped ones.
        duplicated_records: records of done tasks covered by more than one
            segment (counted once per extra coverage).
        missing_records: records of done tasks covered by no segment.
        shards_checked: whether every parameter server was shown to hold
            every record of every done task before the pass completed (None:
            no servers were checked, as in a queue used alone).
        records_reopened: records of done tasks re-opened during the pass
            because some server did not hold them (a server restored from a
            checkpoint); they were trained again, and applied only where missing.
        records_lost: records of earlier, sealed passes that a server lost
            for good (it restarted without a checkpoint that held them),
            counted once per server; found while this pass was checked.
        passes_lost: the earlier passes those records belong to.
        failed_tasks: the ids of the failed tasks (their records are not
            checked on the servers).
        records_skipped: records in the segments of the pass that were
            skipped, not trained (``--bad-records skip``).
        records_repaired: records of earlier, sealed passes trained again
            while this pass was checked, for the servers restored from a
            checkpoint older than those passes' seals (see
            :meth:`TaskQueue.open_repairs`); applied only where missing.
        passes_repaired: the earlier passes those records belong to.
    """

    pass_id: int
    tasks: int
    records: int
    done: int
    failed: int
    records_trained: int
    duplicated_records: int
    missing_records: int
    shards_checked: bool | None = None
    records_reopened: int = 0
    records_lost: int = 0
    passes_lost: tuple[int, ...] = ()
    failed_tasks: tuple[int, ...] = ()
    records_skipped: int = 0
    records_repaired: int = 0
    passes_repaired: tuple[int, ...] = ()

    @property
    def ledger_exactly_once(self) -> bool:
        """Whether the ledger's segments of every done task tile its range exactly once."""
        return self.duplicated_records == 0 and self.missing_records == 0

    @property
    def exactly_once(self) -> bool:
        """Whether every record of every done task was applied once on every shard.

        True only if the ledger agrees, the servers were checked (or there
        were none to check), and no earlier pass's records were lost.
        """
        return (
            self.ledger_exactly_once and self.shards_checked is not False and not self.records_lost
        )

    def as_dict(self) -> dict[str, object]:
        """The summary as a JSON-ready dict, ``exactly_once`` included."""
        out = dataclasses.asdict(self)
        out["passes_lost"] = list(self.passes_lost)
        out["failed_tasks"] = list(self.failed_tasks)
        out["passes_repaired"] = list(self.passes_repaired)
        return {**out, "exactly_once": self.exactly_once}


class EventKind(enum.Enum):
    """What a :class:`TaskEvent` records."""

    DISPATCHED = "dispatched"
    PROGRESS = "progress"
    DONE = "done"
    REQUEUED = "requeued"
    FAILED = "failed"
    PASS_COMPLETED = "pass_completed"
    PASS_STARTED = "pass_started"
    JOB_FINISHED = "job_finished"
    PASS_READY = "pass_ready"
    """Every task of the pass is done or failed; the shell checks the servers
    (with ``verify_passes`` only). Changes nothing durable."""
    REOPENED = "reopened"
    """A done task re-opened at an earlier record (see :meth:`TaskQueue.rewind`)."""
    ADDED = "added"
    """A stream's task was added (see :meth:`TaskQueue.add_tasks`)."""
    SEALED = "sealed"
    """A stream ended: no task will be added (see :meth:`TaskQueue.seal`)."""
    REPAIR = "repair"
    """A repair of a sealed pass changed (see :meth:`TaskQueue.open_repairs`); ``reason``
    says how (``reopened``, ``dispatched``, ``done``, ``requeued: ...``,
    ``failed: ...``). Changes nothing durable."""


TRAINER_LOST = "trainer lost"
"""Reason of a requeue: the trainer's lease expired (no timeout is counted)."""

REOPENED_LACKING = "a parameter server lacks its records"
"""Reason of a re-opening: some parameter server does not hold all of the task's records."""

DISPATCH_NOT_RECEIVED = "dispatch not received"
"""Reason of a requeue: the trainer asked for work while the ledger still charged
it with this task, so the dispatch never reached it (no timeout is counted)."""

QUEUE_EVENTS = frozenset(
    {EventKind.PASS_COMPLETED, EventKind.PASS_STARTED, EventKind.JOB_FINISHED, EventKind.SEALED}
)
"""Event kinds that change the queue's :meth:`TaskQueue.meta` rather than a task."""


@dataclass(frozen=True)
class TaskEvent:
    """One change of the queue, for the shell to log and persist.

    Attributes:
        kind: what happened.
        task_id: the task concerned; None for the queue events (PASS_COMPLETED,
            PASS_STARTED, JOB_FINISHED).
        pass_id: the pass the event belongs to (the new pass for PASS_STARTED,
            the completed one for PASS_COMPLETED).
        attempt: the task's attempt number after the event; 0 for queue events.
        timeout_count: the task's timeouts and failures in this pass after the
            event; 0 for queue events.
        trainer_id: the trainer holding (or that held) the attempt, if any.
        reason: why a task was requeued or failed: ``"timeout"``,
            :data:`TRAINER_LOST`, :data:`DISPATCH_NOT_RECEIVED` or
            ``"reported failure: <message>"``.
        offset: the task's offset after the event; 0 for queue events.
        summary: the audit of the pass, for PASS_COMPLETED only.
    """

    kind: EventKind
    task_id: int | None
    pass_id: int
    attempt: int
    timeout_count: int
    trainer_id: str | None
    reason: str = ""
    offset: int = 0
    summary: PassSummary | None = None


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
        done_all_passes: tasks done, summed over all passes so far.
    """

    pass_id: int
    num_passes: int
    total: int
    todo: int
    pending: int
    done: int
    failed: int
    finished: bool
    done_all_passes: int


# --- the queue ------------------------------------------------------------------


@dataclass
class _Task:
    """Mutable bookkeeping of one task; never leaves this module.

    The per-pass fields (state, timeout_count, offset, segments, seq) belong to
    pass ``pass_id``; if that is older than the queue's pass, they are stale and
    the task is todo with zero counts (see ``TaskQueue._begin_pass``).
    """

    data: DataRange
    pass_id: int = 0
    state: TaskState = TaskState.TODO
    attempt: int = 0
    timeout_count: int = 0
    offset: int = 0
    segments: list[Segment] = field(default_factory=list)
    seq: int | None = None  # order among requeued todo tasks; None if never requeued
    dispatch: Dispatch | None = None  # set while PENDING; its deadline is the live one
    trainer_id: str | None = None  # set while PENDING


class TaskQueue:
    """Hands out data ranges to trainers, pass after pass, tolerating loss.

    Tasks move TODO -> PENDING on :meth:`get_task`, then to DONE on a
    successful report, or back to the end of TODO on a timeout, a reported
    failure or the loss of their trainer. A task that times out or fails more
    than ``max_task_timeouts`` times in a pass is FAILED for that pass. When no
    task is TODO or PENDING, the pass is audited (PASS_COMPLETED) and the next
    pass starts with every task back in TODO, or the job finishes after the
    last pass.

    The todo queue is the tasks not yet dispatched in this pass, in id order
    (a cursor over ids), followed by the requeued tasks in requeue order. Both
    survive :meth:`restore`.

    Not thread-safe: the shell serialises calls (it holds the master lock).

    Args:
        ranges: the data ranges; task ids are their indices.
        config: timeouts and the number of passes.

    Raises:
        ConfigError: ``ranges`` is empty (allowed for a stream).
    """

    def __init__(self, ranges: Sequence[DataRange], config: QueueConfig) -> None:
        if not ranges and not config.streaming:
            raise ConfigError("a task queue needs at least one data range")
        # A stream's pass cannot end before the shell seals it.
        self._sealed = not config.streaming
        self._config = config
        self._tasks = [_Task(data=r) for r in ranges]
        self._records_total = sum(r.num_rows for r in ranges)
        # Tasks [_fresh_next, n) have not been dispatched in this pass. Their
        # order is their id order, so a pass starts in O(1) by resetting this.
        self._fresh_next = 0
        self._requeued: deque[int] = deque()
        self._next_seq = 0
        # Min-heap of (deadline, task_id, attempt). Entries are not removed
        # when a task is reported, requeued or its deadline renewed; they are
        # skipped when popped (lazy deletion) because their attempt or deadline
        # no longer matches, and the heap is compacted when dead entries
        # outnumber live ones.
        self._deadlines: list[tuple[float, int, int]] = []
        self._by_trainer: dict[str, set[int]] = {}
        self._pass_id = 0
        self._finished = False
        self._num_pending = 0
        self._num_done = 0
        self._num_failed = 0
        self._done_before = 0  # tasks done in earlier passes
        # The running audit of the current pass.
        self._records_trained = 0  # records covered by segments, skipped ones included
        self._duplicated = 0
        self._missing = 0
        self._reopened = 0
        # verify_passes: the pass is over but not yet completed by the shell.
        self._ready = False
        self._skipped = 0
        # Records of sealed passes trained again for shards that lack them.
        self._repairs = Repairs(config.task_timeout_s, config.max_task_timeouts)

    # --- queries -----------------------------------------------------------

    @property
    def config(self) -> QueueConfig:
        """The queue's settings."""
        return self._config

    @property
    def num_tasks(self) -> int:
        """Number of tasks per pass."""
        return len(self._tasks)

    def stats(self) -> QueueStats:
        """Return the queue's counters in O(1).

        Returns:
            A snapshot of the counters of the current pass.
        """
        return QueueStats(
            pass_id=self._pass_id,
            num_passes=self._config.num_passes,
            total=len(self._tasks),
            todo=self._num_todo(),
            pending=self._num_pending,
            done=self._num_done,
            failed=self._num_failed,
            finished=self._finished,
            done_all_passes=self._done_before + self._num_done,
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
        task = self._task(task_id)
        return task.state if self._in_pass(task) else TaskState.TODO

    def offset_of(self, task_id: int) -> int:
        """Return the records of a task trained so far in the current pass.

        Raises:
            UnknownTaskError: no such task.
        """
        task = self._task(task_id)
        return task.offset if self._in_pass(task) else 0

    def segments_of(self, task_id: int) -> list[Segment]:
        """Return the segments that trained a task in the current pass, in order.

        Raises:
            UnknownTaskError: no such task.
        """
        task = self._task(task_id)
        return list(task.segments) if self._in_pass(task) else []

    def pending_of(self, trainer_id: str) -> list[Dispatch]:
        """Return the attempts a trainer currently holds, by task id.

        Args:
            trainer_id: the trainer; an unknown trainer holds nothing.

        Returns:
            Its pending dispatches, sorted by task id, with their current
            deadlines (renewed by progress reports).
        """
        dispatches: list[Dispatch] = []
        for task_id in sorted(self._by_trainer.get(trainer_id, ())):
            dispatch = self._tasks[task_id].dispatch
            if dispatch is not None:
                dispatches.append(dispatch)
        dispatches.extend(self._repair_dispatch(a) for a in self._repairs.pending_of(trainer_id))
        return dispatches

    def trainers(self) -> set[str]:
        """Return the trainers that hold at least one pending attempt (repairs included)."""
        return set(self._by_trainer) | self._repairs.trainers()

    @property
    def repairing(self) -> bool:
        """Whether repairs of a sealed pass are todo or pending (see :meth:`open_repairs`)."""
        return self._repairs.active

    @property
    def awaiting_verification(self) -> bool:
        """Whether every task of the pass is done or failed and the pass waits for
        :meth:`complete_pass` (with ``verify_passes`` only)."""
        return self._ready

    @property
    def only_pending(self) -> bool:
        """Whether nothing is todo but some task is pending: a trainer asking now
        waits for another's task to end (or time out)."""
        return not self._finished and not self._num_todo() and self._num_pending > 0

    def done_tasks(self) -> list[int]:
        """The tasks done in the current pass, by id."""
        return [
            i for i, t in enumerate(self._tasks) if self._in_pass(t) and t.state is TaskState.DONE
        ]

    def task_records(self) -> dict[int, int]:
        """Task id -> number of records, for every task."""
        return {i: t.data.num_rows for i, t in enumerate(self._tasks)}

    def next_deadline(self) -> float | None:
        """Return the earliest deadline of a pending attempt, for the shell's timer.

        Returns:
            Monotonic time in seconds, or None if nothing is pending.
        """
        self._drop_dead_heads()
        own = self._deadlines[0][0] if self._deadlines else None
        repair = self._repairs.next_deadline()
        if own is None or repair is None:
            return repair if own is None else own
        return min(own, repair)

    def skip_budget(self, task_id: int, pass_id: int | None = None) -> int:
        """Return how many more mini-batches a task may skip in the current pass.

        A skipped mini-batch (``--bad-records skip``) counts like a timeout: a
        task may have ``max_task_timeouts`` timeouts, failures and skipped
        mini-batches in a pass; one more and it is FAILED. The service hands
        the budget to each attempt (``Task.skip_budget``).

        Args:
            task_id: the task.
            pass_id: the dispatch's pass, if not the current one (a repair).

        Raises:
            UnknownTaskError: no such task.
        """
        task = self._task(task_id)
        if pass_id is not None and pass_id != self._pass_id:
            return self._repairs.skip_budget(task_id, pass_id)
        used = task.timeout_count if self._in_pass(task) else 0
        return max(0, self._config.max_task_timeouts - used)

    @property
    def sealed(self) -> bool:
        """Whether no task will be added: always for files; for a stream, after :meth:`seal`."""
        return self._sealed

    def stream_ends(self) -> dict[str, int]:
        """Each task file -> the end of its last task (a stream's partitions: where the
        next task starts)."""
        ends: dict[str, int] = {}
        for task in self._tasks:
            ends[task.data.file] = max(ends.get(task.data.file, 0), task.data.end)
        return ends

    def untrained_from(self) -> dict[str, tuple[int, int | None]]:
        """Per task file: ``(first record not yet trained, the start of its task)``.

        For a stream, the first offset of each partition whose record is not
        trained yet (a pending task counts its progress), and the first offset
        of the task that holds it; ``(end of the last task, None)`` where every
        task is done. O(tasks).
        """
        out: dict[str, tuple[int, int | None]] = {}
        for task in self._tasks:
            file = task.data.file
            done = self._in_pass(task) and task.state is TaskState.DONE
            offset = task.offset if self._in_pass(task) else 0
            here = (task.data.end, None) if done else (task.data.start + offset, task.data.start)
            best = out.get(file)
            if best is None or (here[1] is not None and (best[1] is None or here[0] < best[0])):
                out[file] = here
            elif best[1] is None and here[1] is None:
                out[file] = (max(best[0], here[0]), None)
        return out

    # --- mutations ---------------------------------------------------------

    def add_tasks(self, ranges: Sequence[DataRange]) -> list[TaskEvent]:
        """Append a stream's new tasks (records that arrived) to the todo queue.

        Args:
            ranges: the new ranges; their task ids follow the existing ones.

        Returns:
            One ADDED event per task.

        Raises:
            ConfigError: the queue is not a stream's, or it is sealed.
        """
        if not self._config.streaming or self._sealed:
            raise ConfigError("tasks can be added only to a stream's queue before it is sealed")
        events: list[TaskEvent] = []
        for data in ranges:
            self._tasks.append(_Task(data=data, pass_id=self._pass_id))
            self._records_total += data.num_rows
            events.append(self._event(EventKind.ADDED, len(self._tasks) - 1, trainer_id=None))
        return events

    def seal(self) -> list[TaskEvent]:
        """End a stream: no task will be added, and its pass ends once every task is.

        Returns:
            SEALED, then what ending the pass caused (PASS_READY or
            PASS_COMPLETED and JOB_FINISHED) if nothing is todo or pending;
            nothing if already sealed.
        """
        if self._sealed:
            return []
        self._sealed = True
        return [self._queue_event(EventKind.SEALED), *self._maybe_advance_pass()]

    def get_task(
        self, trainer_id: str, now: float, holding: Collection[int] = ()
    ) -> tuple[GetTaskResult, list[TaskEvent]]:
        """Hand the front of the todo queue to a trainer.

        Does not expire overdue attempts itself; the shell calls
        :meth:`expire` when :meth:`next_deadline` passes.

        A trainer reports each task before it asks again, so it asks holding
        only the tasks it names in ``holding``: with empty hands, or, to
        have its next task at hand when the one it trains ends, holding that
        one. Any other attempt the queue still charges to it is one whose
        dispatch never reached it: a master persisted the dispatch and died
        before replying (or the reply was lost and the trainer retried).
        Such attempts go back to the end of the todo queue first, at their
        offsets, without a timeout counted, as for a lost trainer; otherwise
        they would hold up their pass until they timed out.

        A trainer holding work is handed one more task only while the todo
        queue has at least as many tasks as there are trainers holding
        work, and while it holds fewer than :data:`MAX_HELD`: a task held
        ahead near the end of a pass would otherwise wait for its trainer
        while another trainer sits idle.

        Args:
            trainer_id: the trainer asking for work.
            now: current monotonic time, in seconds.
            holding: ids of tasks the trainer holds and keeps; those the
                queue does not charge to it are ignored.

        Returns:
            ``(result, events)``: a :class:`Dispatch` (with a DISPATCHED event),
            a :class:`Wait` if every remaining task is pending elsewhere (or,
            for a trainer holding work, if no task is handed out ahead), or
            :class:`Finished` once all passes are over; after REQUEUED events
            (reason :data:`DISPATCH_NOT_RECEIVED`) for attempts the trainer
            never received. A task dispatched again after a timeout, failure
            or trainer loss keeps its offset, so the new attempt resumes where
            the last one stopped.
        """
        if self._finished:
            return Finished(), []
        if self._repairs.active:
            return self._get_repair(trainer_id, now, holding)
        events = self._requeue_held(trainer_id, DISPATCH_NOT_RECEIVED, keep=holding)
        held = len(self._by_trainer.get(trainer_id, ()))
        if held and (held >= MAX_HELD or self._num_todo() < len(self._by_trainer)):
            return Wait(retry_after_s=self._retry_after_s(now)), events
        task_id = self._pop_todo()
        if task_id is None:
            # The pass-transition check after every mutation guarantees that
            # an empty todo queue here means something is pending.
            return Wait(retry_after_s=self._retry_after_s(now)), events
        task = self._tasks[task_id]
        self._begin_pass(task)
        self._transition(task, TaskState.PENDING)
        task.attempt += 1
        task.seq = None
        dispatch = Dispatch(
            task_id=task_id,
            pass_id=self._pass_id,
            attempt=task.attempt,
            data=task.data,
            deadline=now + self._config.task_timeout_s,
            offset=task.offset,
        )
        task.dispatch = dispatch
        task.trainer_id = trainer_id
        self._by_trainer.setdefault(trainer_id, set()).add(task_id)
        heapq.heappush(self._deadlines, (dispatch.deadline, task_id, dispatch.attempt))
        self._compact_deadlines()
        events.append(self._event(EventKind.DISPATCHED, task_id, trainer_id=trainer_id))
        return dispatch, events

    def report_progress(
        self,
        task_id: int,
        pass_id: int,
        attempt: int,
        offset: int,
        now: float,
        *,
        skipped: int = 0,
    ) -> list[TaskEvent]:
        """Record that a trainer has trained a task's records up to ``offset``.

        Progress is also a heartbeat: it renews the deadline of the attempt,
        and of any other its trainer holds (see :meth:`get_task`), to
        ``now + task_timeout_s``. A larger offset than the recorded one records
        the segment ``(attempt, recorded offset, offset)`` and emits PROGRESS; an
        offset at or below it (a retried or reordered report) records nothing
        and emits nothing, but still renews the deadline.

        Args:
            task_id: the task, as in the :class:`Dispatch`.
            pass_id: the pass, as in the :class:`Dispatch`.
            attempt: the attempt, as in the :class:`Dispatch`.
            offset: records trained, counted from the task's first row (not from
                the attempt's offset), ``<= data.num_rows``.
            now: current monotonic time, in seconds.
            skipped: records of the attempt skipped so far (``--bad-records
                skip``), all below ``offset``; the segment records the new ones.

        Returns:
            A PROGRESS event if the offset advanced, else nothing.

        Raises:
            UnknownTaskError: no such task.
            StaleTaskError: ``(pass_id, attempt)`` is not the task's current
                pending attempt, ``offset`` is beyond the task's end, or
                ``skipped`` is not a count of records the attempt covered.
                Nothing is changed.
        """
        if pass_id != self._pass_id and self._repairs.holds(task_id, pass_id):
            self._repairs.progress(task_id, pass_id, attempt, offset, now)
            return []
        task = self._current_attempt(task_id, pass_id, attempt)
        if offset > task.data.num_rows:
            raise StaleTaskError(
                f"task {task_id}: progress offset {offset} is beyond the task's end "
                f"({task.data.num_rows} records)"
            )
        deadline = now + self._config.task_timeout_s
        for held_id in self._by_trainer.get(task.trainer_id or "", ()):
            # A heartbeat of the trainer: the task it holds ahead of this one too.
            held_task = self._tasks[held_id]
            if held_task.state is TaskState.PENDING:
                self._renew_deadline(held_id, held_task, deadline)
        if offset <= task.offset:
            return []
        new_skipped = self._new_skipped(task, skipped, offset - task.offset)
        self._add_segment(task, task.offset, offset, new_skipped)
        task.offset = offset
        return [self._event(EventKind.PROGRESS, task_id, trainer_id=task.trainer_id)]

    def report_task(
        self,
        task_id: int,
        pass_id: int,
        attempt: int,
        *,
        success: bool,
        now: float,
        error: str = "",
        skipped: int = 0,
        skipped_batches: int = 0,
    ) -> list[TaskEvent]:
        """Record a trainer's report on one attempt.

        A successful report marks the task DONE: the attempt trained the rest of
        the task, so the segment ``(attempt, offset, num_rows)`` is recorded. A
        failed report counts like a timeout: the task goes to the end of the
        todo queue (keeping its offset), or is FAILED for this pass past
        ``max_task_timeouts``. A report that arrives after the deadline but
        before :meth:`expire` ran is still accepted: the attempt is current
        until it is expired.

        Args:
            task_id: the task, as in the :class:`Dispatch`.
            pass_id: the pass, as in the :class:`Dispatch`.
            attempt: the attempt, as in the :class:`Dispatch`.
            success: whether the trainer finished the range.
            now: current monotonic time, in seconds.
            error: the trainer's failure message, if ``success`` is False.
            skipped: records of the task the attempt skipped in all
                (``--bad-records skip``); with ``success``, those not yet
                reported with its progress are recorded in its last segment.
                A failed attempt reports its skipped records with its progress.
            skipped_batches: mini-batches the attempt skipped; each counts
                like a timeout (see :meth:`skip_budget`). A failed report
                counts ``max(1, skipped_batches)``.

        Returns:
            The events caused, possibly including PASS_COMPLETED followed by
            PASS_STARTED or JOB_FINISHED.

        Raises:
            UnknownTaskError: no such task.
            StaleTaskError: ``(pass_id, attempt)`` is not the task's current
                pending attempt, or ``skipped``/``skipped_batches`` are not
                counts the attempt can have. Nothing is changed.
        """
        del now  # Reports do not depend on time; kept for a uniform interface.
        if pass_id != self._pass_id and self._repairs.holds(task_id, pass_id):
            if skipped_batches < 0:
                raise StaleTaskError(f"task {task_id}: skipped_batches {skipped_batches} < 0")
            events = self._repair_events(
                self._repairs.report(task_id, pass_id, attempt, success=success, error=error)
            )
            return events + self._maybe_advance_pass()
        task = self._current_attempt(task_id, pass_id, attempt)
        if skipped_batches < 0:
            raise StaleTaskError(f"task {task_id}: skipped_batches {skipped_batches} < 0")
        if success:
            new_skipped = self._new_skipped(task, skipped, task.data.num_rows - task.offset)
            trainer_id = self._release(task_id, task)
            self._add_segment(task, task.offset, task.data.num_rows, new_skipped)
            task.offset = task.data.num_rows
            task.timeout_count += skipped_batches
            self._transition(task, TaskState.DONE)
            self._audit_done(task)
            events = [self._event(EventKind.DONE, task_id, trainer_id=trainer_id)]
        else:
            events = self._count_failure(
                task_id, task, reason=f"reported failure: {error}", failures=max(1, skipped_batches)
            )
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
            PASS_COMPLETED and PASS_STARTED or JOB_FINISHED.
        """
        events: list[TaskEvent] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            entry = heapq.heappop(self._deadlines)
            if self._is_live(entry):
                task_id = entry[1]
                events.extend(self._count_failure(task_id, self._tasks[task_id], reason="timeout"))
        events.extend(self._repair_events(self._repairs.expire(now)))
        events.extend(self._maybe_advance_pass())
        return events

    def trainer_lost(self, trainer_id: str, now: float) -> list[TaskEvent]:
        """Requeue at once every attempt a lost trainer holds.

        The trainer is not at fault for its tasks, so their timeout counts are
        not raised. The tasks go to the end of the todo queue in id order and
        keep their offsets.

        Args:
            trainer_id: the trainer whose lease expired; unknown ids are ignored.
            now: current monotonic time, in seconds.

        Returns:
            One REQUEUED event per task it held (reason :data:`TRAINER_LOST`).
        """
        del now  # Kept for a uniform interface.
        events = self._requeue_held(trainer_id, TRAINER_LOST)
        events.extend(self._repair_events(self._repairs.requeue_held(trainer_id, TRAINER_LOST)))
        # Requeueing never empties the queue, but keep the check after every
        # mutation so the invariant does not depend on that reasoning.
        events.extend(self._maybe_advance_pass())
        return events

    def _requeue_held(
        self, trainer_id: str, reason: str, keep: Collection[int] = ()
    ) -> list[TaskEvent]:
        """Requeue every attempt ``trainer_id`` holds but those of tasks ``keep``, in id
        order; no timeout counted."""
        events: list[TaskEvent] = []
        for task_id in sorted(self._by_trainer.get(trainer_id, set()).difference(keep)):
            task = self._tasks[task_id]
            self._release(task_id, task)
            self._requeue(task_id, task)
            events.append(
                self._event(EventKind.REQUEUED, task_id, trainer_id=trainer_id, reason=reason)
            )
        return events

    def rewind(self, task_id: int, offset: int, now: float) -> list[TaskEvent]:
        """Re-open a task of the current pass at ``offset``: its records from there on
        are trained again.

        The shell calls it for a done task some parameter server does not
        hold in full (``offset``: the first record some server lacks). The
        segments beyond ``offset`` are dropped from the ledger (and from the
        pass audit), the task goes back to the end of the todo queue at that
        offset, with no timeout counted, and the next attempt trains from
        there. A pending attempt is ended first (its later reports are
        stale). A task already at or below ``offset`` is left as it is.

        Args:
            task_id: the task.
            offset: the record to re-open it at, ``0 <= offset``.
            now: current monotonic time, in seconds.

        Returns:
            One REOPENED event, or nothing.

        Raises:
            UnknownTaskError: no such task.
            ValueError: ``offset`` < 0.
        """
        del now
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        task = self._task(task_id)
        if not self._in_pass(task) or task.offset <= offset or task.state is TaskState.FAILED:
            return []
        trainer_id: str | None = None
        if task.state is TaskState.DONE:
            dup, missing = _audit_of(task)
            self._duplicated -= dup
            self._missing -= missing
        elif task.state is TaskState.PENDING:
            trainer_id = self._release(task_id, task)
        kept: list[Segment] = []
        for seg in task.segments:
            if seg.start >= offset:
                self._records_trained -= seg.end - seg.start
                self._skipped -= seg.skipped
            elif seg.end > offset:
                # Where in the segment its skipped records were is not kept:
                # at most the records kept can have been skipped.
                skipped = min(seg.skipped, offset - seg.start)
                self._records_trained -= seg.end - offset
                self._skipped -= seg.skipped - skipped
                kept.append(Segment(seg.attempt, seg.start, offset, skipped))
            else:
                kept.append(seg)
        self._reopened += task.offset - offset
        task.segments = kept
        task.offset = offset
        if task.state is TaskState.TODO:
            pass  # still queued; it will start at the new offset
        else:
            self._requeue(task_id, task)
        self._ready = False
        return [
            self._event(EventKind.REOPENED, task_id, trainer_id=trainer_id, reason=REOPENED_LACKING)
        ]

    def complete_pass(
        self,
        pass_id: int,
        *,
        records_lost: int = 0,
        passes_lost: Sequence[int] = (),
    ) -> list[TaskEvent]:
        """Complete the current pass after the shell checked every parameter server.

        Args:
            pass_id: the pass the shell checked; must be the current one.
            records_lost: records of earlier, sealed passes some server lost
                (see :class:`PassSummary`).
            passes_lost: those passes.

        Returns:
            PASS_COMPLETED (with ``shards_checked`` True) followed by
            PASS_STARTED or JOB_FINISHED; nothing if the pass is not awaiting
            verification (a re-opened task, a master that moved on).
        """
        if not self._ready or pass_id != self._pass_id or self._finished:
            return []
        self._ready = False
        events = self._advance_pass(
            shards_checked=True, records_lost=records_lost, passes_lost=tuple(passes_lost)
        )
        self._repairs.clear()
        return events

    def open_repairs(self, pass_id: int, rewinds: Mapping[int, int]) -> list[TaskEvent]:
        """Re-open records of an earlier, sealed pass for the servers that lack them.

        The shell calls it while the current pass awaits verification (every
        task done or failed) and some server, restored from a checkpoint
        older than pass ``pass_id``'s seal, lacks records of it (see
        :mod:`elasticps.master.repairs`). Until every repair is done or
        failed, :meth:`get_task` hands out repairs (dispatches of pass
        ``pass_id``, pushed with its keys), and the pass is not ready; then
        PASS_READY again, and the shell checks the servers anew. A repair
        that failed in this pass is not re-opened: its records are lost.

        Args:
            pass_id: the sealed pass, below the current one.
            rewinds: task id -> the first record some server lacks.

        Returns:
            One REPAIR event per repair opened; nothing if none was (every one
            had failed before, or the pass is not awaiting verification).

        Raises:
            ValueError: ``pass_id`` is not an earlier pass, or a rewind is
                outside its task.
        """
        if not self._ready or self._finished:
            return []
        if not 0 <= pass_id < self._pass_id:
            raise ValueError(f"pass {pass_id} is not an earlier pass (current {self._pass_id})")
        events = self._repair_events(self._repairs.open(pass_id, rewinds, self.task_records()))
        if events:
            self._ready = False
        return events

    def _get_repair(
        self, trainer_id: str, now: float, holding: Collection[int]
    ) -> tuple[GetTaskResult, list[TaskEvent]]:
        """:meth:`get_task` while repairs are open: the next repair, or Wait."""
        events = self._repair_events(
            self._repairs.requeue_held(trainer_id, DISPATCH_NOT_RECEIVED, keep=holding)
        )
        attempt, more = self._repairs.get(trainer_id, now)
        events.extend(self._repair_events(more))
        if attempt is None:
            return Wait(retry_after_s=self._retry_after_s(now)), events
        return self._repair_dispatch(attempt), events

    def _repair_dispatch(self, attempt: RepairAttempt) -> Dispatch:
        return Dispatch(
            task_id=attempt.task_id,
            pass_id=attempt.pass_id,
            attempt=attempt.attempt,
            data=self._tasks[attempt.task_id].data,
            deadline=attempt.deadline,
            offset=attempt.offset,
        )

    def _repair_events(self, changes: Sequence[RepairEvent]) -> list[TaskEvent]:
        return [
            TaskEvent(
                EventKind.REPAIR,
                c.task_id,
                c.pass_id,
                c.attempt,
                c.timeouts,
                c.trainer_id,
                reason=f"{c.kind}: {c.reason}" if c.reason else c.kind,
                offset=c.offset,
            )
            for c in changes
        ]

    def settle(self) -> list[TaskEvent]:
        """Complete the current pass if nothing is todo or pending.

        Every other mutation does this itself; it is needed only after
        :meth:`restore` from records whose pass was complete but whose meta
        record was not yet advanced (a crash between two ledger writes).

        Returns:
            PASS_COMPLETED followed by PASS_STARTED or JOB_FINISHED, or nothing.
        """
        return self._maybe_advance_pass()

    # --- persistence -------------------------------------------------------

    def record(self, task_id: int) -> dict[str, object]:
        """Return the persisted form of one task, JSON-ready.

        Keys: ``pass`` (the pass the other fields belong to; a record of an
        earlier pass means todo with zero counts), ``state``, ``attempt`` (the
        last attempt number, across passes), ``timeouts``, ``offset``,
        ``segments`` (``[[attempt, from, to], ...]``, with a fourth element,
        the records skipped, when there are any), ``trainer`` (the holder
        while pending, else null) and ``seq`` (order among requeued todo tasks,
        or null); for a stream, ``data`` (``[file, start, end]``) too. The
        deadline is not persisted: monotonic clocks differ between processes,
        and :meth:`restore` gives pending attempts a fresh one.

        Raises:
            UnknownTaskError: no such task.
        """
        task = self._task(task_id)
        data = {"data": [task.data.file, task.data.start, task.data.end]}
        return {
            **(data if self._config.streaming else {}),
            "pass": task.pass_id,
            "state": task.state.value,
            "attempt": task.attempt,
            "timeouts": task.timeout_count,
            "offset": task.offset,
            "segments": [
                [s.attempt, s.start, s.end, *([s.skipped] if s.skipped else [])]
                for s in task.segments
            ],
            "trainer": task.trainer_id,
            "seq": task.seq,
        }

    def meta(self) -> dict[str, object]:
        """Return the persisted form of the queue-wide state, JSON-ready.

        Keys: ``format`` (:data:`QUEUE_FORMAT`), ``pass``, ``num_passes``,
        ``finished`` and ``done_before`` (tasks done in earlier passes), and
        for a stream ``sealed``. It changes only with the queue events (see
        :data:`QUEUE_EVENTS`).
        """
        sealed = {"sealed": self._sealed} if self._config.streaming else {}
        return {
            "format": QUEUE_FORMAT,
            "pass": self._pass_id,
            "num_passes": self._config.num_passes,
            "finished": self._finished,
            "done_before": self._done_before,
            **sealed,
        }

    @classmethod
    def restore(
        cls,
        ranges: Sequence[DataRange],
        config: QueueConfig,
        meta: Mapping[str, object],
        records: Mapping[int, Mapping[str, object]],
        now: float,
    ) -> TaskQueue:
        """Rebuild a queue from its persisted records.

        Records of the current pass keep their state. A PENDING attempt gets a
        fresh deadline ``now + task_timeout_s``: its trainer may still be
        working on it and can still report it (or its progress). Records of an
        earlier pass are todo. The todo order is restored too: tasks not yet
        dispatched in this pass by id, then requeued tasks by ``seq``.

        Call :meth:`settle` afterwards and persist its events.

        Args:
            ranges: the data ranges the records were created for (ignored for a
                stream, whose records carry their ranges).
            config: timeouts and passes; ``num_passes`` must match the meta.
            meta: what :meth:`meta` returned.
            records: task id -> what :meth:`record` returned, for every task.
            now: current monotonic time, in seconds.

        Returns:
            The restored queue.

        Raises:
            ConfigError: ``ranges`` is empty.
            InvalidRecordError: the meta or a record is malformed, does not
                match ``ranges`` or ``config``, or a task has no record.
        """
        if config.streaming:
            ranges = [_parse_range(task_id, records[task_id]) for task_id in sorted(records)]
        queue = cls(ranges, config)
        pass_id, finished, done_before = _parse_meta(meta, config)
        if config.streaming:
            queue._sealed = meta.get("sealed") is True
        ids = set(records)
        expected = set(range(len(ranges)))
        if ids != expected:
            missing = sorted(expected - ids)[:5]
            extra = sorted(ids - expected)[:5]
            raise InvalidRecordError(
                f"the ledger does not have exactly one record per task (0..{len(ranges) - 1}): "
                f"missing {missing}, unexpected {extra} (at most 5 of each shown)"
            )
        queue._pass_id = pass_id
        queue._finished = finished
        queue._done_before = done_before
        queue._tasks = [
            _parse_record(task_id, records[task_id], ranges[task_id], pass_id, config.streaming)
            for task_id in range(len(ranges))
        ]
        queue._rebuild(now)
        return queue

    # --- internals ---------------------------------------------------------

    def _rebuild(self, now: float) -> None:
        """Derive the todo queue, leases, counters and audit from the tasks (restore)."""
        fresh: list[int] = []
        requeued: list[tuple[int, int]] = []
        for task_id, task in enumerate(self._tasks):
            if not self._in_pass(task) or (task.state is TaskState.TODO and task.seq is None):
                fresh.append(task_id)
                continue
            self._records_trained += sum(s.end - s.start for s in task.segments)
            self._skipped += sum(s.skipped for s in task.segments)
            if task.state is TaskState.TODO:
                assert task.seq is not None
                requeued.append((task.seq, task_id))
            elif task.state is TaskState.PENDING:
                assert task.trainer_id is not None
                self._num_pending += 1
                first = next((s.start for s in task.segments if s.attempt == task.attempt), None)
                task.dispatch = Dispatch(
                    task_id=task_id,
                    pass_id=self._pass_id,
                    attempt=task.attempt,
                    data=task.data,
                    deadline=now + self._config.task_timeout_s,
                    offset=task.offset if first is None else first,
                )
                self._by_trainer.setdefault(task.trainer_id, set()).add(task_id)
                self._deadlines.append((task.dispatch.deadline, task_id, task.attempt))
            elif task.state is TaskState.DONE:
                self._num_done += 1
                self._audit_done(task)
            else:
                self._num_failed += 1
        heapq.heapify(self._deadlines)
        # Not-yet-dispatched tasks form a suffix of the ids when the queue wrote
        # the records; if they do not, those below the suffix go first among
        # the requeued ones, in id order.
        n = len(self._tasks)
        self._fresh_next = n
        while fresh and fresh[-1] == self._fresh_next - 1:
            self._fresh_next = fresh.pop()
        requeued.sort()
        self._requeued = deque([*fresh, *(task_id for _, task_id in requeued)])
        self._next_seq = requeued[-1][0] + 1 if requeued else 0
        if self._finished and (self._num_todo() or self._num_pending):
            raise InvalidRecordError(
                f"the ledger says the job is finished, but pass {self._pass_id} still has "
                f"{self._num_todo()} todo and {self._num_pending} pending task(s)"
            )

    def _task(self, task_id: int) -> _Task:
        if not 0 <= task_id < len(self._tasks):
            raise UnknownTaskError(
                f"task {task_id} does not exist (tasks are 0..{len(self._tasks) - 1})"
            )
        return self._tasks[task_id]

    def _in_pass(self, task: _Task) -> bool:
        """Whether a task's per-pass fields belong to the current pass."""
        return task.pass_id == self._pass_id

    def _current_attempt(self, task_id: int, pass_id: int, attempt: int) -> _Task:
        """Return the task if ``(pass_id, attempt)`` is its current pending attempt."""
        task = self._task(task_id)
        state = task.state if self._in_pass(task) else TaskState.TODO
        if state is not TaskState.PENDING or pass_id != self._pass_id or attempt != task.attempt:
            raise StaleTaskError(
                f"task {task_id}: report for pass {pass_id} attempt {attempt} is stale; "
                f"current is pass {self._pass_id} attempt {task.attempt} ({state.value})"
            )
        return task

    def _begin_pass(self, task: _Task) -> None:
        """The lazy reset: give a task of an earlier pass fresh per-pass fields.

        Its state goes straight to TODO without :meth:`_transition`: the
        counters of the old pass were reset when the new pass started.
        """
        if task.pass_id == self._pass_id:
            return
        task.pass_id = self._pass_id
        task.state = TaskState.TODO
        task.timeout_count = 0
        task.offset = 0
        task.segments = []
        task.seq = None
        task.dispatch = None
        task.trainer_id = None

    def _transition(self, task: _Task, new: TaskState) -> None:
        """Move a task to ``new``, keeping the counters; the only place that sets state
        within a pass."""
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

    def _num_todo(self) -> int:
        return len(self._tasks) - self._fresh_next + len(self._requeued)

    def _pop_todo(self) -> int | None:
        if self._fresh_next < len(self._tasks):
            self._fresh_next += 1
            return self._fresh_next - 1
        return self._requeued.popleft() if self._requeued else None

    def _requeue(self, task_id: int, task: _Task) -> None:
        self._transition(task, TaskState.TODO)
        task.seq = self._next_seq
        self._next_seq += 1
        self._requeued.append(task_id)

    def _release(self, task_id: int, task: _Task) -> str | None:
        """Forget a pending attempt's lease; return the trainer that held it.

        Its heap entries stay behind and are skipped when popped.
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

    def _renew_deadline(self, task_id: int, task: _Task, deadline: float) -> None:
        assert task.dispatch is not None
        if deadline <= task.dispatch.deadline:
            return
        task.dispatch = dataclasses.replace(task.dispatch, deadline=deadline)
        heapq.heappush(self._deadlines, (deadline, task_id, task.attempt))
        self._compact_deadlines()

    def _add_segment(self, task: _Task, start: int, end: int, skipped: int = 0) -> None:
        """Record that the current attempt trained records ``[start, end)``,
        ``skipped`` of them skipped rather than trained.

        A segment that continues the previous one of the same attempt extends
        it, so a task has at most one segment per attempt.
        """
        if end <= start:
            return
        self._records_trained += end - start
        self._skipped += skipped
        last = task.segments[-1] if task.segments else None
        if last is not None and last.attempt == task.attempt and last.end == start:
            task.segments[-1] = Segment(task.attempt, last.start, end, last.skipped + skipped)
        else:
            task.segments.append(Segment(task.attempt, start, end, skipped))

    @staticmethod
    def _new_skipped(task: _Task, skipped: int, new_records: int) -> int:
        """The records of ``new_records`` the current attempt skipped, from the
        attempt's running total ``skipped`` (what its segment holds already is
        not new).

        Raises:
            StaleTaskError: ``skipped`` went down, or exceeds what the attempt covers.
        """
        already = sum(s.skipped for s in task.segments if s.attempt == task.attempt)
        new = skipped - already
        if not 0 <= new <= new_records:
            raise StaleTaskError(
                f"task {task.data.file} rows [{task.data.start}, {task.data.end}): attempt "
                f"{task.attempt} reports {skipped} skipped records, which does not fit its "
                f"{already} skipped before and {new_records} new records"
            )
        return new

    def _audit_done(self, task: _Task) -> None:
        """Add a done task's duplicated and missing records to the pass audit."""
        dup, missing = _audit_of(task)
        self._duplicated += dup
        self._missing += missing

    def _count_failure(
        self, task_id: int, task: _Task, *, reason: str, failures: int = 1
    ) -> list[TaskEvent]:
        """Requeue a pending task after a timeout or failure (``failures`` of them:
        skipped mini-batches count too), or fail it past the limit."""
        trainer_id = self._release(task_id, task)
        task.timeout_count += failures
        if task.timeout_count > self._config.max_task_timeouts:
            self._transition(task, TaskState.FAILED)
            kind = EventKind.FAILED
        else:
            self._requeue(task_id, task)
            kind = EventKind.REQUEUED
        return [self._event(kind, task_id, trainer_id=trainer_id, reason=reason)]

    def _maybe_advance_pass(self) -> list[TaskEvent]:
        """Audit the pass and start the next one, or finish the job, once no task
        is todo or pending (with ``verify_passes``: announce it, and wait for
        :meth:`complete_pass`); a stream's pass not before it is sealed. O(1):
        task records are reset lazily."""
        if self._finished or not self._sealed or self._num_todo() or self._num_pending:
            return []
        if self._repairs.active:
            return []
        if self._config.verify_passes:
            if self._ready:
                return []
            self._ready = True
            return [self._queue_event(EventKind.PASS_READY)]
        return self._advance_pass(shards_checked=None)

    def _advance_pass(
        self,
        *,
        shards_checked: bool | None,
        records_lost: int = 0,
        passes_lost: tuple[int, ...] = (),
    ) -> list[TaskEvent]:
        summary = PassSummary(
            pass_id=self._pass_id,
            tasks=len(self._tasks),
            records=self._records_total,
            done=self._num_done,
            failed=self._num_failed,
            records_trained=self._records_trained - self._skipped,
            duplicated_records=self._duplicated,
            missing_records=self._missing,
            shards_checked=shards_checked,
            records_reopened=self._reopened,
            records_lost=records_lost,
            passes_lost=passes_lost,
            failed_tasks=tuple(
                i
                for i, t in enumerate(self._tasks)
                if self._in_pass(t) and t.state is TaskState.FAILED
            )
            if self._num_failed
            else (),
            records_skipped=self._skipped,
            records_repaired=self._repairs.records_repaired(),
            passes_repaired=tuple(self._repairs.passes()),
        )
        events = [self._queue_event(EventKind.PASS_COMPLETED, summary)]
        if self._pass_id + 1 >= self._config.num_passes:
            self._finished = True
            events.append(self._queue_event(EventKind.JOB_FINISHED))
            return events
        self._pass_id += 1
        self._done_before += self._num_done
        # Nothing is pending, so every heap entry is dead.
        self._deadlines.clear()
        self._fresh_next = 0
        self._next_seq = 0
        self._num_done = self._num_failed = 0
        self._records_trained = self._duplicated = self._missing = self._reopened = 0
        self._skipped = 0
        events.append(self._queue_event(EventKind.PASS_STARTED))
        return events

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
        """Whether a heap entry is the current deadline of a pending attempt."""
        deadline, task_id, attempt = entry
        task = self._tasks[task_id]
        return (
            task.dispatch is not None
            and task.state is TaskState.PENDING
            and self._in_pass(task)
            and task.attempt == attempt
            and task.dispatch.deadline == deadline
        )

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
            offset=task.offset,
        )

    def _queue_event(self, kind: EventKind, summary: PassSummary | None = None) -> TaskEvent:
        return TaskEvent(
            kind=kind,
            task_id=None,
            pass_id=self._pass_id,
            attempt=0,
            timeout_count=0,
            trainer_id=None,
            summary=summary,
        )


def _audit_of(task: _Task) -> tuple[int, int]:
    """A done task's duplicated and missing records, from its segments."""
    duplicated = missing = 0
    covered_to = 0
    for s in sorted(task.segments, key=lambda s: (s.start, s.end)):
        if s.start > covered_to:
            missing += s.start - covered_to
        duplicated += max(0, min(s.end, covered_to) - s.start)
        covered_to = max(covered_to, s.end)
    missing += max(0, task.data.num_rows - covered_to)
    return duplicated, missing


# --- record validation (restore) --------------------------------------------------

_RECORD_KEYS = frozenset(
    {"pass", "state", "attempt", "timeouts", "offset", "segments", "trainer", "seq"}
)
_META_KEYS = frozenset({"format", "pass", "num_passes", "finished", "done_before"})


def _check_keys(what: str, obj: Mapping[str, object], keys: frozenset[str]) -> None:
    if not isinstance(obj, Mapping):
        raise InvalidRecordError(f"{what}: expected a JSON object, got {type(obj).__name__}")
    missing = sorted(keys - set(obj))
    unknown = sorted(set(obj) - keys)
    if missing or unknown:
        raise InvalidRecordError(f"{what}: missing fields {missing}, unknown fields {unknown}")


def _int(what: str, name: str, value: object, low: int, high: int | None = None) -> int:
    # bool is an int subclass; JSON true is not a count.
    if not isinstance(value, int) or isinstance(value, bool):
        raise InvalidRecordError(f"{what}: {name!r} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise InvalidRecordError(f"{what}: {name!r} must be {bound}, got {value}")
    return value


def _parse_meta(meta: Mapping[str, object], config: QueueConfig) -> tuple[int, bool, int]:
    what = "queue meta record"
    _check_keys(what, meta, _META_KEYS | ({"sealed"} if config.streaming else set()))
    fmt = meta["format"]
    if not isinstance(fmt, int) or isinstance(fmt, bool) or fmt != QUEUE_FORMAT:
        raise InvalidRecordError(
            f"{what}: format {meta['format']!r} is not supported (expected {QUEUE_FORMAT})"
        )
    num_passes = _int(what, "num_passes", meta["num_passes"], 1)
    if num_passes != config.num_passes:
        raise InvalidRecordError(
            f"{what}: the ledger has {num_passes} passes, the configuration {config.num_passes}"
        )
    pass_id = _int(what, "pass", meta["pass"], 0, num_passes - 1)
    finished = meta["finished"]
    if not isinstance(finished, bool):
        raise InvalidRecordError(f"{what}: 'finished' must be true or false, got {finished!r}")
    done_before = _int(what, "done_before", meta["done_before"], 0)
    return pass_id, finished, done_before


def _parse_range(task_id: int, record: Mapping[str, object]) -> DataRange:
    """The range a stream's task record carries (``data``: ``[file, start, end]``)."""
    what = f"ledger record of task {task_id}"
    raw = record.get("data") if isinstance(record, Mapping) else None
    if not isinstance(raw, list) or len(raw) != 3 or not isinstance(raw[0], str):
        raise InvalidRecordError(f"{what}: 'data' must be [file, start, end], got {raw!r}")
    start = _int(what, "data start", raw[1], 0)
    end = _int(what, "data end", raw[2], start + 1)
    return DataRange(raw[0], start, end)


def _parse_record(
    task_id: int,
    record: Mapping[str, object],
    data: DataRange,
    current_pass: int,
    streaming: bool = False,
) -> _Task:
    what = f"ledger record of task {task_id}"
    _check_keys(what, record, _RECORD_KEYS | ({"data"} if streaming else set()))
    length = data.num_rows
    pass_id = _int(what, "pass", record["pass"], 0, current_pass)
    try:
        state = TaskState(record["state"])
    except ValueError:
        raise InvalidRecordError(
            f"{what}: 'state' must be one of {[s.value for s in TaskState]}, "
            f"got {record['state']!r}"
        ) from None
    attempt = _int(what, "attempt", record["attempt"], 0)
    timeouts = _int(what, "timeouts", record["timeouts"], 0)
    offset = _int(what, "offset", record["offset"], 0, length)
    raw_segments = record["segments"]
    if not isinstance(raw_segments, list):
        raise InvalidRecordError(f"{what}: 'segments' must be a list, got {raw_segments!r}")
    segments: list[Segment] = []
    for raw in raw_segments:
        if not isinstance(raw, list) or len(raw) not in (3, 4):
            raise InvalidRecordError(
                f"{what}: each segment must be [attempt, from, to] or "
                f"[attempt, from, to, skipped], got {raw!r}"
            )
        seg_attempt = _int(what, "segment attempt", raw[0], 1, attempt)
        start = _int(what, "segment from", raw[1], 0, length - 1)
        end = _int(what, "segment to", raw[2], start + 1, length)
        skipped = _int(what, "segment skipped", raw[3], 0, end - start) if len(raw) == 4 else 0
        segments.append(Segment(seg_attempt, start, end, skipped))
    if offset != max((s.end for s in segments), default=0):
        raise InvalidRecordError(
            f"{what}: 'offset' {offset} is not where its last segment ends ({raw_segments!r})"
        )
    if state is TaskState.DONE and offset != length:
        raise InvalidRecordError(
            f"{what}: done, but its offset {offset} is not its length {length}"
        )
    trainer = record["trainer"]
    if trainer is not None and not isinstance(trainer, str):
        raise InvalidRecordError(f"{what}: 'trainer' must be a string or null, got {trainer!r}")
    if state is TaskState.PENDING and (trainer is None or attempt < 1):
        raise InvalidRecordError(f"{what}: pending, but without a trainer or an attempt")
    seq = record["seq"]
    if seq is not None:
        seq = _int(what, "seq", seq, 0)
    return _Task(
        data=data,
        pass_id=pass_id,
        state=state,
        attempt=attempt,
        timeout_count=timeouts,
        offset=offset,
        segments=segments,
        seq=seq,
        trainer_id=trainer if state is TaskState.PENDING else None,
    )
