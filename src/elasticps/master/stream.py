"""The master's stream feeder: reads a Kafka topic, cuts its offsets into tasks, ends the stream.

The feeder is the I/O shell around :class:`~elasticps.data.kafka.WindowCutter`.
One thread on the active master:

1. reads where each partition's tasks end from the queue (the ledger), so a
   master that takes over, or a job resumed from a checkpoint, cuts on from
   exactly there;
2. assigns every partition of the topic to one consumer (no group, no
   rebalancing) at those offsets, or at the beginning of a partition with
   no task yet;
3. feeds every record it reads to the cutter, and adds the ranges that close
   to the queue (``MasterService.add_tasks``: persisted before any trainer
   can be handed them);
4. seals the stream once every partition reached ``until_offset``, or the
   wall clock passed ``until_time``, after cutting what it has;
5. publishes the lag every second under ``stream/lag`` in etcd: per
   partition, the records read but not yet trained, and the age of the
   oldest of them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from elasticps import metrics
from elasticps.coord.store import JobStore
from elasticps.data.kafka import KafkaSource, StreamLimits, WindowCutter, consumer_settings
from elasticps.errors import CoordinationError, DataError, ElasticPSError
from elasticps.master.service import MasterService
from elasticps.master.taskqueue import DataRange
from elasticps.master.verify import ShardCoverage

__all__ = [
    "LAG_EVERY_S",
    "StreamFeeder",
    "committed_offsets",
    "lag_of",
    "offsets_of",
    "resume_point",
]

log = logging.getLogger(__name__)

LAG_EVERY_S = 1.0
"""Seconds between two publications of the lag."""

_POLL_S = 0.05
_TOPIC_WAIT_S = 30.0


def lag_of(
    heads: dict[int, int],
    cut: dict[int, int],
    untrained: dict[int, tuple[int, int | None]],
    arrived: dict[tuple[int, int], float],
    now_wall: float,
) -> dict[str, object]:
    """The lag of a stream, JSON-ready (pure).

    Args:
        heads: partition -> one past the last offset read.
        cut: partition -> the first offset not yet in a task (below it, every
            record is in a task, or was trained before a resume).
        untrained: partition -> (first untrained offset, start of its task or
            None if every task is done), from the queue.
        arrived: (partition, task start) -> wall-clock arrival time of the
            task's first record, seconds since the epoch.
        now_wall: the wall-clock time, seconds since the epoch.

    Returns:
        ``{"partitions": {p: {"head", "behind", "oldest_untrained_age_s"}},
        "records_behind", "oldest_untrained_age_s"}``; an age is None where
        nothing read is untrained.
    """
    parts: dict[str, dict[str, object]] = {}
    total = 0
    oldest: float | None = None
    for p, head in sorted(heads.items()):
        first, task_start = untrained.get(p, (0, None))
        if task_start is None:  # every task done: what follows is not yet in a task
            first = max(first, cut.get(p, head))
        behind = max(0, head - first)
        # None also where the untrained records are not in a task yet (an open window).
        age: float | None = None
        if behind and task_start is not None and (p, task_start) in arrived:
            age = round(max(0.0, now_wall - arrived[(p, task_start)]), 3)
        parts[str(p)] = {"head": head, "behind": behind, "oldest_untrained_age_s": age}
        total += behind
        if age is not None:
            oldest = age if oldest is None else max(oldest, age)
    return {"partitions": parts, "records_behind": total, "oldest_untrained_age_s": oldest}


Intervals = list[tuple[int, int]]


def _merge(intervals: list[tuple[int, int]]) -> Intervals:
    out: Intervals = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _intersect(a: Intervals, b: Intervals) -> Intervals:
    out: Intervals = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def committed_offsets(
    ranges: Mapping[int, DataRange], coverages: Sequence[ShardCoverage]
) -> dict[str, dict[str, object]]:
    """What a consistent checkpoint of a stream holds, per partition (pure).

    Args:
        ranges: task id -> its range, every task of the ledger.
        coverages: what each initialized parameter server holds of the
            stream's pass, read while every server was frozen.

    Returns:
        Task file -> ``{"start", "end", "trained"}``: the first offset of its
        first task, the end of its last task, and the offset ranges
        ``[[first, end), ...]`` that every server holds (the records a
        resume must not train again; the rest of ``[start, end)`` it must).
    """
    held: dict[int, Intervals] | None = None
    for cov in coverages:
        mine: dict[int, Intervals] = {}
        if cov.sealed:
            mine = {t: [(0, r.num_rows)] for t, r in ranges.items()}
        else:
            for task, lo, hi in cov.intervals:
                mine.setdefault(task, []).append((lo, hi))
            mine = {t: _merge(v) for t, v in mine.items()}
        held = (
            mine
            if held is None
            else {t: _intersect(held[t], mine[t]) for t in held.keys() & mine.keys()}
        )
    out: dict[str, dict[str, object]] = {}
    trained: dict[str, Intervals] = {}
    for task, r in ranges.items():
        entry = out.setdefault(r.file, {"start": r.start, "end": r.end})
        entry["start"] = min(int(str(entry["start"])), r.start)
        entry["end"] = max(int(str(entry["end"])), r.end)
        for lo, hi in (held or {}).get(task, []):
            trained.setdefault(r.file, []).append((r.start + lo, r.start + min(hi, r.num_rows)))
    for file, entry in out.items():
        entry["trained"] = [list(i) for i in _merge(trained.get(file, []))]
    return out


def offsets_of(manifest: Mapping[str, object]) -> object:
    """The stream offsets a consistent checkpoint's manifest records
    (``extra.stream.partitions``, see :func:`committed_offsets`), or None."""
    extra = manifest.get("extra")
    stream = extra.get("stream") if isinstance(extra, dict) else None
    return stream.get("partitions") if isinstance(stream, dict) else None


def resume_point(
    offsets: Mapping[str, Mapping[str, object]],
) -> tuple[dict[int, int], list[DataRange]]:
    """Where a resumed stream goes on (pure): the inverse of :func:`committed_offsets`.

    Args:
        offsets: what a checkpoint's manifest records under ``stream.partitions``.

    Returns:
        ``(cut_to, gaps)``: partition -> the offset the master cuts on from,
        and the ranges cut before the checkpoint that no server held whole,
        to train first.

    Raises:
        DataError: the record is malformed.
    """
    cut_to: dict[int, int] = {}
    gaps: list[DataRange] = []
    try:
        for file, entry in offsets.items():
            partition = KafkaSource.parse_partition_file(file)[1]
            start, end = int(str(entry["start"])), int(str(entry["end"]))
            raw = entry["trained"]
            assert isinstance(raw, list)
            at = start
            for lo, hi in sorted((int(a), int(b)) for a, b in raw):
                if lo > at:
                    gaps.append(DataRange(file, at, lo))
                at = max(at, hi)
            if at < end:
                gaps.append(DataRange(file, at, end))
            cut_to[partition] = end
    except (KeyError, ValueError, TypeError, AssertionError) as exc:
        raise DataError(f"the checkpoint's stream offsets are malformed ({exc})") from None
    return cut_to, gaps


class StreamFeeder:
    """Cuts a topic into tasks for the master's queue until the stream ends.

    Args:
        source: the topic.
        client: ``--kafka-config`` settings.
        limits: window size and the stream's end.
        service: the active master's service.
        store: the job's store (for ``stream/lag``).
        stop: set when the master stops; the feeder then returns.
        on_error: called with the exception if the feeder fails (the master
            then stops with it).
        resume: where a job resumed from a checkpoint goes on
            (:func:`resume_point`), or None.
    """

    def __init__(  # noqa: PLR0917 (the feeder's collaborators, each named)
        self,
        source: KafkaSource,
        client: dict[str, str],
        limits: StreamLimits,
        service: MasterService,
        store: JobStore,
        stop: threading.Event,
        on_error: Callable[[BaseException], None],
        resume: tuple[dict[int, int], list[DataRange]] | None = None,
    ) -> None:
        self._source = source
        self._client = client
        self._limits = limits
        self._service = service
        self._store = store
        self._stop = stop
        self._on_error = on_error
        self._resume = resume
        # What _publish_lag reads, set once the feeder reads the topic; the lock
        # serialises the feeder's publications with publish_final's.
        self._lag_lock = threading.Lock()
        self._cutter: WindowCutter | None = None
        self._arrived: dict[tuple[int, int], float] = {}
        self._thread = threading.Thread(target=self._run, name="stream-feeder", daemon=True)

    def start(self) -> None:
        """Start the feeder's thread."""
        self._thread.start()

    def join(self, timeout_s: float = 5.0) -> None:
        """Wait for the thread (after ``stop`` was set)."""
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self._feed()
        except ElasticPSError as exc:
            if not self._stop.is_set():
                log.error("stream feeder failed: %s", exc)
                self._on_error(exc)
        except Exception as exc:  # a bug or a client error: stop the master with it
            if not self._stop.is_set():
                log.exception("stream feeder failed")
                self._on_error(exc)

    def _feed(self) -> None:
        from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

        ends, sealed = self._service.stream_state()
        if sealed:
            return
        source = self._source
        cut_to = {KafkaSource.parse_partition_file(f)[1]: end for f, end in ends.items()}
        if self._resume is not None:
            resumed_to, gaps = self._resume
            if not ends and gaps:
                # A resumed job's first tasks: what its checkpoint did not hold.
                self._service.add_tasks(gaps)
            for p, end in resumed_to.items():
                cut_to[p] = max(cut_to.get(p, 0), end)
        cutter = WindowCutter(self._limits, cut_to)
        consumer = Consumer(consumer_settings(source, self._client))
        try:
            partitions = self._partitions(consumer)
            consumer.assign(
                [
                    TopicPartition(
                        source.topic, p, start if start is not None else OFFSET_BEGINNING
                    )
                    for p in partitions
                    for start in [cutter.start_offset(p)]
                ]
            )
            log.info(
                "reading %s, partitions %s, from offsets %s",
                source.url,
                partitions,
                {p: cutter.start_offset(p) for p in partitions},
            )
            # (partition, task start) -> arrival of the task's first record, and
            # partition -> arrival of the first record of its open window.
            arrived = self._arrived
            self._cutter = cutter
            window_ts: dict[int, float] = {}
            next_lag = time.monotonic()
            while not self._stop.is_set():
                messages = consumer.consume(num_messages=1000, timeout=_POLL_S)
                now = time.monotonic()
                ranges: list[tuple[int, int, int]] = []
                for message in messages:
                    if message.error() is not None:
                        log.warning("reading %s: %s", source.url, message.error())
                        continue
                    partition, offset = message.partition(), message.offset()
                    if partition is None or offset is None:  # not a record
                        continue
                    if cutter.start_offset(partition) in (None, offset):
                        window_ts[partition] = _arrival(message)
                    ranges += _stamp(cutter.observe(partition, offset, now), arrived, window_ts)
                ranges += _stamp(cutter.tick(now), arrived, window_ts)
                ended = cutter.all_ended(partitions) or (
                    self._limits.until_time is not None and time.time() >= self._limits.until_time
                )
                if ended:
                    ranges += _stamp(cutter.flush(), arrived, window_ts)
                if ranges:
                    self._service.add_tasks(
                        [DataRange(source.partition_file(p), a, b) for p, a, b in ranges]
                    )
                if ended:
                    self._service.seal()
                    log.info("stream %s ended; its last tasks are queued", source.url)
                    break
                if now >= next_lag:
                    self._publish_lag(cutter, arrived)
                    next_lag = now + LAG_EVERY_S
        finally:
            consumer.close()
        # The stream ended: the lag goes on shrinking as its last tasks are trained,
        # published more often, so that the job's record ends with the last of it.
        while not self._stop.is_set():
            self._publish_lag(cutter, arrived)
            self._stop.wait(LAG_EVERY_S / 5)

    def _partitions(self, consumer: Any) -> list[int]:
        """The topic's partitions, waiting up to 30 s for the topic to exist."""
        from confluent_kafka import KafkaException

        deadline = time.monotonic() + _TOPIC_WAIT_S
        while True:
            try:
                meta = consumer.list_topics(self._source.topic, timeout=5.0)
                topic = meta.topics.get(self._source.topic)
                if topic is not None and topic.error is None and topic.partitions:
                    return sorted(topic.partitions)
                problem = "it does not exist" if topic is None else str(topic.error)
            except KafkaException as exc:
                problem = str(exc)
            if time.monotonic() >= deadline or self._stop.is_set():
                raise DataError(
                    f"--data {self._source.url}: cannot read the topic's partitions ({problem})"
                )
            self._stop.wait(0.5)

    def publish_final(self) -> None:
        """Publish the lag once more (the job finished: its last tasks are trained)."""
        if self._cutter is not None:
            self._publish_lag(self._cutter, self._arrived)

    def _publish_lag(self, cutter: WindowCutter, arrived: dict[tuple[int, int], float]) -> None:
        with self._lag_lock:
            self._publish_lag_locked(cutter, arrived)

    def _publish_lag_locked(
        self, cutter: WindowCutter, arrived: dict[tuple[int, int], float]
    ) -> None:
        untrained = {
            KafkaSource.parse_partition_file(f)[1]: v
            for f, v in self._service.untrained_from().items()
        }
        lag = lag_of(cutter.heads(), cutter.cut_offsets(), untrained, arrived, time.time())
        for key in [k for k in arrived if _trained(k, untrained)]:
            del arrived[key]
        behind, age = lag["records_behind"], lag["oldest_untrained_age_s"]
        metrics.MASTER_STREAM_LAG_RECORDS.set(behind if isinstance(behind, int) else 0)
        metrics.MASTER_STREAM_AGE_SECONDS.set(age if isinstance(age, int | float) else 0.0)
        try:
            self._store.put_json(self._store.keys.stream_lag, lag)
        except CoordinationError as exc:
            log.debug("could not publish the lag: %s", exc)


def _stamp(
    closed: list[tuple[int, int, int]],
    arrived: dict[tuple[int, int], float],
    window_ts: dict[int, float],
) -> list[tuple[int, int, int]]:
    """Remember when the first record of each closed range arrived; return the ranges."""
    for p, a, _ in closed:
        arrived[(p, a)] = window_ts.get(p, time.time())
    return closed


def _trained(key: tuple[int, int], untrained: dict[int, tuple[int, int | None]]) -> bool:
    """Whether the task starting at ``key`` is wholly trained (its arrival is no longer needed)."""
    p, start = key
    first_task = untrained.get(p, (0, 0))[1]
    return first_task is None or start < first_task


def _arrival(message: Any) -> float:
    """A message's timestamp (produce or log-append time), seconds since the epoch;
    the time it was read where it has none."""
    kind, ms = message.timestamp()
    return ms / 1000.0 if kind != 0 and ms > 0 else time.time()
