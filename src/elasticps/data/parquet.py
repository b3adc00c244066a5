"""Row counts, column checks and row-range reads of Parquet files.

A task names a row range ``[start, end)`` of one Parquet file. The files are
written with small row groups, and :class:`RangeReader` decodes only the row
groups that overlap the range, found from the cumulative ``num_rows`` of the
row-group metadata. Every failure is reported as a one-line
:class:`~elasticps.errors.DataError` naming the file.

A file is a local path or a storage URL (``s3://``, ``gs://``, ``hdfs://``,
see :mod:`elasticps.storage`): a remote file is read by byte ranges, the
footer first and then the column chunks of the row groups a range needs.
A dataset (:func:`resolve_dataset_files`) is one file, a directory of
``<split>.parquet`` or of many Parquet files, or a glob.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from elasticps.errors import DataError, one_line
from elasticps.storage import Location, dir_exists, require_file

FileName = str | Path | Location
"""A Parquet file: a local path, or a URL (see :mod:`elasticps.storage`)."""


def _source(location: Location) -> Any:
    """What pyarrow reads: a local path as it is, a remote file as an open handle.

    Raises:
        DataError: the file is missing or cannot be opened.
    """
    require_file(location)
    if location.is_local:
        return location.local_path
    try:
        return location.open_input()
    except OSError as exc:
        raise DataError(f"cannot open data file {location}: {one_line(exc)}") from exc


def _open_metadata(path: FileName) -> pq.FileMetaData:
    """Read the footer of a Parquet file, translating failures to :class:`DataError`."""
    location = Location.of(path)
    source = _source(location)
    try:
        return pq.read_metadata(source)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"not a readable Parquet file: {location} ({one_line(exc)})") from exc
    finally:
        if not isinstance(source, Path):
            source.close()


def count_rows(path: FileName) -> int:
    """Return the number of rows of a Parquet file, from its footer only.

    Args:
        path: a Parquet file.

    Returns:
        Total rows over all row groups.

    Raises:
        DataError: the file is missing or is not Parquet.
    """
    return int(_open_metadata(path).num_rows)


def column_names(path: FileName) -> list[str]:
    """Return the top-level column names of a Parquet file, from its footer only.

    Raises:
        DataError: the file is missing or is not Parquet.
    """
    return list(_open_metadata(path).schema.to_arrow_schema().names)


def _missing_columns_error(
    path: FileName, missing: Sequence[str], present: Sequence[str]
) -> DataError:
    return DataError(
        f"data file {path} lacks column(s) {', '.join(repr(c) for c in missing)}; "
        f"it has: {', '.join(repr(c) for c in present) or '(no columns)'}"
    )


def check_columns(path: FileName, required: Sequence[str]) -> None:
    """Check that a Parquet file has every column in ``required``.

    Args:
        path: a Parquet file.
        required: column names the caller will read (e.g. a model file's ``COLUMNS``).

    Raises:
        DataError: the file is missing or is not Parquet, or columns are
            missing; the message names the missing columns, the file and the
            columns the file does have.
    """
    present = column_names(path)
    missing = [name for name in required if name not in present]
    if missing:
        raise _missing_columns_error(path, missing, present)


def null_counts(path: FileName, columns: Sequence[str]) -> dict[str, int]:
    """Return the number of null values in each of ``columns``, from the file's footer.

    A flat column's count is the ``null_count`` statistic of each row group,
    read from the footer only, however large the file. A nested column's
    statistic (a list such as MNIST's ``pixels``) cannot tell a null list
    from an empty one, so where it is non-zero the column is read, in those
    row groups only, and its null lists and null elements are counted.
    Row groups written without statistics are not counted.

    Args:
        path: a Parquet file.
        columns: top-level column names (e.g. a model file's ``COLUMNS``).

    Returns:
        Column name -> null values, for every column of ``columns`` the file has.

    Raises:
        DataError: the file is missing, is not Parquet, or cannot be read.
    """
    metadata = _open_metadata(path)
    wanted = set(columns)
    # Top-level column -> [(row group, leaf column index, nested)]
    leaves: dict[str, list[tuple[int, int, bool]]] = {}
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for index in range(row_group.num_columns):
            parts = row_group.column(index).path_in_schema.split(".")
            if parts[0] in wanted:
                leaves.setdefault(parts[0], []).append((group, index, len(parts) > 1))
    counts = {name: 0 for name in columns if name in leaves}
    suspect: dict[str, set[int]] = {}
    for name, entries in leaves.items():
        for group, index, nested in entries:
            stats = metadata.row_group(group).column(index).statistics
            if stats is None or not stats.has_null_count or not stats.null_count:
                continue
            if nested:
                suspect.setdefault(name, set()).add(group)
            else:
                counts[name] += int(stats.null_count)
    for name, groups in suspect.items():
        source = _source(Location.of(path))
        try:
            table = pq.ParquetFile(source).read_row_groups(sorted(groups), columns=[name])
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"cannot read column {name!r} of {path}: {one_line(exc)}") from exc
        finally:
            if not isinstance(source, Path):
                source.close()
        counts[name] += sum(_nulls(chunk) for chunk in table.column(name).chunks)
    return counts


def _nulls(array: pa.Array) -> int:
    """Null values in ``array`` and, for lists and structs, in their values."""
    count = int(array.null_count)
    kind = array.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        count += _nulls(array.flatten())
    elif pa.types.is_struct(kind):
        valid = array.is_valid()  # a null struct's fields are not counted again
        count += sum(_nulls(array.field(i).filter(valid)) for i in range(array.type.num_fields))
    return count


SKIP_HINT = "or pass --bad-records skip to drop the mini-batches they fall in"
"""The end of :func:`check_no_nulls`'s message for training data."""


def check_no_nulls(path: FileName, columns: Sequence[str], *, hint: str = SKIP_HINT) -> None:
    """Check that ``columns`` of a Parquet file hold no null values (see :func:`null_counts`).

    Args:
        path: a Parquet file.
        columns: the columns a model reads (its ``COLUMNS``).
        hint: what else the user can do, at the end of the message (after
            "remove or fill those rows, ").

    Raises:
        DataError: a column holds nulls; one line naming the file, each such
            column and its count. Also if the file is missing or unreadable.
    """
    counts = null_counts(path, columns)
    bad = [(name, n) for name, n in counts.items() if n]
    if bad:
        shown = ", ".join(f"{n:,} null{'s' if n > 1 else ''} in column {name!r}" for name, n in bad)
        raise DataError(
            f"data file {path} has {shown}, which the model file reads (COLUMNS); "
            f"remove or fill those rows, {hint}"
        )


def resolve_dataset(data: str | Path, split: str = "train") -> Path:
    """Return the local Parquet file named by ``data``.

    Args:
        data: a Parquet file, or a directory holding ``<split>.parquet`` (as
            written by :func:`elasticps.data.mnist.prepare_mnist`).
        split: split name used when ``data`` is a directory, e.g. ``"train"``
            or ``"test"``.

    Returns:
        The path of the Parquet file.

    Raises:
        DataError: the file does not exist.
    """
    path = Path(data)
    if path.is_dir():
        path = path / f"{split}.parquet"
    if not path.is_file():
        raise DataError(f"data file not found: {path}")
    return path


def find_split(data: FileName, split: str) -> tuple[Location, ...]:
    """The Parquet files of one split of a dataset, or none.

    ``data`` is looked at in this order:

    1. a glob (``s3://bucket/mnist/part-*.parquet``): every file it matches,
       whatever ``split``;
    2. a file: that file, whatever ``split``;
    3. a directory holding ``<split>.parquet``: that file;
    4. a directory holding a directory ``<split>/``: every ``*.parquet`` in it;
    5. for ``split == "train"``, a directory of ``*.parquet`` files (none
       named ``test.parquet``): all of them.

    Files come sorted by name, so every process sees the same order (the
    master's tasks name a file and a row range of it).

    Args:
        data: a local path or a URL (see :mod:`elasticps.storage`).
        split: ``"train"`` or ``"test"``.

    Returns:
        The files, possibly none.

    Raises:
        DataError: the storage cannot be reached.
    """
    where = Location.of(data)
    try:
        if where.has_glob:
            return tuple(where.glob())
        if where.is_file():
            return (where,)
        if not where.is_dir():
            return ()
        names = where.listdir()
        if f"{split}.parquet" in names:
            return (where / f"{split}.parquet",)
        if split in names and (where / split).is_dir():
            return tuple(
                where / split / n for n in (where / split).listdir() if n.endswith(".parquet")
            )
        if split == "train" and "test.parquet" not in names:
            return tuple(where / n for n in names if n.endswith(".parquet"))
    except OSError as exc:
        raise DataError(f"cannot list the dataset {where}: {one_line(exc)}") from exc
    return ()


def resolve_dataset_files(data: FileName, split: str = "train") -> tuple[Location, ...]:
    """The Parquet files of a split (see :func:`find_split`), at least one.

    Raises:
        DataError: ``data`` names no Parquet file for ``split``, or the
            storage cannot be reached.
    """
    files = find_split(data, split)
    if not files:
        where = Location.of(data)
        if dir_exists(where):
            raise DataError(
                f"data file not found: {where / (split + '.parquet')} (nor a {split}/ "
                "directory or other Parquet files)"
            )
        raise DataError(f"data file not found: {data}")
    return files


@dataclass(frozen=True)
class _OpenFile:
    """An opened Parquet file and the first row of each of its row groups."""

    file: pq.ParquetFile
    # the open remote file the ParquetFile reads, or None for a local path
    handle: Any
    # group_starts[g] is the first row of row group g; group_starts[-1] is the
    # total row count, so group g spans [group_starts[g], group_starts[g + 1]).
    group_starts: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def num_rows(self) -> int:
        return self.group_starts[-1]


DEFAULT_GROUP_CACHE_BYTES = 256 << 20
"""Bytes of decoded row groups a :class:`RangeReader` keeps by default (256 MiB)."""


def first_rows(path: FileName, rows: int, columns: Sequence[str]) -> pa.Table:
    """The first ``rows`` rows of a Parquet file (fewer if it has fewer), read once.

    What a lazy model is materialized with: the job's first training
    mini-batch (:meth:`elasticps.model_file.ModelSpec.instantiate`).

    Raises:
        DataError: the file is missing or is not Parquet, or lacks a column.
    """
    with RangeReader(cache_bytes=0) as reader:
        return reader.read_rows(path, 0, min(rows, reader.num_rows(path)), columns)


class RangeReader:
    """Reads row ranges of Parquet files, decoding only the overlapping row groups.

    Opened files (and their row-group offsets) are cached per path, so the
    footer of a file is parsed once however many tasks read from it. The cache
    is safe to share between threads, but a ``pyarrow.parquet.ParquetFile`` is
    not documented as thread-safe: give each reading thread its own reader.

    Decoded row groups are kept too, least recently used first out, up to
    ``cache_bytes`` bytes (Arrow's ``Table.nbytes``): a row group that two
    adjacent tasks share is decoded once, and a dataset that fits is decoded
    once per trainer rather than once per pass. Decoding is most of a read's
    CPU: a 512-row task of ``elasticps data mnist`` (784 uint8 pixels a row,
    3 row groups of 250 rows) takes 6.6 ms of CPU to decode, against 0.6 ms to
    turn into tensors (measured in ``benchmarks/README.md``). Files are
    assumed not to change while a job reads them.

    Example::

        reader = RangeReader()
        table = reader.read_rows("data/train.parquet", 1000, 1100, ["pixels", "label"])
    """

    def __init__(self, cache_bytes: int = DEFAULT_GROUP_CACHE_BYTES) -> None:
        """
        Args:
            cache_bytes: most bytes of decoded row groups kept (0: none).
        """
        self._files: dict[str, _OpenFile] = {}
        self._lock = threading.Lock()
        self._cache_bytes = cache_bytes
        self._groups: OrderedDict[tuple[str, int, tuple[str, ...] | None], pa.Table] = OrderedDict()
        self._cached_bytes = 0

    def _open(self, path: FileName) -> _OpenFile:
        location = Location.of(path)
        with self._lock:
            cached = self._files.get(location.url)
        if cached is not None:
            return cached
        source = _source(location)
        try:
            metadata = pq.read_metadata(source)
            parquet_file = pq.ParquetFile(source, metadata=metadata)
        except (pa.ArrowException, OSError) as exc:
            if not isinstance(source, Path):
                source.close()
            raise DataError(f"not a readable Parquet file: {location} ({one_line(exc)})") from exc
        starts = [0]
        for group in range(metadata.num_row_groups):
            starts.append(starts[-1] + metadata.row_group(group).num_rows)
        opened = _OpenFile(
            file=parquet_file,
            handle=None if isinstance(source, Path) else source,
            group_starts=tuple(starts),
            names=tuple(parquet_file.schema_arrow.names),
        )
        with self._lock:
            kept = self._files.setdefault(location.url, opened)
        if kept is not opened:
            _close(opened)
        return kept

    def num_rows(self, path: FileName) -> int:
        """Return the row count of ``path`` (cached after the first call).

        Raises:
            DataError: the file is missing or is not Parquet.
        """
        return self._open(path).num_rows

    def read_rows(
        self,
        path: FileName,
        start: int,
        end: int,
        columns: Sequence[str] | None = None,
    ) -> pa.Table:
        """Return rows ``[start, end)`` of a Parquet file.

        Only the row groups that overlap the range are read and decoded; the
        result is then sliced to the exact range.

        Args:
            path: a Parquet file.
            start: first row, 0-based, inclusive.
            end: last row, exclusive; ``start <= end <= num_rows``. An empty
                range returns an empty table with the requested columns.
            columns: columns to read; ``None`` reads every column.

        Returns:
            A table with ``end - start`` rows (possibly several chunks).

        Raises:
            DataError: the file is missing or is not Parquet, the range is out
                of bounds, a requested column is missing, or decoding fails.
        """
        location = Location.of(path)
        opened = self._open(location)
        if not 0 <= start <= end <= opened.num_rows:
            raise DataError(
                f"row range [{start}, {end}) is out of bounds for {path}, "
                f"which has {opened.num_rows} rows"
            )
        names = None if columns is None else list(columns)
        if names is not None:
            missing = [name for name in names if name not in opened.names]
            if missing:
                raise _missing_columns_error(path, missing, opened.names)
        if start == end:
            schema = opened.file.schema_arrow
            if names is not None:
                schema = pa.schema([schema.field(name) for name in names])
            return schema.empty_table()

        starts = opened.group_starts
        # Last group starting at or before `start` (skips empty groups), and the
        # last group starting before `end`.
        first_group = bisect.bisect_right(starts, start) - 1
        last_group = bisect.bisect_left(starts, end) - 1
        url = location.url
        cols = None if names is None else tuple(names)
        groups = range(first_group, last_group + 1)
        with self._lock:
            found = {g: self._cached_group(url, g, cols) for g in groups}
        to_read = [g for g, t in found.items() if t is None]
        if to_read:
            try:
                fresh = opened.file.read_row_groups(to_read, columns=names)
            except (pa.ArrowException, OSError) as exc:
                raise DataError(
                    f"cannot read rows [{start}, {end}) of {path}: {one_line(exc)}"
                ) from exc
            offset = 0
            with self._lock:
                for g in to_read:
                    rows = starts[g + 1] - starts[g]
                    found[g] = part = fresh.slice(offset, rows)
                    offset += rows
                    self._keep_group(url, g, cols, part)
        parts = [t for t in found.values() if t is not None]
        table = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
        return table.slice(start - starts[first_group], end - start)

    def _cached_group(self, url: str, group: int, cols: tuple[str, ...] | None) -> pa.Table | None:
        """A decoded row group, if kept (marked as just used). Called under the lock."""
        table = self._groups.get((url, group, cols))
        if table is not None:
            self._groups.move_to_end((url, group, cols))
        return table

    def _keep_group(
        self, url: str, group: int, cols: tuple[str, ...] | None, table: pa.Table
    ) -> None:
        """Keep a decoded row group, dropping the least recently used past the budget."""
        size = table.nbytes
        key = (url, group, cols)
        if size > self._cache_bytes or key in self._groups:
            return
        self._groups[key] = table
        self._cached_bytes += size
        while self._cached_bytes > self._cache_bytes:
            _, dropped = self._groups.popitem(last=False)
            self._cached_bytes -= dropped.nbytes

    def close(self) -> None:
        """Close every cached file; the reader can still be used afterwards."""
        with self._lock:
            files, self._files = self._files, {}
            self._groups.clear()
            self._cached_bytes = 0
        for opened in files.values():
            _close(opened)

    def __enter__(self) -> RangeReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _close(opened: _OpenFile) -> None:
    opened.file.close()
    if opened.handle is not None:
        opened.handle.close()
