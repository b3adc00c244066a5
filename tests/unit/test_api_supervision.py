"""train(cluster=Local(...))'s trainer threads under the job's supervision policy (no sockets).

``_run_trainer_threads`` runs one real-trainer thread per config and judges
each one that ends through the policy the servers hold
(:meth:`elasticps.api.servers.LocalServers.decide`). Here the trainer and its
etcd store are fakes, and the servers are a stand-in holding a real
:class:`~elasticps.launcher.supervisor.Supervisor`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from torch import Tensor, nn

from elasticps.api import train as api_train
from elasticps.config import CommonConfig, OptimizerConfig, TrainerConfig
from elasticps.errors import (
    CoordinationError,
    DataError,
    JobFailedError,
    ServiceUnavailableError,
)
from elasticps.launcher.local_processes import DecisionLog
from elasticps.launcher.supervisor import Action, Event, Exited, Supervisor, SupervisorConfig
from elasticps.model_file import in_process_spec
from elasticps.testing import wait_for

pytestmark = pytest.mark.timeout(30)


class FakeServers:
    """The part of LocalServers that _run_trainer_threads uses."""

    def __init__(self, config: SupervisorConfig | None = None) -> None:
        self.policy = Supervisor(config or SupervisorConfig())
        self.events: list[Event] = []
        self.log = DecisionLog()
        self.checks = 0

    def check(self) -> None:
        self.checks += 1

    def decide(self, event: Event) -> Action:
        self.events.append(event)
        return self.log.decide(self.policy, event)

    def decision_records(self) -> list[dict[str, object]]:
        return self.log.as_json()


class FakeStore:
    def __init__(self, endpoint: str, job: str) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def fake_trainer(
    outcomes: dict[int, Callable[[], None]], started: list[int], stops: list[threading.Event]
) -> type:
    """A Trainer class whose run() does what ``outcomes[trainer_id]`` does (default: return)."""

    class Trainer:
        def __init__(
            self,
            config: TrainerConfig,
            spec: object,
            store: object,
            stop: threading.Event,
            **kwargs: object,
        ) -> None:
            self.config = config
            stops.append(stop)

        def run(self) -> None:
            started.append(self.config.trainer_id)
            outcomes.get(self.config.trainer_id, lambda: None)()

    return Trainer


def raises(exc: BaseException) -> Callable[[], None]:
    def run() -> None:
        raise exc

    return run


def run_threads(
    monkeypatch: pytest.MonkeyPatch,
    outcomes: dict[int, Callable[[], None]],
    servers: FakeServers,
    *,
    trainers: int = 2,
    started: list[int] | None = None,
    stops: list[threading.Event] | None = None,
) -> list[int]:
    started = [] if started is None else started
    stops = [] if stops is None else stops
    monkeypatch.setattr(api_train, "Trainer", fake_trainer(outcomes, started, stops))
    monkeypatch.setattr(api_train, "JobStore", FakeStore)

    def loss(outputs: Tensor, targets: Tensor) -> Tensor:
        return outputs.sum()

    spec = in_process_spec(nn.Linear(1, 1), loss)
    job = api_train._Job(
        spec=spec,
        reader=lambda: iter(()),
        optimizer=OptimizerConfig(),
        frozen=(),
        num_passes=1,
        hub=api_train._EventHub(None),
    )
    common = CommonConfig(job="j", etcd_endpoint="127.0.0.1:1")
    configs = [
        TrainerConfig(common=common, trainer_id=i, model_path=Path("m.py")) for i in range(trainers)
    ]
    api_train._run_trainer_threads(job, configs, None, servers)  # type: ignore[arg-type]
    return started


def test_a_trainer_that_cannot_reach_a_server_is_replaced_with_a_new_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servers = FakeServers()
    outcomes = {0: raises(ServiceUnavailableError("ps 1 refused")), 1: lambda: None}
    started = run_threads(monkeypatch, outcomes, servers)
    assert sorted(started) == [0, 1, 2]
    ends = {e.name: e for e in servers.events if isinstance(e, Exited)}
    assert ends["trainer-0"].status == 75
    assert ends["trainer-2"].status == 0


def test_internal_errors_are_replaced_until_they_keep_failing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servers = FakeServers(SupervisorConfig(max_trainer_failures=3))
    always = raises(RuntimeError("a bug"))
    outcomes = dict.fromkeys(range(10), always)
    with pytest.raises(JobFailedError, match=r"trainers keep failing.*RuntimeError: a bug") as err:
        run_threads(monkeypatch, outcomes, servers, trainers=1)
    # The error carries the policy's decisions, as run.json lists them.
    decided = [(d["worker"], d["happened"], str(d["decided"]).split(":")[0])
               for d in err.value.decisions]  # fmt: skip
    assert decided == [
        ("trainer-0", "exit 1", "replace"),
        ("trainer-1", "exit 1", "replace"),
        ("trainer-2", "exit 1", "fail (exit 1)"),
    ], decided


def test_a_user_error_ends_the_job_as_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    servers = FakeServers()
    stopped: list[bool] = []

    def until_stopped() -> None:  # as a real trainer: it returns when told to stop
        wait_for(lambda: bool(stops) and stops[0].is_set(), "the stop event")
        stopped.append(True)

    stops: list[threading.Event] = []
    outcomes = {0: raises(DataError("row 7 is bad")), 1: until_stopped}
    with pytest.raises(DataError, match="row 7 is bad"):
        run_threads(monkeypatch, outcomes, servers, stops=stops)
    assert stopped == [True]
    assert servers.policy.failed is not None and servers.policy.failed.exit_code == 2


def test_the_job_goes_on_while_one_trainer_lives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two of three trainers die of infrastructure errors: each is replaced (ids 3 and 4)
    while the third lives; once it is told the job is finished, a death is ignored."""
    servers = FakeServers()
    started: list[int] = []

    def survivor() -> None:  # trainer 2: lives until both replacements run
        wait_for(lambda: {3, 4} <= set(started), "both replacements to start")

    def after_the_end(then: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            wait_for(lambda: servers.policy.finished, "the job to finish")
            then()

        return run

    outcomes = {
        0: raises(CoordinationError("etcd is restarting")),
        1: raises(ServiceUnavailableError("master gone")),
        2: survivor,
        3: after_the_end(raises(ServiceUnavailableError("late"))),
        4: after_the_end(lambda: None),
    }
    started = run_threads(monkeypatch, outcomes, servers, trainers=3, started=started)
    assert sorted(started) == [0, 1, 2, 3, 4]
    assert servers.policy.failed is None
    late = [e for e in servers.events if isinstance(e, Exited) and e.name == "trainer-3"]
    assert late and late[0].status == 75
