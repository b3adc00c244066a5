"""The repair table: records of sealed passes re-opened for the shards that lack them."""

from __future__ import annotations

import pytest

from elasticps.errors import StaleTaskError
from elasticps.master.repairs import Repairs

pytestmark = pytest.mark.timeout(30)

RECORDS = {0: 100, 1: 100, 2: 50}


def test_a_repair_is_dispatched_with_its_sealed_pass_and_done_once() -> None:
    repairs = Repairs(task_timeout_s=10.0, max_task_timeouts=2)
    events = repairs.open(3, {1: 40, 2: 0}, RECORDS)
    assert [(e.kind, e.task_id, e.pass_id, e.offset) for e in events] == [
        ("reopened", 1, 3, 40),
        ("reopened", 2, 3, 0),
    ]
    assert repairs.active
    attempt, _ = repairs.get("t0", now=0.0)
    assert attempt is not None and (attempt.task_id, attempt.pass_id, attempt.offset) == (1, 3, 40)
    assert repairs.trainers() == {"t0"}
    repairs.progress(1, 3, attempt.attempt, 80, now=1.0)
    repairs.report(1, 3, attempt.attempt, success=True)
    with pytest.raises(StaleTaskError):
        repairs.report(1, 3, attempt.attempt, success=True)
    second, _ = repairs.get("t1", now=2.0)
    assert second is not None and second.task_id == 2
    repairs.report(2, 3, second.attempt, success=True)
    assert not repairs.active
    assert repairs.records_repaired() == 60 + 50
    assert repairs.passes() == [3]


def test_a_repair_past_its_timeouts_fails_and_is_not_reopened() -> None:
    repairs = Repairs(task_timeout_s=1.0, max_task_timeouts=1)
    repairs.open(0, {0: 10}, RECORDS)
    for now in (0.0, 5.0):
        attempt, _ = repairs.get("t0", now=now)
        assert attempt is not None
        repairs.expire(now + 2.0)
    assert repairs.failed(0) == {0}
    assert not repairs.active
    assert repairs.open(0, {0: 10}, RECORDS) == []
    assert repairs.records_repaired() == 0


def test_repairs_open_only_when_none_is_open_and_a_done_one_reopens() -> None:
    repairs = Repairs(task_timeout_s=1.0, max_task_timeouts=1)
    repairs.open(0, {0: 10}, RECORDS)
    with pytest.raises(ValueError, match="still open"):
        repairs.open(1, {0: 10}, RECORDS)
    attempt, _ = repairs.get("t0", now=0.0)
    assert attempt is not None
    repairs.report(0, 0, attempt.attempt, success=True)
    (event,) = repairs.open(0, {0: 5}, RECORDS)
    assert (event.kind, event.offset) == ("reopened", 5)
    again, _ = repairs.get("t1", now=1.0)
    assert again is not None and (again.offset, again.attempt) == (5, attempt.attempt + 1)
    with pytest.raises(ValueError, match="not in"):
        Repairs(1.0, 1).open(0, {2: 50}, RECORDS)


def test_a_lost_trainer_requeues_without_a_timeout() -> None:
    repairs = Repairs(task_timeout_s=1.0, max_task_timeouts=1)
    repairs.open(0, {0: 10, 1: 0}, RECORDS)
    repairs.get("t0", now=0.0)
    repairs.get("t0", now=0.0)
    events = repairs.requeue_held("t0", "trainer lost", keep={1})
    assert [(e.kind, e.task_id) for e in events] == [("requeued", 0)]
    assert [a.task_id for a in repairs.pending_of("t0")] == [1]
    assert repairs.skip_budget(0, 0) == 1
