"""A parameter server's part of every sparse table: validation, lookups and updates (pure).

A model's sparse tables (:mod:`elasticps.nn`) are described in the HELLO
layout of every shard (:func:`tables_layout`): each table's
:class:`~elasticps.pserver.sparse.TableSpec`, how its rows are partitioned
(by a hash of the id or by id range) and over how many servers. Shard ``s``
holds, of every table, the rows whose ids the table's
:class:`~elasticps.pserver.sparse.Partitioner` maps to ``s``, in a
:class:`~elasticps.pserver.sparse.SparseTable` with the lazy optimizer that
matches the server's dense one (:func:`~elasticps.pserver.sparse.sparse_rule_from_config`).

:class:`ShardTables` is what :class:`~elasticps.pserver.shard.ParameterShard`
holds for them. It checks the ids of a request before anything reads or
changes a table (every id of a fixed table in range, owned by this shard,
unique within a push), looks rows up, and applies row gradients: at once in
async mode, or, in sync mode, summed over the round's pushes with the same
weights as the dense gradient (samples, or 1 with the ``sum`` reduction) and
divided by the same total, so that a sparse table trains exactly as the same
rows of a dense parameter would (for SGD; the lazy rules of AdaGrad and Adam
differ from the dense ones only on rows that are not pushed). Every step of
the shard is a step of every table (an empty one for a table no push
touched), so a table's version counts the shard's steps.

Frozen tables (names matching the shard's ``frozen`` patterns) refuse a
push whose rows for them are not all zero, with
:class:`~elasticps.errors.FrozenParameterError`, before anything is applied;
zero rows are dropped, so a frozen table never changes.

Eviction (Monolith's expiry and frequency filter,
:class:`~elasticps.pserver.sparse.EvictionPolicy`) runs every
``check_every`` steps when a policy is set.

Checkpoints: :meth:`ShardTables.state` copies every table as row chunks
(:class:`TablesState`), which the shard's writers store as row-chunked part
files (:mod:`elasticps.pserver.sparse_checkpoint`), never as one tensor.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import torch

from elasticps import metrics
from elasticps.errors import (
    ConfigError,
    FrozenParameterError,
    LayoutMismatchError,
    SparseTableError,
)
from elasticps.pserver.sparse import (
    EvictionPolicy,
    FloatArray,
    IdArray,
    Partitioner,
    RowChunk,
    SparseRule,
    SparseTable,
    TableSpec,
    apply_tables,
    check_id_range,
)

_NO_IDS = np.zeros(0, np.int64)

__all__ = [
    "MAX_TABLES",
    "PARTITION_KINDS",
    "TABLES_KEY",
    "RowGrads",
    "ShardTables",
    "TableEntry",
    "TablesState",
    "parse_tables",
    "split_counts",
    "tables_layout",
]

TABLES_KEY: Final = "tables"
"""Key of the sparse tables in a HELLO layout (``ShardLayout.describe()`` plus this)."""

PARTITION_KINDS: Final = ("hash", "range")
"""How a table's rows are spread over the servers."""

MAX_TABLES: Final = 4096
"""Most sparse tables a layout may declare (a bound on what a HELLO may ask a server to build)."""

_BYTES_EVERY_STEPS: Final = 64
"""Steps between two readings of a table's bytes for its metric (the sum walks every chunk)."""


@dataclass(frozen=True)
class TableEntry:
    """One sparse table as a layout declares it.

    Attributes:
        spec: the table.
        partition: ``hash`` or ``range``.
        num_shards: parameter servers its rows are spread over.
    """

    spec: TableSpec
    partition: str
    num_shards: int

    @property
    def partitioner(self) -> Partitioner:
        """The table's id -> server map."""
        kind: Literal["hash", "range"] = "range" if self.partition == "range" else "hash"
        return Partitioner(kind, self.num_shards, self.spec.num_embeddings)

    def describe(self) -> dict[str, Any]:
        """JSON-ready, as in a layout's ``tables`` list."""
        return {
            "spec": self.spec.describe(),
            "partition": self.partition,
            "num_shards": self.num_shards,
        }


def tables_layout(
    specs: Sequence[TableSpec], partitions: Mapping[str, str], num_shards: int
) -> list[dict[str, Any]]:
    """The ``tables`` entry of every shard's HELLO layout.

    Args:
        specs: the model's tables, in model order.
        partitions: table name -> ``hash`` or ``range`` (missing: ``hash``).
        num_shards: number of parameter servers.

    Returns:
        A JSON-ready list, one object per table.

    Raises:
        ConfigError: an unknown partition kind, or ``range`` for a hashed table.
    """
    out = []
    for spec in specs:
        entry = TableEntry(spec, partitions.get(spec.name, "hash"), num_shards)
        if entry.partition not in PARTITION_KINDS:
            raise ConfigError(
                f"sparse table {spec.name}: partition must be hash or range, "
                f"got {entry.partition!r}"
            )
        entry.partitioner  # noqa: B018 (checks range against a hashed table)
        out.append(entry.describe())
    return out


def parse_tables(layout: Mapping[str, object]) -> list[TableEntry]:
    """The sparse tables a layout declares (validated: it comes from the network).

    Args:
        layout: a HELLO layout; ``tables`` may be absent (no sparse tables).

    Returns:
        The tables in layout order (empty if none).

    Raises:
        LayoutMismatchError: ``tables`` is malformed, names a table twice,
            or a spec, partition or server count is invalid.
    """
    raw = layout.get(TABLES_KEY)
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_TABLES:
        raise LayoutMismatchError(f"layout 'tables' must be a list of at most {MAX_TABLES} tables")
    out: list[TableEntry] = []
    seen: set[str] = set()
    for item in raw:
        if not isinstance(item, dict):
            raise LayoutMismatchError(f"layout table entry {item!r:.80} is not an object")
        try:
            spec = TableSpec.from_json(item.get("spec"))
            partition = item.get("partition")
            num_shards = item.get("num_shards")
            if partition not in PARTITION_KINDS:
                raise ConfigError(f"partition must be hash or range, got {partition!r}")
            if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1:
                raise ConfigError(f"num_shards must be an integer >= 1, got {num_shards!r}")
            entry = TableEntry(spec, str(partition), num_shards)
            entry.partitioner  # noqa: B018 (validates range against the spec)
        except (ConfigError, TypeError) as exc:
            raise LayoutMismatchError(f"layout declares an invalid sparse table: {exc}") from exc
        if spec.name in seen:
            raise LayoutMismatchError(f"layout declares sparse table {spec.name!r} twice")
        seen.add(spec.name)
        out.append(entry)
    return out


def split_counts(counts: IdArray, dims: Sequence[int], body_nbytes: int, row_itemsize: int) -> int:
    """Check a row frame's per-table counts against its body size (pure).

    A ROW_PULL body is ``counts int64 [T]`` and the ids ``int64 [K]``
    (``row_itemsize`` 0); a ROW_GRADS body has the rows after the ids,
    ``sum_t counts_t * dims_t`` elements of ``row_itemsize`` bytes.

    Args:
        counts: int64 ``[T]`` as received.
        dims: each table's row width, ``T`` of them.
        body_nbytes: the frame's body size, bytes.
        row_itemsize: bytes per row element; 0 when the body has no rows.

    Returns:
        ``K``, the total number of ids.

    Raises:
        SparseTableError: a count is negative, or the body size does not
            match the counts.
    """
    if len(counts) != len(dims):
        raise SparseTableError(f"a row frame has {len(counts)} counts for {len(dims)} tables")
    if len(counts) and int(counts.min()) < 0:
        raise SparseTableError("a row frame has a negative count")
    total: int = sum(int(c) for c in counts.tolist())  # Python ints: no overflow
    elements = int(sum(int(c) * d for c, d in zip(counts.tolist(), dims, strict=True)))
    expected = 8 * len(dims) + 8 * total + row_itemsize * elements
    if expected != body_nbytes:
        raise SparseTableError(
            f"a row frame body is {body_nbytes} bytes, its counts {counts.tolist()[:8]} "
            f"need {expected}"
        )
    return total


@dataclass(frozen=True)
class RowGrads:
    """The row gradients of one push to one server, checked against its tables.

    Attributes:
        ids: per table (layout order), int64 ``[k_t]``, unique.
        grads: per table, float32 ``[k_t, dim_t]``.
    """

    ids: tuple[IdArray, ...]
    grads: tuple[FloatArray, ...]

    @property
    def num_rows(self) -> int:
        """Rows over every table."""
        return sum(len(i) for i in self.ids)


@dataclass(frozen=True)
class TablesState:
    """A copy of every table of a shard, for a checkpoint (owns its memory).

    Attributes:
        metas: per table name, :meth:`SparseTable.meta`.
        chunks: per table name, its rows as :class:`RowChunk` copies.
    """

    metas: Mapping[str, Mapping[str, Any]]
    chunks: Mapping[str, Sequence[RowChunk]]

    def rows(self) -> dict[str, int]:
        """Rows held per table."""
        return {name: sum(len(c) for c in cs) for name, cs in self.chunks.items()}


def _copy_chunk(chunk: RowChunk) -> RowChunk:
    return RowChunk(
        chunk.ids.copy(),
        chunk.rows.copy(),
        {k: v.copy() for k, v in chunk.state.items()},
        {k: v.copy() for k, v in chunk.counters.items()},
    )


class ShardTables:
    """One server's part of every sparse table of a model.

    Not thread-safe: :class:`~elasticps.pserver.shard.ParameterShard` calls it
    under its own locks (lookups under the read side of its values lock,
    updates under the write side).

    Args:
        entries: the tables, in layout order (:func:`parse_tables`).
        shard: this server's index.
        rule: the lazy update rule of every table.
        frozen: ``fnmatch`` patterns over table names; matching tables never change.
        eviction: rows to evict, or None.
        evict_every: run eviction every this many steps (>= 1).

    Raises:
        LayoutMismatchError: ``shard`` is not below a table's server count.
    """

    def __init__(
        self,
        entries: Sequence[TableEntry],
        shard: int,
        rule: SparseRule,
        *,
        frozen: Sequence[str] = (),
        eviction: EvictionPolicy | None = None,
        evict_every: int = 1,
    ) -> None:
        self.entries = tuple(entries)
        self.shard = shard
        self.rule = rule
        for e in self.entries:
            if not 0 <= shard < e.num_shards:
                raise LayoutMismatchError(
                    f"sparse table {e.spec.name} is spread over {e.num_shards} servers; "
                    f"this is server {shard}"
                )
        self.tables = {e.spec.name: SparseTable(e.spec, rule) for e in self.entries}
        self._partitioners = [e.partitioner for e in self.entries]
        self.dims = [e.spec.dim for e in self.entries]
        self.frozen = frozenset(
            e.spec.name
            for e in self.entries
            if any(fnmatch.fnmatchcase(e.spec.name, p) for p in frozen)
        )
        self.eviction = eviction
        self._evict_every = max(1, evict_every)
        self._steps = 0
        self.evicted = 0
        self._rows_seen: dict[str, int] = {}  # rows per table after the last step
        self._metrics: dict[str, _TableMetrics] = {}
        # The open sync round: per table, (ids, weighted grads) of each push.
        self._round: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.entries]
        # For checking every table's ids at once (see split_ids): each table's
        # id bounds, and the one hash partitioner all tables share, if they do.
        info = np.iinfo(np.int64)
        self._lower = np.array(
            [info.min if e.spec.num_embeddings is None else 0 for e in self.entries], np.int64
        )
        self._upper = np.array(
            [info.max if e.spec.num_embeddings is None else e.spec.num_embeddings
             for e in self.entries],
            np.int64,
        )  # fmt: skip
        self._bounded = any(e.spec.num_embeddings is not None for e in self.entries)
        kinds = {(p.kind, p.num_shards) for p in self._partitioners}
        self._common_hash = (
            self._partitioners[0]
            if len(kinds) == 1 and self._partitioners[0].kind == "hash"
            else None
        )

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def names(self) -> list[str]:
        """Table names in layout order."""
        return [e.spec.name for e in self.entries]

    def describe(self) -> str:
        """The tables as canonical JSON (equal tables, equal text)."""
        return json.dumps([e.describe() for e in self.entries], sort_keys=True)

    # --- validation -----------------------------------------------------------------

    def split_ids(self, counts: IdArray, ids: IdArray, *, unique: bool) -> tuple[IdArray, ...]:
        """Cut a request's ids into tables and check them.

        Args:
            counts: int64 ``[T]``, checked by :func:`split_counts`.
            ids: int64 ``[sum(counts)]``.
            unique: refuse an id twice within a table (pushes).

        Returns:
            Per table, its ids (views of ``ids``).

        Raises:
            SparseTableError: an id is out of a fixed table's range, is held
                by another server, or (``unique``) repeats.
        """
        ends = np.cumsum(counts)
        if len(ids) and self._all_valid(counts, ends, ids, unique=unique):
            return tuple(
                ids[e - n : e] for n, e in zip(counts.tolist(), ends.tolist(), strict=True)
            )
        return self._split_ids_one_by_one(counts, ids, unique=unique)

    def _all_valid(self, counts: IdArray, ends: IdArray, ids: IdArray, *, unique: bool) -> bool:
        """Whether every table's ids pass split_ids' checks, tested on all ids at once.

        ``ends`` is ``np.cumsum(counts)``: where each table's ids end.

        False means some may not (a check that needs a partitioner per table,
        or ids not ascending within a table): the caller checks table by table,
        which also names the first bad id.
        """
        if self._bounded and bool(
            ((ids < np.repeat(self._lower, counts)) | (ids >= np.repeat(self._upper, counts))).any()
        ):
            return False
        part = self._common_hash
        if part is None:
            return False
        if part.num_shards > 1 and bool((part.shard_of(ids) != self.shard).any()):
            return False
        if unique and len(ids) > 1:
            # Unique within each table if ascending within each (as trainers send
            # them); where one table's ids end and the next begin, anything goes.
            ascending = ids[1:] > ids[:-1]
            starts = ends[:-1]
            ascending[starts[(starts > 0) & (starts < len(ids))] - 1] = True
            if not bool(ascending.all()):
                return False
        return True

    def _split_ids_one_by_one(
        self, counts: IdArray, ids: IdArray, *, unique: bool
    ) -> tuple[IdArray, ...]:
        out = []
        start = 0
        for entry, part, n in zip(self.entries, self._partitioners, counts.tolist(), strict=True):
            chunk = ids[start : start + n]
            start += n
            name = entry.spec.name
            check_id_range(name, chunk, entry.spec.num_embeddings)
            if n and part.num_shards > 1:
                owner = part.shard_of(chunk)
                if (owner != self.shard).any():
                    bad = chunk[owner != self.shard][0]
                    raise SparseTableError(
                        f"sparse table {name}: id {int(bad)} belongs to parameter server "
                        f"{int(part.shard_of(np.array([bad]))[0])}, not {self.shard}"
                    )
            if unique and n > 1 and len(np.unique(chunk)) != n:
                raise SparseTableError(f"sparse table {name}: pushed ids are not unique")
            out.append(chunk)
        return tuple(out)

    def split_rows(self, ids: Sequence[IdArray], rows: FloatArray) -> RowGrads:
        """Pair each table's ids with its gradient rows (cut from one flat float32 array).

        Raises:
            FrozenParameterError: non-zero rows for a frozen table; nothing
                is applied.
        """
        grads = []
        start = 0
        touched = []
        for entry, chunk in zip(self.entries, ids, strict=True):
            n = len(chunk) * entry.spec.dim
            part = rows[start : start + n].reshape(len(chunk), entry.spec.dim)
            start += n
            if entry.spec.name in self.frozen and len(chunk) and bool(np.any(part)):
                touched.append(entry.spec.name)
            grads.append(part)
        if touched:
            raise FrozenParameterError(
                f"push refused: non-zero gradient rows for frozen sparse table(s) "
                f"{', '.join(touched)}; nothing was applied"
            )
        return RowGrads(tuple(ids), tuple(grads))

    # --- pulls and updates ------------------------------------------------------------

    def lookup(self, ids: Sequence[IdArray]) -> FloatArray:
        """The rows of every table's ids, concatenated: float32 ``[sum_t k_t * dim_t]``.

        ``ids`` as :meth:`split_ids` returns them (checked).
        """
        dims = self.dims
        out = np.empty(sum(len(c) * d for c, d in zip(ids, dims, strict=True)), np.float32)
        start = 0
        for e, chunk, dim in zip(self.entries, ids, dims, strict=True):
            end = start + len(chunk) * dim
            self.tables[e.spec.name].lookup_into(chunk, out[start:end].reshape(len(chunk), dim))
            start = end
        return out

    def apply(self, grads: RowGrads | None, lr: float) -> None:
        """One step of every table with one push's rows (async mode; None: no rows)."""
        pushes = []
        for t, entry in enumerate(self.entries):
            table = self.tables[entry.spec.name]
            if grads is None or entry.spec.name in self.frozen or not len(grads.ids[t]):
                pushes.append((table, _NO_IDS, np.zeros((0, entry.spec.dim), np.float32)))
            else:
                pushes.append((table, grads.ids[t], grads.grads[t]))
        apply_tables(pushes, lr, checked=True)  # checked by split_ids
        self._after_step()

    def accumulate(self, grads: RowGrads, weight: float) -> None:
        """Add one push's rows, times ``weight``, to the open sync round."""
        for t, entry in enumerate(self.entries):
            if entry.spec.name in self.frozen or not len(grads.ids[t]):
                continue
            g = torch.from_numpy(np.ascontiguousarray(grads.grads[t]))
            self._round[t].append(
                (torch.from_numpy(np.ascontiguousarray(grads.ids[t])), g * weight)
            )

    def apply_round(self, lr: float, divisor: float) -> None:
        """One step of every table with the round's summed rows divided by ``divisor``.

        As the dense shard divides the round's weighted sum by the samples
        behind it (mean reduction) or by 1 (sum), a row pushed by some
        trainers only is averaged over all of them, as if the others had
        pushed a zero row (which is what their dense gradient holds).
        """
        pushes: list[tuple[SparseTable, IdArray, torch.Tensor | FloatArray]] = []
        for t, entry in enumerate(self.entries):
            table = self.tables[entry.spec.name]
            parts = self._round[t]
            if not parts:
                pushes.append((table, _NO_IDS, np.zeros((0, entry.spec.dim), np.float32)))
                continue
            ids = torch.cat([i for i, _ in parts])
            rows = torch.cat([g for _, g in parts])
            if len(parts) > 1:
                unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
                rows = torch.zeros(len(unique), entry.spec.dim).index_add_(0, inverse, rows)
                ids = unique
            if divisor != 1.0:
                rows = rows / divisor
            pushes.append((table, ids.numpy(), rows.contiguous()))
        # Checked by split_ids as each push came; unique once summed.
        apply_tables(pushes, lr, checked=True)
        self.clear_round()
        self._after_step()

    def clear_round(self) -> None:
        """Drop the open sync round's rows."""
        self._round = [[] for _ in self.entries]

    def _after_step(self) -> None:
        self._steps += 1
        evicting = self.eviction is not None and self._steps % self._evict_every == 0
        for name, table in self.tables.items():
            evicted = len(table.evict(self.eviction)) if evicting and self.eviction else 0
            self.evicted += evicted
            rows = len(table)
            # Rows the step added: what the table grew by, and what eviction took back.
            admitted = rows + evicted - self._rows_seen.get(name, 0)
            self._rows_seen[name] = rows
            m = self._metrics.get(name) or self._metrics.setdefault(name, _TableMetrics(self, name))
            m.rows.set(rows)
            if admitted > 0:
                m.admitted.inc(admitted)
            if evicted:
                m.evicted.inc(evicted)
            if evicted or self._steps % _BYTES_EVERY_STEPS == 1:
                m.bytes.set(table.nbytes)

    # --- checkpoints --------------------------------------------------------------

    def rows_held(self) -> dict[str, int]:
        """Rows allocated per table."""
        return {name: len(t) for name, t in self.tables.items()}

    def state(self) -> TablesState:
        """Copy every table (rows, optimizer state, counters) as row chunks."""
        metas = {name: t.meta() for name, t in self.tables.items()}
        chunks = {
            name: [_copy_chunk(c) for c in t.state_chunks()] for name, t in self.tables.items()
        }
        return TablesState(metas, chunks)

    def check_state(self, state: TablesState) -> dict[str, SparseTable]:
        """Build this shard's tables from a saved state, without installing them.

        Tables the state lacks start empty; rows of other servers (a state
        saved under another partitioning) are dropped. A table saved under
        another update rule keeps its rows and starts its optimizer state
        afresh.

        Raises:
            SparseTableError: a saved table has another spec, or a chunk does not fit.
        """
        out: dict[str, SparseTable] = {}
        for entry, part in zip(self.entries, self._partitioners, strict=True):
            name = entry.spec.name
            table = SparseTable(entry.spec, self.rule)
            meta = state.metas.get(name)
            if meta is not None:
                saved = TableSpec.from_json(meta.get("spec"))
                if saved != entry.spec:
                    raise SparseTableError(
                        f"sparse table {name}: saved as {saved.describe()}, the model declares "
                        f"{entry.spec.describe()}"
                    )
                version = meta.get("version", 0)
                table.version = version if isinstance(version, int) else 0
                for chunk in _own_rows(state.chunks.get(name, ()), part, self.shard):
                    table.load_chunk(_fit_state(chunk, self.rule))
            out[name] = table
        return out

    def install(self, tables: Mapping[str, SparseTable]) -> None:
        """Use ``tables`` (from :meth:`check_state`); the open round is dropped."""
        self.tables = dict(tables)
        self._rows_seen = {name: len(t) for name, t in self.tables.items()}  # not admitted
        self.clear_round()


class _TableMetrics:
    """The children of :mod:`elasticps.metrics`' sparse-table metrics for one table."""

    def __init__(self, tables: ShardTables, name: str) -> None:
        labels = (str(tables.shard), name)
        self.rows = metrics.PS_TABLE_ROWS.labels(*labels)
        self.bytes = metrics.PS_TABLE_BYTES.labels(*labels)
        self.admitted = metrics.PS_TABLE_ADMITTED.labels(*labels)
        self.evicted = metrics.PS_TABLE_EVICTED.labels(*labels)


def _own_rows(chunks: Sequence[RowChunk], part: Partitioner, shard: int) -> Iterator[RowChunk]:
    for chunk in chunks:
        if part.num_shards == 1:
            yield chunk
            continue
        mine = np.flatnonzero(part.shard_of(chunk.ids) == shard)
        if len(mine) == len(chunk):
            yield chunk
        elif len(mine):
            yield chunk.take(mine)


def _fit_state(chunk: RowChunk, rule: SparseRule) -> RowChunk:
    """The chunk with optimizer state for ``rule`` (fresh zeros if it was saved for another)."""
    if set(chunk.state) == set(rule.state_keys):
        return chunk
    r, dim = chunk.rows.shape
    fill = getattr(rule, "initial_accumulator_value", 0.0)
    state = {k: np.full((r, dim), fill if k == "sum" else 0.0, np.float32) for k in rule.state_keys}
    return RowChunk(chunk.ids, chunk.rows, state, chunk.counters)
