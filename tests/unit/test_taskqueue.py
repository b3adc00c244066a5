"""Tests of the master's pure task queue (``elasticps.master.taskqueue``)."""

from __future__ import annotations

import copy
import itertools
import json
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
)

from elasticps.errors import ConfigError, StaleTaskError, UnknownTaskError
from elasticps.master.taskqueue import (
    DISPATCH_NOT_RECEIVED,
    MAX_HELD,
    MAX_RETRY_AFTER_S,
    TRAINER_LOST,
    DataRange,
    Dispatch,
    EventKind,
    Finished,
    PassSummary,
    QueueConfig,
    QueueStats,
    Segment,
    TaskEvent,
    TaskQueue,
    TaskState,
    Wait,
    split_into_tasks,
)

TIMEOUT_S = 10.0


def make_queue(
    num_tasks: int = 3,
    *,
    max_task_timeouts: int = 2,
    num_passes: int = 1,
) -> TaskQueue:
    ranges = [DataRange("data.parquet", 10 * i, 10 * i + 10) for i in range(num_tasks)]
    config = QueueConfig(
        task_timeout_s=TIMEOUT_S, max_task_timeouts=max_task_timeouts, num_passes=num_passes
    )
    return TaskQueue(ranges, config)


def dispatch(queue: TaskQueue, trainer_id: str = "t0", now: float = 0.0) -> Dispatch:
    """Dispatch to ``trainer_id``; a trainer holds one task (asking again requeues it)."""
    result, _ = queue.get_task(trainer_id, now)
    assert isinstance(result, Dispatch)
    return result


def succeed(queue: TaskQueue, d: Dispatch, now: float = 0.0) -> list[TaskEvent]:
    return queue.report_task(d.task_id, d.pass_id, d.attempt, success=True, now=now)


def kinds(events: list[TaskEvent]) -> list[EventKind]:
    return [e.kind for e in events]


# --- DataRange and split_into_tasks --------------------------------------------


def test_data_range_rejects_empty_or_negative_ranges() -> None:
    with pytest.raises(ValueError, match="start < end"):
        DataRange("f", 5, 5)
    with pytest.raises(ValueError, match="start < end"):
        DataRange("f", -1, 3)
    assert DataRange("f", 2, 7).num_rows == 5


def test_split_cuts_files_into_contiguous_ranges_in_file_order() -> None:
    ranges = split_into_tasks([("a", 25), ("b", 10)], records_per_task=10)
    assert ranges == [
        DataRange("a", 0, 10),
        DataRange("a", 10, 20),
        DataRange("a", 20, 25),
        DataRange("b", 0, 10),
    ]


def test_split_skips_empty_files() -> None:
    assert split_into_tasks([("a", 0), ("b", 3), ("c", 0)], records_per_task=5) == [
        DataRange("b", 0, 3)
    ]
    assert split_into_tasks([], records_per_task=5) == []


def test_split_rejects_non_positive_records_per_task() -> None:
    with pytest.raises(ConfigError, match="records_per_task"):
        split_into_tasks([("a", 10)], records_per_task=0)


def test_split_rejects_negative_row_counts() -> None:
    with pytest.raises(ConfigError, match="negative"):
        split_into_tasks([("a", -1)], records_per_task=1)


# --- configuration ------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"task_timeout_s": 0.0},
        {"task_timeout_s": -1.0},
        {"task_timeout_s": float("nan")},
        {"max_task_timeouts": 0},
        {"num_passes": 0},
    ],
)
def test_queue_config_rejects_out_of_range_values(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        QueueConfig(**kwargs)


def test_queue_needs_at_least_one_range() -> None:
    with pytest.raises(ConfigError, match="at least one"):
        TaskQueue([], QueueConfig())


# --- dispatch and reports -------------------------------------------------------


def test_tasks_are_dispatched_in_range_order_with_a_deadline() -> None:
    queue = make_queue(3)
    first, events = queue.get_task("t0", now=100.0)
    assert first == Dispatch(
        task_id=0, pass_id=0, attempt=1, data=DataRange("data.parquet", 0, 10), deadline=110.0
    )
    assert events == [
        TaskEvent(EventKind.DISPATCHED, 0, pass_id=0, attempt=1, timeout_count=0, trainer_id="t0")
    ]
    assert [dispatch(queue, "t1").task_id, dispatch(queue, "t2").task_id] == [1, 2]
    assert queue.state_of(0) is TaskState.PENDING
    assert [d.task_id for d in queue.pending_of("t0")] == [0]
    assert [d.task_id for d in queue.pending_of("t2")] == [2]


def test_successful_report_marks_the_task_done() -> None:
    queue = make_queue(2)
    d = dispatch(queue)
    events = succeed(queue, d)
    assert events == [
        TaskEvent(
            EventKind.DONE, 0, pass_id=0, attempt=1, timeout_count=0, trainer_id="t0", offset=10
        )
    ]
    assert queue.state_of(0) is TaskState.DONE
    assert queue.pending_of("t0") == []


def test_timeout_requeues_the_task_at_the_end_with_its_count_raised() -> None:
    queue = make_queue(3)
    d0 = dispatch(queue, now=0.0)
    assert queue.expire(now=TIMEOUT_S - 0.001) == []
    events = queue.expire(now=TIMEOUT_S)
    assert events == [
        TaskEvent(
            EventKind.REQUEUED,
            0,
            pass_id=0,
            attempt=1,
            timeout_count=1,
            trainer_id="t0",
            reason="timeout",
        )
    ]
    assert queue.state_of(0) is TaskState.TODO
    redispatched = [dispatch(queue, now=TIMEOUT_S) for _ in range(3)]
    assert [d.task_id for d in redispatched] == [1, 2, 0]
    assert redispatched[-1].attempt == d0.attempt + 1


def test_task_fails_once_its_timeouts_exceed_the_limit() -> None:
    queue = make_queue(1, max_task_timeouts=2)
    now = 0.0
    for expected_count in (1, 2):
        dispatch(queue, now=now)
        now += TIMEOUT_S
        [event] = queue.expire(now)
        assert (event.kind, event.timeout_count) == (EventKind.REQUEUED, expected_count)
    dispatch(queue, now=now)
    events = queue.expire(now + TIMEOUT_S)
    assert kinds(events) == [EventKind.FAILED, EventKind.PASS_COMPLETED, EventKind.JOB_FINISHED]
    assert (events[0].timeout_count, events[0].attempt, events[0].reason) == (3, 3, "timeout")
    assert queue.state_of(0) is TaskState.FAILED


def test_reported_failure_counts_like_a_timeout() -> None:
    queue = make_queue(2, max_task_timeouts=1)
    d = dispatch(queue)
    [event] = queue.report_task(d.task_id, 0, d.attempt, success=False, now=1.0, error="OOM")
    assert (event.kind, event.timeout_count) == (EventKind.REQUEUED, 1)
    assert event.reason == "reported failure: OOM"
    dispatch(queue)  # task 1
    d = dispatch(queue)  # task 0 again
    [event] = queue.report_task(d.task_id, 0, d.attempt, success=False, now=2.0, error="OOM")
    assert (event.kind, event.timeout_count) == (EventKind.FAILED, 2)
    assert queue.state_of(0) is TaskState.FAILED


def test_report_for_old_attempt_is_rejected_after_timeout() -> None:
    queue = make_queue(2)
    old = dispatch(queue, "slow", now=0.0)
    queue.expire(now=TIMEOUT_S)
    dispatch(queue, "t1", now=TIMEOUT_S)  # task 1
    new = dispatch(queue, "t2", now=TIMEOUT_S)  # task 0, attempt 2
    before = (queue.stats(), queue.state_of(0), queue.pending_of("t2"), queue.next_deadline())

    with pytest.raises(StaleTaskError, match=r"task 0: .*attempt 1 .*attempt 2"):
        succeed(queue, old)
    with pytest.raises(StaleTaskError):
        queue.report_task(0, 0, old.attempt, success=False, now=TIMEOUT_S, error="late")

    after = (queue.stats(), queue.state_of(0), queue.pending_of("t2"), queue.next_deadline())
    assert after == before
    assert kinds(succeed(queue, new)) == [EventKind.DONE]


def test_second_report_for_a_done_task_is_rejected() -> None:
    queue = make_queue(2)
    d = dispatch(queue)
    succeed(queue, d)
    before = queue.stats()
    with pytest.raises(StaleTaskError):
        succeed(queue, d)
    assert queue.stats() == before


def test_report_from_an_earlier_pass_is_rejected() -> None:
    queue = make_queue(1, num_passes=2)
    d = dispatch(queue)
    succeed(queue, d)  # finishes pass 0
    assert queue.stats().pass_id == 1
    current = dispatch(queue)
    assert (current.pass_id, current.attempt) == (1, 2)
    with pytest.raises(StaleTaskError, match="pass 0"):
        succeed(queue, d)
    # Right attempt number, wrong pass: still stale.
    with pytest.raises(StaleTaskError):
        queue.report_task(0, 0, current.attempt, success=True, now=0.0)
    assert queue.state_of(0) is TaskState.PENDING


def test_late_timeout_of_a_reported_attempt_is_ignored() -> None:
    queue = make_queue(2)
    d = dispatch(queue, now=0.0)
    succeed(queue, d, now=1.0)
    assert queue.expire(now=2 * TIMEOUT_S) == []
    assert queue.state_of(0) is TaskState.DONE


def test_report_after_the_deadline_but_before_expire_is_accepted() -> None:
    queue = make_queue(2)
    d = dispatch(queue, now=0.0)
    assert kinds(succeed(queue, d, now=2 * TIMEOUT_S)) == [EventKind.DONE]
    assert queue.expire(now=2 * TIMEOUT_S) == []


def test_unknown_task_ids_are_rejected() -> None:
    queue = make_queue(2)
    with pytest.raises(UnknownTaskError, match="task 2"):
        queue.report_task(2, 0, 1, success=True, now=0.0)
    with pytest.raises(UnknownTaskError):
        queue.report_task(-1, 0, 1, success=True, now=0.0)
    with pytest.raises(UnknownTaskError):
        queue.state_of(5)


def test_trainer_lost_requeues_its_tasks_without_raising_their_count() -> None:
    queue = make_queue(3, max_task_timeouts=1)
    dispatch(queue, "dead")
    dispatch(queue, "alive")
    events = queue.trainer_lost("dead", now=1.0)
    assert [(e.kind, e.task_id, e.timeout_count, e.reason) for e in events] == [
        (EventKind.REQUEUED, 0, 0, TRAINER_LOST),
    ]
    assert [d.task_id for d in queue.pending_of("alive")] == [1]
    assert queue.pending_of("dead") == []
    assert queue.trainer_lost("dead", now=1.0) == []
    assert queue.trainer_lost("never-seen", now=1.0) == []
    # Losing a trainer many times never fails a task.
    for _ in range(3):
        d = dispatch(queue, "flaky")
        queue.trainer_lost("flaky", now=1.0)
        assert queue.state_of(d.task_id) is TaskState.TODO
    assert queue.stats().failed == 0


def test_a_trainer_asking_again_gets_the_task_it_never_received_requeued() -> None:
    # The master persisted the dispatch of task 0 and died before replying;
    # the trainer asks the new master for work with empty hands.
    queue = make_queue(3, max_task_timeouts=1)
    lost = dispatch(queue, "t0")
    progress(queue, lost, 4)  # progress from an earlier attempt is kept
    result, events = queue.get_task("t0", now=1.0)
    assert [(e.kind, e.task_id, e.timeout_count, e.reason) for e in events] == [
        (EventKind.REQUEUED, 0, 0, DISPATCH_NOT_RECEIVED),
        (EventKind.DISPATCHED, 1, 0, ""),
    ]
    assert isinstance(result, Dispatch) and result.task_id == 1
    assert queue.pending_of("t0") == [result]
    # A late report for the attempt that never arrived is stale.
    with pytest.raises(StaleTaskError):
        succeed(queue, lost)
    # The requeued task resumes at its offset with a new attempt, no timeout counted.
    again = [dispatch(queue, t) for t in ("t1", "t2")][-1]
    assert (again.task_id, again.attempt, again.offset) == (0, 2, 4)
    assert queue.record(0)["timeouts"] == 0


def test_a_trainer_holding_its_task_gets_the_next_one_ahead() -> None:
    queue = make_queue(5)
    first = dispatch(queue, "t0")
    result, events = queue.get_task("t0", now=1.0, holding=[first.task_id])
    assert isinstance(result, Dispatch) and result.task_id == 1
    assert kinds(events) == [EventKind.DISPATCHED]  # the held task stays charged to t0
    assert [d.task_id for d in queue.pending_of("t0")] == [0, 1]
    # Never more than MAX_HELD: a third is not handed out, and nothing is requeued.
    assert MAX_HELD == 2
    result, events = queue.get_task("t0", now=1.0, holding=[0, 1])
    assert isinstance(result, Wait) and events == []
    # The report of the first task asks for the one after the held one.
    succeed(queue, first)
    result, _ = queue.get_task("t0", now=2.0, holding=[1])
    assert isinstance(result, Dispatch) and result.task_id == 2
    # Asking with empty hands requeues what it held, as never received.
    result, events = queue.get_task("t0", now=3.0)
    assert [(e.kind, e.task_id, e.reason) for e in events] == [
        (EventKind.REQUEUED, 1, DISPATCH_NOT_RECEIVED),
        (EventKind.REQUEUED, 2, DISPATCH_NOT_RECEIVED),
        (EventKind.DISPATCHED, 3, ""),
    ]


def test_no_task_is_handed_out_ahead_when_another_trainer_would_go_without() -> None:
    queue = make_queue(4)
    a, b = dispatch(queue, "a"), dispatch(queue, "b")
    # Two tasks todo, two trainers holding work: one goes ahead to a.
    result, _ = queue.get_task("a", now=0.0, holding=[a.task_id])
    assert isinstance(result, Dispatch) and result.task_id == 2
    # One todo left for two trainers: b gets none ahead, but gets it with empty hands.
    result, events = queue.get_task("b", now=0.0, holding=[b.task_id])
    assert isinstance(result, Wait) and events == []
    succeed(queue, b)
    assert dispatch(queue, "b").task_id == 3


def test_progress_renews_the_deadline_of_the_task_held_ahead() -> None:
    queue = make_queue(3)
    first = dispatch(queue, "t0", now=0.0)
    ahead, _ = queue.get_task("t0", now=0.0, holding=[first.task_id])
    assert isinstance(ahead, Dispatch)
    progress(queue, first, 5, now=TIMEOUT_S - 1)
    # Past the first deadlines, both attempts are still held: progress is a heartbeat.
    assert queue.expire(now=TIMEOUT_S + 1) == []
    assert [d.deadline for d in queue.pending_of("t0")] == [2 * TIMEOUT_S - 1] * 2


# --- passes and the end of the job ---------------------------------------------


def test_next_pass_starts_with_all_tasks_todo_and_counts_reset() -> None:
    queue = make_queue(2, max_task_timeouts=1, num_passes=2)
    now = 0.0
    dispatch(queue, now=now)  # task 0 times out twice and fails
    now += TIMEOUT_S
    queue.expire(now)
    d1 = dispatch(queue, "t1", now=now)
    d0 = dispatch(queue, "t0", now=now)
    assert d0.task_id == 0
    queue.report_task(0, 0, d0.attempt, success=False, now=now, error="bad")
    assert queue.state_of(0) is TaskState.FAILED

    events = succeed(queue, d1, now=now)
    assert kinds(events) == [EventKind.DONE, EventKind.PASS_COMPLETED, EventKind.PASS_STARTED]
    assert events[2] == TaskEvent(EventKind.PASS_STARTED, None, 1, 0, 0, None)
    assert queue.stats() == QueueStats(
        pass_id=1,
        num_passes=2,
        total=2,
        todo=2,
        pending=0,
        done=0,
        failed=0,
        finished=False,
        done_all_passes=1,
    )
    assert [queue.state_of(i) for i in (0, 1)] == [TaskState.TODO, TaskState.TODO]

    result, dispatched = queue.get_task("t0", now)
    assert isinstance(result, Dispatch)
    assert (result.task_id, result.pass_id, result.attempt) == (0, 1, 3)
    assert dispatched[0].timeout_count == 0
    # The count was reset: one timeout no longer fails task 0.
    [event] = queue.expire(now + TIMEOUT_S)
    assert (event.kind, event.timeout_count) == (EventKind.REQUEUED, 1)


def test_get_task_returns_finished_after_the_last_pass() -> None:
    queue = make_queue(2, num_passes=2)
    all_events: list[TaskEvent] = []
    for _ in range(4):
        all_events += succeed(queue, dispatch(queue))
    assert kinds(all_events).count(EventKind.PASS_STARTED) == 1
    assert kinds(all_events)[-1] is EventKind.JOB_FINISHED
    assert kinds(all_events).count(EventKind.JOB_FINISHED) == 1
    assert queue.get_task("t0", now=1.0) == (Finished(), [])
    assert queue.expire(now=1e9) == []
    assert queue.trainer_lost("t0", now=1e9) == []
    assert queue.stats().finished
    assert queue.stats().pass_id == 1


def test_get_task_says_wait_when_everything_is_pending() -> None:
    queue = make_queue(1)
    dispatch(queue, "t0", now=0.0)
    result, events = queue.get_task("t1", now=0.0)
    assert result == Wait(retry_after_s=MAX_RETRY_AFTER_S)
    assert events == []
    # Close to the deadline, the hint shrinks to the time left, but stays > 0.
    result, _ = queue.get_task("t1", now=TIMEOUT_S - 0.25)
    assert isinstance(result, Wait)
    assert result.retry_after_s == pytest.approx(0.25)
    result, _ = queue.get_task("t1", now=TIMEOUT_S + 5.0)
    assert isinstance(result, Wait)
    assert result.retry_after_s > 0


def test_stats_count_tasks_in_each_state() -> None:
    queue = make_queue(5, max_task_timeouts=1, num_passes=3)
    assert queue.stats() == QueueStats(
        pass_id=0,
        num_passes=3,
        total=5,
        todo=5,
        pending=0,
        done=0,
        failed=0,
        finished=False,
        done_all_passes=0,
    )
    d0 = dispatch(queue, "t0", now=0.0)
    d1 = dispatch(queue, "t1", now=0.0)
    dispatch(queue, "t2", now=0.0)
    succeed(queue, d0)
    queue.report_task(d1.task_id, 0, d1.attempt, success=False, now=0.0)
    stats = queue.stats()
    assert (stats.todo, stats.pending, stats.done, stats.failed) == (3, 1, 1, 0)
    # Todo is now tasks 3, 4, then the requeued 1.
    d1 = [dispatch(queue, t, now=0.0) for t in ("t3", "t4", "t5")][-1]
    assert d1.task_id == 1
    queue.report_task(1, 0, d1.attempt, success=False, now=0.0)
    stats = queue.stats()
    assert (stats.todo, stats.pending, stats.done, stats.failed) == (0, 3, 1, 1)
    assert stats.todo + stats.pending + stats.done + stats.failed == stats.total


def test_next_deadline_is_the_earliest_pending_deadline() -> None:
    queue = make_queue(3)
    assert queue.next_deadline() is None
    d0 = dispatch(queue, "t0", now=1.0)
    d1 = dispatch(queue, "t1", now=2.0)
    assert queue.next_deadline() == 1.0 + TIMEOUT_S
    succeed(queue, d0)
    assert queue.next_deadline() == 2.0 + TIMEOUT_S
    queue.trainer_lost("t1", now=3.0)
    assert queue.next_deadline() is None
    assert d1.task_id == 1


def test_deadlines_stay_correct_when_reports_outpace_expire() -> None:
    # One slow attempt holds the earliest deadline while many others are
    # dispatched and reported without expire() running, so the deadline heap
    # fills with dead entries and is compacted; the slow one must still time out.
    queue = make_queue(100)
    slow = dispatch(queue, "slow", now=0.0)
    for i in range(1, 100):
        d = dispatch(queue, "fast", now=float(i) / 100)
        assert d.task_id == i
        succeed(queue, d)
    assert queue.next_deadline() == slow.deadline
    assert queue.expire(slow.deadline - 0.001) == []
    [event] = queue.expire(slow.deadline)
    assert (event.kind, event.task_id, event.reason) == (EventKind.REQUEUED, 0, "timeout")
    assert queue.next_deadline() is None
    assert kinds(succeed(queue, dispatch(queue))) == [
        EventKind.DONE,
        EventKind.PASS_COMPLETED,
        EventKind.JOB_FINISHED,
    ]


# --- progress, offsets and segments ----------------------------------------------


def progress(queue: TaskQueue, d: Dispatch, offset: int, now: float = 0.0) -> list[TaskEvent]:
    return queue.report_progress(d.task_id, d.pass_id, d.attempt, offset, now)


def test_progress_records_a_segment_and_renews_the_deadline() -> None:
    queue = make_queue(2)
    d = dispatch(queue, now=0.0)
    assert d.offset == 0
    [event] = progress(queue, d, 4, now=5.0)
    assert (event.kind, event.task_id, event.offset, event.trainer_id) == (
        EventKind.PROGRESS,
        0,
        4,
        "t0",
    )
    assert queue.offset_of(0) == 4
    assert queue.segments_of(0) == [Segment(attempt=1, start=0, end=4)]
    # Progress is a heartbeat: the attempt no longer times out at its first deadline.
    assert queue.next_deadline() == 5.0 + TIMEOUT_S
    assert queue.expire(now=TIMEOUT_S) == []
    assert queue.state_of(0) is TaskState.PENDING
    assert [p.deadline for p in queue.pending_of("t0")] == [5.0 + TIMEOUT_S]
    [event] = queue.expire(now=5.0 + TIMEOUT_S)
    assert (event.kind, event.offset) == (EventKind.REQUEUED, 4)


def test_progress_of_one_attempt_extends_its_segment() -> None:
    queue = make_queue(1)
    d = dispatch(queue)
    progress(queue, d, 3)
    progress(queue, d, 7)
    assert queue.segments_of(0) == [Segment(1, 0, 7)]
    events = succeed(queue, d)
    assert queue.segments_of(0) == [Segment(1, 0, 10)]
    assert (events[0].kind, events[0].offset) == (EventKind.DONE, 10)


def test_progress_at_or_below_the_recorded_offset_only_renews_the_deadline() -> None:
    queue = make_queue(2)
    d = dispatch(queue, now=0.0)
    progress(queue, d, 6, now=1.0)
    before = (queue.record(0), queue.meta(), queue.stats())
    assert progress(queue, d, 6, now=2.0) == []
    assert progress(queue, d, 2, now=3.0) == []
    assert progress(queue, d, -1, now=4.0) == []
    assert (queue.record(0), queue.meta(), queue.stats()) == before
    assert queue.next_deadline() == 4.0 + TIMEOUT_S


def test_progress_beyond_the_task_end_is_rejected_and_changes_nothing() -> None:
    queue = make_queue(2)
    d = dispatch(queue, now=0.0)
    with pytest.raises(StaleTaskError, match="beyond the task's end"):
        progress(queue, d, 11, now=1.0)
    assert queue.offset_of(0) == 0
    assert queue.next_deadline() == TIMEOUT_S


def test_progress_for_a_stale_attempt_is_rejected_and_changes_nothing() -> None:
    queue = make_queue(2, num_passes=2)
    old = dispatch(queue, "slow", now=0.0)
    queue.expire(now=TIMEOUT_S)
    dispatch(queue, "t1", now=TIMEOUT_S)  # task 1
    new = dispatch(queue, "t2", now=TIMEOUT_S)  # task 0, attempt 2
    before = (queue.record(0), queue.stats(), queue.next_deadline())
    with pytest.raises(StaleTaskError, match="attempt 1"):
        progress(queue, old, 5, now=TIMEOUT_S + 1)
    with pytest.raises(UnknownTaskError):
        queue.report_progress(7, 0, 1, 5, now=TIMEOUT_S + 1)
    assert (queue.record(0), queue.stats(), queue.next_deadline()) == before
    assert kinds(progress(queue, new, 5)) == [EventKind.PROGRESS]


def test_redispatch_after_a_timeout_resumes_at_the_last_offset() -> None:
    queue = make_queue(1)
    first = dispatch(queue, "a", now=0.0)
    progress(queue, first, 4, now=1.0)
    queue.expire(now=1.0 + TIMEOUT_S)
    second = dispatch(queue, "b", now=20.0)
    assert (second.attempt, second.offset) == (2, 4)
    progress(queue, second, 9, now=21.0)
    succeed(queue, second)
    assert queue.segments_of(0) == [Segment(1, 0, 4), Segment(2, 4, 10)]


def test_redispatch_after_trainer_loss_or_failure_resumes_at_the_last_offset() -> None:
    queue = make_queue(1, max_task_timeouts=3)
    d = dispatch(queue, "a")
    progress(queue, d, 2)
    [event] = queue.trainer_lost("a", now=1.0)
    assert (event.kind, event.offset, event.timeout_count) == (EventKind.REQUEUED, 2, 0)
    d = dispatch(queue, "b")
    assert d.offset == 2
    progress(queue, d, 5)
    queue.report_task(d.task_id, d.pass_id, d.attempt, success=False, now=2.0, error="OOM")
    d = dispatch(queue, "c")
    assert (d.attempt, d.offset) == (3, 5)
    assert queue.segments_of(0) == [Segment(1, 0, 2), Segment(2, 2, 5)]


def test_a_new_pass_starts_every_task_at_offset_zero() -> None:
    queue = make_queue(1, num_passes=2)
    d = dispatch(queue)
    progress(queue, d, 5)
    succeed(queue, d)
    assert queue.stats().pass_id == 1
    assert (queue.state_of(0), queue.offset_of(0), queue.segments_of(0)) == (
        TaskState.TODO,
        0,
        [],
    )
    d = dispatch(queue)
    assert (d.pass_id, d.attempt, d.offset) == (1, 2, 0)
    progress(queue, d, 3)
    assert queue.segments_of(0) == [Segment(2, 0, 3)]


def test_a_pass_transition_changes_no_task_record_only_the_meta() -> None:
    # The lazy reset: starting a pass must not require rewriting every record.
    queue = make_queue(3, num_passes=2)
    for _ in range(2):
        succeed(queue, dispatch(queue))
    records_before = [queue.record(i) for i in range(3)]
    meta_before = queue.meta()
    events = succeed(queue, dispatch(queue))
    assert kinds(events) == [EventKind.DONE, EventKind.PASS_COMPLETED, EventKind.PASS_STARTED]
    # Only the reported task changed; the other two still say "done in pass 0".
    assert [queue.record(i) for i in range(2)] == records_before[:2]
    assert queue.record(2) != records_before[2]
    assert queue.record(2)["pass"] == 0
    assert queue.meta() != meta_before
    assert (queue.meta()["pass"], queue.meta()["done_before"]) == (1, 3)
    assert [queue.state_of(i) for i in range(3)] == [TaskState.TODO] * 3


def test_pass_completed_carries_an_exactly_once_audit() -> None:
    queue = make_queue(3, max_task_timeouts=1)
    d0 = dispatch(queue, "a", now=0.0)
    d1 = dispatch(queue, "b", now=0.0)
    d2 = dispatch(queue, "c", now=0.0)
    progress(queue, d0, 4)
    queue.trainer_lost("a", now=1.0)
    succeed(queue, d1)
    progress(queue, d2, 3)
    queue.report_task(d2.task_id, 0, d2.attempt, success=False, now=1.0)
    d0 = dispatch(queue, "b", now=1.0)
    assert d0.offset == 4
    succeed(queue, d0)
    d2 = dispatch(queue, "b", now=1.0)
    progress(queue, d2, 8)
    events = queue.report_task(d2.task_id, 0, d2.attempt, success=False, now=2.0)
    assert kinds(events) == [EventKind.FAILED, EventKind.PASS_COMPLETED, EventKind.JOB_FINISHED]
    summary = events[1].summary
    assert summary == PassSummary(
        pass_id=0,
        tasks=3,
        records=30,
        done=2,
        failed=1,
        records_trained=28,  # 10 + 10 for the done tasks, 8 for the failed one
        duplicated_records=0,
        missing_records=0,
        failed_tasks=(2,),
    )
    assert summary.exactly_once
    assert summary.as_dict()["exactly_once"] is True


def test_trainers_lists_the_holders_of_pending_attempts() -> None:
    queue = make_queue(3)
    dispatch(queue, "a")
    dispatch(queue, "b")
    succeed(queue, dispatch(queue, "c"))
    assert queue.trainers() == {"a", "b"}


# --- persistence: records, meta and restore --------------------------------------


def ranges_of(num_tasks: int) -> list[DataRange]:
    return [DataRange("data.parquet", 10 * i, 10 * i + 10) for i in range(num_tasks)]


def persisted(queue: TaskQueue) -> tuple[dict[str, object], dict[int, dict[str, object]]]:
    """What a shell that wrote every record would hold, through JSON as in etcd."""
    meta = json.loads(json.dumps(queue.meta()))
    records = {i: json.loads(json.dumps(queue.record(i))) for i in range(queue.num_tasks)}
    return meta, records


def restore(queue: TaskQueue, now: float = 100.0) -> TaskQueue:
    meta, records = persisted(queue)
    return TaskQueue.restore(ranges_of(queue.num_tasks), queue.config, meta, records, now)


def drain_order(queue: TaskQueue, now: float) -> list[tuple[int, int, int]]:
    """(task, attempt, offset) of what the todo queue hands out next, on a copy."""
    probe = copy.deepcopy(queue)
    order = []
    for _ in range(probe.stats().todo):
        result, _ = probe.get_task("probe", now)
        assert isinstance(result, Dispatch)
        order.append((result.task_id, result.attempt, result.offset))
    return order


def test_restore_keeps_states_offsets_counts_and_todo_order() -> None:
    queue = make_queue(6, max_task_timeouts=1)
    d = [dispatch(queue, t, now=0.0) for t in ("a", "b", "c", "d")]
    succeed(queue, d[0])
    progress(queue, d[1], 7)
    queue.trainer_lost("b", now=1.0)  # task 1 requeued at offset 7
    queue.report_task(2, 0, d[2].attempt, success=False, now=1.0)  # task 2 requeued
    progress(queue, d[3], 3)  # task 3 pending with "d"
    restored = restore(queue, now=50.0)
    for i in range(6):
        assert restored.record(i) == queue.record(i)
    assert restored.meta() == queue.meta()
    assert restored.stats() == queue.stats()
    assert drain_order(restored, 60.0) == drain_order(queue, 60.0)
    assert drain_order(restored, 60.0)[:2] == [(4, 1, 0), (5, 1, 0)]
    assert restored.trainers() == {"d"}


def test_restored_pending_attempt_gets_a_fresh_deadline_and_can_still_report() -> None:
    queue = make_queue(2)
    d = dispatch(queue, "a", now=0.0)
    progress(queue, d, 6, now=1.0)
    restored = restore(queue, now=500.0)
    [held] = restored.pending_of("a")
    assert (held.task_id, held.attempt, held.offset, held.deadline) == (0, 1, 0, 500.0 + TIMEOUT_S)
    assert restored.expire(now=499.0 + TIMEOUT_S) == []
    assert kinds(progress(restored, d, 8, now=501.0)) == [EventKind.PROGRESS]
    assert kinds(succeed(restored, d)) == [EventKind.DONE]
    assert restored.segments_of(0) == [Segment(1, 0, 10)]


def test_restore_treats_records_of_earlier_passes_as_todo() -> None:
    queue = make_queue(2, num_passes=3)
    for _ in range(2):
        succeed(queue, dispatch(queue))  # pass 0 done; records say "done in pass 0"
    d = dispatch(queue, now=0.0)  # task 0, pass 1
    restored = restore(queue)
    assert restored.stats().pass_id == 1
    assert restored.state_of(0) is TaskState.PENDING
    assert restored.state_of(1) is TaskState.TODO
    assert restored.record(1)["pass"] == 0
    nxt = dispatch(restored, "t1")
    assert (nxt.task_id, nxt.pass_id, nxt.attempt, nxt.offset) == (1, 1, 2, 0)
    assert restored.record(1)["pass"] == 1
    assert kinds(succeed(restored, d)) == [EventKind.DONE]


def test_settle_completes_a_pass_whose_meta_was_not_advanced() -> None:
    # A crash between the record writes of a mass timeout and the meta write
    # leaves every record final but the meta in the old pass.
    queue = make_queue(2, num_passes=2)
    meta_before = queue.meta()
    for _ in range(2):
        succeed(queue, dispatch(queue))
    _, records = persisted(queue)
    restored = TaskQueue.restore(ranges_of(2), queue.config, meta_before, records, 0.0)
    assert restored.stats().pass_id == 0
    events = restored.settle()
    assert kinds(events) == [EventKind.PASS_COMPLETED, EventKind.PASS_STARTED]
    assert restored.meta() == queue.meta()
    assert restored.settle() == []


def test_audit_reports_duplicated_and_missing_records() -> None:
    # The audit does not trust the queue's own bookkeeping: hand it records
    # whose segments overlap or leave a gap (as a corrupted ledger would).
    config = QueueConfig(task_timeout_s=TIMEOUT_S, max_task_timeouts=2)
    done: dict[str, object] = {
        "pass": 0,
        "state": "done",
        "attempt": 2,
        "timeouts": 1,
        "offset": 10,
        "trainer": None,
        "seq": None,
    }
    records = {
        0: {**done, "segments": [[1, 0, 6], [2, 4, 10]]},  # records 4 and 5 twice
        1: {**done, "segments": [[1, 0, 3], [2, 5, 10]]},  # records 3 and 4 never
    }
    meta = {"format": 1, "pass": 0, "num_passes": 1, "finished": False, "done_before": 0}
    queue = TaskQueue.restore(ranges_of(2), config, meta, records, 0.0)
    [completed, _] = queue.settle()
    assert completed.summary is not None
    assert (completed.summary.duplicated_records, completed.summary.missing_records) == (2, 2)
    assert completed.summary.records_trained == 20
    assert not completed.summary.exactly_once


# --- invariant: every task ends DONE or FAILED exactly once per pass ------------

TRAINERS = ("a", "b", "c")
TASK_LENGTH = 10


class TaskQueueMachine(RuleBasedStateMachine):
    """Random interleavings of dispatch, progress, reports, expiry, trainer loss
    and master crashes (restore from what the shell persisted)."""

    dispatches = Bundle("dispatches")

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.outcomes: Counter[tuple[int, int]] = Counter()
        self.done_in_pass: Counter[int] = Counter()
        self.failed_in_pass: Counter[int] = Counter()
        self.passes_started = 0
        self.passes_completed = 0
        self.jobs_finished = 0
        self.attempts_seen: set[tuple[int, int]] = set()
        # Model of each task's timeout count, keyed by (pass, task).
        self.timeout_counts: Counter[tuple[int, int]] = Counter()
        # Model of training, keyed by (pass, task): the offset reached and the
        # record ranges trained, as the trainers would have trained them.
        self.offsets: Counter[tuple[int, int]] = Counter()
        self.trained: dict[tuple[int, int], list[Segment]] = {}
        self.trained_in_pass: Counter[int] = Counter()
        # What the shell has written to etcd so far (through JSON).
        self.saved_meta: dict[str, Any] = {}
        self.saved_records: dict[int, dict[str, Any]] = {}
        self.restores = 0

    @initialize(
        num_tasks=st.integers(1, 5),
        max_task_timeouts=st.integers(1, 3),
        num_passes=st.integers(1, 3),
    )
    def create(self, num_tasks: int, max_task_timeouts: int, num_passes: int) -> None:
        self.num_tasks = num_tasks
        self.num_passes = num_passes
        self.max_task_timeouts = max_task_timeouts
        self.queue = make_queue(
            num_tasks, max_task_timeouts=max_task_timeouts, num_passes=num_passes
        )
        # The ledger is created with every record and the meta.
        self.saved_meta, self.saved_records = persisted(self.queue)

    # --- the shell's side: persist what the events name ---------------------------

    def persist(self, events: list[TaskEvent]) -> None:
        for event in events:
            if event.task_id is not None:
                self.saved_records[event.task_id] = json.loads(
                    json.dumps(self.queue.record(event.task_id))
                )
        if any(event.task_id is None for event in events):
            self.saved_meta = json.loads(json.dumps(self.queue.meta()))

    def record(self, events: list[TaskEvent]) -> None:
        self.persist(events)
        for event in events:
            self.check_timeout_count(event)
            if event.kind in (EventKind.DONE, EventKind.FAILED):
                assert event.task_id is not None
                key = (event.pass_id, event.task_id)
                assert self.outcomes[key] == 0, f"task ended twice in a pass: {key}"
                self.outcomes[key] += 1
                if event.kind is EventKind.DONE:
                    self.done_in_pass[event.pass_id] += 1
                    self.train(key, event.attempt, TASK_LENGTH)
                    self.check_tiles_exactly_once(key)
                else:
                    self.failed_in_pass[event.pass_id] += 1
            elif event.kind is EventKind.PASS_COMPLETED:
                self.passes_completed += 1
                self.check_pass_complete(event.pass_id)
                self.check_summary(event)
            elif event.kind is EventKind.PASS_STARTED:
                self.passes_started += 1
                self.check_pass_complete(event.pass_id - 1)
            elif event.kind is EventKind.JOB_FINISHED:
                self.jobs_finished += 1
                self.check_pass_complete(event.pass_id)

    def train(self, key: tuple[int, int], attempt: int, offset: int) -> None:
        """The trainer of ``attempt`` trained the task's records up to ``offset``."""
        start = self.offsets[key]
        if offset <= start:
            return
        trained = self.trained.setdefault(key, [])
        if trained and trained[-1].attempt == attempt and trained[-1].end == start:
            trained[-1] = Segment(attempt, trained[-1].start, offset)
        else:
            trained.append(Segment(attempt, start, offset))
        self.trained_in_pass[key[0]] += offset - start
        self.offsets[key] = offset

    def check_tiles_exactly_once(self, key: tuple[int, int]) -> None:
        trained = self.trained.get(key, [])
        covered = sorted((seg.start, seg.end) for seg in trained)
        assert covered[0][0] == 0 and covered[-1][1] == TASK_LENGTH, covered
        for (_, end), (start, _) in itertools.pairwise(covered):
            assert end == start, f"records trained twice or never: {covered}"
        in_pass = key[0] == self.queue.stats().pass_id
        if in_pass and self.queue.state_of(key[1]) is TaskState.DONE:
            assert self.queue.segments_of(key[1]) == trained

    def check_summary(self, event: TaskEvent) -> None:
        summary = event.summary
        assert summary is not None
        assert summary.exactly_once, summary
        assert summary.pass_id == event.pass_id
        assert (summary.tasks, summary.records) == (self.num_tasks, self.num_tasks * TASK_LENGTH)
        assert summary.done == self.done_in_pass[event.pass_id]
        assert summary.failed == self.failed_in_pass[event.pass_id]
        assert summary.records_trained == self.trained_in_pass[event.pass_id]

    def check_timeout_count(self, event: TaskEvent) -> None:
        if event.task_id is None:
            return
        key = (event.pass_id, event.task_id)
        counted = event.kind is EventKind.FAILED or (
            event.kind is EventKind.REQUEUED
            and event.reason not in (TRAINER_LOST, DISPATCH_NOT_RECEIVED)
        )
        if counted:
            self.timeout_counts[key] += 1
        assert event.timeout_count == self.timeout_counts[key], event
        if event.kind is EventKind.FAILED:
            assert event.timeout_count > self.max_task_timeouts, event
        if event.kind is EventKind.REQUEUED:
            assert event.timeout_count <= self.max_task_timeouts, event

    def check_pass_complete(self, pass_id: int) -> None:
        for task_id in range(self.num_tasks):
            assert self.outcomes[(pass_id, task_id)] == 1, (pass_id, task_id)

    def holders(self, d: Dispatch) -> list[str]:
        key = (d.task_id, d.pass_id, d.attempt)
        return [
            t
            for t in TRAINERS
            if key in {(p.task_id, p.pass_id, p.attempt) for p in self.queue.pending_of(t)}
        ]

    # --- rules ------------------------------------------------------------------

    @rule(target=dispatches, trainer=st.sampled_from(TRAINERS))
    def get_task(self, trainer: str) -> Dispatch | None:
        return self.ask(trainer, keep=0)

    @rule(target=dispatches, trainer=st.sampled_from(TRAINERS))
    def get_task_ahead(self, trainer: str) -> Dispatch | None:
        # The trainer keeps the first task it holds and asks for the one after it.
        return self.ask(trainer, keep=1)

    def ask(self, trainer: str, keep: int) -> Dispatch | None:
        held = [] if self.queue.stats().finished else self.queue.pending_of(trainer)
        kept, lost = held[:keep], held[keep:]
        holding = [d.task_id for d in kept]
        result, events = self.queue.get_task(trainer, self.now, holding=holding)
        # What the trainer does not name as held never reached it.
        requeued = [e for e in events if e.kind is EventKind.REQUEUED]
        assert [e.task_id for e in requeued] == [d.task_id for d in lost]
        assert all(e.reason == DISPATCH_NOT_RECEIVED for e in requeued)
        now_held = self.queue.pending_of(trainer)
        assert [d.task_id for d in now_held if d not in kept] == (
            [result.task_id] if isinstance(result, Dispatch) else []
        )
        assert len(now_held) <= MAX_HELD
        if kept and isinstance(result, Dispatch):
            # Handed out ahead only while no trainer would be left without work.
            stats = self.queue.stats()
            assert stats.todo + 1 >= len(self.queue.trainers())
        self.record(events)
        if isinstance(result, Dispatch):
            key = (result.task_id, result.attempt)
            assert key not in self.attempts_seen, "attempt number reused"
            self.attempts_seen.add(key)
            assert result.deadline == self.now + TIMEOUT_S
            # A re-dispatched task resumes exactly where the last attempt stopped.
            assert result.offset == self.offsets[(result.pass_id, result.task_id)]
            return result
        if isinstance(result, Wait):
            assert 0 < result.retry_after_s <= MAX_RETRY_AFTER_S
            assert self.queue.stats().pending > 0
        else:
            assert self.queue.stats().finished
        return None

    @rule(d=dispatches, success=st.booleans())
    def report(self, d: Dispatch | None, success: bool) -> None:
        if d is None:
            return
        holders = self.holders(d)
        before = self.snapshot()
        try:
            events = self.queue.report_task(
                d.task_id, d.pass_id, d.attempt, success=success, now=self.now, error="boom"
            )
        except StaleTaskError:
            assert holders == [], "current attempt rejected as stale"
            assert self.snapshot() == before, "rejected report changed the queue"
            return
        assert len(holders) == 1, "stale attempt accepted"
        self.record(events)

    @rule(d=dispatches, offset=st.integers(-1, TASK_LENGTH + 1))
    def report_progress(self, d: Dispatch | None, offset: int) -> None:
        if d is None:
            return
        holders = self.holders(d)
        key = (d.pass_id, d.task_id)
        before = self.snapshot()
        try:
            events = self.queue.report_progress(d.task_id, d.pass_id, d.attempt, offset, self.now)
        except StaleTaskError:
            assert holders == [] or offset > TASK_LENGTH, "current progress rejected"
            assert self.snapshot() == before, "rejected progress changed the queue"
            return
        assert len(holders) == 1 and offset <= TASK_LENGTH, "stale progress accepted"
        if offset <= self.offsets[key]:
            assert events == []
        else:
            assert kinds(events) == [EventKind.PROGRESS]
            assert events[0].offset == offset
        self.train(key, d.attempt, offset)
        assert self.queue.offset_of(d.task_id) == self.offsets[key]
        self.record(events)
        # Progress is a heartbeat.
        assert self.queue.next_deadline() is not None
        assert [
            p.deadline for p in self.queue.pending_of(holders[0]) if p.task_id == d.task_id
        ] == [self.now + TIMEOUT_S]

    @rule(seconds=st.sampled_from([0.0, 0.5, TIMEOUT_S / 2, TIMEOUT_S, 3 * TIMEOUT_S]))
    def advance_clock_and_expire(self, seconds: float) -> None:
        self.now += seconds
        self.record(self.queue.expire(self.now))
        deadline = self.queue.next_deadline()
        assert deadline is None or deadline > self.now

    @rule(seconds=st.sampled_from([0.5, TIMEOUT_S]))
    def advance_clock_only(self, seconds: float) -> None:
        self.now += seconds

    @rule(trainer=st.sampled_from(TRAINERS))
    def lose_trainer(self, trainer: str) -> None:
        held = self.queue.pending_of(trainer)
        events = self.queue.trainer_lost(trainer, self.now)
        assert [e.task_id for e in events if e.kind is EventKind.REQUEUED] == [
            d.task_id for d in held
        ]
        assert EventKind.FAILED not in kinds(events)
        self.record(events)

    @rule()
    def crash_and_restore(self) -> None:
        """The master dies; a new one restores from what the shell persisted."""
        self.now += 1.0
        restored = TaskQueue.restore(
            ranges_of(self.num_tasks),
            self.queue.config,
            self.saved_meta,
            self.saved_records,
            self.now,
        )
        # Every change was persisted: the restored queue is the same queue.
        assert restored.meta() == self.queue.meta()
        for task_id in range(self.num_tasks):
            assert restored.record(task_id) == self.queue.record(task_id), task_id
        assert restored.stats() == self.queue.stats()
        assert restored.trainers() == self.queue.trainers()
        assert drain_order(restored, self.now) == drain_order(self.queue, self.now)
        assert restored.settle() == []
        for trainer in TRAINERS:
            assert [p.deadline for p in restored.pending_of(trainer)] == [
                self.now + TIMEOUT_S for _ in restored.pending_of(trainer)
            ]
        self.queue = restored
        self.restores += 1

    def snapshot(self) -> tuple[object, ...]:
        return (
            self.queue.stats(),
            self.queue.meta(),
            tuple(str(self.queue.record(i)) for i in range(self.num_tasks)),
            tuple(tuple(self.queue.pending_of(t)) for t in TRAINERS),
            self.queue.next_deadline(),
        )

    @invariant()
    def counters_add_up(self) -> None:
        stats = self.queue.stats()
        states = Counter(self.queue.state_of(i) for i in range(self.num_tasks))
        assert stats.todo == states[TaskState.TODO]
        assert stats.pending == states[TaskState.PENDING]
        assert stats.done == states[TaskState.DONE]
        assert stats.failed == states[TaskState.FAILED]
        assert stats.pending == sum(len(self.queue.pending_of(t)) for t in TRAINERS)
        assert stats.finished or stats.todo + stats.pending > 0
        assert stats.done_all_passes == sum(self.done_in_pass.values())

    def teardown(self) -> None:
        if not hasattr(self, "queue"):
            return
        # Drive the job to completion: one diligent trainer takes every task
        # and succeeds; tasks held by others are reclaimed by timeouts.
        for _ in range(10 * self.num_tasks * self.num_passes + 10):
            result, events = self.queue.get_task("finisher", self.now)
            self.record(events)
            if isinstance(result, Finished):
                break
            if isinstance(result, Wait):
                self.now += TIMEOUT_S
                self.record(self.queue.expire(self.now))
            else:
                assert isinstance(result, Dispatch)
                assert result.offset == self.offsets[(result.pass_id, result.task_id)]
                self.record(succeed(self.queue, result, self.now))
        else:
            pytest.fail("job did not finish")
        assert self.jobs_finished == 1
        assert self.passes_started == self.num_passes - 1
        assert self.passes_completed == self.num_passes
        for pass_id in range(self.num_passes):
            self.check_pass_complete(pass_id)
        assert set(self.outcomes) == {
            (p, t) for p in range(self.num_passes) for t in range(self.num_tasks)
        }


TaskQueueMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_every_task_ends_done_or_failed_exactly_once_per_pass = TaskQueueMachine.TestCase


# --- verified passes: PASS_READY, rewind, complete_pass ----------------------------


def make_verified_queue(num_tasks: int = 2, num_passes: int = 2) -> TaskQueue:
    ranges = [DataRange("data.parquet", 10 * i, 10 * i + 10) for i in range(num_tasks)]
    config = QueueConfig(task_timeout_s=TIMEOUT_S, num_passes=num_passes, verify_passes=True)
    return TaskQueue(ranges, config)


def finish_all(queue: TaskQueue) -> list[TaskEvent]:
    events: list[TaskEvent] = []
    while True:
        result, _ = queue.get_task("t0", 0.0)
        if not isinstance(result, Dispatch):
            return events
        events.extend(succeed(queue, result))


def test_a_verified_pass_waits_for_complete_pass() -> None:
    queue = make_verified_queue()
    events = finish_all(queue)
    assert kinds(events)[-1] is EventKind.PASS_READY
    assert queue.awaiting_verification
    result, again = queue.get_task("t1", 0.0)
    assert isinstance(result, Wait) and again == []
    assert queue.settle() == []  # announced once

    done = queue.complete_pass(0)
    assert kinds(done) == [EventKind.PASS_COMPLETED, EventKind.PASS_STARTED]
    summary = done[0].summary
    assert summary is not None and summary.shards_checked is True and summary.exactly_once
    assert queue.complete_pass(0) == []  # once only


def test_rewinding_a_done_task_reopens_it_at_the_first_record_some_shard_lacks() -> None:
    queue = make_verified_queue(num_tasks=2, num_passes=1)
    finish_all(queue)
    events = queue.rewind(1, 4, 0.0)
    assert kinds(events) == [EventKind.REOPENED]
    assert not queue.awaiting_verification
    assert queue.state_of(1) is TaskState.TODO
    assert queue.offset_of(1) == 4
    d = dispatch(queue)
    assert (d.task_id, d.offset) == (1, 4)
    assert kinds(succeed(queue, d)) == [EventKind.DONE, EventKind.PASS_READY]
    done = queue.complete_pass(0)
    summary = done[0].summary
    assert summary is not None
    # The ledger tiles every task exactly once again, and says what was re-opened.
    assert summary.ledger_exactly_once and summary.records_reopened == 6
    assert summary.records_trained == 20
    assert kinds(done)[-1] is EventKind.JOB_FINISHED


def test_rewind_past_the_offset_or_of_a_failed_task_changes_nothing() -> None:
    queue = make_verified_queue(num_tasks=1, num_passes=1)
    d = dispatch(queue)
    queue.report_progress(d.task_id, d.pass_id, d.attempt, 3, 0.0)
    assert queue.rewind(0, 5, 0.0) == []
    assert queue.offset_of(0) == 3


def test_rewinding_a_pending_task_ends_its_attempt() -> None:
    queue = make_verified_queue(num_tasks=1, num_passes=1)
    d = dispatch(queue)
    queue.report_progress(d.task_id, d.pass_id, d.attempt, 8, 0.0)
    queue.rewind(0, 2, 0.0)
    with pytest.raises(StaleTaskError):
        succeed(queue, d)
    again = dispatch(queue, "t1")
    assert again.offset == 2 and again.attempt == d.attempt + 1


def test_a_summary_with_lost_records_is_not_exactly_once() -> None:
    queue = make_verified_queue(num_tasks=1, num_passes=1)
    finish_all(queue)
    (completed, _) = queue.complete_pass(0, records_lost=7, passes_lost=[0])
    assert completed.summary is not None
    assert completed.summary.ledger_exactly_once
    assert not completed.summary.exactly_once
    assert completed.summary.as_dict()["passes_lost"] == [0]


def test_a_restored_queue_announces_a_ready_pass_again() -> None:
    queue = make_verified_queue(num_tasks=2, num_passes=2)
    finish_all(queue)
    records = {i: queue.record(i) for i in range(queue.num_tasks)}
    restored = TaskQueue.restore(
        [DataRange("data.parquet", 10 * i, 10 * i + 10) for i in range(2)],
        QueueConfig(task_timeout_s=TIMEOUT_S, num_passes=2, verify_passes=True),
        queue.meta(),
        records,
        0.0,
    )
    assert kinds(restored.settle()) == [EventKind.PASS_READY]
    assert restored.done_tasks() == [0, 1]


# --- repairs of sealed passes ------------------------------------------------------


def queue_in_pass_1_ready() -> TaskQueue:
    """Pass 0 completed, and every task of pass 1 done: pass 1 awaits verification."""
    queue = make_verified_queue(num_tasks=2, num_passes=2)
    finish_all(queue)
    queue.complete_pass(0)
    finish_all(queue)
    assert queue.awaiting_verification
    return queue


def test_repairs_are_dispatched_with_the_sealed_pass_then_the_pass_is_ready_again() -> None:
    queue = queue_in_pass_1_ready()
    events = queue.open_repairs(0, {1: 4})
    assert [(e.kind, e.task_id, e.pass_id, e.reason) for e in events] == [
        (EventKind.REPAIR, 1, 0, "reopened")
    ]
    assert not queue.awaiting_verification and queue.repairing
    d = dispatch(queue, "t0")
    assert (d.task_id, d.pass_id, d.offset) == (1, 0, 4)
    assert queue.trainers() == {"t0"} and queue.pending_of("t0") == [d]
    assert isinstance(queue.get_task("t1", 0.0)[0], Wait)
    assert queue.report_progress(d.task_id, d.pass_id, d.attempt, 7, 1.0) == []
    assert queue.skip_budget(d.task_id, d.pass_id) == queue.config.max_task_timeouts
    assert kinds(succeed(queue, d)) == [EventKind.REPAIR, EventKind.PASS_READY]
    # The current pass's own tasks were not touched.
    assert queue.done_tasks() == [0, 1] and queue.offset_of(1) == 10
    (completed, finished) = queue.complete_pass(1)
    assert completed.summary is not None and finished.kind is EventKind.JOB_FINISHED
    assert (completed.summary.records_repaired, completed.summary.passes_repaired) == (6, (0,))
    assert completed.summary.as_dict()["passes_repaired"] == [0]
    assert completed.summary.exactly_once


def test_a_lost_trainers_repair_is_requeued_and_a_failed_one_is_not_reopened() -> None:
    queue = queue_in_pass_1_ready()
    queue.open_repairs(0, {0: 0})
    d = dispatch(queue, "t0")
    (requeued,) = queue.trainer_lost("t0", 0.0)
    assert requeued.kind is EventKind.REPAIR and requeued.reason.startswith("requeued")
    with pytest.raises(StaleTaskError):
        succeed(queue, d)
    # Time out every attempt: the repair fails, its records are lost.
    now = 0.0
    while queue.repairing:
        again = dispatch(queue, "t1", now)
        now += 2 * TIMEOUT_S
        queue.expire(now)
    assert again.pass_id == 0 and queue.awaiting_verification
    assert queue.open_repairs(0, {0: 0}) == []  # stays failed in this pass
    (completed, _) = queue.complete_pass(1, records_lost=10, passes_lost=[0])
    assert completed.summary is not None and completed.summary.records_repaired == 0


def test_repairs_open_only_while_the_pass_awaits_verification_and_are_not_durable() -> None:
    from elasticps.coord.keys import Keys
    from elasticps.master.ledger import ledger_writes

    queue = make_verified_queue(num_tasks=2, num_passes=2)
    assert queue.open_repairs(0, {0: 0}) == []  # pass 0 is running
    queue = queue_in_pass_1_ready()
    with pytest.raises(ValueError, match="not an earlier pass"):
        queue.open_repairs(1, {0: 0})
    events = queue.open_repairs(0, {0: 0})
    assert ledger_writes(Keys("job"), queue, events) == []
