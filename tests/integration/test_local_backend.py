"""The worker manager on the local backend, with real processes (``sleep``) as workers.

The workers run ``sleep`` rather than a trainer, so that these tests check the
manager and the backend (placement, backoff, scale down, replacement, events)
in a few seconds, without etcd (one test reads trainer progress from a real etcd). Every
process is stopped by PID at the end.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from elasticps.config import ManagerConfig
from elasticps.coord.etcd_server import EtcdServer
from elasticps.coord.store import JobStore
from elasticps.errors import UnschedulableError
from elasticps.launcher.backend import Role, WorkerEvent, WorkerSpec, WorkerState
from elasticps.launcher.local_backend import LocalBackend, exit_status
from elasticps.launcher.manager import LedgerProgress, StaticDesiredCount, WorkerManager
from elasticps.netutil import die_with_parent_prefix
from elasticps.testing import pid_gone, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def sleeper(spec: WorkerSpec) -> list[str]:
    return [*die_with_parent_prefix(), "sleep", "600"]


def trainer_spec(index: int) -> WorkerSpec:
    return WorkerSpec(Role.TRAINER, index)


@pytest.fixture
def backend() -> Iterator[LocalBackend]:
    started: list[int] = []
    backend = LocalBackend(
        command=sleeper, capacity=2, term_timeout_s=2.0, on_start=lambda _, pid: started.append(pid)
    )
    try:
        yield backend
    finally:
        backend.close(timeout_s=2.0)
        for pid in started:
            if not pid_gone(pid):
                os.kill(pid, signal.SIGKILL)
        wait_for(lambda: all(pid_gone(pid) for pid in started), "every worker to be gone", 5.0)


def test_manager_backs_off_on_unschedulable_then_fills_scales_down_and_replaces(
    backend: LocalBackend,
) -> None:
    desired = StaticDesiredCount(4)
    config = ManagerConfig(
        min_trainers=1, max_trainers=4, backoff_base_s=0.1, backoff_cap_s=0.8, tick_s=0.05
    )
    manager = WorkerManager(backend, config, desired, None, trainer_spec=trainer_spec)
    manager.start()
    try:
        wait_for(lambda: len(backend.pids(Role.TRAINER)) == 2, "2 trainers placed")

        def failed_attempts() -> list[float]:
            return [
                r.retry_in_s
                for r in manager.records()
                if r.name == "trainer-3" and r.result == "unschedulable" and r.retry_in_s
            ]

        # Capacity 2: the other two are retried with growing delays, up to the cap.
        wait_for(lambda: len(failed_attempts()) >= 5, "5 unschedulable attempts", 20.0)
        delays = failed_attempts()[:5]
        for delay, low in zip(delays, (0.1, 0.2, 0.4, 0.8, 0.8), strict=True):
            assert low <= delay <= min(low + 0.1, 0.8), delays
        assert len(backend.pids(Role.TRAINER)) == 2

        backend.set_capacity(None)
        wait_for(lambda: len(backend.pids(Role.TRAINER)) == 4, "4 trainers once room is made", 5)
        assert set(backend.pids(Role.TRAINER)) == {f"trainer-{i}" for i in range(4)}

        # Scale down: the newest go first.
        desired.set(2)
        wait_for(
            lambda: set(backend.pids(Role.TRAINER)) == {"trainer-0", "trainer-1"},
            "the two newest trainers to be deleted",
        )
        deleted = [e for e in backend.list() if e.state is WorkerState.DELETED]
        assert {e.name for e in deleted} == {"trainer-2", "trainer-3"}
        assert all(exit_status(e) == -signal.SIGTERM for e in deleted), deleted

        # Out of band: SIGKILL trainer-0; a new trainer takes its place.
        os.kill(backend.pids(Role.TRAINER)["trainer-0"], signal.SIGKILL)
        wait_for(
            lambda: set(backend.pids(Role.TRAINER)) == {"trainer-1", "trainer-4"},
            "trainer-0 to be replaced by trainer-4",
        )
        killed = next(e for e in backend.list() if e.name == "trainer-0")
        assert killed.state is WorkerState.FAILED and killed.reason == "signal 9"
    finally:
        manager.stop()


def test_backend_reports_running_then_the_exit_status(backend: LocalBackend) -> None:
    events: list[WorkerEvent] = []
    backend.watch(events.append)
    lines: list[tuple[str, str]] = []
    failing = LocalBackend(
        command=lambda spec: ["sh", "-c", "echo hello; exit 3"],
        on_output=lambda name, line: lines.append((name, line)),
    )
    failing.watch(events.append)
    try:
        failing.create(WorkerSpec(Role.TRAINER, 0))
        wait_for(lambda: any(e.state is WorkerState.FAILED for e in events), "the exit")
        assert [(e.name, e.state, e.reason) for e in events] == [
            ("trainer-0", WorkerState.RUNNING, ""),
            ("trainer-0", WorkerState.FAILED, "exit 3"),
        ]
        assert lines == [("trainer-0", "hello")]
    finally:
        failing.close(timeout_s=2.0)
    backend.create(WorkerSpec(Role.PS, 0))
    backend.create(WorkerSpec(Role.PS, 1))
    with pytest.raises(UnschedulableError):
        backend.create(WorkerSpec(Role.PS, 2))
    backend.delete("ps-0")
    wait_for(lambda: "ps-0" not in backend.pids(), "ps-0 to be deleted")
    event = next(e for e in backend.list() if e.name == "ps-0")
    assert event.state is WorkerState.DELETED


def test_a_stuck_worker_process_is_deleted_and_replaced(backend: LocalBackend) -> None:
    backend.set_capacity(None)
    config = ManagerConfig(min_trainers=2, max_trainers=2, stuck_after_s=0.5, tick_s=0.05)

    def progress() -> dict[str, float]:
        return {"trainer-0": time.monotonic()}  # trainer-0 progresses, the others never

    manager = WorkerManager(
        backend, config, StaticDesiredCount(2), progress, trainer_spec=trainer_spec
    )
    manager.start()
    try:
        wait_for(lambda: "trainer-2" in backend.pids(), "stuck trainer-1 to be replaced", 10)
        assert "trainer-0" in backend.pids()
        stuck = [r for r in manager.records() if r.action == "delete"]
        assert stuck and stuck[0].name == "trainer-1" and stuck[0].reason.startswith("stuck")
    finally:
        manager.stop()


def test_ledger_progress_moves_when_a_held_task_changes(
    etcd_server: EtcdServer, job_name: str
) -> None:
    now = [10.0]
    with JobStore(etcd_server.endpoint, job_name) as store:
        progress = LedgerProgress(store, clock=lambda: now[0])
        lease = store.grant_lease(5.0)
        store.register_trainer("0", {"pid": 1}, lease)
        store.register_trainer("1", {"pid": 2}, lease)
        record = {"state": "pending", "trainer": "0", "pass": 0, "attempt": 1, "offset": 0}
        store.put_json(store.keys.task(0), record)
        assert progress() == {"trainer-0": 10.0, "trainer-1": 10.0}
        now[0] = 20.0  # trainer-0 holds an unchanged task; trainer-1 is idle
        assert progress() == {"trainer-0": 10.0, "trainer-1": 20.0}
        now[0] = 30.0
        store.put_json(store.keys.task(0), {**record, "offset": 64})
        assert progress()["trainer-0"] == 30.0
        now[0] = 40.0  # trainer-0 leaves: it keeps its last progress time
        store.delete_if_pid(store.keys.trainer("0"), 1)
        assert progress() == {"trainer-0": 30.0, "trainer-1": 40.0}
        lease.revoke()
