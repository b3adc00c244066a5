"""SparseTable: lookup/apply against a dict-of-rows model, lazy rules vs dense rules, eviction,
partitioning, repartitioning and chunked checkpoints."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticps.errors import ConfigError, DataError, SparseTableError
from elasticps.pserver.rules import AdagradRule, AdamRule, SGDRule
from elasticps.pserver.sparse import (
    EvictionPolicy,
    Partitioner,
    RowChunk,
    SparseAdagrad,
    SparseAdam,
    SparseSGD,
    SparseTable,
    TableSpec,
    apply_tables,
    combine_gradients,
    concat_chunks,
    initial_rows,
    repartition,
    rule_from_json,
    rule_to_json,
    select_shard,
    sparse_rule_from_config,
)
from elasticps.pserver.sparse_checkpoint import iter_chunks, load_table, save_table, table_dir

DIM = 4


def _dense_start(spec: TableSpec, n: int) -> torch.Tensor:
    return torch.from_numpy(initial_rows(spec, np.arange(n)).reshape(-1).copy())


# --- initial values ----------------------------------------------------------------------


def test_initial_rows_depend_only_on_seed_name_and_id() -> None:
    spec = TableSpec("user", 8, num_embeddings=1000, seed=3)
    a = initial_rows(spec, np.array([5, 7, 5]))
    assert np.array_equal(a[0], a[2])
    assert not np.array_equal(a[0], a[1])
    assert np.array_equal(initial_rows(spec, np.array([7]))[0], a[1])
    other_name = initial_rows(TableSpec("item", 8, seed=3), np.array([5]))
    other_seed = initial_rows(TableSpec("user", 8, seed=4), np.array([5]))
    assert not np.array_equal(other_name[0], a[0])
    assert not np.array_equal(other_seed[0], a[0])


def test_normal_initialiser_has_mean_zero_and_the_given_std() -> None:
    values = initial_rows(TableSpec("t", 16, init_scale=0.5), np.arange(20_000))
    assert values.dtype == np.float32
    assert abs(float(values.mean())) < 0.01
    assert abs(float(values.std()) - 0.5) < 0.01


def test_uniform_and_zero_initialisers() -> None:
    u = initial_rows(TableSpec("t", 8, init="uniform", init_scale=0.1), np.arange(5000))
    assert float(u.min()) >= -0.1 and float(u.max()) <= 0.1
    assert abs(float(u.std()) - 0.1 / np.sqrt(3)) < 0.003
    assert not initial_rows(TableSpec("t", 8, init="zeros"), np.arange(10)).any()


def test_lookup_of_absent_rows_returns_initial_values_without_allocating() -> None:
    table = SparseTable(TableSpec("t", DIM))
    rows = table.lookup(torch.tensor([3, -(2**62), 3]))
    assert rows.shape == (3, DIM) and rows.dtype == torch.float32
    assert torch.equal(rows[0], rows[2])
    assert len(table) == 0


# --- specs and validation -------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"name": "", "dim": 4},
        {"name": "a/b", "dim": 4},
        {"name": "t", "dim": 0},
        {"name": "t", "dim": 4, "num_embeddings": 0},
        {"name": "t", "dim": 4, "init": "xavier"},
        {"name": "t", "dim": 4, "init_scale": -1.0},
    ],
)
def test_invalid_specs_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        TableSpec(**kwargs)  # type: ignore[arg-type]


def test_spec_round_trips_through_json() -> None:
    spec = TableSpec("t", 4, num_embeddings=9, init="uniform", init_scale=0.2, seed=5)
    assert TableSpec.from_json(spec.describe()) == spec
    with pytest.raises(ConfigError):
        TableSpec.from_json({"name": "t", "dim": 4, "evil": 1})


def test_fixed_table_refuses_ids_out_of_range() -> None:
    table = SparseTable(TableSpec("t", DIM, num_embeddings=10))
    with pytest.raises(SparseTableError, match="out of range"):
        table.lookup(torch.tensor([0, 10]))
    with pytest.raises(SparseTableError, match="out of range"):
        table.apply(torch.tensor([-1]), torch.zeros(1, DIM), 0.1)


def test_apply_refuses_duplicate_ids_and_wrong_shapes() -> None:
    table = SparseTable(TableSpec("t", DIM))
    with pytest.raises(SparseTableError, match="unique"):
        table.apply(torch.tensor([1, 1]), torch.zeros(2, DIM), 0.1)
    with pytest.raises(SparseTableError, match="grads must be"):
        table.apply(torch.tensor([1, 2]), torch.zeros(2, DIM + 1), 0.1)
    with pytest.raises(SparseTableError, match="float32"):
        table.apply(torch.tensor([1]), torch.zeros(1, DIM, dtype=torch.float64), 0.1)
    with pytest.raises(SparseTableError, match="int64"):
        table.lookup(torch.tensor([1.0]))
    assert table.version == 0 and len(table) == 0


def test_empty_apply_bumps_the_version_only() -> None:
    table = SparseTable(TableSpec("t", DIM))
    table.apply(torch.zeros(0, dtype=torch.int64), torch.zeros(0, DIM), 0.1)
    assert table.version == 1 and len(table) == 0


# --- the reference model ---------------------------------------------------------------------

id_lists = st.lists(
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12, unique=True), min_size=1, max_size=8
)


@settings(max_examples=60, deadline=None)
@given(batches=id_lists, chunk_rows=st.sampled_from([1, 3, 64]), seed=st.integers(0, 2**16))
def test_apply_and_lookup_match_a_dict_of_rows(
    batches: list[list[int]], chunk_rows: int, seed: int
) -> None:
    spec = TableSpec("t", DIM, seed=seed)
    table = SparseTable(spec, SparseSGD(), chunk_rows=chunk_rows)
    model: dict[int, np.ndarray] = {}
    gen = torch.Generator().manual_seed(seed)
    for ids in batches:
        grads = torch.randn(len(ids), DIM, generator=gen)
        table.apply(torch.tensor(ids, dtype=torch.int64), grads, 0.5)
        for i, key in enumerate(ids):
            row = model.get(key)
            if row is None:
                row = initial_rows(spec, np.array([key]))[0]
            model[key] = (torch.from_numpy(row) - 0.5 * grads[i]).numpy()
    assert len(table) == len(model)
    assert sorted(table.ids().tolist()) == sorted(model)
    probe = [*model, 12345678901]
    rows = table.lookup(torch.tensor(probe, dtype=torch.int64)).numpy()
    for i, key in enumerate(probe):
        expected = model.get(key, initial_rows(spec, np.array([key]))[0])
        np.testing.assert_array_equal(rows[i], expected)
    counts = table.counters(torch.tensor(list(model), dtype=torch.int64))["count"]
    assert counts.tolist() == [sum(key in b for b in batches) for key in model]


def test_storage_grows_by_chunks_and_the_index_by_doubling() -> None:
    table = SparseTable(TableSpec("t", DIM), chunk_rows=100)
    for start in range(0, 5000, 1000):
        ids = torch.arange(start, start + 1000) * 7919
        table.apply(ids, torch.ones(1000, DIM), 0.1)
    assert len(table) == 5000
    assert torch.equal(
        table.contains(torch.tensor([0, 7919 * 4999, 1])), torch.tensor([1, 1, 0]).bool()
    )


# --- lazy rules vs dense rules ---------------------------------------------------------------


def _random_pushes(n: int, steps: int, seed: int) -> list[tuple[np.ndarray, torch.Tensor]]:
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = np.unique(rng.integers(0, n, rng.integers(1, n)))
        out.append((ids, torch.randn(len(ids), DIM, generator=gen)))
    return out


@pytest.mark.parametrize(
    ("sparse_rule", "dense"),
    [
        (SparseSGD(), SGDRule),
        (SparseSGD(maximize=True), lambda p: SGDRule(p, maximize=True)),
        (SparseAdagrad(), AdagradRule),
        (
            SparseAdagrad(initial_accumulator_value=0.1, eps=1e-6),
            lambda p: AdagradRule(p, initial_accumulator_value=0.1, eps=1e-6),
        ),
    ],
    ids=["sgd", "sgd-maximize", "adagrad", "adagrad-options"],
)
def test_sgd_and_adagrad_are_bit_identical_to_the_dense_rules(sparse_rule, dense) -> None:  # type: ignore[no-untyped-def]
    n = 37  # not a multiple of the vector width: the kernels' tails are covered
    spec = TableSpec("t", DIM, num_embeddings=n)
    table = SparseTable(spec, sparse_rule, chunk_rows=8)
    flat = _dense_start(spec, n)
    rule = dense(flat)
    for ids, grads in _random_pushes(n, 40, seed=1):
        table.apply(ids, grads, 0.05)
        full = torch.zeros(n, DIM)
        full[torch.from_numpy(ids)] = grads
        rule.step(full.reshape(-1), 0.05)
    assert torch.equal(table.lookup(np.arange(n)), flat.view(n, DIM))


def test_adagrad_lr_decay_follows_each_rows_own_step() -> None:
    spec = TableSpec("t", DIM, num_embeddings=4)
    table = SparseTable(spec, SparseAdagrad(lr_decay=0.5))
    flat = _dense_start(spec, 1)  # row 0 alone, dense, as if it were the only row
    rule = AdagradRule(flat, lr_decay=0.5)
    for step in range(5):
        g = torch.full((1, DIM), 0.3 + step)
        table.apply(
            np.array([0, 1]) if step % 2 else np.array([0]), torch.cat([g, g])[: 1 + step % 2], 0.1
        )
        rule.step(g.reshape(-1), 0.1)
    assert torch.equal(table.lookup(np.array([0]))[0], flat)


@pytest.mark.parametrize("step_count", ["row", "table"])
def test_lazy_adam_equals_dense_adam_when_every_row_is_pushed_every_step(step_count: str) -> None:
    n = 10
    spec = TableSpec("t", DIM, num_embeddings=n)
    table = SparseTable(spec, SparseAdam(step_count=step_count))  # type: ignore[arg-type]
    flat = _dense_start(spec, n)
    rule = AdamRule(flat)
    gen = torch.Generator().manual_seed(0)
    for _ in range(30):
        grads = torch.randn(n, DIM, generator=gen)
        table.apply(np.arange(n), grads, 0.01)
        rule.step(grads.reshape(-1), 0.01)
    torch.testing.assert_close(table.lookup(np.arange(n)), flat.view(n, DIM), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("options", "torch_cls"),
    [
        ({"weight_decay": 0.1}, torch.optim.Adam),
        ({"weight_decay": 0.1, "decoupled_weight_decay": True}, torch.optim.AdamW),
        ({"maximize": True, "betas": (0.8, 0.95), "eps": 1e-4}, torch.optim.Adam),
    ],
)
def test_lazy_adam_options_match_torch_adam_when_every_row_is_pushed(
    options: dict[str, object], torch_cls: type[torch.optim.Optimizer]
) -> None:
    n = 6
    spec = TableSpec("t", DIM, num_embeddings=n)
    table = SparseTable(spec, SparseAdam(**options))  # type: ignore[arg-type]
    dense = torch.nn.Parameter(_dense_start(spec, n).view(n, DIM).clone())
    kwargs = {k: v for k, v in options.items() if k != "decoupled_weight_decay"}
    opt = torch_cls([dense], lr=0.01, **kwargs)  # type: ignore[call-arg]
    gen = torch.Generator().manual_seed(3)
    for _ in range(20):
        grads = torch.randn(n, DIM, generator=gen)
        table.apply(np.arange(n), grads, 0.01)
        dense.grad = grads.clone()
        opt.step()
    torch.testing.assert_close(table.lookup(np.arange(n)), dense.detach(), rtol=0, atol=1e-6)


_RULES_TOGETHER = [
    SparseSGD(),
    SparseSGD(momentum=0.5, weight_decay=0.01),
    SparseAdagrad(eps=1e-3),
    SparseAdam(),
    SparseAdam(step_count="table", weight_decay=0.01),
]


@pytest.mark.parametrize("rule", _RULES_TOGETHER, ids=lambda r: repr(r)[:40])
def test_apply_tables_equals_applying_each_table_alone(rule: object) -> None:
    # Two tables share a row width (stepped together), one has another, one is hashed.
    specs = [
        TableSpec("a", DIM, num_embeddings=50, seed=1),
        TableSpec("b", DIM, num_embeddings=30, seed=2),
        TableSpec("c", 2, num_embeddings=40, seed=3),
        TableSpec("d", DIM, seed=4),
    ]

    def tables() -> list[SparseTable]:
        return [SparseTable(s, rule, chunk_rows=8) for s in specs]  # type: ignore[arg-type]

    together, alone = tables(), tables()
    rng = np.random.default_rng(5)
    for step in range(12):
        pushes = []
        for spec in specs:
            space = spec.num_embeddings or 1000
            k = 0 if (step + len(spec.name)) % 5 == 0 else int(rng.integers(1, 12))
            ids = rng.choice(space, size=k, replace=False).astype(np.int64)
            pushes.append((ids, torch.from_numpy(rng.standard_normal((k, spec.dim), np.float32))))
        apply_tables([(t, ids, g) for t, (ids, g) in zip(together, pushes, strict=True)], 0.05)
        for t, (ids, g) in zip(alone, pushes, strict=True):
            t.apply(ids, g, 0.05)
    for t, u in zip(together, alone, strict=True):
        assert t.version == u.version == 12
        ids = np.arange(t.spec.num_embeddings or 1000)
        torch.testing.assert_close(t.lookup(ids), u.lookup(ids), rtol=1e-6, atol=1e-7)


def test_apply_tables_refuses_a_bad_push_before_any_table_changes() -> None:
    good = SparseTable(TableSpec("good", DIM, num_embeddings=10), SparseAdam())
    bad = SparseTable(TableSpec("bad", DIM, num_embeddings=10), SparseAdam())
    before = good.lookup(np.arange(10))
    with pytest.raises(SparseTableError, match="bad"):
        apply_tables(
            [
                (good, np.array([1, 2]), torch.ones(2, DIM)),
                (bad, np.array([1, 1]), torch.ones(2, DIM)),
            ],
            0.1,
        )
    assert good.version == bad.version == 0
    assert torch.equal(good.lookup(np.arange(10)), before)


def test_lazy_adam_row_step_gives_a_rare_row_a_first_step_bias_correction() -> None:
    spec = TableSpec("t", 1, init="zeros")
    table = SparseTable(spec, SparseAdam(step_count="row"))
    for _ in range(10):
        table.apply(np.array([0]), torch.ones(1, 1), 0.1)
    table.apply(np.array([1]), torch.ones(1, 1), 0.1)
    # A row's first update moves it by lr (m_hat / sqrt(v_hat) = 1), whatever the table step.
    torch.testing.assert_close(table.lookup(np.array([1])), torch.tensor([[-0.1]]))
    table_step = SparseTable(spec, SparseAdam(step_count="table"))
    for _ in range(10):
        table_step.apply(np.array([0]), torch.ones(1, 1), 0.1)
    table_step.apply(np.array([1]), torch.ones(1, 1), 0.1)
    assert float(table_step.lookup(np.array([1]))[0, 0]) > -0.1  # under-corrected


def test_lazy_momentum_keeps_a_rows_buffer_between_its_updates() -> None:
    table = SparseTable(TableSpec("t", 1, init="zeros"), SparseSGD(momentum=0.9))
    table.apply(np.array([0]), torch.ones(1, 1), 1.0)  # buf = 1, p = -1
    table.apply(np.array([1]), torch.ones(1, 1), 1.0)  # row 0 untouched: stays at -1
    assert float(table.lookup(np.array([0]))[0, 0]) == -1.0
    table.apply(np.array([0]), torch.ones(1, 1), 1.0)  # buf = 1.9, p = -2.9
    torch.testing.assert_close(table.lookup(np.array([0])), torch.tensor([[-2.9]]))


def test_rules_round_trip_through_json_and_map_from_the_ps_optimizer() -> None:
    for rule in (SparseSGD(momentum=0.5), SparseAdagrad(eps=1e-3), SparseAdam(betas=(0.8, 0.9))):
        assert rule_from_json(rule_to_json(rule)) == rule
    assert sparse_rule_from_config("adam", {"betas": [0.5, 0.6]}) == SparseAdam(betas=(0.5, 0.6))
    assert sparse_rule_from_config("momentum", {}, momentum=0.9) == SparseSGD(momentum=0.9)
    with pytest.raises(ConfigError):
        sparse_rule_from_config("adam", {"amsgrad": True})
    with pytest.raises(ConfigError):
        sparse_rule_from_config("torch", {})
    with pytest.raises(ConfigError):
        rule_from_json({"name": "rmsprop"})


def test_the_rule_can_change_only_while_the_table_is_empty() -> None:
    table = SparseTable(TableSpec("t", DIM))
    table.set_rule(SparseAdam())
    table.apply(np.array([1]), torch.ones(1, DIM), 0.1)
    with pytest.raises(SparseTableError, match="cannot change"):
        table.set_rule(SparseSGD())


# --- eviction -------------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    batches=st.lists(
        st.lists(st.integers(0, 40), max_size=10, unique=True), min_size=1, max_size=12
    ),
    expire=st.integers(0, 6),
    min_count=st.integers(0, 3),
    window=st.integers(1, 5),
    chunk_rows=st.sampled_from([1, 4, 64]),
)
def test_eviction_removes_exactly_the_rows_the_policy_names(
    batches: list[list[int]], expire: int, min_count: int, window: int, chunk_rows: int
) -> None:
    spec = TableSpec("t", DIM)
    table = SparseTable(spec, SparseAdagrad(), chunk_rows=chunk_rows)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    count: dict[int, int] = {}
    for version, ids in enumerate(batches, start=1):
        table.apply(np.array(ids, dtype=np.int64), torch.ones(len(ids), DIM) * version, 0.1)
        for key in ids:
            first.setdefault(key, version)
            last[key] = version
            count[key] = count.get(key, 0) + 1
    before = {key: table.lookup(np.array([key]))[0].clone() for key in count}
    now = len(batches)
    policy = EvictionPolicy(expire, min_count, window if min_count else 0)
    expected = {
        key
        for key in count
        if (expire and now - last[key] >= expire)
        or (min_count and now - first[key] >= window and count[key] < min_count)
    }
    evicted = table.evict(policy)
    assert set(evicted.tolist()) == expected
    assert set(table.ids().tolist()) == set(count) - expected
    for key in set(count) - expected:
        assert torch.equal(table.lookup(np.array([key]))[0], before[key])
        assert int(table.counters(np.array([key]))["count"][0]) == count[key]
    for key in expected:  # back to its initial value
        assert torch.equal(
            table.lookup(np.array([key]))[0],
            torch.from_numpy(initial_rows(spec, np.array([key]))[0]),
        )
    # The table keeps working after compaction.
    table.apply(
        np.array([1000, *sorted(expected)[:2]]), torch.ones(1 + len(sorted(expected)[:2]), DIM), 0.1
    )
    assert table.contains(np.array([1000])).all()


def test_eviction_policy_is_validated() -> None:
    with pytest.raises(ConfigError):
        EvictionPolicy(min_count=2)
    with pytest.raises(ConfigError):
        EvictionPolicy(expire_versions=-1)


# --- partitioning ------------------------------------------------------------------------------


def test_hash_partition_balances_consecutive_ids() -> None:
    shards = Partitioner("hash", 4).shard_of(np.arange(100_000))
    counts = np.bincount(shards, minlength=4)
    assert counts.min() > 24_000


def test_range_partition_matches_even_split() -> None:
    part = Partitioner("range", 3, num_embeddings=10)
    assert part.shard_of(np.arange(10)).tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert part.range_bounds() == [(0, 4), (4, 7), (7, 10)]
    with pytest.raises(ConfigError):
        Partitioner("range", 2)


@settings(max_examples=40, deadline=None)
@given(
    ids=st.lists(st.integers(0, 999), max_size=60, unique=True),
    shards=st.integers(1, 5),
    kind=st.sampled_from(["hash", "range"]),
)
def test_split_positions_cover_every_id_once(ids: list[int], shards: int, kind: str) -> None:
    part = Partitioner(kind, shards, num_embeddings=1000)  # type: ignore[arg-type]
    arr = np.array(ids, dtype=np.int64)
    positions = part.split(arr)
    assert sorted(np.concatenate(positions).tolist()) == list(range(len(ids)))
    for s, pos in enumerate(positions):
        assert (part.shard_of(arr[pos]) == s).all()


def _table_chunks(table: SparseTable) -> list[RowChunk]:
    return [c.take(np.arange(len(c))) for c in table.state_chunks()]


def _as_dict(chunks: list[RowChunk]) -> dict[int, tuple[list[float], list[float], int]]:
    out = {}
    for c in chunks:
        for i, key in enumerate(c.ids.tolist()):
            assert key not in out
            out[key] = (c.rows[i].tolist(), c.state["sum"][i].tolist(), int(c.counters["count"][i]))
    return out


@settings(max_examples=30, deadline=None)
@given(
    ids=st.lists(st.integers(0, 10_000), min_size=1, max_size=80, unique=True),
    old=st.integers(1, 4),
    new=st.integers(1, 5),
    kind=st.sampled_from(["hash", "range"]),
    chunk_rows=st.integers(1, 7),
)
def test_repartition_n_to_m_and_back_keeps_every_row(
    ids: list[int], old: int, new: int, kind: str, chunk_rows: int
) -> None:
    spec = TableSpec("t", DIM, num_embeddings=10_001)
    full = SparseTable(spec, SparseAdagrad(), chunk_rows=5)
    full.apply(np.array(ids), torch.randn(len(ids), DIM), 0.1)
    reference = _as_dict(_table_chunks(full))
    old_part = Partitioner(kind, old, num_embeddings=10_001)  # type: ignore[arg-type]
    old_shards = repartition(_table_chunks(full), old_part, chunk_rows)
    for s, chunks in enumerate(old_shards):
        assert all(len(c) <= chunk_rows for c in chunks)
        assert all((old_part.shard_of(c.ids) == s).all() for c in chunks)
    new_part = Partitioner(kind, new, num_embeddings=10_001)  # type: ignore[arg-type]
    everything = [c for chunks in old_shards for c in chunks]
    new_shards = repartition(everything, new_part, chunk_rows)
    merged: dict[int, tuple[list[float], list[float], int]] = {}
    for s, chunks in enumerate(new_shards):
        selected = list(select_shard(everything, new_part, s))
        assert _as_dict(selected) == _as_dict(chunks)
        merged.update(_as_dict(chunks))
    assert merged == reference
    back = repartition([c for chunks in new_shards for c in chunks], Partitioner("hash", 1), 1000)
    assert _as_dict(back[0]) == reference


def test_concat_refuses_chunks_with_different_state() -> None:
    a = RowChunk(
        np.array([1]), np.zeros((1, DIM), np.float32), {"sum": np.zeros((1, DIM), np.float32)}
    )
    b = RowChunk(np.array([2]), np.zeros((1, DIM), np.float32), {})
    with pytest.raises(SparseTableError):
        concat_chunks([a, b])


# --- checkpoints ---------------------------------------------------------------------------------


def _trained_table(rule: object = None, chunk_rows: int = 16) -> SparseTable:
    table = SparseTable(TableSpec("emb", DIM, seed=9), rule or SparseAdam(), chunk_rows=chunk_rows)  # type: ignore[arg-type]
    rng = np.random.default_rng(0)
    for _ in range(6):
        ids = np.unique(rng.integers(-(10**12), 10**12, 40))
        table.apply(ids, torch.randn(len(ids), DIM), 0.1)
    return table


def test_state_round_trips_through_chunks_bit_for_bit() -> None:
    table = _trained_table()
    copy = SparseTable.from_state(table.meta(), _table_chunks(table), chunk_rows=7)
    ids = table.ids()
    assert copy.version == table.version and len(copy) == len(table)
    assert torch.equal(copy.lookup(ids), table.lookup(ids))
    # Both continue identically (optimizer state and per-row steps were restored).
    grads = torch.randn(len(ids), DIM)
    table.apply(ids, grads, 0.1)
    copy.apply(ids, grads, 0.1)
    assert torch.equal(copy.lookup(ids), table.lookup(ids))


def test_saved_table_loads_bit_for_bit_and_old_parts_are_removed(tmp_path: Path) -> None:
    table = _trained_table(chunk_rows=8)
    saved = save_table(tmp_path, table, max_file_bytes=2000)
    parts = sorted(table_dir(tmp_path, "emb").glob("*.safetensors"))
    assert len(parts) > 1 and saved.rows == len(table)
    loaded = load_table(tmp_path, "emb")
    ids = table.ids()
    assert torch.equal(loaded.lookup(ids), table.lookup(ids)) and loaded.version == table.version
    assert torch.equal(loaded.counters(ids)["last_version"], table.counters(ids)["last_version"])
    table.apply(ids[:2], torch.ones(2, DIM), 0.1)
    save_table(tmp_path, table, max_file_bytes=10**9)
    assert len(list(table_dir(tmp_path, "emb").glob("*.safetensors"))) == 1


def test_load_keeps_one_shards_rows(tmp_path: Path) -> None:
    table = _trained_table()
    save_table(tmp_path, table)
    part = Partitioner("hash", 3)
    shards = [load_table(tmp_path, "emb", partitioner=part, shard=s) for s in range(3)]
    assert sum(len(s) for s in shards) == len(table)
    for s, shard in enumerate(shards):
        assert (part.shard_of(shard.ids().numpy()) == s).all()


def test_a_corrupt_part_is_reported(tmp_path: Path) -> None:
    table = _trained_table()
    save_table(tmp_path, table)
    part = next(table_dir(tmp_path, "emb").glob("*.safetensors"))
    data = bytearray(part.read_bytes())
    data[-1] ^= 0xFF
    part.write_bytes(bytes(data))
    meta, chunks = iter_chunks(tmp_path, "emb")
    assert meta["rows"] == len(table)
    with pytest.raises(DataError, match="corrupt"):
        list(chunks)
    with pytest.raises(DataError, match="cannot read"):
        load_table(tmp_path, "missing")


def test_combined_sync_gradients_equal_the_dense_weighted_mean() -> None:
    n = 6
    a_ids, a_grads = torch.tensor([0, 2]), torch.randn(2, DIM)
    b_ids, b_grads = torch.tensor([2, 5]), torch.randn(2, DIM)
    ids, grads = combine_gradients([(a_ids, a_grads, 3.0), (b_ids, b_grads, 1.0)], DIM)
    dense_a, dense_b = torch.zeros(n, DIM), torch.zeros(n, DIM)
    dense_a[a_ids], dense_b[b_ids] = a_grads, b_grads
    dense = (3.0 * dense_a + 1.0 * dense_b) / 4.0
    assert ids.tolist() == [0, 2, 5]
    torch.testing.assert_close(grads, dense[ids])
    assert combine_gradients([], DIM)[0].numel() == 0
    with pytest.raises(SparseTableError):
        combine_gradients([(a_ids, a_grads, 0.0)], DIM)


def test_a_rows_first_update_takes_the_initial_value_its_lookup_computed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    spec = TableSpec("cache", 4, init_scale=0.5, seed=3)
    cached, plain = SparseTable(spec, SparseAdam()), SparseTable(spec, SparseAdam())
    ids = np.array([9, 2, 40, 7], dtype=np.int64)
    looked_up = cached.lookup(ids)
    assert torch.equal(looked_up, torch.from_numpy(initial_rows(spec, ids)))
    computed: list[int] = []
    real = initial_rows

    def counting(s: TableSpec, i: np.ndarray) -> np.ndarray:
        computed.append(len(i))
        return real(s, i)

    monkeypatch.setattr("elasticps.pserver.sparse.initial_rows", counting)
    grads = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    cached.apply(np.array([2, 7, 11], dtype=np.int64), grads, 0.1)  # 11 was not looked up
    assert computed == [1]
    monkeypatch.setattr("elasticps.pserver.sparse.initial_rows", real)
    plain.apply(np.array([2, 7, 11], dtype=np.int64), grads, 0.1)
    every = np.array([2, 7, 9, 11, 40], dtype=np.int64)
    assert torch.equal(cached.lookup(every), plain.lookup(every))  # bit for bit


@settings(max_examples=40, deadline=None)
@given(
    batches=st.lists(
        st.lists(st.integers(0, 2999), max_size=40, unique=True), min_size=1, max_size=10
    ),
    expire=st.integers(0, 4),
    chunk_rows=st.sampled_from([1, 7, 64]),
)
def test_a_fixed_tables_direct_index_behaves_as_the_hash_index(
    batches: list[list[int]], expire: int, chunk_rows: int
) -> None:
    # A fixed table of few ids maps ids to slots with an array indexed by id
    # (grown by doubling up to num_embeddings); a hashed table probes a hash
    # index. Updates, lookups, counters, eviction and reloading agree.
    fixed = SparseTable(
        TableSpec("t", DIM, num_embeddings=3000), SparseAdam(), chunk_rows=chunk_rows
    )
    hashed = SparseTable(TableSpec("t", DIM), SparseAdam(), chunk_rows=chunk_rows)
    probe = np.array([0, 1, 1023, 1024, 2047, 2999, *range(0, 3000, 37)], dtype=np.int64)
    for version, ids in enumerate(batches, start=1):
        grads = torch.full((len(ids), DIM), float(version))
        for table in (fixed, hashed):
            table.apply(np.array(ids, dtype=np.int64), grads, 0.1)
        assert torch.equal(fixed.contains(probe), hashed.contains(probe))
        assert torch.equal(fixed.lookup(probe), hashed.lookup(probe))
    if expire:
        policy = EvictionPolicy(expire, 0, 0)
        assert torch.equal(fixed.evict(policy), hashed.evict(policy))
    assert torch.equal(fixed.ids(), hashed.ids())
    assert torch.equal(fixed.lookup(probe), hashed.lookup(probe))
    assert fixed.counters(probe).keys() == hashed.counters(probe).keys()
    for key, values in fixed.counters(probe).items():
        assert torch.equal(values, hashed.counters(probe)[key])
    reloaded = SparseTable.from_state(fixed.meta(), fixed.state_chunks(), chunk_rows=chunk_rows)
    assert torch.equal(reloaded.lookup(probe), fixed.lookup(probe))
    assert torch.equal(reloaded.contains(probe), fixed.contains(probe))
    with pytest.raises(SparseTableError, match="out of range"):
        fixed.lookup(np.array([3000]))


@pytest.mark.parametrize("chunk_rows", [4, 1024])
def test_lookup_into_writes_what_lookup_returns(chunk_rows: int) -> None:
    table = SparseTable(
        TableSpec("t", DIM, num_embeddings=100, seed=6), SparseAdam(), chunk_rows=chunk_rows
    )
    table.apply(np.array([3, 50, 7, 99]), torch.ones(4, DIM), 0.1)
    for ids in (np.array([50, 3, 50, 99]), np.array([7, 8, 0]), np.zeros(0, np.int64)):
        out = np.full((len(ids), DIM), np.nan, np.float32)
        table.lookup_into(ids, out)
        assert np.array_equal(out, table.lookup(ids).numpy())
