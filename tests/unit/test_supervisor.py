"""The supervision policy: what a process death means, as a pure state machine."""

from __future__ import annotations

import signal

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from elasticps.errors import (
    ConfigError,
    CoordinationError,
    DataError,
    ElasticPSError,
    ModelContractError,
    ServiceUnavailableError,
    SteppedDownError,
)
from elasticps.launcher.supervisor import (
    EXIT_FAILURE,
    EXIT_TEMPFAIL,
    EXIT_USER_ERROR,
    MAX_TRAINER_FAILURES,
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
    exit_status_for,
    exited_from_reason,
)


def make(max_restarts: int | None = 2, **kwargs: object) -> Supervisor:
    return Supervisor(SupervisorConfig(max_restarts=max_restarts, **kwargs))  # type: ignore[arg-type]


def killed(name: str, kind: Kind) -> Exited:
    return Exited(name, kind, signal=signal.SIGKILL)


# --- exit statuses of role processes ------------------------------------------------


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (DataError("bad row"), EXIT_USER_ERROR),
        (ModelContractError("no Model"), EXIT_USER_ERROR),
        (ConfigError("--lr"), EXIT_USER_ERROR),
        (CoordinationError("etcd down"), EXIT_TEMPFAIL),
        (SteppedDownError("lock lost"), EXIT_TEMPFAIL),
        (ServiceUnavailableError("ps-1 refused"), EXIT_TEMPFAIL),
        (ElasticPSError("a bug of ours"), EXIT_FAILURE),
        (RuntimeError("a bug"), EXIT_FAILURE),
    ],
)
def test_exit_status_of_a_role_follows_the_error(exc: BaseException, status: int) -> None:
    assert exit_status_for(exc) == status


def test_backend_reasons_become_exits() -> None:
    assert exited_from_reason("trainer-1", Kind.TRAINER, "exit 75").status == 75
    assert exited_from_reason("ps-0", Kind.PS, "signal 9").signal == 9
    oom = exited_from_reason("trainer-1", Kind.TRAINER, "OOMKilled")
    assert oom.internal and oom.status is None
    assert not exited_from_reason("trainer-1", Kind.TRAINER, "Evicted").internal
    assert not exited_from_reason("trainer-1", Kind.TRAINER, "signal 9").internal
    assert not exited_from_reason("trainer-1", Kind.TRAINER, "exit 75").internal
    assert exited_from_reason("trainer-1", Kind.TRAINER, "exit 1").internal


# --- servers ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [Kind.ETCD, Kind.MASTER, Kind.PS])
def test_a_dead_server_is_restarted_until_its_budget_runs_out(kind: Kind) -> None:
    sup = make(max_restarts=2)
    name = "etcd" if kind is Kind.ETCD else f"{kind.value}-1"
    assert sup.handle(killed(name, kind)) == Restart(name, kind, 1, 2)
    assert sup.handle(Exited(name, kind, status=1)) == Restart(name, kind, 2, 2)
    action = sup.handle(killed(name, kind))
    assert isinstance(action, FailJob) and action.exit_code == EXIT_FAILURE
    assert name in action.message and "--max-restarts 2" in action.message
    assert sup.restarts == {name: 2}


def test_each_server_has_its_own_budget() -> None:
    sup = make(max_restarts=1)
    assert isinstance(sup.handle(killed("ps-0", Kind.PS)), Restart)
    assert isinstance(sup.handle(killed("ps-1", Kind.PS)), Restart)
    assert isinstance(sup.handle(killed("master-0", Kind.MASTER)), Restart)
    assert isinstance(sup.handle(killed("ps-0", Kind.PS)), FailJob)


def test_no_limit_restarts_forever() -> None:
    sup = make(max_restarts=None)
    for attempt in range(1, 50):
        assert sup.handle(killed("ps-0", Kind.PS)) == Restart("ps-0", Kind.PS, attempt, None)


def test_a_server_user_error_fails_the_job_with_status_2_and_its_message() -> None:
    sup = make()
    action = sup.handle(Exited("master-0", Kind.MASTER, status=2, message="no such file x"))
    assert action == FailJob("master-0: no such file x", EXIT_USER_ERROR)


def test_a_failed_restart_counts_as_a_death() -> None:
    sup = make(max_restarts=2)
    assert isinstance(sup.handle(killed("etcd", Kind.ETCD)), Restart)
    assert sup.handle(RestartFailed("etcd", Kind.ETCD, "killed while starting")) == Restart(
        "etcd", Kind.ETCD, 2, 2
    )
    action = sup.handle(RestartFailed("etcd", Kind.ETCD, "port taken"))
    assert isinstance(action, FailJob) and "port taken" in action.message


def test_a_stepped_down_master_is_restarted() -> None:
    assert isinstance(make().handle(Exited("master-0", Kind.MASTER, status=3)), Restart)


# --- trainers -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "exit_",
    [
        Exited("trainer-3", Kind.TRAINER, signal=9),
        Exited("trainer-3", Kind.TRAINER, status=EXIT_TEMPFAIL),
        Exited("trainer-3", Kind.TRAINER, status=1),
        Exited("trainer-3", Kind.TRAINER, cause="Evicted"),
    ],
)
def test_a_dead_trainer_is_replaced(exit_: Exited) -> None:
    assert make().handle(exit_) == Replace("trainer-3")


def test_a_trainer_user_error_fails_the_job_with_its_one_line() -> None:
    action = make().handle(
        Exited("trainer-0", Kind.TRAINER, status=2, message="model.py:12: bad label 11")
    )
    assert action == FailJob("trainer-0: model.py:12: bad label 11", EXIT_USER_ERROR)


def test_a_trainer_exiting_0_is_not_replaced() -> None:
    assert isinstance(make().handle(Exited("trainer-0", Kind.TRAINER, status=0)), Ignore)


def test_trainers_failing_again_and_again_without_progress_fail_the_job() -> None:
    sup = make()
    for i in range(MAX_TRAINER_FAILURES - 1):
        assert sup.handle(Exited(f"trainer-{i}", Kind.TRAINER, status=1)) == Replace(f"trainer-{i}")
    last = Exited("trainer-9", Kind.TRAINER, status=1, message="KeyError: 'w'")
    action = sup.handle(last)
    assert isinstance(action, FailJob) and action.exit_code == EXIT_FAILURE
    assert "trainers keep failing" in action.message and "KeyError: 'w'" in action.message


def test_progress_between_internal_errors_keeps_the_job_going() -> None:
    sup = make()
    for i in range(10 * MAX_TRAINER_FAILURES):
        assert isinstance(sup.handle(Exited(f"trainer-{i}", Kind.TRAINER, status=1)), Replace)
        if i % (MAX_TRAINER_FAILURES - 1) == 0:
            sup.handle(Progressed())
    assert sup.failed is None


def test_kills_and_tempfails_never_count_as_trainer_failures() -> None:
    sup = make()
    for i in range(100):
        exit_ = (
            Exited(f"trainer-{i}", Kind.TRAINER, signal=9)
            if i % 2
            else Exited(f"trainer-{i}", Kind.TRAINER, status=EXIT_TEMPFAIL)
        )
        assert isinstance(sup.handle(exit_), Replace)
    assert sup.trainer_failure_streak == 0


def test_without_replacement_any_trainer_death_fails_the_job() -> None:
    sup = make(replace_trainers=False)
    action = sup.handle(Exited("trainer-1", Kind.TRAINER, signal=9))
    assert isinstance(action, FailJob) and "trainer-1" in action.message
    assert isinstance(make(replace_trainers=False).handle(killed("ps-0", Kind.PS)), Restart)


# --- deliberate stops, the end, the failure --------------------------------------------


def test_deleted_roles_are_ignored() -> None:
    sup = make(max_restarts=0)
    assert isinstance(sup.handle(Deleted("trainer-2", Kind.TRAINER)), Ignore)
    assert isinstance(sup.handle(Deleted("ps-0", Kind.PS)), Ignore)
    assert sup.failed is None


def test_after_training_finished_trainer_deaths_are_ignored_and_servers_restarted() -> None:
    sup = make(max_restarts=1)
    sup.handle(JobFinished())
    assert isinstance(sup.handle(Exited("trainer-0", Kind.TRAINER, status=2)), Ignore)
    assert isinstance(sup.handle(Exited("trainer-1", Kind.TRAINER, status=1)), Ignore)
    # The final checkpoint still needs the servers.
    assert isinstance(sup.handle(killed("ps-0", Kind.PS)), Restart)
    assert sup.failed is None


def test_everything_after_a_failure_is_ignored() -> None:
    sup = make(max_restarts=0)
    first = sup.handle(killed("ps-0", Kind.PS))
    assert isinstance(first, FailJob)
    assert isinstance(sup.handle(killed("ps-1", Kind.PS)), Ignore)
    assert isinstance(sup.handle(Exited("trainer-0", Kind.TRAINER, status=2)), Ignore)
    assert sup.failed == first


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        SupervisorConfig(max_restarts=-1)
    with pytest.raises(ConfigError):
        SupervisorConfig(max_trainer_failures=0)


# --- the state machine against a model ----------------------------------------------------

SERVERS = ("etcd", "master-0", "master-1", "ps-0", "ps-1")
KINDS = {"etcd": Kind.ETCD, "master-0": Kind.MASTER, "master-1": Kind.MASTER}
STATUSES = st.one_of(
    st.sampled_from([0, 1, 2, 3, 75, 137]).map(lambda s: ("status", s)),
    st.sampled_from([9, 15]).map(lambda s: ("signal", s)),
    st.sampled_from(["OOMKilled", "Evicted", "NodeLost"]).map(lambda c: ("cause", c)),
)


def kind_of(name: str) -> Kind:
    return KINDS.get(name, Kind.PS if name.startswith("ps") else Kind.TRAINER)


def build_exit(name: str, how: tuple[str, object]) -> Exited:
    what, value = how
    if what == "status":
        return Exited(name, kind_of(name), status=int(str(value)))
    if what == "signal":
        return Exited(name, kind_of(name), signal=int(str(value)))
    return Exited(name, kind_of(name), cause=str(value))


class SupervisorMachine(RuleBasedStateMachine):
    """Random event sequences, checked against a plain model of the policy."""

    def __init__(self) -> None:
        super().__init__()
        self.limit = 2
        self.sup = Supervisor(SupervisorConfig(max_restarts=self.limit))
        self.restarts: dict[str, int] = {}
        self.streak = 0
        self.failed: FailJob | None = None
        self.finished = False
        self.fail_jobs = 0
        self.next_trainer = 0

    def apply(self, event: object) -> object:
        action = self.sup.handle(event)  # type: ignore[arg-type]
        if isinstance(action, FailJob):
            self.fail_jobs += 1
            assert action.exit_code in (EXIT_FAILURE, EXIT_USER_ERROR)
            assert "\n" not in action.message and action.message
        return action

    @rule(name=st.sampled_from(SERVERS), how=STATUSES)
    def server_exits(self, name: str, how: tuple[str, object]) -> None:
        event = build_exit(name, how)
        action = self.apply(event)
        if self.failed is not None:
            assert isinstance(action, Ignore)
            return
        if event.status == EXIT_USER_ERROR:
            assert isinstance(action, FailJob) and action.exit_code == EXIT_USER_ERROR
            self.failed = action
        elif self.restarts.get(name, 0) >= self.limit:
            assert isinstance(action, FailJob) and action.exit_code == EXIT_FAILURE
            self.failed = action
        else:
            self.restarts[name] = self.restarts.get(name, 0) + 1
            assert action == Restart(name, kind_of(name), self.restarts[name], self.limit)

    @rule(how=STATUSES)
    def trainer_exits(self, how: tuple[str, object]) -> None:
        name = f"trainer-{self.next_trainer}"
        self.next_trainer += 1
        event = build_exit(name, how)
        action = self.apply(event)
        if self.failed is not None or self.finished:
            assert isinstance(action, Ignore)
            return
        if event.status == 0:
            assert isinstance(action, Ignore)
        elif event.status == EXIT_USER_ERROR:
            assert isinstance(action, FailJob) and action.exit_code == EXIT_USER_ERROR
            self.failed = action
        elif event.internal and self.streak + 1 >= MAX_TRAINER_FAILURES:
            assert isinstance(action, FailJob) and "keep failing" in action.message
            self.failed = action
        else:
            self.streak += int(event.internal)
            assert action == Replace(name)

    @rule(name=st.sampled_from((*SERVERS, "trainer-0")))
    def deleted(self, name: str) -> None:
        assert isinstance(self.apply(Deleted(name, kind_of(name))), Ignore)

    @rule()
    def progressed(self) -> None:
        assert isinstance(self.apply(Progressed()), Ignore)
        if self.failed is None:
            self.streak = 0

    @rule()
    def job_finished(self) -> None:
        assert isinstance(self.apply(JobFinished()), Ignore)
        if self.failed is None:
            self.finished = True

    @rule(name=st.sampled_from(SERVERS))
    def restart_failed(self, name: str) -> None:
        action = self.apply(RestartFailed(name, kind_of(name), "did not come up"))
        if self.failed is not None:
            assert isinstance(action, Ignore)
        elif self.restarts.get(name, 0) >= self.limit:
            assert isinstance(action, FailJob)
            self.failed = action
        else:
            self.restarts[name] = self.restarts.get(name, 0) + 1
            assert isinstance(action, Restart)

    @invariant()
    def matches_the_model(self) -> None:
        assert self.fail_jobs <= 1
        assert self.sup.failed == self.failed
        assert self.sup.finished == self.finished
        assert dict(self.sup.restarts) == self.restarts
        assert all(n <= self.limit for n in self.sup.restarts.values())
        if self.failed is None:
            assert self.sup.trainer_failure_streak == self.streak < MAX_TRAINER_FAILURES


TestSupervisorMachine = SupervisorMachine.TestCase
TestSupervisorMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


def test_an_exit_is_read_from_a_popen_returncode() -> None:
    assert Exited.of_returncode("ps-0", Kind.PS, 2) == Exited("ps-0", Kind.PS, status=2)
    killed = Exited.of_returncode("trainer-1", Kind.TRAINER, -signal.SIGKILL, "boom")
    assert killed == Exited("trainer-1", Kind.TRAINER, signal=signal.SIGKILL, message="boom")
    assert killed.describe() == f"signal {int(signal.SIGKILL)}" and not killed.internal
    never = Exited.of_returncode("etcd", Kind.ETCD, None)
    assert never.status is None and never.signal is None and never.describe() == "ended"
