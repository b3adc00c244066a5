"""Sparse tables on disk: safetensors part files of row chunks, and a JSON index.

A parameter server's sparse table ``NAME`` is saved under
``<dir>/sparse/NAME/``:

- ``v<version>-<part>.safetensors``: consecutive :class:`~elasticps.pserver.sparse.RowChunk` s
  of the table, at most ``max_file_bytes`` each (a file is built in memory,
  so this bounds the memory a save needs beyond the table itself); chunk
  ``c`` is stored as tensors ``c<c>.ids`` (int64), ``c<c>.rows`` (float32
  ``[r, dim]``), ``c<c>.optim.<key>`` (float32 ``[r, dim]``) and
  ``c<c>.count`` / ``.created_version`` / ``.last_version`` (int64), with
  a CRC-32 of the content in the safetensors metadata
  (:func:`elasticps.pserver.atomic.content_crc32`);
- ``index.json``: the table's metadata (:meth:`SparseTable.meta`) and the
  list of part files with their rows, sizes and CRC-32 of their bytes.

Every file is written atomically (temporary file, fsync, rename). The index
is written last and is the commit point: parts carry the version in their
names, so a save that dies halfway leaves the previous index and its parts
intact; parts no index names are removed after a successful save. A table
never becomes one giant tensor or one giant file.

How it sits next to the dense shard file (``ps-<i>/shard.safetensors``,
:mod:`elasticps.pserver.checkpoint`): a PS saves its tables under
``ps-<i>/sparse/`` at the same version as its dense shard; the dense shard's
metadata can name the tables and the index versions it goes with, so a
restore loads a consistent pair. On restore onto another number of PS,
each new PS reads every old PS's parts and keeps its own rows
(:func:`~elasticps.pserver.sparse.select_shard`).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from elasticps.errors import DataError, SparseTableError
from elasticps.pserver.atomic import content_crc32, write_atomic
from elasticps.pserver.sparse import (
    TABLE_FORMAT,
    Partitioner,
    RowChunk,
    SparseTable,
    TableSpec,
    select_shard,
)
from elasticps.pserver.sparse_shard import TablesState

INDEX_FILE: Final = "index.json"
"""Name of a table's index under ``<dir>/sparse/<name>/``."""

DEFAULT_MAX_FILE_BYTES: Final = 256 << 20
"""Default bound on one part file: 256 MiB."""

_META_KEY: Final = "elasticps-sparse"
_CRC_KEY: Final = "crc32"


@dataclass(frozen=True)
class SavedTable:
    """What :func:`save_table` wrote.

    Attributes:
        index: the index file.
        version: the table version saved.
        rows: rows saved.
        nbytes: bytes of all part files.
    """

    index: Path
    version: int
    rows: int
    nbytes: int


def table_dir(directory: Path, name: str) -> Path:
    """``<directory>/sparse/<name>``: where table ``name`` is saved."""
    return Path(directory) / "sparse" / name


def _encode_part(chunks: list[tuple[int, RowChunk]], part_meta: dict[str, Any]) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    for c, chunk in chunks:
        tensors.update(chunk.tensors(f"c{c}."))
    meta_json = json.dumps(part_meta, sort_keys=True, separators=(",", ":"))
    crc = content_crc32(meta_json, tensors)
    return bytes(save_safetensors(tensors, metadata={_META_KEY: meta_json, _CRC_KEY: str(crc)}))


def save_table(
    directory: Path, table: SparseTable, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> SavedTable:
    """Save ``table`` under ``<directory>/sparse/<name>/``, atomically and durably.

    Args:
        directory: the parameter server's checkpoint directory.
        table: the table; not modified (its chunks are read while writing,
            so the caller holds off updates meanwhile).
        max_file_bytes: start a new part file once one reaches this size.

    Returns:
        The index written and what it describes.

    Raises:
        OSError: a file cannot be written.
    """
    return save_table_chunks(
        directory, table.meta(), table.state_chunks(), max_file_bytes=max_file_bytes
    )


def save_table_chunks(
    directory: Path,
    meta: Mapping[str, Any],
    chunks: Iterable[RowChunk],
    *,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
) -> SavedTable:
    """Save a table given as its metadata and row chunks (e.g. a copy taken earlier).

    As :func:`save_table`, for a table's :meth:`SparseTable.meta` and
    :meth:`SparseTable.state_chunks` (or copies of them).

    Raises:
        OSError: a file cannot be written.
        SparseTableError: ``meta`` has no valid spec or version.
    """
    spec = TableSpec.from_json(meta.get("spec"))
    version = meta.get("version")
    if not isinstance(version, int):
        raise SparseTableError(f"sparse table {spec.name}: metadata has no integer version")
    out = table_dir(directory, spec.name)
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(meta)
    rows_total = 0
    parts: list[dict[str, Any]] = []
    pending: list[tuple[int, RowChunk]] = []
    pending_bytes = 0
    total = 0

    def flush() -> None:
        nonlocal pending, pending_bytes, total
        if not pending:
            return
        name = f"v{version}-{len(parts):05d}.safetensors"
        rows = sum(len(c) for _, c in pending)
        data = _encode_part(pending, {"table": spec.name, "version": version, "rows": rows})
        write_atomic(out / name, data)
        parts.append(
            {
                "file": name,
                "chunks": [c for c, _ in pending],
                "rows": rows,
                "nbytes": len(data),
                "crc32": zlib.crc32(data),
            }
        )
        total += len(data)
        pending, pending_bytes = [], 0

    for c, chunk in enumerate(chunks):
        rows_total += len(chunk)
        pending.append((c, chunk))
        pending_bytes += sum(t.nbytes for t in chunk.tensors("").values())
        if pending_bytes >= max_file_bytes:
            flush()
    flush()
    meta["rows"] = rows_total
    index = {"format": TABLE_FORMAT, "meta": meta, "parts": parts}
    index_path = out / INDEX_FILE
    write_atomic(index_path, json.dumps(index, sort_keys=True, indent=1).encode())
    keep = {p["file"] for p in parts} | {INDEX_FILE}
    for stale in out.glob("v*.safetensors"):
        if stale.name not in keep:
            stale.unlink(missing_ok=True)
    return SavedTable(index_path, version, rows_total, total)


def read_index(directory: Path, name: str) -> dict[str, Any]:
    """The index of table ``name`` under ``directory`` (validated).

    Raises:
        DataError: the index is missing, unreadable or malformed.
    """
    path = table_dir(directory, name) / INDEX_FILE
    try:
        index = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read sparse table index {path}: {exc}") from exc
    if (
        not isinstance(index, dict)
        or index.get("format") != TABLE_FORMAT
        or not isinstance(index.get("meta"), dict)
        or not isinstance(index.get("parts"), list)
    ):
        raise DataError(f"sparse table index {path} is not an {TABLE_FORMAT} index")
    return index


def iter_chunks(directory: Path, name: str) -> tuple[dict[str, Any], Iterator[RowChunk]]:
    """The metadata and the chunks of a saved table, read one part file at a time.

    Returns:
        ``(meta, chunks)``: ``meta`` as :meth:`SparseTable.meta`; ``chunks``
        a lazy iterator (each part's CRC-32 is checked when it is read).

    Raises:
        DataError: the index is missing or malformed (at once), or a part
            file is missing, corrupt or inconsistent (while iterating).
    """
    index = read_index(directory, name)
    meta: dict[str, Any] = index["meta"]
    try:
        dim = TableSpec.from_json(meta.get("spec")).dim
    except (SparseTableError, ValueError) as exc:
        raise DataError(f"sparse table {name}: invalid spec in its index: {exc}") from exc
    base = table_dir(directory, name)

    def chunks() -> Iterator[RowChunk]:
        for part in index["parts"]:
            file = part.get("file") if isinstance(part, dict) else None
            if not isinstance(file, str) or "/" in file or not file.endswith(".safetensors"):
                raise DataError(f"sparse table {name}: bad part entry {part!r:.80}")
            path = base / file
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise DataError(f"cannot read sparse table part {path}: {exc}") from exc
            if zlib.crc32(data) != part.get("crc32"):
                raise DataError(f"sparse table part {path} is corrupt (CRC-32 mismatch)")
            try:
                tensors = load_safetensors(data)
            except (SafetensorError, ValueError) as exc:
                raise DataError(f"sparse table part {path} is unreadable: {exc}") from exc
            for c in part.get("chunks", []):
                try:
                    yield RowChunk.from_tensors(tensors, f"c{c}.", dim)
                except SparseTableError as exc:
                    raise DataError(f"sparse table part {path}: {exc}") from exc

    return meta, chunks()


def load_table(
    directory: Path, name: str, *, partitioner: Partitioner | None = None, shard: int = 0
) -> SparseTable:
    """Load a table saved by :func:`save_table`, optionally keeping one shard's rows.

    Args:
        directory: the checkpoint directory it was saved under.
        name: the table.
        partitioner: with ``shard``: keep only the rows of that shard (for a
            restore onto another number of PS; call once per old directory
            and merge with :meth:`SparseTable.load_chunk`).
        shard: the shard to keep, with ``partitioner``.

    Returns:
        The table at the saved version.

    Raises:
        DataError: the files are missing, corrupt or inconsistent.
    """
    meta, chunks = iter_chunks(directory, name)
    if partitioner is not None:
        chunks = select_shard(chunks, partitioner, shard)
    try:
        return SparseTable.from_state(meta, chunks)
    except (SparseTableError, ValueError) as exc:
        raise DataError(f"sparse table {name} in {directory}: {exc}") from exc


# --- every table of a shard -------------------------------------------------------------------


def save_tables_state(
    directory: Path, state: TablesState, *, max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
) -> dict[str, SavedTable]:
    """Save a shard's tables (a copy from ``ParameterShard.state()``) under ``directory``.

    Each table goes to ``<directory>/sparse/<name>/`` as :func:`save_table` writes it.

    Returns:
        Per table name, what was written.

    Raises:
        OSError: a file cannot be written.
    """
    return {
        name: save_table_chunks(
            directory, state.metas[name], state.chunks.get(name, ()), max_file_bytes=max_file_bytes
        )
        for name in state.metas
    }


def load_tables_state(
    directories: Iterable[Path],
    names: Iterable[str],
    *,
    partitioners: Mapping[str, Partitioner] | None = None,
    shard: int = 0,
) -> TablesState:
    """Read tables saved by :func:`save_tables_state`, from one or more directories.

    With several directories (the shards of a consistent checkpoint) the
    rows of each are merged, and the version is the largest saved. With
    ``partitioners`` only the rows ``shard`` holds under them are kept, one
    part file at a time (a restore onto another number of servers).

    Args:
        directories: where the tables were saved; a directory without a
            table is skipped.
        names: the tables to read.
        partitioners: table name -> the new partitioning (tables missing
            from it keep every row).
        shard: the server whose rows to keep, with ``partitioners``.

    Returns:
        The tables' metadata and row chunks (tables found nowhere are absent).

    Raises:
        DataError: an index or part file is corrupt or inconsistent.
    """
    metas: dict[str, dict[str, Any]] = {}
    chunks: dict[str, list[RowChunk]] = {}
    dirs = list(directories)
    for name in names:
        for directory in dirs:
            if not (table_dir(directory, name) / INDEX_FILE).exists():
                continue
            meta, found = iter_chunks(directory, name)
            part = None if partitioners is None else partitioners.get(name)
            if part is not None:
                found = select_shard(found, part, shard)
            chunks.setdefault(name, []).extend(found)
            old = metas.get(name)
            if old is None or int(meta.get("version", 0)) > int(old.get("version", 0)):
                metas[name] = dict(meta)
    return TablesState(metas, chunks)
