"""The Prometheus targets file, from the roles' ``metrics/`` records. No sockets."""

from __future__ import annotations

import json

from elasticps.metrics import mean_step_s, stragglers, targets_file


def test_the_targets_file_lists_each_well_formed_record_once() -> None:
    records = {
        "/j/metrics/ps-1": {"address": "127.0.0.1:9001", "role": "ps", "id": "1"},
        "/j/metrics/ps-0": {"address": "127.0.0.1:9000", "role": "ps", "id": "0"},
        "/j/metrics/bad": {"address": "", "role": "ps", "id": "2"},
        "/j/metrics/worse": ["not", "a", "record"],
    }
    groups = json.loads(targets_file(records, "j"))
    assert groups == [
        {"targets": ["127.0.0.1:9000"], "labels": {"job": "j", "role": "ps", "id": "0"}},
        {"targets": ["127.0.0.1:9001"], "labels": {"job": "j", "role": "ps", "id": "1"}},
    ]


def test_a_trainer_far_above_the_median_step_time_is_a_straggler() -> None:
    assert stragglers({"0": 0.1, "1": 0.11, "2": 0.5}) == ["2"]
    assert stragglers({"0": 0.1, "1": 0.11, "2": 0.19, "3": 0.1}) == []
    assert stragglers({"0": 0.1, "1": 5.0}) == []  # two: no median to stand out from


def test_the_mean_step_time_is_read_from_a_trainer_s_metrics() -> None:
    text = (
        "# TYPE elasticps_trainer_step_seconds histogram\n"
        'elasticps_trainer_step_seconds_bucket{le="+Inf"} 4.0\n'
        "elasticps_trainer_step_seconds_count 4.0\n"
        "elasticps_trainer_step_seconds_sum 2.0\n"
    )
    assert mean_step_s(text) == 0.5
    assert mean_step_s("# TYPE x counter\nx_total 1.0\n") is None


def test_staleness_since_counts_a_restarted_shard_from_zero() -> None:
    from elasticps.metrics import staleness_since

    def load(total: float, count: float) -> dict[str, float]:
        return {"staleness_sum": total, "staleness_count": count}

    before = {"0": load(10.0, 10.0), "1": load(4.0, 2.0)}
    # Shard 0: 10 more pushes of staleness 3; shard 1 restarted: 2 pushes of 1.
    now = {"0": load(40.0, 20.0), "1": load(2.0, 2.0)}
    assert staleness_since(before, now) == (30.0 + 2.0) / 12
    assert staleness_since(now, now) is None
    assert staleness_since({}, {"2": load(6.0, 3.0)}) == 2.0
