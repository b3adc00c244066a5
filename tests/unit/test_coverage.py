"""Tests of a shard's record coverage (``elasticps.pserver.coverage``), the ground truth
of exactly-once: which push keys a shard has applied."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from elasticps.pserver.coverage import Coverage, KeyStatus, PushKey


def key(lo: int, hi: int, task: int = 0, pass_id: int = 0) -> PushKey:
    return PushKey(pass_id, task, lo, hi)


def test_a_new_key_is_new_and_held_once_added() -> None:
    cov = Coverage()
    assert cov.status(key(0, 10)) is KeyStatus.NEW
    cov.add(key(0, 10))
    assert cov.status(key(0, 10)) is KeyStatus.HELD
    assert cov.status(key(2, 5)) is KeyStatus.HELD
    assert cov.status(key(10, 20)) is KeyStatus.NEW
    assert cov.status(key(0, 10, task=1)) is KeyStatus.NEW
    assert cov.status(key(0, 10, pass_id=1)) is KeyStatus.NEW


def test_a_key_overlapping_held_records_partly_is_partial() -> None:
    cov = Coverage.of([key(10, 20)])
    assert cov.status(key(5, 15)) is KeyStatus.PARTIAL
    assert cov.status(key(15, 25)) is KeyStatus.PARTIAL
    assert cov.status(key(0, 30)) is KeyStatus.PARTIAL
    with pytest.raises(ValueError, match="overlaps"):
        cov.add(key(15, 25))


def test_adjacent_keys_merge_into_one_interval() -> None:
    cov = Coverage.of([key(0, 10), key(20, 30), key(10, 20)])
    assert cov.intervals(0, 0) == [(0, 30)]
    assert len(cov) == 1
    assert cov.prefix(0, 0) == 30


def test_prefix_stops_at_the_first_gap() -> None:
    cov = Coverage.of([key(0, 10), key(20, 30)])
    assert cov.prefix(0, 0) == 10
    assert Coverage.of([key(5, 10)]).prefix(0, 0) == 0
    assert Coverage().prefix(0, 0) == 0


def test_sealing_drops_the_keys_and_holds_the_whole_pass() -> None:
    cov = Coverage.of([key(0, 10), key(0, 10, pass_id=1)])
    cov.seal(0)
    assert cov.sealed_through == 0
    assert cov.status(key(100, 200, task=7)) is KeyStatus.HELD
    assert list(cov.tasks(0)) == []
    assert cov.intervals(1, 0) == [(0, 10)]
    with pytest.raises(ValueError, match="sealed"):
        cov.add(key(10, 20))
    cov.seal(0)  # idempotent
    assert cov.sealed_through == 0


def test_round_trip_through_a_tensor() -> None:
    cov = Coverage.of([key(0, 10, task=3, pass_id=2), key(20, 30, task=3, pass_id=2)])
    cov.add(key(0, 5, task=1, pass_id=3))
    cov.seal(1)
    rows = cov.to_tensor()
    assert rows.dtype == torch.int64 and rows.shape == (3, 4)
    again = Coverage.from_tensor(rows, cov.sealed_through)
    assert torch.equal(again.to_tensor(), rows)
    assert again.sealed_through == 1


def test_from_tensor_rejects_malformed_rows() -> None:
    with pytest.raises(ValueError, match="int64"):
        Coverage.from_tensor(torch.zeros((1, 3), dtype=torch.int64), -1)
    with pytest.raises(ValueError, match="lo < hi"):
        Coverage.from_tensor(torch.tensor([[0, 0, 5, 5]]), -1)
    with pytest.raises(ValueError, match="overlaps"):
        Coverage.from_tensor(torch.tensor([[0, 0, 0, 5], [0, 0, 3, 8]]), -1)
    with pytest.raises(ValueError, match="sealed"):
        Coverage.from_tensor(torch.tensor([[0, 0, 0, 5]]), 0)


@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.integers(1, 8)), max_size=60))
def test_status_and_add_agree_with_a_set_of_records(
    pushes: list[tuple[int, int, int]],
) -> None:
    """Against a reference model: the set of (task, record) pairs held."""
    cov = Coverage()
    held: set[tuple[int, int]] = set()
    for task, lo, size in pushes:
        k = key(lo, lo + size, task=task)
        records = {(task, r) for r in range(k.lo, k.hi)}
        overlap = records & held
        expected = (
            KeyStatus.NEW
            if not overlap
            else KeyStatus.HELD
            if overlap == records
            else KeyStatus.PARTIAL
        )
        assert cov.status(k) is expected
        if expected is KeyStatus.NEW:
            cov.add(k)
            held |= records
    for task in range(3):
        got = {(task, r) for lo, hi in cov.intervals(0, task) for r in range(lo, hi)}
        assert got == {h for h in held if h[0] == task}
        ivs = cov.intervals(0, task)
        # Disjoint, sorted and merged: no two intervals touch.
        assert all(a[1] < b[0] for a, b in itertools.pairwise(ivs))
    assert cov.records(0) == len(held)
