"""Repairs: records of sealed passes trained again for the shards that lack them.

A parameter server that restarts from a checkpoint older than its newest (the
newest was damaged, deleted or never finished) can be missing records of a
pass the master has already sealed. Its coverage (see
:mod:`elasticps.pserver.coverage`) still names what it holds of that pass,
since the checkpoint it restored was taken before the seal, and the pass's
summary names the tasks that failed in it. So, once the current pass's own
tasks are all done or failed and before the pass is sealed, the master
re-opens the records some shard lacks as *repairs*: tasks dispatched with
the sealed pass's id. Trainers push them with that pass's push keys; every
shard that holds them drops them as duplicates (in sync-SGD a duplicate
joins its step as an empty push, so every shard still takes one push per
trainer and step, and the versions stay aligned), and only the shards that
lack them apply them. Once every shard holds every record again, the
current pass is checked and sealed as usual.

:class:`Repairs` is the pure bookkeeping of those attempts, kept by
:class:`~elasticps.master.taskqueue.TaskQueue`. It is not persisted: what a
repair has achieved is on the shards (their coverage), so a master that
takes over finds what is still lacking by the same check, and re-opens it.
Repairs are opened for one sealed pass at a time, so that the task ids a
trainer holds are unambiguous, and are dropped when the current pass
completes. A repair that times out or fails more than ``max_task_timeouts``
times is FAILED: its records are reported lost, and it is not re-opened
again in this pass.

This module is pure: no I/O, no clock, no locks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from elasticps.errors import StaleTaskError

__all__ = ["RepairAttempt", "Repairs"]

# The states of a repair, as in the task queue (strings to stay independent of it).
TODO, PENDING, DONE, FAILED = "todo", "pending", "done", "failed"
_STATES = (TODO, PENDING, DONE, FAILED)


@dataclass(frozen=True)
class RepairAttempt:
    """A repair handed to a trainer.

    Attributes:
        task_id: the task.
        pass_id: the sealed pass whose records it trains again (the push keys' pass).
        attempt: the repair's dispatch number, from 1; reports quote it.
        offset: the first record, counted from the task's first record.
        deadline: monotonic time, seconds, after which the attempt times out
            unless its trainer reports progress.
    """

    task_id: int
    pass_id: int
    attempt: int
    offset: int
    deadline: float


@dataclass
class _Repair:
    task_id: int
    pass_id: int
    records: int  # records in the task
    start: int  # the first record re-opened (records repaired: records - start)
    state: str = TODO
    attempt: int = 0
    timeouts: int = 0
    offset: int = 0
    trainer_id: str | None = None
    deadline: float | None = None
    seq: int = 0  # order in the todo queue


@dataclass(frozen=True)
class RepairEvent:
    """One change of a repair, for the queue to turn into a task event.

    Attributes:
        kind: ``"reopened"``, ``"dispatched"``, ``"progress"``, ``"done"``,
            ``"requeued"`` or ``"failed"``.
        task_id / pass_id / attempt / timeouts / offset: the repair's after it.
        trainer_id: the trainer that holds (or held) it.
        reason: why it was requeued or failed.
    """

    kind: str
    task_id: int
    pass_id: int
    attempt: int
    timeouts: int
    offset: int
    trainer_id: str | None
    reason: str = ""


class Repairs:
    """The repair attempts of the current pass, keyed by (sealed pass, task).

    Args:
        task_timeout_s: seconds a trainer has to report a repair (or its
            progress), > 0.
        max_task_timeouts: timeouts and failures a repair may have; one more
            and it is FAILED.
    """

    def __init__(self, task_timeout_s: float, max_task_timeouts: int) -> None:
        self._timeout_s = task_timeout_s
        self._max_timeouts = max_task_timeouts
        self._repairs: dict[tuple[int, int], _Repair] = {}
        self._next_seq = 0

    # --- queries -----------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether some repair is todo or pending (the pass cannot be checked yet)."""
        return any(r.state in (TODO, PENDING) for r in self._repairs.values())

    def holds(self, task_id: int, pass_id: int) -> bool:
        """Whether ``(pass_id, task_id)`` is a repair of this pass."""
        return (pass_id, task_id) in self._repairs

    def failed(self, pass_id: int) -> set[int]:
        """The tasks of sealed pass ``pass_id`` whose repair failed in this pass."""
        return {t for (p, t), r in self._repairs.items() if p == pass_id and r.state == FAILED}

    def records_repaired(self) -> int:
        """Records trained again by the repairs done in this pass."""
        return sum(r.records - r.start for r in self._repairs.values() if r.state == DONE)

    def passes(self) -> list[int]:
        """The sealed passes repaired (some repair done) in this pass."""
        return sorted({p for (p, _), r in self._repairs.items() if r.state == DONE})

    def pending_of(self, trainer_id: str) -> list[RepairAttempt]:
        """The repair attempts a trainer holds, by task id."""
        return [
            self._attempt(r)
            for r in sorted(self._repairs.values(), key=lambda r: r.task_id)
            if r.state == PENDING and r.trainer_id == trainer_id
        ]

    def trainers(self) -> set[str]:
        """The trainers that hold a pending repair."""
        return {
            r.trainer_id
            for r in self._repairs.values()
            if r.state == PENDING and r.trainer_id is not None
        }

    def num_held(self, trainer_id: str) -> int:
        """Repairs ``trainer_id`` holds."""
        return len(self.pending_of(trainer_id))

    def next_deadline(self) -> float | None:
        """The earliest deadline of a pending repair, or None."""
        deadlines = [r.deadline for r in self._repairs.values() if r.state == PENDING]
        return min((d for d in deadlines if d is not None), default=None)

    def skip_budget(self, task_id: int, pass_id: int) -> int:
        """Mini-batches a repair may still skip (as :meth:`TaskQueue.skip_budget`)."""
        repair = self._repairs.get((pass_id, task_id))
        used = 0 if repair is None else repair.timeouts
        return max(0, self._max_timeouts - used)

    # --- mutations -----------------------------------------------------------

    def open(
        self, pass_id: int, rewinds: Mapping[int, int], task_records: Mapping[int, int]
    ) -> list[RepairEvent]:
        """Re-open records of sealed pass ``pass_id``: task -> first record some shard lacks.

        A repair already FAILED in this pass stays failed (its records are
        lost); one DONE is re-opened at ``offset``; a new one is added. They
        are queued in task order.

        Args:
            pass_id: the sealed pass.
            rewinds: task id -> the first record to train again.
            task_records: task id -> records in the task.

        Returns:
            One ``reopened`` event per repair opened; none if every one failed before.

        Raises:
            ValueError: some repair is still todo or pending, an offset is
                negative or beyond its task, or a task is unknown.
        """
        if self.active:
            raise ValueError(f"repairs are still open; cannot open more for pass {pass_id}")
        events: list[RepairEvent] = []
        for task_id, offset in sorted(rewinds.items()):
            records = task_records.get(task_id)
            if records is None:
                raise ValueError(f"task {task_id} is unknown")
            if not 0 <= offset < records:
                raise ValueError(f"task {task_id}: repair offset {offset} not in [0, {records})")
            repair = self._repairs.get((pass_id, task_id))
            if repair is None:
                repair = _Repair(task_id, pass_id, records, start=offset, offset=offset)
                self._repairs[(pass_id, task_id)] = repair
            elif repair.state == FAILED:
                continue
            else:  # DONE: a shard lacks its records again (restored once more)
                repair.start = min(repair.start, offset)
                repair.offset = offset
            self._requeue(repair)
            events.append(self._event("reopened", repair))
        return events

    def get(self, trainer_id: str, now: float) -> tuple[RepairAttempt | None, list[RepairEvent]]:
        """Hand the first todo repair to ``trainer_id``, or None if none is todo."""
        todo = [r for r in self._repairs.values() if r.state == TODO]
        if not todo:
            return None, []
        repair = min(todo, key=lambda r: r.seq)
        repair.state = PENDING
        repair.attempt += 1
        repair.trainer_id = trainer_id
        repair.deadline = now + self._timeout_s
        return self._attempt(repair), [self._event("dispatched", repair)]

    def progress(
        self, task_id: int, pass_id: int, attempt: int, offset: int, now: float
    ) -> list[RepairEvent]:
        """A trainer trained a repair up to ``offset``; renews its deadline.

        Raises:
            StaleTaskError: not the repair's current pending attempt, or an
                offset beyond the task. Nothing is changed.
        """
        repair = self._current(task_id, pass_id, attempt)
        if offset > repair.records:
            raise StaleTaskError(
                f"task {task_id}: repair progress offset {offset} is beyond the task's end "
                f"({repair.records} records)"
            )
        repair.deadline = now + self._timeout_s
        if offset <= repair.offset:
            return []
        repair.offset = offset
        return [self._event("progress", repair)]

    def report(
        self, task_id: int, pass_id: int, attempt: int, *, success: bool, error: str = ""
    ) -> list[RepairEvent]:
        """A trainer's report on a repair attempt.

        Raises:
            StaleTaskError: not the repair's current pending attempt.
        """
        repair = self._current(task_id, pass_id, attempt)
        if success:
            trainer_id = repair.trainer_id
            repair.state = DONE
            repair.offset = repair.records
            repair.trainer_id = None
            repair.deadline = None
            return [dataclasses.replace(self._event("done", repair), trainer_id=trainer_id)]
        return self._count_failure(repair, f"reported failure: {error}")

    def expire(self, now: float) -> list[RepairEvent]:
        """Time out every pending repair whose deadline is ``<= now``."""
        events: list[RepairEvent] = []
        for repair in sorted(self._repairs.values(), key=lambda r: (r.deadline or 0.0, r.seq)):
            if repair.state == PENDING and repair.deadline is not None and repair.deadline <= now:
                events.extend(self._count_failure(repair, "timeout"))
        return events

    def requeue_held(
        self, trainer_id: str, reason: str, keep: Collection[int] = ()
    ) -> list[RepairEvent]:
        """Requeue the repairs ``trainer_id`` holds but those of tasks ``keep``; no
        timeout counted (a lost trainer, a dispatch never received)."""
        events: list[RepairEvent] = []
        for repair in sorted(self._repairs.values(), key=lambda r: r.task_id):
            if repair.state != PENDING or repair.trainer_id != trainer_id:
                continue
            if repair.task_id in keep:
                continue
            self._requeue(repair)
            events.append(
                dataclasses.replace(
                    self._event("requeued", repair), trainer_id=trainer_id, reason=reason
                )
            )
        return events

    def clear(self) -> None:
        """Forget every repair (the current pass completed)."""
        self._repairs.clear()
        self._next_seq = 0

    # --- internals ---------------------------------------------------------

    def _current(self, task_id: int, pass_id: int, attempt: int) -> _Repair:
        repair = self._repairs.get((pass_id, task_id))
        if repair is None or repair.state != PENDING or repair.attempt != attempt:
            state = "none" if repair is None else f"{repair.state}, attempt {repair.attempt}"
            raise StaleTaskError(
                f"task {task_id}: report for the repair of pass {pass_id} attempt {attempt} "
                f"is stale; current is {state}"
            )
        return repair

    def _requeue(self, repair: _Repair) -> None:
        repair.state = TODO
        repair.trainer_id = None
        repair.deadline = None
        repair.seq = self._next_seq
        self._next_seq += 1

    def _count_failure(self, repair: _Repair, reason: str) -> list[RepairEvent]:
        trainer_id = repair.trainer_id
        repair.timeouts += 1
        if repair.timeouts > self._max_timeouts:
            repair.state = FAILED
            repair.trainer_id = None
            repair.deadline = None
            kind = "failed"
        else:
            self._requeue(repair)
            kind = "requeued"
        return [
            dataclasses.replace(self._event(kind, repair), trainer_id=trainer_id, reason=reason)
        ]

    def _attempt(self, repair: _Repair) -> RepairAttempt:
        assert repair.deadline is not None
        return RepairAttempt(
            repair.task_id, repair.pass_id, repair.attempt, repair.offset, repair.deadline
        )

    @staticmethod
    def _event(kind: str, repair: _Repair) -> RepairEvent:
        return RepairEvent(
            kind,
            repair.task_id,
            repair.pass_id,
            repair.attempt,
            repair.timeouts,
            repair.offset,
            repair.trainer_id,
        )
