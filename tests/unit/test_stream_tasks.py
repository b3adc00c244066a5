"""A stream's tasks: the window cutter, the open-ended task queue and its ledger records."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticps.coord.keys import Keys
from elasticps.data.kafka import (
    KafkaSource,
    StreamLimits,
    WindowCutter,
    decode_values,
    load_client_config,
)
from elasticps.errors import ConfigError, DataError, InvalidRecordError
from elasticps.master.ledger import ledger_writes
from elasticps.master.stream import committed_offsets, lag_of, resume_point
from elasticps.master.taskqueue import (
    DataRange,
    Dispatch,
    EventKind,
    Finished,
    QueueConfig,
    TaskQueue,
    Wait,
)
from elasticps.master.verify import ShardCoverage

SOURCE = KafkaSource.parse("kafka://127.0.0.1:9092/clicks")


def test_source_url_round_trips_through_partition_file_names() -> None:
    assert SOURCE.bootstrap == "127.0.0.1:9092" and SOURCE.topic == "clicks"
    name = SOURCE.partition_file(3)
    assert name == "kafka://127.0.0.1:9092/clicks/3"
    assert KafkaSource.parse_partition_file(name) == (SOURCE, 3)


@pytest.mark.parametrize(
    "url",
    ["kafka://", "kafka://host/t", "kafka://h:1/", "kafka://h:1/a/b", "kafka://h:1/bad topic"],
)
def test_malformed_kafka_urls_are_config_errors(url: str) -> None:
    with pytest.raises(ConfigError):
        KafkaSource.parse(url)


def test_window_closes_at_records_per_task() -> None:
    cutter = WindowCutter(StreamLimits(records_per_task=3, window_s=10))
    out = [r for offset in range(7) for r in cutter.observe(0, offset, now=0.0)]
    assert out == [(0, 0, 3), (0, 3, 6)]
    assert cutter.flush() == [(0, 6, 7)]
    assert cutter.flush() == []


def test_window_closes_after_window_s_from_its_first_record() -> None:
    cutter = WindowCutter(StreamLimits(records_per_task=100, window_s=1.0))
    cutter.observe(1, 40, now=10.0)  # a partition starts at the first offset it sees
    cutter.observe(1, 41, now=10.5)
    assert cutter.tick(10.9) == []
    assert cutter.tick(11.0) == [(1, 40, 42)]
    assert cutter.tick(20.0) == []  # no open window
    cutter.observe(1, 42, now=20.0)
    assert cutter.tick(20.5) == [] and cutter.tick(21.0) == [(1, 42, 43)]


def test_cutter_resumes_where_the_ledger_ends_and_ignores_records_read_again() -> None:
    cutter = WindowCutter(StreamLimits(records_per_task=2, window_s=5), cut_to={0: 10})
    assert cutter.start_offset(0) == 10 and cutter.start_offset(1) is None
    assert cutter.observe(0, 9, now=0.0) == []
    assert cutter.observe(0, 10, now=0.0) == []
    assert cutter.observe(0, 11, now=0.0) == [(0, 10, 12)]


def test_until_offset_ends_each_partition_and_the_stream() -> None:
    cutter = WindowCutter(StreamLimits(records_per_task=4, window_s=5, until_offset=6))
    out = [r for offset in range(8) for r in cutter.observe(0, offset, now=0.0)]
    assert out == [(0, 0, 4), (0, 4, 6)]
    assert not cutter.all_ended([0, 1])
    for offset in range(6):
        cutter.observe(1, offset, now=0.0)
    assert cutter.all_ended([0, 1])
    assert cutter.heads() == {0: 6, 1: 6}


def stream_queue() -> TaskQueue:
    return TaskQueue([], QueueConfig(task_timeout_s=5, streaming=True, verify_passes=False))


def test_stream_queue_starts_empty_waits_and_ends_only_when_sealed() -> None:
    q = stream_queue()
    result, _ = q.get_task("t0", now=0.0)
    assert isinstance(result, Wait)
    events = q.add_tasks([DataRange(SOURCE.partition_file(0), 0, 5)])
    assert [e.kind for e in events] == [EventKind.ADDED]
    task, _ = q.get_task("t0", now=0.0)
    assert isinstance(task, Dispatch) and task.data.end == 5
    events = q.report_task(task.task_id, task.pass_id, task.attempt, success=True, now=1.0)
    assert EventKind.PASS_COMPLETED not in {e.kind for e in events}  # not sealed
    assert isinstance(q.get_task("t0", now=1.0)[0], Wait)
    events = q.seal()
    kinds = [e.kind for e in events]
    assert kinds[0] is EventKind.SEALED and EventKind.JOB_FINISHED in kinds
    assert isinstance(q.get_task("t0", now=2.0)[0], Finished)
    with pytest.raises(ConfigError):
        q.add_tasks([DataRange(SOURCE.partition_file(0), 5, 6)])


def test_stream_queue_restores_its_tasks_ranges_from_the_ledger_records() -> None:
    q = stream_queue()
    q.add_tasks(
        [DataRange(SOURCE.partition_file(0), 0, 4), DataRange(SOURCE.partition_file(1), 7, 9)]
    )
    task, _ = q.get_task("t0", now=0.0)
    assert isinstance(task, Dispatch)
    q.report_progress(task.task_id, task.pass_id, task.attempt, 2, now=0.5)
    writes = dict(ledger_writes(Keys("j"), q, [e for e in q.seal()]))
    assert any(k.endswith("queue/meta") for k in writes)
    records = {i: q.record(i) for i in range(q.num_tasks)}
    assert records[1]["data"] == [SOURCE.partition_file(1), 7, 9]
    restored = TaskQueue.restore([], q.config, q.meta(), records, now=1.0)
    assert restored.sealed and restored.num_tasks == 2
    assert restored.stream_ends() == {SOURCE.partition_file(0): 4, SOURCE.partition_file(1): 9}
    assert restored.untrained_from() == {
        SOURCE.partition_file(0): (2, 0),
        SOURCE.partition_file(1): (7, 7),
    }
    del records[1]["data"]
    with pytest.raises(InvalidRecordError):
        TaskQueue.restore([], q.config, q.meta(), records, now=1.0)


def test_a_stream_has_one_pass() -> None:
    with pytest.raises(ConfigError):
        QueueConfig(streaming=True, num_passes=2)


def test_lag_counts_records_read_but_untrained_and_the_age_of_the_oldest() -> None:
    lag = lag_of(
        heads={0: 100, 1: 50},
        cut={0: 100, 1: 50},
        untrained={0: (80, 60), 1: (20, None)},  # 1: tasks done to 20, then trained before
        arrived={(0, 60): 1000.0},
        now_wall=1012.5,
    )
    assert lag["records_behind"] == 20
    assert lag["oldest_untrained_age_s"] == 12.5
    assert lag["partitions"] == {
        "0": {"head": 100, "behind": 20, "oldest_untrained_age_s": 12.5},
        "1": {"head": 50, "behind": 0, "oldest_untrained_age_s": None},
    }


def test_records_decode_from_json_objects_and_bad_ones_name_their_offset() -> None:
    table = decode_values(
        [b'{"idx": 1, "x": [1, 2]}', b'{"idx": 2, "x": [3, 4]}'], ["idx"], "p0", 10
    )
    assert table.column_names == ["idx"] and table.column("idx").to_pylist() == [1, 2]
    with pytest.raises(DataError, match="offset 11: not a UTF-8 JSON record"):
        decode_values([b'{"idx": 1}', b"{oops"], ["idx"], "p0", 10)
    with pytest.raises(DataError, match="offset 10: the record lacks column"):
        decode_values([b'{"x": 1}'], ["idx"], "p0", 10)


def test_client_config_file_takes_key_values_and_refuses_what_elasticps_sets(
    tmp_path: Path,
) -> None:
    good = tmp_path / "client.properties"
    good.write_text("# security\nsecurity.protocol=SASL_SSL\nsasl.username = me\n")
    assert load_client_config(good) == {"security.protocol": "SASL_SSL", "sasl.username": "me"}
    bad = tmp_path / "bad.properties"
    bad.write_text("group.id=mine\n")
    with pytest.raises(ConfigError, match="set by elasticps"):
        load_client_config(bad)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_client_config(tmp_path / "missing")


def test_committed_offsets_are_what_every_server_holds_and_resume_trains_the_rest() -> None:
    p0, p1 = SOURCE.partition_file(0), SOURCE.partition_file(1)
    ranges = {0: DataRange(p0, 0, 10), 1: DataRange(p0, 10, 20), 2: DataRange(p1, 5, 15)}
    shard0 = ShardCoverage(0, sealed=False, intervals=[(0, 0, 10), (1, 0, 4), (2, 0, 10)])
    shard1 = ShardCoverage(1, sealed=False, intervals=[(0, 0, 10), (1, 0, 2), (2, 0, 6)])
    offsets = committed_offsets(ranges, [shard0, shard1])
    assert offsets == {
        p0: {"start": 0, "end": 20, "trained": [[0, 12]]},
        p1: {"start": 5, "end": 15, "trained": [[5, 11]]},
    }
    cut_to, gaps = resume_point(offsets)
    assert cut_to == {0: 20, 1: 15}
    assert gaps == [DataRange(p0, 12, 20), DataRange(p1, 11, 15)]
    sealed = committed_offsets(ranges, [ShardCoverage(0, sealed=True)])
    assert resume_point(sealed)[1] == []
    with pytest.raises(DataError):
        resume_point({p0: {"start": 0}})


def test_train_flags_of_a_stream_build_its_job_config() -> None:
    from elasticps import cli

    stream = ["train", "--model", "m.py", "--data", "kafka://127.0.0.1:9092/clicks"]
    until = ["--until-time", "2030-01-02T03:04:05+00:00", "--until-offset", "100"]
    args = cli.parse_args([*stream, *until, "--task-window-s", "2", "--test-data", "d/x.parquet"])
    config = cli.job_config(args)
    assert config.stream == "kafka://127.0.0.1:9092/clicks"
    assert config.until_time == 1893553445.0 and config.until_offset == 100
    assert config.task_window_s == 2.0 and config.test_data == Path("d/x.parquet")
    with pytest.raises(ConfigError, match="no passes"):
        cli.job_config(cli.parse_args([*stream, "--epochs", "2"]))
