"""The pod -> worker state table, without sockets: pure functions over pod JSON."""

from __future__ import annotations

from typing import Any

import pytest

from elasticps.launcher.backend import Role, WorkerState
from elasticps.launcher.pod_events import (
    TRANSITIONS,
    PodView,
    advance,
    classify,
    worker_event,
    worker_identity,
)

LABELS = {
    "app": "elasticps",
    "elasticps/job": "j",
    "elasticps/role": "trainer",
    "elasticps/index": "3",
}


def pod(
    phase: str = "Pending",
    *,
    conditions: list[dict[str, str]] | None = None,
    waiting: str | None = None,
    terminated: tuple[int, str] | None = None,
    deleting: bool = False,
    status_reason: str = "",
    uid: str = "u1",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod as the API server serves it (only the fields that matter)."""
    state: dict[str, Any] = {}
    if waiting:
        state["waiting"] = {"reason": waiting}
    if terminated:
        state["terminated"] = {"exitCode": terminated[0], "reason": terminated[1]}
    if not state and phase == "Running":
        state["running"] = {"startedAt": "2026-11-22T03:00:00Z"}
    meta: dict[str, Any] = {
        "name": "j-trainer-3",
        "uid": uid,
        "labels": LABELS if labels is None else labels,
        "creationTimestamp": "2026-11-22T03:00:00Z",
        "resourceVersion": "7",
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-11-22T03:01:00Z"
    status: dict[str, Any] = {"phase": phase, "conditions": conditions or []}
    if state:
        status["containerStatuses"] = [{"name": "trainer", "state": state}]
    if status_reason:
        status["reason"] = status_reason
    return {"metadata": meta, "status": status}


UNSCHEDULABLE = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    "message": "0/3 nodes are available: 3 Insufficient cpu.",
}
PREEMPTED = {"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}


@pytest.mark.parametrize(
    ("obj", "removed", "expected"),
    [
        (pod("Pending"), False, (WorkerState.PENDING, "")),
        (
            pod("Pending", waiting="ContainerCreating"),
            False,
            (WorkerState.PENDING, "ContainerCreating"),
        ),
        (
            pod("Pending", conditions=[UNSCHEDULABLE]),
            False,
            (
                WorkerState.UNSCHEDULABLE,
                "Unschedulable: 0/3 nodes are available: 3 Insufficient cpu.",
            ),
        ),
        (
            pod("Pending", waiting="ImagePullBackOff"),
            False,
            (WorkerState.FAILED, "ImagePullBackOff"),
        ),
        (pod("Running"), False, (WorkerState.RUNNING, "")),
        (
            pod("Succeeded", terminated=(0, "Completed")),
            False,
            (WorkerState.SUCCEEDED, "Completed"),
        ),
        (pod("Failed", terminated=(1, "Error")), False, (WorkerState.FAILED, "exit 1")),
        (pod("Failed", terminated=(137, "OOMKilled")), False, (WorkerState.FAILED, "OOMKilled")),
        (
            pod("Failed", status_reason="Evicted", conditions=[PREEMPTED]),
            False,
            (WorkerState.FAILED, "Evicted"),
        ),
        (pod("Running", deleting=True), False, (WorkerState.DELETED, "Terminating")),
        (pod("Running", conditions=[PREEMPTED]), False, (WorkerState.DELETED, "Preempted")),
        (
            pod("Running", conditions=[PREEMPTED], deleting=True),
            False,
            (WorkerState.DELETED, "Preempted"),
        ),
        (pod("Running"), True, (WorkerState.DELETED, "Deleted")),
        (pod("Succeeded"), True, (WorkerState.DELETED, "Deleted")),
        (pod("Unknown"), False, (WorkerState.FAILED, "NodeLost")),
    ],
)
def test_each_pod_shape_maps_to_one_worker_state(
    obj: dict[str, Any], removed: bool, expected: tuple[WorkerState, str]
) -> None:
    assert classify(PodView.from_json(obj, removed=removed)) == expected


def test_the_table_ends_with_a_row_that_matches_every_pod() -> None:
    assert TRANSITIONS[-1].match(PodView.from_json(pod("Whatever")))
    assert all(rule.when for rule in TRANSITIONS)


def test_a_new_pod_gives_its_state_and_a_repeated_one_gives_nothing() -> None:
    first = advance(None, PodView.from_json(pod("Pending")))
    assert first == (WorkerState.PENDING, "")
    assert advance(first, PodView.from_json(pod("Pending"))) is None
    assert advance(first, PodView.from_json(pod("Running"))) == (WorkerState.RUNNING, "")


def test_a_deleted_worker_stays_deleted() -> None:
    gone = (WorkerState.DELETED, "Terminating")
    for later in (pod("Running"), pod("Failed", terminated=(1, "Error"))):
        assert advance(gone, PodView.from_json(later)) is None
    assert advance(gone, PodView.from_json(pod("Running"), removed=True)) is None


def test_a_finished_worker_can_only_be_deleted_next() -> None:
    failed = (WorkerState.FAILED, "exit 1")
    assert advance(failed, PodView.from_json(pod("Running"))) is None
    assert advance(failed, PodView.from_json(pod("Failed", deleting=True))) is None
    assert advance(failed, PodView.from_json(pod("Failed"), removed=True)) == (
        WorkerState.DELETED,
        "Deleted",
    )


def test_kubectl_delete_is_seen_at_the_deletion_timestamp_then_the_removal_adds_nothing() -> None:
    running = advance(None, PodView.from_json(pod("Running")))
    terminating = advance(running, PodView.from_json(pod("Running", deleting=True)))
    assert terminating == (WorkerState.DELETED, "Terminating")
    assert advance(terminating, PodView.from_json(pod("Running"), removed=True)) is None


def test_unschedulable_then_scheduled_becomes_running() -> None:
    stuck = advance(None, PodView.from_json(pod("Pending", conditions=[UNSCHEDULABLE])))
    assert stuck is not None and stuck[0] is WorkerState.UNSCHEDULABLE
    scheduled = {"type": "PodScheduled", "status": "True"}
    assert advance(stuck, PodView.from_json(pod("Running", conditions=[scheduled]))) == (
        WorkerState.RUNNING,
        "",
    )


def test_worker_event_carries_name_role_index_and_creation_time() -> None:
    view = PodView.from_json(pod("Running"))
    event = worker_event(view, WorkerState.RUNNING, "")
    assert event is not None
    assert (event.name, event.role, event.index) == ("trainer-3", Role.TRAINER, 3)
    assert event.created_at == pytest.approx(1795316400.0)


@pytest.mark.parametrize(
    "labels",
    [
        {"elasticps/role": "etcd", "elasticps/index": "0"},
        {"elasticps/role": "trainer"},
        {"elasticps/role": "trainer", "elasticps/index": "x"},
        {"elasticps/role": "trainer", "elasticps/index": "-1"},
    ],
)
def test_pods_that_are_not_workers_give_no_event(labels: dict[str, str]) -> None:
    assert worker_identity(labels) is None
    view = PodView.from_json(pod("Running", labels=labels))
    assert worker_event(view, WorkerState.RUNNING, "") is None


def test_a_pod_without_a_name_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"metadata\.name"):
        PodView.from_json({"metadata": {}, "status": {}})
