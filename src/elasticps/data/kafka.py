"""Training data from a Kafka topic: offset-range tasks, the window cutter, range reads.

A stream job's data is ``kafka://HOST:PORT[,HOST:PORT...]/TOPIC``. Its tasks are
offset ranges ``[first, end)`` of one partition, named like files by
:meth:`KafkaSource.partition_file` (``kafka://HOST:PORT/TOPIC/PARTITION``), so
that the task queue, the ledger and the parameter servers' coverage treat
them exactly as row ranges of a Parquet file.

- The master reads every partition (it never joins a consumer group) and
  cuts what arrives into tasks with a :class:`WindowCutter`: a window closes
  at ``records_per_task`` records or ``window_s`` seconds after its first
  record arrived, whichever comes first. Reading the records themselves,
  not the broker's high watermark, is what tells the master where a
  partition ends.
- A trainer reads its range with ``assign`` and an explicit start offset
  (:class:`KafkaRangeReader`).

Each message's value is one record: a UTF-8 JSON object mapping column names
to values (``{"pixels": [0, 12, ...], "label": 7}``); :func:`decode_values`
turns a range of them into a ``pyarrow.Table``. Offsets of a partition must be
contiguous (no compacted or transactional topics): a gap is a
:class:`~elasticps.errors.DataError` naming it.

The ``kafka`` extra (``confluent-kafka``) provides the client; only
:class:`KafkaRangeReader` and the master's feeder import it.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticps.errors import ConfigError, DataError, ServiceUnavailableError

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = [
    "CONTROLLED_KEYS",
    "KAFKA_SCHEME",
    "KafkaRangeReader",
    "KafkaSource",
    "StreamLimits",
    "WindowCutter",
    "consumer_settings",
    "decode_values",
    "is_kafka_url",
    "load_client_config",
]

KAFKA_SCHEME = "kafka://"
"""The prefix of a stream's ``--data``."""

_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_HOSTPORT = re.compile(r"^[A-Za-z0-9._\[\]:-]+:\d{1,5}$")

CONTROLLED_KEYS = frozenset(
    {"bootstrap.servers", "group.id", "enable.auto.commit", "enable.partition.eof"}
)
"""Consumer settings elasticps sets itself; a ``--kafka-config`` file may not."""


def is_kafka_url(data: str | Path) -> bool:
    """Whether ``--data`` names a Kafka topic (``kafka://...``)."""
    return str(data).startswith(KAFKA_SCHEME)


@dataclass(frozen=True)
class KafkaSource:
    """A topic on a Kafka cluster.

    Attributes:
        bootstrap: ``host:port`` of one or more brokers, comma-separated.
        topic: the topic name (letters, digits, ``.``, ``_``, ``-``).

    Raises:
        ConfigError: a malformed broker address or topic name.
    """

    bootstrap: str
    topic: str

    def __post_init__(self) -> None:
        if not self.bootstrap or not all(_HOSTPORT.match(b) for b in self.bootstrap.split(",")):
            raise ConfigError(
                f"kafka data: brokers must be HOST:PORT[,HOST:PORT...], got {self.bootstrap!r}"
            )
        if not _TOPIC.match(self.topic):
            raise ConfigError(
                f"kafka data: {self.topic!r} is not a topic name "
                "(1-249 letters, digits, '.', '_' or '-')"
            )

    @classmethod
    def parse(cls, url: str) -> KafkaSource:
        """Parse ``kafka://HOST:PORT[,HOST:PORT...]/TOPIC``.

        Raises:
            ConfigError: the URL has another shape.
        """
        if not is_kafka_url(url):
            raise ConfigError(f"not a kafka:// URL: {url!r}")
        rest = url[len(KAFKA_SCHEME) :]
        bootstrap, sep, topic = rest.partition("/")
        if not sep or "/" in topic:
            raise ConfigError(f"--data {url}: expected kafka://HOST:PORT/TOPIC")
        return cls(bootstrap, topic)

    @property
    def url(self) -> str:
        """``kafka://BOOTSTRAP/TOPIC``."""
        return f"{KAFKA_SCHEME}{self.bootstrap}/{self.topic}"

    def partition_file(self, partition: int) -> str:
        """The "file" name of a partition's tasks: ``kafka://BOOTSTRAP/TOPIC/PARTITION``."""
        return f"{self.url}/{partition}"

    @staticmethod
    def parse_partition_file(name: str) -> tuple[KafkaSource, int]:
        """Invert :meth:`partition_file`.

        Raises:
            DataError: ``name`` is not such a name.
        """
        head, sep, partition = name.rpartition("/")
        if not sep or not partition.isdigit():
            raise DataError(f"not a Kafka partition task: {name!r}")
        try:
            return KafkaSource.parse(head), int(partition)
        except ConfigError as exc:
            raise DataError(f"not a Kafka partition task: {name!r} ({exc})") from None


def load_client_config(path: Path | None) -> dict[str, str]:
    """Read a consumer configuration file (``--kafka-config``): security settings and the like.

    The file holds ``key=value`` lines, as Kafka's ``.properties`` files do
    (``#`` starts a comment): for example ``security.protocol=SASL_SSL``,
    ``sasl.mechanism=PLAIN``, ``sasl.username=...``. The values are never
    logged.

    Args:
        path: the file, or None for no settings.

    Returns:
        The settings, key -> value.

    Raises:
        ConfigError: the file cannot be read, a line is not ``key=value``, or
            it sets a key elasticps controls (:data:`CONTROLLED_KEYS`).
    """
    if path is None:
        return {}
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--kafka-config {path}: cannot be read ({exc})") from None
    settings: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--kafka-config {path}, line {number}: expected key=value")
        if key in CONTROLLED_KEYS:
            raise ConfigError(
                f"--kafka-config {path}, line {number}: {key} is set by elasticps "
                "(the brokers come from --data kafka://HOST:PORT/TOPIC)"
            )
        settings[key] = value.strip()
    return settings


def consumer_settings(source: KafkaSource, client: Mapping[str, str]) -> dict[str, Any]:
    """The full consumer configuration: the user's settings plus elasticps's own.

    The consumer never joins a group (partitions are assigned explicitly) nor
    commits offsets; ``group.id`` is set only because the client requires it.
    A short ``fetch.wait.max.ms`` makes a re-assignment cheap.
    """
    return {
        "fetch.wait.max.ms": 10,
        **client,
        "bootstrap.servers": source.bootstrap,
        "group.id": "elasticps",
        "enable.auto.commit": False,
        "enable.partition.eof": False,
    }


def decode_values(
    values: Sequence[bytes | None], columns: Sequence[str], where: str, first_offset: int
) -> pa.Table:
    """Decode message values (JSON objects) into a table of ``columns``.

    Args:
        values: the messages' values, in offset order.
        columns: the columns the model reads (its ``COLUMNS``).
        where: names the partition in error messages.
        first_offset: the offset of ``values[0]``, for error messages.

    Returns:
        A table with one row per value and exactly ``columns``.

    Raises:
        DataError: a value is not a UTF-8 JSON object, lacks a column, or the
            columns do not form a table (mixed types).
    """
    import pyarrow as pa

    rows: list[dict[str, object]] = []
    for i, value in enumerate(values):
        try:
            row = json.loads(value) if value is not None else None
        except (UnicodeDecodeError, ValueError) as exc:
            raise DataError(
                f"{where} offset {first_offset + i}: not a UTF-8 JSON record ({exc})"
            ) from None
        if not isinstance(row, dict):
            raise DataError(f"{where} offset {first_offset + i}: the record is not a JSON object")
        missing = [c for c in columns if c not in row]
        if missing:
            raise DataError(
                f"{where} offset {first_offset + i}: the record lacks column(s) "
                f"{', '.join(repr(c) for c in missing)}; it has {sorted(row)}"
            )
        rows.append({c: row[c] for c in columns})
    try:
        if not rows:
            return pa.table({c: pa.array([], pa.null()) for c in columns})
        return pa.Table.from_pylist(rows)
    except (pa.ArrowException, TypeError, ValueError) as exc:
        raise DataError(
            f"{where} offsets [{first_offset}, {first_offset + len(rows)}): "
            f"the records' columns do not form a table ({' '.join(str(exc).split())})"
        ) from None


# --- the master's window cutter (pure) ----------------------------------------------


@dataclass(frozen=True)
class StreamLimits:
    """How the master cuts a stream into tasks, and where it ends.

    Attributes:
        records_per_task: a window closes when it holds this many records, >= 1.
        window_s: ...or this many seconds after its first record arrived, > 0.
        until_offset: every partition ends before this offset (exclusive); None:
            no end by offset.
        until_time: the stream ends at this wall-clock time, seconds since the
            epoch; None: no end by time.

    Raises:
        ConfigError: a value out of range.
    """

    records_per_task: int = 512
    window_s: float = 5.0
    until_offset: int | None = None
    until_time: float | None = None

    def __post_init__(self) -> None:
        if self.records_per_task < 1:
            raise ConfigError(f"--records-per-task must be >= 1, got {self.records_per_task}")
        if not self.window_s > 0:
            raise ConfigError(f"--task-window-s must be > 0, got {self.window_s}")
        if self.until_offset is not None and self.until_offset < 1:
            raise ConfigError(f"--until-offset must be >= 1, got {self.until_offset}")


@dataclass
class _Partition:
    cut_to: int | None = None  # first offset not in a task; None: nothing seen yet
    head: int = 0  # one past the last offset seen
    opened_at: float | None = None  # monotonic arrival of the open window's first record
    ended: bool = False  # reached until_offset


@dataclass
class WindowCutter:
    """Turns arriving offsets of each partition into task ranges (no I/O, no clock).

    The caller feeds it every record it reads (:meth:`observe`) and the time
    (:meth:`tick`); both return the ranges ``(partition, first, end)`` that
    closed. Ranges of a partition are contiguous and in order.

    Args:
        limits: the window size and the stream's end.
        cut_to: partition -> first offset not yet in a task (from the ledger on a
            restart or a resume); a partition not named starts at the first
            offset it sees.
    """

    limits: StreamLimits
    cut_to: Mapping[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._parts: dict[int, _Partition] = {
            p: _Partition(cut_to=o, head=o) for p, o in self.cut_to.items()
        }

    def start_offset(self, partition: int) -> int | None:
        """Where reading a partition starts: its first offset not in a task, if known."""
        part = self._parts.get(partition)
        return part.cut_to if part is not None else None

    def observe(self, partition: int, offset: int, now: float) -> list[tuple[int, int, int]]:
        """A record at ``offset`` of ``partition`` arrived at monotonic time ``now``."""
        part = self._parts.setdefault(partition, _Partition())
        until = self.limits.until_offset
        if part.ended or (until is not None and offset >= until):
            return self._end(partition, part)
        if part.cut_to is None:
            part.cut_to = part.head = offset
        if offset < part.cut_to:
            return []  # already in a task (read again after a restart)
        part.head = max(part.head, offset + 1)
        if part.opened_at is None:
            part.opened_at = now
        out: list[tuple[int, int, int]] = []
        size = self.limits.records_per_task
        while part.head - part.cut_to >= size:
            out.append((partition, part.cut_to, part.cut_to + size))
            part.cut_to += size
            part.opened_at = now if part.head > part.cut_to else None
        if until is not None and part.head >= until:
            out += self._end(partition, part)
        return out

    def tick(self, now: float) -> list[tuple[int, int, int]]:
        """Close the windows whose first record arrived ``window_s`` or more before ``now``."""
        out: list[tuple[int, int, int]] = []
        for partition, part in self._parts.items():
            if part.opened_at is not None and now - part.opened_at >= self.limits.window_s:
                out += self._close(partition, part)
        return out

    def flush(self) -> list[tuple[int, int, int]]:
        """Close every open window (the stream ends)."""
        out: list[tuple[int, int, int]] = []
        for partition, part in self._parts.items():
            out += self._close(partition, part)
        return out

    def all_ended(self, partitions: Iterable[int]) -> bool:
        """Whether every one of ``partitions`` reached ``until_offset``."""
        return self.limits.until_offset is not None and all(
            self._parts.get(p, _Partition()).ended
            or (self._parts.get(p, _Partition()).cut_to or 0) >= self.limits.until_offset
            for p in partitions
        )

    def cut_offsets(self) -> dict[int, int]:
        """Partition -> the first offset not yet in a task."""
        return {p: part.cut_to for p, part in self._parts.items() if part.cut_to is not None}

    def heads(self) -> dict[int, int]:
        """Partition -> one past the last offset seen."""
        return {p: part.head for p, part in self._parts.items() if part.cut_to is not None}

    def _end(self, partition: int, part: _Partition) -> list[tuple[int, int, int]]:
        if part.ended:
            return []
        part.ended = True
        return self._close(partition, part)

    @staticmethod
    def _close(partition: int, part: _Partition) -> list[tuple[int, int, int]]:
        part.opened_at = None
        if part.cut_to is None or part.head <= part.cut_to:
            return []
        out = [(partition, part.cut_to, part.head)]
        part.cut_to = part.head
        return out


# --- the trainer's range reader (I/O) ------------------------------------------------


class KafkaRangeReader:
    """Reads offset ranges of partitions with ``assign`` and an explicit start offset.

    One consumer per broker list, made on first use and kept; it never joins
    a group nor commits. Not thread-safe: one reader per thread.

    Args:
        client: the ``--kafka-config`` settings (security and the like).
        timeout_s: how long a read may go without receiving a record, seconds.
    """

    def __init__(self, client: Mapping[str, str] | None = None, timeout_s: float = 30.0) -> None:
        self._client = dict(client or {})
        self._timeout_s = timeout_s
        self._consumers: dict[str, Any] = {}

    def _consumer(self, source: KafkaSource) -> Any:
        consumer = self._consumers.get(source.bootstrap)
        if consumer is None:
            from confluent_kafka import Consumer

            consumer = Consumer(consumer_settings(source, self._client))
            self._consumers[source.bootstrap] = consumer
        return consumer

    def read_rows(self, file: str, start: int, end: int, columns: Sequence[str]) -> pa.Table:
        """Return the records at offsets ``[start, end)`` of a partition task's ``file``.

        Args:
            file: a :meth:`KafkaSource.partition_file` name.
            start: first offset, inclusive.
            end: last offset, exclusive; ``start <= end``.
            columns: the columns to decode.

        Returns:
            A table of ``end - start`` rows, in offset order.

        Raises:
            DataError: the name is malformed, an offset in the range is missing
                (a gap), or a record does not decode.
            ServiceUnavailableError: no record arrived for ``timeout_s`` seconds,
                or the broker reported an error.
        """
        from confluent_kafka import KafkaException, TopicPartition

        source, partition = KafkaSource.parse_partition_file(file)
        where = f"{source.topic} partition {partition}"
        if start >= end:
            return decode_values([], columns, where, start)
        consumer = self._consumer(source)
        values: list[bytes | None] = []
        expected = start
        try:
            consumer.assign([TopicPartition(source.topic, partition, start)])
            deadline = time.monotonic() + self._timeout_s
            while expected < end:
                messages = consumer.consume(num_messages=min(end - expected, 1000), timeout=0.1)
                for message in messages:
                    error = message.error()
                    if error is not None:
                        raise ServiceUnavailableError(f"{where}: {error}")
                    offset = message.offset()
                    if offset < expected or offset >= end:
                        continue
                    if offset != expected:
                        raise DataError(
                            f"{where}: offsets {expected}..{offset - 1} are missing; "
                            "elasticps needs contiguous offsets (no compacted or "
                            "transactional topics)"
                        )
                    values.append(message.value())
                    expected += 1
                    deadline = time.monotonic() + self._timeout_s
                if expected < end and time.monotonic() >= deadline:
                    raise ServiceUnavailableError(
                        f"{where}: no record at offset {expected} for {self._timeout_s:g} s "
                        f"(reading [{start}, {end}))"
                    )
        except KafkaException as exc:
            raise ServiceUnavailableError(f"{where}: {exc}") from exc
        finally:
            consumer.unassign()
        return decode_values(values, columns, where, start)

    def close(self) -> None:
        """Close every consumer."""
        consumers, self._consumers = self._consumers, {}
        for consumer in consumers.values():
            consumer.close()
