"""Skipped records in the task queue (``--bad-records skip``): counted as skipped, never
as trained, and each skipped mini-batch counts like a timeout."""

from __future__ import annotations

import json

import pytest

from elasticps.errors import StaleTaskError
from elasticps.master.taskqueue import (
    DataRange,
    Dispatch,
    EventKind,
    QueueConfig,
    Segment,
    TaskQueue,
    TaskState,
)

RANGES = [DataRange("data.parquet", 10 * i, 10 * i + 10) for i in range(2)]


def make_queue(max_task_timeouts: int = 3, num_passes: int = 1) -> TaskQueue:
    config = QueueConfig(
        task_timeout_s=10.0, max_task_timeouts=max_task_timeouts, num_passes=num_passes
    )
    return TaskQueue(RANGES, config)


def dispatch(queue: TaskQueue, trainer_id: str = "t0") -> Dispatch:
    result, _ = queue.get_task(trainer_id, 0.0)
    assert isinstance(result, Dispatch)
    return result


def test_skipped_records_are_in_the_segment_and_the_audit_as_skipped_not_trained() -> None:
    queue = make_queue()
    d0 = dispatch(queue)
    queue.report_progress(d0.task_id, 0, d0.attempt, 4, 0.0, skipped=2)
    queue.report_task(
        d0.task_id, 0, d0.attempt, success=True, now=0.0, skipped=3, skipped_batches=2
    )
    d1 = dispatch(queue)
    events = queue.report_task(d1.task_id, 0, d1.attempt, success=True, now=0.0)

    assert queue.segments_of(d0.task_id) == [Segment(d0.attempt, 0, 10, skipped=3)]
    completed = [e for e in events if e.kind is EventKind.PASS_COMPLETED]
    summary = completed[0].summary
    assert summary is not None
    assert summary.records_skipped == 3
    assert summary.records_trained == 17  # 20 records, 3 of them skipped
    assert summary.exactly_once  # skipped records are covered once, like trained ones
    assert summary.as_dict()["records_skipped"] == 3


def test_each_skipped_mini_batch_uses_up_the_skip_budget_like_a_timeout() -> None:
    queue = make_queue(max_task_timeouts=3)
    d = dispatch(queue)
    assert queue.skip_budget(d.task_id) == 3
    queue.report_task(d.task_id, 0, d.attempt, success=False, now=0.0, error="boom")
    d = dispatch(queue)  # the other task
    d = dispatch(queue)
    assert d.task_id == 0
    assert queue.skip_budget(0) == 2


def test_an_attempt_that_overran_its_skip_budget_fails_the_task() -> None:
    queue = make_queue(max_task_timeouts=2)
    d = dispatch(queue)
    queue.report_progress(d.task_id, 0, d.attempt, 6, 0.0, skipped=6)
    events = queue.report_task(
        d.task_id, 0, d.attempt, success=False, now=0.0, error="too many", skipped=6,
        skipped_batches=3,
    )  # fmt: skip
    assert events[0].kind is EventKind.FAILED
    assert queue.state_of(d.task_id) is TaskState.FAILED
    assert queue.segments_of(d.task_id) == [Segment(d.attempt, 0, 6, skipped=6)]


def test_skips_within_the_budget_leave_the_task_done_with_its_count_raised() -> None:
    queue = make_queue(max_task_timeouts=3)
    d = dispatch(queue)
    queue.report_task(d.task_id, 0, d.attempt, success=True, now=0.0, skipped=4, skipped_batches=2)
    assert queue.state_of(d.task_id) is TaskState.DONE
    assert queue.record(d.task_id)["timeouts"] == 2


@pytest.mark.parametrize(
    ("offset", "skipped"),
    [(4, 5), (4, -1)],  # more skipped than records covered; a negative count
)
def test_progress_with_an_impossible_skipped_count_is_rejected_and_changes_nothing(
    offset: int, skipped: int
) -> None:
    queue = make_queue()
    d = dispatch(queue)
    with pytest.raises(StaleTaskError):
        queue.report_progress(d.task_id, 0, d.attempt, offset, 0.0, skipped=skipped)
    assert queue.offset_of(d.task_id) == 0


def test_a_skipped_count_that_goes_down_is_rejected() -> None:
    queue = make_queue()
    d = dispatch(queue)
    queue.report_progress(d.task_id, 0, d.attempt, 4, 0.0, skipped=3)
    with pytest.raises(StaleTaskError):
        queue.report_task(d.task_id, 0, d.attempt, success=True, now=0.0, skipped=1)
    assert queue.state_of(d.task_id) is TaskState.PENDING


def test_skipped_counts_survive_a_restore_and_old_records_still_parse() -> None:
    queue = make_queue()
    d = dispatch(queue)
    queue.report_progress(d.task_id, 0, d.attempt, 5, 0.0, skipped=2)
    record = json.loads(json.dumps(queue.record(d.task_id)))
    assert record["segments"] == [[d.attempt, 0, 5, 2]]
    records = {i: json.loads(json.dumps(queue.record(i))) for i in range(queue.num_tasks)}
    restored = TaskQueue.restore(RANGES, queue.config, queue.meta(), records, 0.0)
    assert restored.segments_of(d.task_id) == [Segment(d.attempt, 0, 5, skipped=2)]
    # A record without the fourth element (written before skips existed) means 0.
    records[d.task_id]["segments"] = [[d.attempt, 0, 5]]
    restored = TaskQueue.restore(RANGES, queue.config, queue.meta(), records, 0.0)
    assert restored.segments_of(d.task_id) == [Segment(d.attempt, 0, 5)]


def test_a_later_attempt_counts_its_own_skips_from_zero() -> None:
    queue = make_queue()
    d = dispatch(queue, "a")
    queue.report_progress(d.task_id, 0, d.attempt, 4, 0.0, skipped=2)
    queue.trainer_lost("a", 0.0)
    dispatch(queue, "c")  # the fresh task comes first
    d2 = dispatch(queue, "b")
    assert (d2.task_id, d2.offset) == (d.task_id, 4)
    queue.report_task(d2.task_id, 0, d2.attempt, success=True, now=0.0, skipped=1)
    assert queue.segments_of(d.task_id) == [
        Segment(d.attempt, 0, 4, skipped=2),
        Segment(d2.attempt, 4, 10, skipped=1),
    ]
