"""A shard's sparse tables (``elasticps.pserver.sparse_shard`` inside ``ParameterShard``):
request checks, async and sync updates, push keys, frozen tables, eviction, checkpoints.

Pure: no sockets. Sync rounds run blocking pushes on daemon threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from prometheus_client import REGISTRY

from elasticps.config import OptimizerConfig, UpdateMode
from elasticps.errors import FrozenParameterError, LayoutMismatchError, SparseTableError
from elasticps.pserver.checkpoint import ShardFiles, tables_dir_of
from elasticps.pserver.coverage import PushKey
from elasticps.pserver.shard import ParameterShard, PushResult
from elasticps.pserver.sparse import (
    EvictionPolicy,
    Partitioner,
    SparseSGD,
    TableSpec,
    initial_rows,
)
from elasticps.pserver.sparse_shard import (
    RowGrads,
    ShardTables,
    TableEntry,
    parse_tables,
    split_counts,
    tables_layout,
)
from elasticps.wire.frame import PushStatus

DIM = 3
ROWS = 40
SGD_LR1 = OptimizerConfig(name="sgd", lr=1.0)
SPEC = TableSpec("emb", DIM, ROWS, init_scale=0.5)
HASHED = TableSpec("tags", 2)


def layout(shard: int = 0, num_shards: int = 1, numel: int = 2) -> dict[str, object]:
    return {
        "shard": shard,
        "numel": numel,
        "pieces": [["w", 0, numel]] if numel else [],
        "tables": tables_layout([SPEC, HASHED], {"emb": "range"}, num_shards),
    }


@pytest.fixture
def shards() -> Iterator[list[ParameterShard]]:
    made: list[ParameterShard] = []
    yield made
    for s in made:
        s.close()


def make(
    made: list[ParameterShard],
    mode: UpdateMode = UpdateMode.ASYNC,
    *,
    shard: int = 0,
    num_shards: int = 1,
    optimizer: OptimizerConfig = SGD_LR1,
    **options: object,
) -> ParameterShard:
    s = ParameterShard(
        layout(shard, num_shards),
        "f" * 64,
        optimizer,
        mode,
        **options,  # type: ignore[arg-type]
    )
    made.append(s)
    return s


def rows_of(shard: ParameterShard, name: str, ids: list[int]) -> torch.Tensor:
    assert shard.tables is not None
    return shard.tables.tables[name].lookup(np.array(ids, dtype=np.int64))


def grads(
    tables: ShardTables, emb: dict[int, float], tags: dict[int, float] | None = None
) -> RowGrads:
    """Row gradients: every element of row ``id`` equal to the value given."""
    ids = (np.array(list(emb), np.int64), np.array(list(tags or {}), np.int64))
    emb_rows = np.repeat(np.array(list(emb.values()), np.float32), DIM)
    tag_rows = np.repeat(np.array(list((tags or {}).values()), np.float32), 2)
    flat = np.concatenate([emb_rows, tag_rows]).astype(np.float32)
    counts = np.array([len(ids[0]), len(ids[1])], np.int64)
    per = tables.split_ids(counts, np.concatenate(ids), unique=True)
    return tables.split_rows(per, flat)


# --- layouts and request checks ---------------------------------------------------------------


def test_a_layout_declares_tables_and_is_checked() -> None:
    entries = parse_tables(layout(num_shards=3))
    assert [e.spec for e in entries] == [SPEC, HASHED]
    assert entries[0].partitioner == Partitioner("range", 3, ROWS)
    assert parse_tables({"shard": 0, "numel": 0}) == []
    bad = layout()
    bad["tables"] = [*bad["tables"], bad["tables"][0]]  # type: ignore[list-item, misc]
    with pytest.raises(LayoutMismatchError, match="twice"):
        parse_tables(bad)
    with pytest.raises(LayoutMismatchError, match="invalid sparse table"):
        parse_tables({"tables": [{"spec": {"name": "x", "dim": 0}, "partition": "hash",
                                  "num_shards": 1}]})  # fmt: skip
    with pytest.raises(LayoutMismatchError, match="invalid sparse table"):
        parse_tables({"tables": [{"spec": HASHED.describe(), "partition": "range",
                                  "num_shards": 2}]})  # fmt: skip


def test_counts_must_match_the_body() -> None:
    assert split_counts(np.array([2, 1]), [3, 2], 8 * 2 + 8 * 3 + 4 * (6 + 2), 4) == 3
    assert split_counts(np.array([2, 1]), [3, 2], 8 * 2 + 8 * 3, 0) == 3
    with pytest.raises(SparseTableError, match="need"):
        split_counts(np.array([2, 1]), [3, 2], 8 * 2 + 8 * 3 + 4, 0)
    with pytest.raises(SparseTableError, match="negative"):
        split_counts(np.array([-1, 1]), [3, 2], 8 * 2, 0)
    with pytest.raises(SparseTableError, match="counts for"):
        split_counts(np.array([1]), [3, 2], 8 + 8, 0)


def test_ids_out_of_range_of_another_server_or_repeated_are_refused(
    shards: list[ParameterShard],
) -> None:
    s = make(shards, shard=1, num_shards=2)
    assert s.tables is not None
    mine = int(Partitioner("range", 2, ROWS).range_bounds()[1][0])
    ok = s.tables.split_ids(np.array([1, 2]), np.array([mine, 7, 7]), unique=False)
    assert ok[0].tolist() == [mine]
    with pytest.raises(SparseTableError, match="out of range"):
        s.tables.split_ids(np.array([1, 0]), np.array([ROWS]), unique=False)
    with pytest.raises(SparseTableError, match="belongs to parameter server 0"):
        s.tables.split_ids(np.array([1, 0]), np.array([0]), unique=False)
    hashed_other = next(
        i for i in range(100) if Partitioner("hash", 2).shard_of(np.array([i]))[0] == 0
    )
    with pytest.raises(SparseTableError, match="belongs to parameter server 0"):
        s.tables.split_ids(np.array([0, 1]), np.array([hashed_other]), unique=False)
    with pytest.raises(SparseTableError, match="not unique"):
        s.tables.split_ids(np.array([2, 0]), np.array([mine, mine]), unique=True)


def test_ids_of_hash_partitioned_tables_are_checked_all_at_once_with_the_same_verdicts() -> None:
    # Every table hash-partitioned over the same servers: split_ids checks
    # all ids in one pass (ascending within a table means unique), and
    # falls back to table by table for anything else, so errors are the same.
    fixed, hashed = TableSpec("fixed", DIM, ROWS), TableSpec("free", 2)
    entries = [TableEntry(fixed, "hash", 2), TableEntry(hashed, "hash", 2)]
    tables = ShardTables(entries, 1, SparseSGD())
    part = Partitioner("hash", 2)
    mine = [i for i in range(ROWS) if part.shard_of(np.array([i]))[0] == 1]
    other = next(i for i in range(ROWS) if part.shard_of(np.array([i]))[0] == 0)
    big = [k for k in (-(2**62), -5, 10**12, 2**62) if part.shard_of(np.array([k]))[0] == 1]
    rng = np.random.default_rng(0)
    for _ in range(50):
        a = np.sort(rng.choice(mine, size=int(rng.integers(0, len(mine))), replace=False))
        b = np.array(sorted(rng.choice(big, size=int(rng.integers(0, len(big) + 1)),
                                       replace=False)), np.int64)  # fmt: skip
        if rng.random() < 0.3:
            a = rng.permutation(a)  # unique, not ascending: the table-by-table check
        counts = np.array([len(a), len(b)], np.int64)
        ids = np.concatenate([a, b]).astype(np.int64)
        got = tables.split_ids(counts, ids, unique=True)
        want = tables._split_ids_one_by_one(counts, ids, unique=True)
        assert [g.tolist() for g in got] == [w.tolist() for w in want] == [a.tolist(), b.tolist()]
    with pytest.raises(SparseTableError, match="out of range"):
        tables.split_ids(np.array([1, 0]), np.array([ROWS + 1]), unique=True)
    with pytest.raises(SparseTableError, match=f"id {other} belongs to parameter server 0"):
        tables.split_ids(np.array([2, 0]), np.array([mine[0], other]), unique=True)
    with pytest.raises(SparseTableError, match="not unique"):
        tables.split_ids(np.array([2, 0]), np.array([mine[0], mine[0]]), unique=True)
    # One id in each table, equal or descending across the boundary: fine.
    ok = tables.split_ids(np.array([1, 1]), np.array([mine[1], mine[0]]), unique=True)
    assert [o.tolist() for o in ok] == [[mine[1]], [mine[0]]]
    assert [o.tolist() for o in tables.split_ids(np.array([0, 0]), np.array([], np.int64),
                                                 unique=True)] == [[], []]  # fmt: skip


# --- updates ------------------------------------------------------------------------------------


def test_async_push_updates_only_its_rows_and_a_repeated_key_is_applied_once(
    shards: list[ParameterShard],
) -> None:
    s = make(shards)
    assert s.tables is not None
    before = rows_of(s, "emb", [1, 2, 3])
    key = PushKey(0, 5, 0, 10)
    g = grads(s.tables, {1: 1.0, 3: -2.0}, {123456789: 0.5})
    result = s.push(0, torch.zeros(2), 0, 10, key=key, rows=g)
    assert result.status is PushStatus.APPLIED
    after = rows_of(s, "emb", [1, 2, 3])
    torch.testing.assert_close(
        after - before, torch.tensor([[-1.0] * DIM, [0.0] * DIM, [2.0] * DIM])
    )
    assert s.tables.rows_held() == {"emb": 2, "tags": 1}
    again = s.push(0, torch.zeros(2), 0, 10, key=key, rows=g)
    assert again.status is PushStatus.DUPLICATE
    torch.testing.assert_close(rows_of(s, "emb", [1, 2, 3]), after)
    assert all(t.version == 1 for t in s.tables.tables.values())  # one step, every table


def push_in_thread(
    shard: ParameterShard, trainer: int, samples: int, rows: RowGrads
) -> Future[PushResult]:
    future: Future[PushResult] = Future()

    def target() -> None:
        try:
            future.set_result(shard.push(trainer, torch.zeros(2), 0, samples, rows=rows))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=target, daemon=True).start()
    return future


def test_a_sync_step_averages_rows_by_samples_as_the_dense_gradient(
    shards: list[ParameterShard],
) -> None:
    """Trainer 1 (30 samples) pushes rows 1 and 2, trainer 2 (10 samples) row 2 only:
    row 1 moves by 30/40 of its gradient, as a dense row whose other gradient is 0."""
    s = make(shards, UpdateMode.SYNC)
    assert s.tables is not None
    s.set_live_trainers({1, 2})
    before = rows_of(s, "emb", [1, 2])
    first = push_in_thread(s, 1, 30, grads(s.tables, {1: 4.0, 2: 4.0}))
    second = push_in_thread(s, 2, 10, grads(s.tables, {2: 8.0}))
    assert first.result(5).version == second.result(5).version == 1
    moved = before - rows_of(s, "emb", [1, 2])
    torch.testing.assert_close(moved[:, 0], torch.tensor([3.0, (30 * 4.0 + 10 * 8.0) / 40]))


def test_non_zero_rows_of_a_frozen_table_are_refused_before_anything_is_applied(
    shards: list[ParameterShard],
) -> None:
    s = make(shards, frozen=("tags",))
    assert s.tables is not None
    with pytest.raises(FrozenParameterError, match="tags"):
        grads(s.tables, {1: 1.0}, {9: 1.0})
    before = rows_of(s, "tags", [9])
    s.push(0, torch.zeros(2), 0, 1, rows=grads(s.tables, {1: 1.0}, {9: 0.0}))
    assert torch.equal(rows_of(s, "tags", [9]), before)
    assert s.tables.rows_held()["tags"] == 0


def test_rows_need_tables_and_a_gradient(shards: list[ParameterShard]) -> None:
    plain = ParameterShard({"shard": 0, "numel": 2}, "f" * 64, SGD_LR1, UpdateMode.ASYNC)
    shards.append(plain)
    s = make(shards)
    assert s.tables is not None
    g = grads(s.tables, {1: 1.0})
    with pytest.raises(SparseTableError, match="no sparse tables"):
        plain.push(0, torch.zeros(2), 0, 1, rows=g)
    with pytest.raises(SparseTableError, match="no gradient"):
        s.push(0, None, 0, 1, rows=g)


def test_an_optimizer_without_a_lazy_rule_is_refused_at_hello(shards: list[ParameterShard]) -> None:
    with pytest.raises(LayoutMismatchError, match="cannot be trained"):
        make(shards, optimizer=OptimizerConfig(name="torch", torch_class="RMSprop"))


def table_metric(name: str) -> float:
    """``name``'s value for table ``emb`` of shard 0 in this process's metrics."""
    labels = {"shard": "0", "table": "emb"}
    return REGISTRY.get_sample_value(f"elasticps_ps_table_{name}", labels) or 0.0


def test_rows_not_updated_for_a_while_are_evicted(shards: list[ParameterShard]) -> None:
    s = make(shards, eviction=EvictionPolicy(expire_versions=3))
    assert s.tables is not None
    admitted, evicted = table_metric("admitted_rows_total"), table_metric("evicted_rows_total")
    s.push(0, torch.zeros(2), 0, 1, rows=grads(s.tables, {1: 1.0, 2: 1.0}))
    for _ in range(4):
        s.push(0, torch.zeros(2), 0, 1, rows=grads(s.tables, {2: 1.0}))
    assert s.tables.tables["emb"].ids().tolist() == [2]
    assert s.tables.evicted == 1
    # The metrics say the same: two rows admitted, one evicted, one held.
    assert table_metric("admitted_rows_total") - admitted == 2
    assert table_metric("evicted_rows_total") - evicted == 1
    assert table_metric("rows") == 1
    assert table_metric("bytes") > 0
    expected = torch.from_numpy(initial_rows(SPEC, np.array([1], np.int64)))
    assert torch.equal(rows_of(s, "emb", [1]), expected)  # back to its initial value


# --- checkpoints ---------------------------------------------------------------------------------


def test_state_round_trips_through_the_shard_files_as_row_chunks(
    shards: list[ParameterShard], tmp_path: Path
) -> None:
    s = make(shards, optimizer=OptimizerConfig(name="adam", lr=0.1))
    assert s.tables is not None
    s.push(0, torch.ones(2), 0, 1, key=PushKey(0, 0, 0, 4),
           rows=grads(s.tables, {1: 1.0, 5: 2.0}, {77: 1.0}))  # fmt: skip
    files = ShardFiles(tmp_path, 0, epoch=3)
    saved = files.save(*s.state())
    assert saved is not None
    parts = list((tables_dir_of(saved.path) / "sparse" / "emb").glob("v*.safetensors"))
    assert parts, "the table is saved as part files beside the shard file"
    tensors, meta = files.load_version(saved.version)
    adam = OptimizerConfig(name="adam", lr=0.1)
    restored = ParameterShard.from_state(tensors, meta, optimizer=adam, mode=UpdateMode.ASYNC)
    shards.append(restored)
    assert restored.tables is not None
    for name in ("emb", "tags"):
        a, b = s.tables.tables[name], restored.tables.tables[name]
        assert torch.equal(a.ids(), b.ids())
        assert torch.equal(a.lookup(a.ids()), b.lookup(b.ids()))
        assert a.version == b.version
    # The push key came back with the rows: a re-sent push is a duplicate.
    again = restored.push(0, torch.ones(2), 0, 1, key=PushKey(0, 0, 0, 4),
                          rows=grads(restored.tables, {1: 1.0}))  # fmt: skip
    assert again.status is PushStatus.DUPLICATE
    # A successor (next epoch) adopts the newest file and its tables.
    successor = ShardFiles(tmp_path, 0, epoch=4)
    found = successor.restore()
    assert found is not None
    assert tables_dir_of(successor.path_of(saved.version)).is_dir()


def test_a_state_saved_under_another_partitioning_keeps_only_this_servers_rows(
    shards: list[ParameterShard],
) -> None:
    one = make(shards)
    assert one.tables is not None
    ids = {i: 1.0 for i in range(ROWS)}
    one.push(0, torch.zeros(2), 0, 1, rows=grads(one.tables, ids))
    tensors, meta = one.state()
    kept = 0
    for index in range(3):
        s = make(shards, shard=index, num_shards=3)
        s.load_state(tensors, meta)
        assert s.tables is not None
        held = s.tables.tables["emb"].ids().numpy()
        lo, hi = Partitioner("range", 3, ROWS).range_bounds()[index]
        assert held.min() >= lo and held.max() < hi
        kept += len(held)
    assert kept == ROWS


def test_entries_describe_what_the_trainer_sends() -> None:
    entry = TableEntry(SPEC, "range", 2)
    assert parse_tables({"tables": [entry.describe()]}) == [entry]


def test_the_eviction_flag_is_a_json_object_of_counts() -> None:
    from elasticps.config import check_sparse_eviction
    from elasticps.errors import ConfigError

    assert check_sparse_eviction("") == {}
    assert check_sparse_eviction('{"expire_versions": 5}') == {"expire_versions": 5}
    assert EvictionPolicy(**check_sparse_eviction('{"min_count": 2, "count_window_versions": 9}'))
    for bad in ('{"expire": 5}', '{"expire_versions": -1}', "[1]", "{", '{"min_count": 2}'):
        with pytest.raises(ConfigError, match="sparse-eviction"):
            check_sparse_eviction(bad)
