"""The pure parts shared by the supervision loops: decision records and relayed exit statuses."""

from __future__ import annotations

import dataclasses
import json
import signal

import pytest

from elasticps.launcher.local_processes import DecisionLog, returncode_of
from elasticps.launcher.supervisor import (
    Decision,
    Deleted,
    Exited,
    FailJob,
    Ignore,
    JobFinished,
    Kind,
    Progressed,
    Replace,
    Restart,
    RestartFailed,
    Supervisor,
    SupervisorConfig,
    decision_of,
    relayed_returncode,
)

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("status", "code"),
    [(0, 0), (1, 1), (2, 2), (75, 75), (128, 128), (137, -9), (143, -15), (129, -1), (192, -64)],
)
def test_relayed_status_reads_as_a_signal(status: int, code: int) -> None:
    assert relayed_returncode(status) == code


@pytest.mark.parametrize("status", [193, 255, -9])
def test_other_relayed_statuses_are_kept(status: int) -> None:
    # 255 is ssh's lost connection: not a signal of the role.
    assert relayed_returncode(status) == status


def test_a_relayed_sigkill_is_not_an_internal_error() -> None:
    """An ssh-relayed 137 reads as signal 9, like a local child: it never counts."""
    exited = Exited.of_returncode("trainer-3", Kind.TRAINER, relayed_returncode(137))
    assert exited.signal == signal.SIGKILL
    assert not exited.internal
    assert Exited.of_returncode("trainer-3", Kind.TRAINER, 137).internal


def test_returncode_of_a_local_child_is_unchanged() -> None:
    assert returncode_of(object(), 137) == 137
    assert returncode_of(object(), -9) == -9


def test_decision_records_each_kind_of_event() -> None:
    at = 1700000000.0
    assert decision_of(at, Progressed(), Ignore("progress")) is None
    assert decision_of(at, JobFinished(), Ignore("the job is finished")) == Decision(
        at, "job", "job", "finished", "ignore: the job is finished"
    )
    assert decision_of(
        at, Exited("ps-1", Kind.PS, signal=9), Restart("ps-1", Kind.PS, 1, 3)
    ) == Decision(at, "ps", "ps-1", "signal 9", "restart 1/3")
    assert decision_of(
        at, Exited("master-0", Kind.MASTER, status=1), Restart("master-0", Kind.MASTER, 2, None)
    ) == Decision(at, "master", "master-0", "exit 1", "restart 2/unlimited")
    assert decision_of(at, Deleted("trainer-1", Kind.TRAINER), Ignore("on purpose")) == Decision(
        at, "trainer", "trainer-1", "deleted", "ignore: on purpose"
    )
    failed = decision_of(
        at, RestartFailed("etcd", Kind.ETCD, "port taken"), FailJob("etcd died", 1)
    )
    assert failed == Decision(
        at, "etcd", "etcd", "restart failed: port taken", "fail (exit 1): etcd died"
    )
    assert decision_of(at, Exited("trainer-2", Kind.TRAINER, status=75), Replace("trainer-2")) == (
        Decision(at, "trainer", "trainer-2", "exit 75", "replace")
    )


def test_a_decision_is_frozen_and_json_ready() -> None:
    decision = Decision(1.23456, "trainer", "trainer-0", "exit 1", "replace")
    with pytest.raises(dataclasses.FrozenInstanceError):
        decision.role = "ps"  # type: ignore[misc]
    assert json.loads(json.dumps(decision.as_dict())) == {
        "at": 1.235,
        "role": "trainer",
        "worker": "trainer-0",
        "happened": "exit 1",
        "decided": "replace",
    }


def test_a_schedule_of_failures_records_the_same_decisions() -> None:
    """Trainer killed, PS killed, then a trainer failing past the limit: the job fails."""
    ticks = iter(range(100))
    log = DecisionLog(clock=lambda: float(next(ticks)))
    policy = Supervisor(SupervisorConfig(max_restarts=3, max_trainer_failures=3))
    schedule = [
        Exited("trainer-0", Kind.TRAINER, signal=9),
        Progressed(),
        Exited("ps-0", Kind.PS, signal=9),
        Exited("trainer-1", Kind.TRAINER, status=1, message="RuntimeError: boom"),
        Exited("trainer-2", Kind.TRAINER, status=1, message="RuntimeError: boom"),
        Exited("trainer-3", Kind.TRAINER, status=1, message="RuntimeError: boom"),
        Exited("trainer-4", Kind.TRAINER, signal=15),
    ]
    for event in schedule:
        log.record(event, policy.handle(event))
    got = [(d.worker, d.happened, d.decided.split(":")[0]) for d in log.records()]
    assert got == [
        ("trainer-0", "signal 9", "replace"),
        ("ps-0", "signal 9", "restart 1/3"),
        ("trainer-1", "exit 1", "replace"),
        ("trainer-2", "exit 1", "replace"),
        ("trainer-3", "exit 1", "fail (exit 1)"),
        ("trainer-4", "signal 15", "ignore"),
    ]
    assert [d.at for d in log.records()] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert policy.failed is not None
    assert log.as_json()[4]["decided"] == "fail (exit 1): " + policy.failed.message
