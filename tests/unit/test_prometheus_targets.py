"""The Prometheus targets file, from the roles' ``metrics/`` records. No sockets."""

from __future__ import annotations

import json

from elasticps.metrics import targets_file


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
