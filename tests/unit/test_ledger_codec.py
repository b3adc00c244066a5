"""The task ledger's codec: records and meta as JSON, their validation, the spec,
and which keys a mutation writes (``elasticps.master.ledger``, no etcd)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from elasticps.coord.store import Keys
from elasticps.errors import ConfigError
from elasticps.master.ledger import (
    KEPT_PASS_SUMMARIES,
    LedgerSpec,
    decode_object,
    encode,
    ledger_deletes,
    ledger_writes,
)
from elasticps.master.taskqueue import (
    DataRange,
    Dispatch,
    InvalidRecordError,
    QueueConfig,
    TaskQueue,
)

TIMEOUT_S = 10.0
CONFIG = QueueConfig(task_timeout_s=TIMEOUT_S, max_task_timeouts=2, num_passes=2)
RANGES = [DataRange("train.parquet", 10 * i, 10 * i + 10) for i in range(4)]
KEYS = Keys("codec-job")


def busy_queue() -> TaskQueue:
    """A queue with a task in every state and some progress."""
    queue = TaskQueue(RANGES, CONFIG)
    d = [queue.get_task(t, 0.0)[0] for t in ("a", "b", "c")]
    assert all(isinstance(x, Dispatch) for x in d)
    d0, d1, d2 = (x for x in d if isinstance(x, Dispatch))
    queue.report_progress(d0.task_id, 0, d0.attempt, 4, 1.0)
    queue.report_task(d0.task_id, 0, d0.attempt, success=True, now=2.0)
    queue.report_progress(d1.task_id, 0, d1.attempt, 3, 1.0)
    queue.trainer_lost("b", 2.0)
    queue.report_progress(d2.task_id, 0, d2.attempt, 7, 1.0)
    return queue


def through_json(queue: TaskQueue) -> tuple[dict[str, object], dict[int, dict[str, object]]]:
    meta = decode_object(encode(queue.meta()).encode("utf-8"), "meta")
    records = {
        i: decode_object(encode(queue.record(i)).encode("utf-8"), f"task {i}")
        for i in range(queue.num_tasks)
    }
    return meta, records


def valid_record(**changes: Any) -> dict[str, Any]:
    record: dict[str, Any] = {
        "pass": 0,
        "state": "pending",
        "attempt": 2,
        "timeouts": 1,
        "offset": 6,
        "segments": [[1, 0, 4], [2, 4, 6]],
        "trainer": "t0",
        "seq": None,
    }
    record.update(changes)
    return record


def valid_meta(**changes: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "format": 1,
        "pass": 0,
        "num_passes": 2,
        "finished": False,
        "done_before": 0,
    }
    meta.update(changes)
    return meta


def restore_with(record: dict[str, Any], meta: dict[str, Any] | None = None) -> TaskQueue:
    """Restore a one-task queue from one record."""
    return TaskQueue.restore(RANGES[:1], CONFIG, meta or valid_meta(), {0: record}, 0.0)


# --- round trips ---------------------------------------------------------------


def test_records_and_meta_round_trip_through_json_text() -> None:
    queue = busy_queue()
    meta, records = through_json(queue)
    restored = TaskQueue.restore(RANGES, CONFIG, meta, records, 5.0)
    assert restored.meta() == queue.meta()
    assert [restored.record(i) for i in range(4)] == [queue.record(i) for i in range(4)]
    assert restored.stats() == queue.stats()


def test_a_record_is_compact_json_with_every_field() -> None:
    queue = busy_queue()
    text = encode(queue.record(1))
    assert " " not in text
    assert json.loads(text) == {
        "attempt": 1,
        "offset": 3,
        "pass": 0,
        "segments": [[1, 0, 3]],
        "seq": 0,
        "state": "todo",
        "timeouts": 0,
        "trainer": None,
    }
    assert json.loads(encode(queue.record(2)))["trainer"] == "c"


def test_a_valid_hand_written_record_is_accepted() -> None:
    queue = restore_with(valid_record())
    assert queue.record(0) == valid_record()
    [held] = queue.pending_of("t0")
    # The attempt started where its own first segment starts.
    assert (held.attempt, held.offset, held.deadline) == (2, 4, TIMEOUT_S)


# --- validation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"state": "lost"}, "'state' must be one of"),
        ({"attempt": True}, "'attempt' must be an integer"),
        ({"attempt": "2"}, "'attempt' must be an integer"),
        ({"timeouts": -1}, "'timeouts' must be >= 0"),
        ({"pass": 1}, r"'pass' must be in \[0, 0\]"),
        ({"offset": 11, "segments": [[2, 0, 11]]}, r"'offset' must be in \[0, 10\]"),
        ({"segments": {"a": 1}}, "'segments' must be a list"),
        ({"segments": [[1, 0]], "offset": 0}, r"each segment must be \[attempt, from, to\]"),
        ({"segments": [[3, 0, 6]]}, r"'segment attempt' must be in \[1, 2\]"),
        ({"segments": [[2, 5, 5]], "offset": 5}, "'segment to' must be in"),
        ({"segments": [[1, 0, 4]]}, "'offset' 6 is not where its last segment ends"),
        ({"state": "done"}, "done, but its offset 6 is not its length 10"),
        ({"trainer": None}, "pending, but without a trainer"),
        ({"trainer": 7}, "'trainer' must be a string or null"),
        ({"seq": -2}, "'seq' must be >= 0"),
    ],
)
def test_malformed_records_are_refused_with_the_task_and_field_named(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidRecordError, match=message) as caught:
        restore_with(valid_record(**changes))
    assert "ledger record of task 0" in str(caught.value)


def test_records_with_missing_or_unknown_fields_are_refused() -> None:
    record = valid_record()
    del record["offset"]
    with pytest.raises(InvalidRecordError, match=r"missing fields \['offset'\]"):
        restore_with(record)
    with pytest.raises(InvalidRecordError, match=r"unknown fields \['deadline'\]"):
        restore_with(valid_record(deadline=3.0))
    with pytest.raises(InvalidRecordError, match="expected a JSON object"):
        TaskQueue.restore(RANGES[:1], CONFIG, valid_meta(), {0: [1, 2]}, 0.0)  # type: ignore[dict-item]


def test_a_ledger_without_one_record_per_task_is_refused() -> None:
    with pytest.raises(InvalidRecordError, match=r"missing \[1\], unexpected \[\]"):
        TaskQueue.restore(RANGES[:2], CONFIG, valid_meta(), {0: valid_record()}, 0.0)
    with pytest.raises(InvalidRecordError, match=r"missing \[\], unexpected \[5\]"):
        TaskQueue.restore(
            RANGES[:1], CONFIG, valid_meta(), {0: valid_record(), 5: valid_record()}, 0.0
        )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": 2}, "format 2 is not supported"),
        ({"format": True}, "format True is not supported"),
        ({"num_passes": 3}, "the ledger has 3 passes, the configuration 2"),
        ({"pass": 2}, r"'pass' must be in \[0, 1\]"),
        ({"finished": "no"}, "'finished' must be true or false"),
        ({"done_before": -1}, "'done_before' must be >= 0"),
        ({"finished": True}, "says the job is finished, but pass 0 still has"),
    ],
)
def test_malformed_meta_is_refused(changes: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidRecordError, match=message):
        restore_with(valid_record(), valid_meta(**changes))


def test_decode_refuses_text_that_is_not_a_json_object() -> None:
    with pytest.raises(InvalidRecordError, match="tasks/0000000003: not valid UTF-8 JSON"):
        decode_object(b"{nope", "tasks/0000000003")
    with pytest.raises(InvalidRecordError, match="not valid UTF-8 JSON"):
        decode_object(b"\xff\xfe", "k")
    with pytest.raises(InvalidRecordError, match="expected a JSON object, got list"):
        decode_object("[1]", "k")


def test_invalid_record_error_is_a_coordination_and_value_error() -> None:
    from elasticps.errors import CoordinationError

    assert issubclass(InvalidRecordError, CoordinationError)
    assert issubclass(InvalidRecordError, ValueError)


# --- which keys a mutation writes ---------------------------------------------------


def test_a_dispatch_writes_one_task_record_and_nothing_else() -> None:
    queue = TaskQueue(RANGES, CONFIG)
    result, events = queue.get_task("a", 0.0)
    assert isinstance(result, Dispatch)
    assert ledger_writes(KEYS, queue, events) == [(KEYS.task(0), encode(queue.record(0)))]
    assert ledger_writes(KEYS, queue, []) == []


def test_the_end_of_a_pass_writes_the_record_the_summary_and_the_meta_last() -> None:
    queue = TaskQueue(RANGES[:1], CONFIG)
    result, _ = queue.get_task("a", 0.0)
    assert isinstance(result, Dispatch)
    queue.report_progress(0, 0, result.attempt, 4, 1.0)
    events = queue.report_task(0, 0, result.attempt, success=True, now=2.0)
    writes = ledger_writes(KEYS, queue, events)
    assert [key for key, _ in writes] == [KEYS.task(0), KEYS.pass_summary(0), KEYS.queue_meta]
    summary = json.loads(writes[1][1])
    assert summary == {
        "pass_id": 0,
        "tasks": 1,
        "records": 10,
        "done": 1,
        "failed": 0,
        "records_trained": 10,
        "duplicated_records": 0,
        "missing_records": 0,
        "shards_checked": None,
        "records_reopened": 0,
        "records_lost": 0,
        "passes_lost": [],
        "failed_tasks": [],
        "records_skipped": 0,
        "records_repaired": 0,
        "passes_repaired": [],
        "exactly_once": True,
    }
    assert json.loads(writes[2][1]) == queue.meta()
    assert json.loads(writes[2][1])["pass"] == 1


def test_a_task_named_by_several_events_is_written_once_with_its_final_record() -> None:
    queue = TaskQueue(RANGES[:2], CONFIG)
    result, events = queue.get_task("a", 0.0)
    assert isinstance(result, Dispatch)
    events += queue.report_progress(0, 0, result.attempt, 5, 1.0)
    events += queue.trainer_lost("a", 2.0)
    assert [e.task_id for e in events] == [0, 0, 0]
    writes = ledger_writes(KEYS, queue, events)
    assert writes == [(KEYS.task(0), encode(queue.record(0)))]
    assert json.loads(writes[0][1])["state"] == "todo"


# --- the spec ------------------------------------------------------------------------


SPEC = LedgerSpec(files=(("a.parquet", 25), ("b.parquet", 10)), records_per_task=10, num_passes=2)


def test_spec_round_trips_and_cuts_the_same_ranges() -> None:
    stored = json.loads(encode(SPEC.as_dict()))
    assert stored["num_tasks"] == 4
    assert LedgerSpec.from_dict(stored) == SPEC
    assert SPEC.ranges()[-1] == DataRange("b.parquet", 0, 10)
    SPEC.check_matches(LedgerSpec.from_dict(stored))


def test_a_ledger_of_another_configuration_is_refused_naming_the_difference() -> None:
    other = LedgerSpec(files=SPEC.files, records_per_task=5, num_passes=2)
    with pytest.raises(ConfigError, match="records_per_task: ledger 10, this master 5") as caught:
        other.check_matches(SPEC)
    assert "files" not in str(caught.value)
    moved = LedgerSpec(files=(("c.parquet", 25),), records_per_task=10, num_passes=2)
    with pytest.raises(ConfigError, match=r"another job configuration .*files"):
        moved.check_matches(SPEC)


@pytest.mark.parametrize(
    "stored",
    [
        {"format": 9, "files": [], "records_per_task": 1, "num_passes": 1},
        {"format": 1, "files": [["a", -1]], "records_per_task": 1, "num_passes": 1},
        {"format": 1, "files": [["a"]], "records_per_task": 1, "num_passes": 1},
        {"format": 1, "files": [["a", 3]], "records_per_task": "1", "num_passes": 1},
        {"format": 1, "files": "a", "records_per_task": 1, "num_passes": 1},
    ],
)
def test_a_malformed_spec_is_refused(stored: dict[str, Any]) -> None:
    with pytest.raises(InvalidRecordError, match="ledger spec"):
        LedgerSpec.from_dict(stored)


def test_ledger_keys_are_zero_padded_under_the_job_root() -> None:
    assert KEYS.queue_meta == "/elasticps/codec-job/queue/meta"
    assert KEYS.queue_spec == "/elasticps/codec-job/queue/spec"
    assert KEYS.pass_summary(3) == "/elasticps/codec-job/passes/000003"
    with pytest.raises(ConfigError):
        KEYS.pass_summary(-1)


def test_a_completed_pass_deletes_the_audit_that_fell_out_of_the_kept_window() -> None:
    from elasticps.pserver.checkpoint import KEEP_CHECKPOINTS

    # The oldest checkpoint a server keeps predates at most KEEP_CHECKPOINTS seals;
    # a repair of those passes needs their audits.
    assert KEPT_PASS_SUMMARIES > KEEP_CHECKPOINTS
    passes = KEPT_PASS_SUMMARIES + 2
    queue = TaskQueue(RANGES[:1], QueueConfig(task_timeout_s=TIMEOUT_S, num_passes=passes))
    deleted: list[str] = []
    for _ in range(passes):
        result, _ = queue.get_task("a", 0.0)
        assert isinstance(result, Dispatch)
        events = queue.report_task(0, result.pass_id, result.attempt, success=True, now=0.0)
        deleted += ledger_deletes(KEYS, events)
    assert deleted == [KEYS.pass_summary(0), KEYS.pass_summary(1)]
