"""The worker manager's pure core: decisions from states, a wanted count and a fake clock."""

from __future__ import annotations

import pytest

from elasticps.config import ManagerConfig
from elasticps.errors import ConfigError
from elasticps.launcher.backend import Role, WorkerEvent, WorkerSpec, WorkerState
from elasticps.launcher.manager import (
    Action,
    Create,
    Delete,
    FailJob,
    LedgerTaskProgress,
    ManagerCore,
    StaticDesiredCount,
    backoff_delay_s,
    task_marks,
    tasks_progressed,
)


def trainer_spec(index: int) -> WorkerSpec:
    return WorkerSpec(Role.TRAINER, index, ("--trainer-id", str(index)))


def make_core(
    low: int = 1,
    high: int = 4,
    *,
    stuck_after_s: float | None = None,
    fixed: tuple[WorkerSpec, ...] = (),
) -> ManagerCore:
    config = ManagerConfig(
        min_trainers=low,
        max_trainers=high,
        stuck_after_s=stuck_after_s,
        backoff_base_s=1.0,
        backoff_cap_s=8.0,
    )
    return ManagerCore(config, trainer_spec, fixed)


def event(name: str, state: WorkerState, reason: str = "") -> WorkerEvent:
    role, index = name.split("-")
    return WorkerEvent(name, Role(role), int(index), state, reason)


def creates(actions: list[Action]) -> list[str]:
    return [a.spec.name for a in actions if isinstance(a, Create)]


def deletes(actions: list[Action]) -> list[str]:
    return [a.name for a in actions if isinstance(a, Delete)]


def run_all(core: ManagerCore, actions: list[Action], now: float) -> None:
    """What a backend that places everything would report."""
    for action in actions:
        if isinstance(action, Create):
            core.observe(event(action.spec.name, WorkerState.RUNNING), now)


# --- range ---------------------------------------------------------------------------


@pytest.mark.parametrize(("wanted", "expected"), [(0, 2), (2, 2), (3, 3), (4, 4), (9, 4)])
def test_wanted_count_is_clamped_to_the_range(wanted: int, expected: int) -> None:
    core = make_core(2, 4)
    actions = core.step(0.0, wanted)
    assert creates(actions) == [f"trainer-{i}" for i in range(expected)]
    assert core.step(0.0, wanted) == []


def test_scaling_up_creates_trainers_with_fresh_indices() -> None:
    core = make_core(1, 4)
    run_all(core, core.step(0.0, 2), 0.0)
    core.observe(event("trainer-1", WorkerState.FAILED, "signal 9"), 1.0)
    assert creates(core.step(1.0, 2)) == ["trainer-2"]  # not trainer-1 again
    assert creates(core.step(1.0, 4)) == ["trainer-3", "trainer-4"]


def test_manager_config_rejects_an_empty_range() -> None:
    with pytest.raises(ConfigError):
        ManagerConfig(min_trainers=3, max_trainers=2)
    with pytest.raises(ConfigError):
        ManagerConfig(min_trainers=1, max_trainers=2, backoff_base_s=2.0, backoff_cap_s=1.0)


# --- scale down ------------------------------------------------------------------------


def test_trainers_above_the_wanted_count_are_deleted_newest_first() -> None:
    core = make_core(1, 4)
    run_all(core, core.step(0.0, 4), 0.0)
    actions = core.step(1.0, 1)
    assert deletes(actions) == ["trainer-3", "trainer-2", "trainer-1"]
    assert core.live_trainers() == ["trainer-0"]
    # The deletions are not replaced when they are reported.
    for name in deletes(actions):
        core.observe(event(name, WorkerState.DELETED), 2.0)
    assert core.step(2.0, 1) == []


def test_scale_down_removes_not_yet_running_trainers_before_running_ones() -> None:
    core = make_core(1, 4)
    first = core.step(0.0, 2)
    run_all(core, first, 0.0)
    more = core.step(1.0, 4)  # trainer-2 placed later than trainer-3 is asked for
    core.observe(event("trainer-2", WorkerState.RUNNING), 1.0)
    assert creates(more) == ["trainer-2", "trainer-3"]
    assert deletes(core.step(2.0, 2)) == ["trainer-3", "trainer-2"]


def test_scale_down_drops_waiting_retries_before_deleting_anything() -> None:
    core = make_core(1, 4)
    actions = core.step(0.0, 3)
    core.observe(event("trainer-0", WorkerState.RUNNING), 0.0)
    core.observe(event("trainer-1", WorkerState.RUNNING), 0.0)
    core.create_failed(trainer_spec(2), 0.0, "no capacity")
    assert creates(actions) == ["trainer-0", "trainer-1", "trainer-2"]
    assert core.step(0.1, 2) == []
    assert core.retrying() == {}
    assert core.step(100.0, 2) == []


# --- backoff -----------------------------------------------------------------------------


def test_backoff_grows_exponentially_within_its_jitter_and_stops_at_the_cap() -> None:
    for attempt, low in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (10, 8.0)]:
        for _ in range(50):
            delay = backoff_delay_s(attempt, base_s=1.0, cap_s=8.0)
            assert low <= delay <= min(low + 1.0, 8.0), (attempt, delay)
    with pytest.raises(ValueError):
        backoff_delay_s(0, base_s=1.0, cap_s=8.0)


def test_unschedulable_create_is_retried_with_growing_delays_until_placed() -> None:
    core = make_core(1, 1)
    now = 0.0
    assert creates(core.step(now, 1)) == ["trainer-0"]
    delays = []
    for attempt in range(1, 6):
        delay = core.create_failed(trainer_spec(0), now, "no capacity")
        delays.append(delay)
        assert core.retrying() == {"trainer-0": attempt}
        assert core.step(now + delay - 0.01, 1) == []  # not due yet, and not replaced
        now += delay
        actions = core.step(now, 1)
        assert [(a.spec.name, a.attempt) for a in actions if isinstance(a, Create)] == [
            ("trainer-0", attempt + 1)
        ]
    for delay, low in zip(delays, (1.0, 2.0, 4.0, 8.0, 8.0), strict=True):
        assert low <= delay <= min(low + 1.0, 8.0), delays
    core.observe(event("trainer-0", WorkerState.RUNNING), now)
    assert core.retrying() == {}
    assert core.step(now + 100, 1) == []


def test_a_worker_reported_unschedulable_is_deleted_then_created_again_after_backoff() -> None:
    core = make_core(1, 1)
    core.step(0.0, 1)
    core.observe(event("trainer-0", WorkerState.UNSCHEDULABLE, "Unschedulable"), 0.5)
    actions = core.step(0.5, 1)
    assert actions == [Delete("trainer-0", "unschedulable")]
    due = core.next_due()
    assert due is not None and 1.5 <= due <= 2.5
    # Due, but the old pod is not gone yet: wait for it.
    assert core.step(due, 1) == []
    core.observe(event("trainer-0", WorkerState.DELETED), due)
    assert creates(core.step(due, 1)) == ["trainer-0"]


# --- stuck, out of band, PS ---------------------------------------------------------------


def test_a_trainer_without_progress_for_stuck_after_s_is_deleted_and_replaced() -> None:
    core = make_core(2, 2, stuck_after_s=10.0)
    run_all(core, core.step(0.0, 2), 0.0)
    assert core.step(9.0, 2, {"trainer-0": 8.0}) == []
    actions = core.step(10.5, 2, {"trainer-0": 8.0})  # trainer-1: never any progress
    assert deletes(actions) == ["trainer-1"]
    assert creates(actions) == ["trainer-2"]
    assert deletes(core.step(18.5, 2, {"trainer-0": 8.0})) == ["trainer-0"]


def test_stuck_detection_is_off_without_progress_data() -> None:
    core = make_core(1, 1, stuck_after_s=1.0)
    run_all(core, core.step(0.0, 1), 0.0)
    assert core.step(100.0, 1) == []
    assert core.step(100.0, 1, None) == []


def test_a_trainer_deleted_out_of_band_is_replaced() -> None:
    core = make_core(2, 3)
    run_all(core, core.step(0.0, 2), 0.0)
    core.observe(event("trainer-0", WorkerState.DELETED, "kubectl delete"), 1.0)
    assert creates(core.step(1.0, 2)) == ["trainer-2"]


def test_a_ps_is_replaced_with_the_same_index() -> None:
    ps = (WorkerSpec(Role.PS, 0, ("--x",)), WorkerSpec(Role.PS, 1, ("--x",)))
    core = make_core(1, 1, fixed=ps)
    actions = core.step(0.0, 1)
    assert sorted(creates(actions)) == ["ps-0", "ps-1", "trainer-0"]
    run_all(core, actions, 0.0)
    core.observe(event("ps-1", WorkerState.FAILED, "OOMKilled"), 2.0)
    actions = core.step(2.0, 1)
    assert len(actions) == 1 and isinstance(actions[0], Create)
    assert actions[0].spec is ps[1]


def test_a_trainer_exiting_zero_on_its_own_ends_all_creation() -> None:
    ps = (WorkerSpec(Role.PS, 0),)
    core = make_core(2, 2, fixed=ps)
    run_all(core, core.step(0.0, 2), 0.0)
    core.observe(event("trainer-0", WorkerState.SUCCEEDED, "exit 0"), 1.0)
    core.observe(event("ps-0", WorkerState.SUCCEEDED, "exit 0"), 1.0)
    assert core.finishing
    assert core.step(1.0, 2) == []


def test_unknown_live_workers_are_adopted_and_their_indices_not_reused() -> None:
    core = make_core(1, 3)
    core.observe(event("trainer-7", WorkerState.RUNNING), 0.0)
    assert core.live_trainers() == ["trainer-7"]
    assert creates(core.step(0.0, 2)) == ["trainer-8"]


def test_static_desired_count_notifies_watchers_until_cancelled() -> None:
    source = StaticDesiredCount(2)
    seen: list[int | None] = []
    cancel = source.watch(seen.append)
    source.set(3)
    cancel()
    source.set(4)
    assert seen == [3] and source.get() == 4


def test_no_trainer_is_stuck_while_the_job_finishes() -> None:
    core = make_core(1, 1, stuck_after_s=1.0)
    run_all(core, core.step(0.0, 1), 0.0)
    core.finish()
    assert core.step(100.0, 1, {}) == []


# --- task progress, told to the supervision policy ----------------------------------------


def record(pass_id: int, state: str, offset: int, trainer: str | None = None) -> dict[str, object]:
    return {"pass": pass_id, "state": state, "offset": offset, "trainer": trainer, "attempt": 1}


def test_a_dispatch_or_requeue_is_no_progress_but_done_offset_and_next_pass_are() -> None:
    before = task_marks({"0": record(0, "todo", 0), "1": record(0, "pending", 5, "2")})
    dispatched = task_marks({"0": record(0, "pending", 0, "3"), "1": record(0, "todo", 5)})
    assert not tasks_progressed(before, dispatched)
    advanced = task_marks({"0": record(0, "todo", 0), "1": record(0, "pending", 9, "2")})
    assert tasks_progressed(before, advanced)
    done = task_marks({"0": record(0, "done", 0), "1": record(0, "pending", 5, "2")})
    assert tasks_progressed(before, done)
    next_pass = task_marks({"0": record(1, "todo", 0), "1": record(0, "pending", 5, "2")})
    assert tasks_progressed(before, next_pass)
    assert task_marks({"x": {"pass": "?", "state": "done"}}) == {}


def test_internal_trainer_failures_fail_the_job_only_without_progress_in_between() -> None:
    def fail_three(core: ManagerCore, progress: bool) -> list[Action]:
        actions: list[Action] = []
        for index in range(3):
            name = f"trainer-{index}"
            core.observe(event(name, WorkerState.RUNNING), 0.0)
            if progress:
                core.progressed()
            core.observe(event(name, WorkerState.FAILED, "exit 1"), 1.0)
            actions += core.step(1.0, 1)
        return actions

    failing = make_core()
    assert any(isinstance(a, FailJob) for a in fail_three(failing, progress=False))
    assert failing.failed is not None and failing.failed.exit_code == 1
    progressing = make_core()
    assert not any(isinstance(a, FailJob) for a in fail_three(progressing, progress=True))
    assert progressing.failed is None


def test_a_trainer_user_error_fails_the_job_with_status_2() -> None:
    core = make_core()
    core.observe(event("trainer-0", WorkerState.RUNNING), 0.0)
    core.observe(
        WorkerEvent("trainer-0", Role.TRAINER, 0, WorkerState.FAILED, "exit 2", message="bad row"),
        1.0,
    )
    actions = core.step(1.0, 1)
    failed = [a for a in actions if isinstance(a, FailJob)]
    assert failed and failed[0].exit_code == 2 and "bad row" in failed[0].message
    assert creates(actions) == []


class FakeLedger:
    """The part of JobStore that LedgerTaskProgress reads."""

    class keys:  # noqa: N801 (mirrors JobStore.keys)
        tasks_prefix = "/elasticps/j/tasks/"

    def __init__(self) -> None:
        self.tasks: dict[str, object] = {"0": record(0, "pending", 0, "1")}
        self.reads = 0

    def get_prefix_json(self, prefix: str) -> tuple[dict[str, object], int]:
        assert prefix == self.keys.tasks_prefix
        self.reads += 1
        return dict(self.tasks), self.reads


def test_ledger_task_progress_sets_a_baseline_then_reads_at_most_every_every_s() -> None:
    ledger = FakeLedger()
    now = [0.0]
    source = LedgerTaskProgress(ledger, every_s=5.0, clock=lambda: now[0])  # type: ignore[arg-type]
    assert source() is False  # the baseline
    ledger.tasks["0"] = record(0, "done", 0)
    now[0] = 1.0
    assert source() is False and ledger.reads == 1  # too soon: not read
    now[0] = 6.0
    assert source() is True and ledger.reads == 2
    now[0] = 12.0
    assert source() is False  # nothing new
