"""The task ledger in etcd: the I/O shell that makes the :class:`TaskQueue` durable.

Layout, under the job's root (see :class:`~elasticps.coord.store.Keys`):

- ``tasks/<id>``: one JSON record per task, :meth:`TaskQueue.record`;
- ``queue/meta``: the queue-wide record, :meth:`TaskQueue.meta`. It is written
  last when the ledger is created, so its presence means the ledger is complete;
- ``queue/spec``: the data split the ledger was made for (:class:`LedgerSpec`),
  so a master started with another configuration refuses the ledger;
- ``passes/<pass>``: the audit of each completed pass (:class:`PassSummary`).

Every write is one etcd transaction fenced by the master lock: it succeeds only
while the lock key is held by this master's lease, so a deposed master that has
not noticed yet cannot overwrite its successor's ledger (Paddle's Go master does
the same). The service calls :meth:`Ledger.persist` after each queue mutation,
inside the critical section of that mutation and before it replies, so the
ledger order is the queue order and nothing a trainer was told is ever missing
from the ledger.

A mutation writes only the records its events name, plus ``queue/meta`` when a
pass ends: the cost of a ``GetTask`` or a report does not grow with the number
of tasks, and there is no prefix scan outside :meth:`Ledger.open`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Final, Protocol

from elasticps.coord.store import JobStore, KeptLease, Keys, is_transient
from elasticps.errors import ConfigError, CoordinationError, SteppedDownError
from elasticps.master.taskqueue import (
    QUEUE_EVENTS,
    DataRange,
    EventKind,
    InvalidRecordError,
    QueueConfig,
    TaskEvent,
    TaskQueue,
    split_into_tasks,
)

__all__ = [
    "CHUNK_OPS",
    "CREATE_PARALLELISM",
    "KEPT_PASS_SUMMARIES",
    "SPEC_FORMAT",
    "Journal",
    "Ledger",
    "LedgerSpec",
    "SteppedDownError",
    "decode_object",
    "encode",
    "ledger_deletes",
    "ledger_writes",
]

log = logging.getLogger(__name__)

CHUNK_OPS: Final = 100
"""Most operations per ledger transaction (etcd accepts 128 by default)."""

KEPT_PASS_SUMMARIES: Final = 32
"""Pass audits (``passes/<n>``) kept in etcd; the master deletes older ones as
each pass completes, so that the ledger stays the same size however many
passes a job runs. The launcher copies every audit into ``run.json`` as it
appears (it reads them several times a second; the margin covers passes of
a fraction of a second while it reconnects to a restarted etcd). A repair of
a sealed pass needs that pass's audit (its failed tasks): a parameter
server keeps its 3 newest checkpoints and writes one at every seal, so the
oldest one it keeps predates at most the last 3 seals."""

CREATE_PARALLELISM: Final = 4
"""Transactions in flight at once while a new ledger is written."""

SPEC_FORMAT: Final = 1
"""Version of the ``queue/spec`` layout."""

_RETRY_FIRST_S: Final = 0.02
_RETRY_MAX_S: Final = 0.5


class Journal(Protocol):
    """What :class:`~elasticps.master.service.MasterService` needs to make mutations durable."""

    def persist(self, queue: TaskQueue, events: Sequence[TaskEvent]) -> None:
        """Write the records that ``events`` changed, before the caller replies.

        Raises:
            SteppedDownError: the write was not (or may not have been) accepted;
                the caller must stop serving.
        """


# --- the codec ---------------------------------------------------------------------


def encode(obj: Mapping[str, object]) -> str:
    """Encode a ledger record as compact JSON text with sorted keys."""
    return json.dumps(obj, separators=(",", ":"), sort_keys=True, allow_nan=False)


def decode_object(raw: bytes | str, what: str) -> dict[str, object]:
    """Decode a ledger value that must be a JSON object.

    Args:
        raw: the value, UTF-8 JSON.
        what: names the value in the error message (e.g. the key).

    Raises:
        InvalidRecordError: not UTF-8 JSON, or not an object.
    """
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRecordError(f"{what}: not valid UTF-8 JSON ({exc})") from None
    if not isinstance(value, dict):
        raise InvalidRecordError(f"{what}: expected a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class LedgerSpec:
    """What identifies a job's data split: the ledger is valid only for the same spec.

    Attributes:
        files: ``(path, number of rows)`` of each data file, in order.
        records_per_task: rows per task.
        num_passes: passes (epochs) over the data.
    """

    files: tuple[tuple[str, int], ...]
    records_per_task: int
    num_passes: int

    def ranges(self) -> list[DataRange]:
        """The tasks' data ranges, as :func:`split_into_tasks` cuts them.

        Raises:
            ConfigError: ``records_per_task`` < 1 or a negative row count.
        """
        return split_into_tasks(self.files, self.records_per_task)

    def as_dict(self) -> dict[str, object]:
        """The JSON-ready form stored under ``queue/spec``."""
        return {
            "format": SPEC_FORMAT,
            "files": [[path, rows] for path, rows in self.files],
            "records_per_task": self.records_per_task,
            "num_passes": self.num_passes,
            "num_tasks": len(self.ranges()),
        }

    @classmethod
    def from_dict(cls, obj: Mapping[str, object]) -> LedgerSpec:
        """Parse what :meth:`as_dict` returned.

        Raises:
            InvalidRecordError: the object does not have that shape.
        """
        what = "ledger spec (queue/spec)"
        fmt = obj.get("format")
        if type(fmt) is not int or fmt != SPEC_FORMAT:
            raise InvalidRecordError(f"{what}: unsupported format {fmt!r}")
        files = obj.get("files")
        records_per_task = obj.get("records_per_task")
        num_passes = obj.get("num_passes")
        ok_files = isinstance(files, list) and all(
            isinstance(f, list)
            and len(f) == 2
            and isinstance(f[0], str)
            and type(f[1]) is int
            and f[1] >= 0
            for f in files
        )
        if not ok_files or type(records_per_task) is not int or type(num_passes) is not int:
            raise InvalidRecordError(
                f"{what}: expected 'files' [[path, rows], ...] and integer "
                f"'records_per_task' and 'num_passes', got {obj!r}"
            )
        assert isinstance(files, list)
        return cls(
            files=tuple((str(f[0]), int(f[1])) for f in files),
            records_per_task=records_per_task,
            num_passes=num_passes,
        )

    def check_matches(self, stored: LedgerSpec) -> None:
        """Refuse a ledger made for another data split.

        Args:
            stored: the spec found in etcd.

        Raises:
            ConfigError: the specs differ; the message names what differs.
        """
        if stored == self:
            return
        differences = [
            f"{name}: ledger {theirs!r}, this master {ours!r}"
            for name, theirs, ours in (
                ("files", stored.files, self.files),
                ("records_per_task", stored.records_per_task, self.records_per_task),
                ("num_passes", stored.num_passes, self.num_passes),
            )
            if theirs != ours
        ]
        raise ConfigError(
            "the task ledger in etcd was created for another job configuration ("
            + "; ".join(differences)
            + "); use another job name, or the configuration the job started with"
        )


def ledger_deletes(keys: Keys, events: Sequence[TaskEvent]) -> list[str]:
    """The pass audits that ``events`` make too old to keep (see :data:`KEPT_PASS_SUMMARIES`).

    Args:
        keys: the job's keys.
        events: what one mutation returned.

    Returns:
        ``passes/<n - KEPT_PASS_SUMMARIES>`` for each pass ``n`` completed.
    """
    return [
        keys.pass_summary(e.pass_id - KEPT_PASS_SUMMARIES)
        for e in events
        if e.kind is EventKind.PASS_COMPLETED and e.pass_id >= KEPT_PASS_SUMMARIES
    ]


def ledger_writes(
    keys: Keys, queue: TaskQueue, events: Sequence[TaskEvent]
) -> list[tuple[str, str]]:
    """The ``(key, value)`` writes that persist what ``events`` changed in ``queue``.

    One write per task named by an event (its current record), one per pass
    summary, and ``queue/meta`` last if a queue event occurred, so that when the
    writes must be split over several transactions the pass advances only after
    the records of the pass are final.

    Args:
        keys: the job's keys.
        queue: the queue the events came from, in its state after them.
        events: what one mutation returned.

    Returns:
        The writes, without duplicates; empty if nothing durable changed.
    """
    writes: dict[str, str] = {}
    meta_changed = False
    for event in events:
        if event.kind is EventKind.REPAIR:
            continue  # not durable: the servers' coverage says what a repair achieved
        if event.task_id is not None:
            writes[keys.task(event.task_id)] = encode(queue.record(event.task_id))
        elif event.kind in QUEUE_EVENTS:
            meta_changed = True
        if event.kind is EventKind.PASS_COMPLETED and event.summary is not None:
            writes[keys.pass_summary(event.pass_id)] = encode(event.summary.as_dict())
    if meta_changed:
        writes[keys.queue_meta] = encode(queue.meta())
    return list(writes.items())


# --- the ledger --------------------------------------------------------------------


class Ledger:
    """The task ledger of one job, written by the master that holds ``lease``.

    Args:
        store: the job's store.
        lease: the lease this master acquired the master lock with.
        retry_s: how long to keep retrying a write that etcd did not answer
            (unreachable, timed out), seconds; past it the master steps down.
            Default: as long as the lease is kept while etcd is unreachable
            (``lease.unreachable_grace_s``): a restarted etcd extends the lease,
            so the lock may still be ours, and the fence decides once etcd
            answers. Other etcd errors are not retried.
        page_size: tasks per range request when the ledger is read.
    """

    def __init__(
        self,
        store: JobStore,
        lease: KeptLease,
        *,
        retry_s: float | None = None,
        page_size: int = 1000,
    ) -> None:
        self._store = store
        self._keys = store.keys
        self._lease = lease
        self._retry_s = lease.unreachable_grace_s if retry_s is None else retry_s
        self._page_size = page_size

    def open(self, spec: LedgerSpec, config: QueueConfig, now: float) -> tuple[TaskQueue, bool]:
        """Restore the queue from the ledger, or create the ledger for a new queue.

        If ``queue/meta`` exists, the ledger is complete: check its spec, read
        every task record (one range read, paged at one revision) and restore.
        Otherwise (a new job, or a master that crashed while creating the
        ledger) write a fresh ledger.

        Args:
            spec: the data split of this master's configuration.
            config: the queue's settings; ``num_passes`` must match ``spec``.
            now: current monotonic time, in seconds (deadlines of restored
                pending attempts start from it).

        Returns:
            ``(queue, restored)``: the queue, and whether it was restored.

        Raises:
            ConfigError: the ledger belongs to another configuration, or
                ``spec`` has no data.
            InvalidRecordError: a ledger record is malformed.
            SteppedDownError: the fence refused a write (another master).
            CoordinationError: etcd failed.
        """
        if spec.num_passes != config.num_passes:
            raise ConfigError(
                f"the ledger spec has {spec.num_passes} passes, the queue {config.num_passes}"
            )
        ranges = spec.ranges()
        meta = self._store.get_json(self._keys.queue_meta)
        if meta is None:
            queue = TaskQueue(ranges, config)
            self._create(queue, spec)
            log.info(
                "created the task ledger: %d tasks, %d passes", queue.num_tasks, spec.num_passes
            )
            return queue, False
        stored = self._store.get_json(self._keys.queue_spec)
        if stored is None:
            raise InvalidRecordError(
                f"{self._keys.queue_meta} exists but {self._keys.queue_spec} does not"
            )
        spec.check_matches(LedgerSpec.from_dict(stored))
        raw, revision = self._store.get_prefix_json(
            self._keys.tasks_prefix, page_size=self._page_size
        )
        records: dict[int, dict[str, object]] = {}
        for suffix, record in raw.items():
            if not suffix.isdigit():
                raise InvalidRecordError(f"unexpected key {self._keys.tasks_prefix}{suffix}")
            records[int(suffix)] = record
        queue = TaskQueue.restore(ranges, config, meta, records, now)
        self.persist(queue, queue.settle())
        stats = queue.stats()
        log.info(
            "restored the task ledger at revision %d: pass %d/%d, %d todo, %d pending, "
            "%d done, %d failed%s",
            revision,
            stats.pass_id,
            stats.num_passes,
            stats.todo,
            stats.pending,
            stats.done,
            stats.failed,
            " (finished)" if stats.finished else "",
        )
        return queue, True

    def persist(self, queue: TaskQueue, events: Sequence[TaskEvent]) -> None:
        """Write what ``events`` changed, fenced by the master lock.

        One transaction, unless a mutation touched more than :data:`CHUNK_OPS`
        records (a mass timeout); then several, with ``queue/meta`` in the last.
        Each record is written whole, so re-sending a write after an
        ambiguous etcd error is harmless.

        Raises:
            SteppedDownError: the fence refused the write, the lease is lost, or
                etcd did not accept it for ``retry_s`` seconds.
        """
        writes = ledger_writes(self._keys, queue, events)
        deletes = ledger_deletes(self._keys, events)
        starts = range(0, len(writes), CHUNK_OPS)
        for start in starts:
            last = start == starts[-1]
            self._write(writes[start : start + CHUNK_OPS], delete_keys=deletes if last else ())

    def _create(self, queue: TaskQueue, spec: LedgerSpec) -> None:
        """Write a whole new ledger: every record, then spec and meta.

        A first transaction deletes what an interrupted creation may have left.
        The task records go in transactions of :data:`CHUNK_OPS` writes, up to
        :data:`CREATE_PARALLELISM` in flight at once (etcd batches concurrent
        transactions into one raft entry and one fsync); ``queue/spec`` and
        ``queue/meta`` are written only after every record was accepted, so a
        creation interrupted anywhere leaves no ``queue/meta`` and is redone.
        """
        writes = [
            (self._keys.task(task_id), encode(queue.record(task_id)))
            for task_id in range(queue.num_tasks)
        ]
        # etcd refuses a put inside a range deleted by the same transaction.
        self._write([], delete_prefixes=[self._keys.tasks_prefix, self._keys.passes_prefix])
        chunks = [writes[start : start + CHUNK_OPS] for start in range(0, len(writes), CHUNK_OPS)]
        if len(chunks) > 1:
            with ThreadPoolExecutor(CREATE_PARALLELISM, thread_name_prefix="ledger") as pool:
                for done in [pool.submit(self._write, chunk) for chunk in chunks]:
                    done.result()  # re-raises SteppedDownError / CoordinationError
        else:
            for chunk in chunks:
                self._write(chunk)
        self._write(
            [
                (self._keys.queue_spec, encode(spec.as_dict())),
                (self._keys.queue_meta, encode(queue.meta())),
            ]
        )

    def _write(
        self,
        writes: Sequence[tuple[str, str]],
        delete_prefixes: Sequence[str] = (),
        delete_keys: Sequence[str] = (),
    ) -> None:
        if not writes and not delete_prefixes and not delete_keys:
            return
        deadline = time.monotonic() + self._retry_s
        delay = _RETRY_FIRST_S
        while True:
            if self._lease.lost.is_set():
                raise SteppedDownError("the master's etcd lease is lost")
            try:
                written = self._store.fenced_write(
                    writes, self._lease, delete_prefixes=delete_prefixes, delete_keys=delete_keys
                )
            except CoordinationError as exc:
                if not is_transient(exc):
                    raise SteppedDownError(f"etcd refused a ledger write: {exc}") from exc
                if time.monotonic() + delay >= deadline:
                    raise SteppedDownError(
                        f"etcd did not accept a ledger write for {self._retry_s:g} s: {exc}"
                    ) from exc
                log.log(
                    logging.WARNING if delay == _RETRY_FIRST_S else logging.DEBUG,
                    "ledger write failed (%s); retrying for up to %g s",
                    exc,
                    self._retry_s,
                )
                time.sleep(delay)
                delay = min(2 * delay, _RETRY_MAX_S)
                continue
            if not written:
                raise SteppedDownError(
                    f"the fence refused a ledger write: {self._keys.master_lock} is no longer "
                    f"held by lease {self._lease.id:x} (another master took over)"
                )
            return
