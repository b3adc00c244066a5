"""Trained sparse tables: read them back, inspect and export rows by id, bind them to a model.

A job's sparse tables (:mod:`elasticps.nn`) live on the parameter servers,
partitioned by row, and every consistent checkpoint holds each server's
part beside its shard file, as row-chunked safetensors part files
(:mod:`elasticps.pserver.sparse_checkpoint`). :func:`load_tables` reads them
back, from a consistent checkpoint (``OUTPUT/snapshot`` of a job) or from a
directory written by :meth:`TableSet.save`, into a :class:`TableSet`: one
whole :class:`~elasticps.pserver.sparse.SparseTable` per name, with the
optimizer state and per-row counters the servers kept.

>>> tables = load_tables("runs/movielens/snapshot")  # doctest: +SKIP
>>> tables.rows("user", torch.tensor([1, 42]))       # doctest: +SKIP
tensor([[...], [...]])

A row that was never updated is not stored; :meth:`TableSet.rows` returns
its initial value, as the servers would. Loading a table needs memory for
all of it: for a table larger than one machine, read one server's part
(:func:`elasticps.pserver.sparse_checkpoint.load_table`) instead.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from elasticps.errors import DataError, MissingParameterError, SparseTableError
from elasticps.pserver.sparse import SparseTable
from elasticps.pserver.sparse_checkpoint import (
    INDEX_FILE,
    load_tables_state,
    save_table,
)

__all__ = ["TableSet", "load_tables"]


class TableSet(Mapping[str, SparseTable]):
    """Whole sparse tables by name.

    Args:
        tables: name -> table (kept, not copied).

    Raises:
        SparseTableError: a table is filed under another name than its own.
    """

    def __init__(self, tables: Mapping[str, SparseTable]) -> None:
        for name, table in tables.items():
            if table.spec.name != name:
                raise SparseTableError(f"table {table.spec.name!r} filed under the name {name!r}")
        self._tables = dict(tables)

    def __getitem__(self, name: str) -> SparseTable:
        return self._tables[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables)

    def __len__(self) -> int:
        return len(self._tables)

    def __repr__(self) -> str:
        held = ", ".join(f"{n}: {len(t)} rows" for n, t in self._tables.items())
        return f"TableSet({held})"

    def _table(self, name: str) -> SparseTable:
        table = self._tables.get(name)
        if table is None:
            raise MissingParameterError(
                f"no sparse table named {name!r} (tables: {', '.join(self._tables) or 'none'})"
            )
        return table

    def rows(self, name: str, ids: Tensor) -> Tensor:
        """The rows of ``ids`` in table ``name`` (initial values for rows never updated).

        Args:
            name: the table.
            ids: int64 ``[k]``.

        Returns:
            float32 ``[k, dim]``.

        Raises:
            MissingParameterError: no such table.
            SparseTableError: an id out of a fixed table's range.
        """
        return self._table(name).lookup(ids)

    def ids(self, name: str) -> Tensor:
        """The ids of table ``name`` that were updated in training: int64 ``[n]``, ascending.

        Raises:
            MissingParameterError: no such table.
        """
        return torch.sort(self._table(name).ids()).values

    def export(self, name: str) -> tuple[Tensor, Tensor]:
        """Every stored row of table ``name``: ``(ids int64 [n] ascending, rows float32 [n, dim])``.

        Raises:
            MissingParameterError: no such table.
        """
        ids = self.ids(name)
        return ids, self._table(name).lookup(ids)

    def counters(self, name: str, ids: Tensor) -> dict[str, Tensor]:
        """Per-row counters of ``ids`` (``count``, ``created_version``, ``last_version``).

        Raises:
            MissingParameterError: no such table.
        """
        return self._table(name).counters(ids)

    def bind(self, model: nn.Module, *, strict: bool = True) -> list[str]:
        """Make ``model``'s sparse modules read these tables (for evaluation and inference).

        Args:
            model: a model with :mod:`elasticps.nn` modules.
            strict: if True, every table of the model must be in the set.

        Returns:
            The model's tables not in the set (they keep their own, only with
            ``strict=False``).

        Raises:
            MissingParameterError: ``strict`` and the set lacks a table.
            SparseTableError: a table has another spec than the model's.
        """
        from elasticps.nn import sparse_modules

        missing = []
        for name, module in sparse_modules(model).items():
            table = self._tables.get(name)
            if table is None:
                missing.append(name)
                continue
            module.local.set_table(table)
        if strict and missing:
            raise MissingParameterError(f"no trained rows for sparse table(s) {', '.join(missing)}")
        return missing

    def save(self, directory: str | Path) -> Path:
        """Write every table under ``<directory>/sparse/<name>/`` as row-chunked part files.

        Returns:
            ``directory``.

        Raises:
            OSError: a file cannot be written.
        """
        out = Path(directory)
        for table in self._tables.values():
            save_table(out, table)
        return out


def _table_names(directory: Path) -> list[str]:
    base = directory / "sparse"
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if (p / INDEX_FILE).is_file())


def load_tables(directory: str | Path) -> TableSet:
    """Read the sparse tables of a consistent checkpoint, or of :meth:`TableSet.save`.

    Args:
        directory: a consistent checkpoint (its shards' ``shard-<i>.tables``
            directories are merged) or a directory a set was saved to.

    Returns:
        The tables (an empty set if there are none).

    Raises:
        DataError: a file is missing, corrupt or inconsistent.
    """
    root = Path(directory)
    if not root.is_dir():
        raise DataError(f"no sparse tables at {root}: not a directory")
    dirs = sorted(p for p in root.glob("shard-*.tables") if p.is_dir()) or [root]
    names = sorted({n for d in dirs for n in _table_names(d)})
    state = load_tables_state(dirs, names)
    tables = {}
    for name in names:
        try:
            tables[name] = SparseTable.from_state(state.metas[name], state.chunks.get(name, ()))
        except (SparseTableError, ValueError) as exc:
            raise DataError(f"sparse table {name} in {root}: {exc}") from exc
    return TableSet(tables)
