"""CheckpointHealthWatch: the launcher's policy over the PS checkpoint health records."""

from __future__ import annotations

import pytest

from elasticps.errors import ConfigError
from elasticps.launcher.checkpoint_health import CheckpointHealthWatch


def failing(since: float, failures: int = 1, error: str = "No space left on device") -> dict:
    return {
        "ok": False,
        "failing_since_unix_s": since,
        "error": error,
        "failures": failures,
        "saved_version": 3,
    }


OK = {"ok": True, "failing_since_unix_s": None, "error": "", "failures": 0, "saved_version": 9}


def test_healthy_records_say_nothing() -> None:
    watch = CheckpointHealthWatch(10.0)
    verdict = watch.update({"ps-0": OK, "ps-1": OK}, 100.0)
    assert verdict.warnings == () and verdict.fatal is None and not watch.failing
    assert watch.summary() == {"ok": True, "failing": [], "events": []}


def test_the_first_failure_warns_once_and_the_grace_period_makes_it_fatal() -> None:
    watch = CheckpointHealthWatch(10.0)
    first = watch.update({"ps-0": OK, "ps-1": failing(100.0)}, 100.5)
    assert len(first.warnings) == 1 and "ps-1" in first.warnings[0]
    assert "No space left" in first.warnings[0] and first.fatal is None
    again = watch.update({"ps-1": failing(100.0, failures=3)}, 109.9)
    assert again.warnings == () and again.fatal is None
    late = watch.update({"ps-1": failing(100.0, failures=4)}, 110.0)
    assert late.fatal is not None and "ps-1" in late.fatal and "4 attempts" in late.fatal
    summary = watch.summary()
    assert summary["ok"] is False
    assert summary["failing"] == [
        {"ps": "ps-1", "since_unix_s": 100.0, "error": "No space left on device", "failures": 4}
    ]


def test_a_success_ends_the_spell_and_a_new_failure_warns_again() -> None:
    watch = CheckpointHealthWatch(10.0)
    watch.update({"ps-0": failing(100.0)}, 101.0)
    back = watch.update({"ps-0": OK}, 105.0)
    assert back.recovered == ("ps-0",) and not watch.failing
    # The grace period counts from the new spell's start, not the old one's.
    new = watch.update({"ps-0": failing(108.0)}, 115.0)
    assert len(new.warnings) == 1 and new.fatal is None
    events = watch.summary()["events"]
    assert [e["event"] for e in events] == ["failing", "recovered", "failing"]  # type: ignore[index]


def test_a_restarted_server_spell_with_a_new_start_warns_again() -> None:
    watch = CheckpointHealthWatch(10.0)
    watch.update({"ps-0": failing(100.0)}, 101.0)
    verdict = watch.update({"ps-0": failing(102.0)}, 103.0)
    assert len(verdict.warnings) == 1 and verdict.fatal is None


@pytest.mark.parametrize("record", [None, "x", {"ok": False}, {"ok": "no"}, {}])
def test_malformed_records_are_ignored(record: object) -> None:
    watch = CheckpointHealthWatch(10.0)
    verdict = watch.update({"ps-0": record}, 1e9)
    assert verdict.warnings == () and verdict.fatal is None


@pytest.mark.parametrize("grace", [0.0, -1.0, float("nan")])
def test_the_grace_period_must_be_positive(grace: float) -> None:
    with pytest.raises(ConfigError, match="fatal-after-s"):
        CheckpointHealthWatch(grace)
