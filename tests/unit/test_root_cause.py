"""The first fault of a failed job, from its supervision decisions. No processes."""

from __future__ import annotations

from elasticps.launcher.supervisor import Decision, root_cause


def fault(at: float, worker: str, happened: str, decided: str = "restart 1/3") -> Decision:
    role = "etcd" if worker == "etcd" else worker.split("-", maxsplit=1)[0]
    return Decision(at, role, worker, happened, decided)


def test_a_bad_model_is_the_first_trainer_that_ended_on_it() -> None:
    first = Decision(5.0, "trainer", "trainer-0", "exit 2", "fail (exit 2): ...", "bad label")
    second = fault(5.2, "trainer-1", "exit 2", "ignore: the job is failing")
    cause, after = root_cause([first, second], "trainer-0")
    assert cause is first and cause.message == "bad label"
    assert after == [second]


def test_a_ps_killed_beyond_its_restarts_and_not_an_earlier_recovered_fault() -> None:
    early = fault(1.0, "trainer-3", "signal 9", "replace")
    kill = fault(20.0, "ps-0", "signal 9", "restart 1/1")
    consequence = fault(21.0, "trainer-0", "exit 1", "replace")
    last = fault(25.0, "ps-0", "signal 9", "fail (exit 1): ps-0 ... no restarts left")
    cause, after = root_cause([early, kill, consequence, last], "ps-0")
    assert cause is kill
    assert after == [consequence, last]


def test_etcd_that_cannot_be_restarted_is_the_cause_of_the_master_s_end() -> None:
    etcd = fault(10.0, "etcd", "exit 1")
    master = fault(12.0, "master-0", "exit 75", "restart 1/3")
    failed = fault(13.0, "etcd", "restart failed: no quorum", "fail (exit 1): etcd ...")
    assert root_cause([etcd, master, failed], "etcd")[0] is etcd
    assert root_cause([etcd, master, failed], "master-0")[0] is etcd


def test_a_trainer_that_ended_because_its_ps_vanished_is_not_the_root_cause() -> None:
    ps = fault(5.0, "ps-1", "signal 9")
    trainer = fault(6.0, "trainer-2", "exit 1", "fail (exit 1): trainers keep failing")
    cause, after = root_cause([ps, trainer], "trainer-2")
    assert cause is ps and after == [trainer]
    # Long before: not a cause.
    old = fault(-30.0, "ps-1", "signal 9")
    assert root_cause([old, trainer], "trainer-2")[0] is trainer


def test_without_a_failing_worker_the_failing_decision_names_it_and_no_fault_gives_none() -> None:
    ps = fault(5.0, "ps-0", "signal 9", "fail (exit 1): no restarts left")
    assert root_cause([ps], None)[0] is ps
    assert root_cause([Decision(1.0, "job", "job", "finished", "ignore: done")], None) == (None, [])


def test_a_decision_reads_back_from_its_record_and_a_malformed_one_is_none() -> None:
    decision = Decision(5.25, "ps", "ps-0", "signal 9", "restart 1/3", "boom")
    assert Decision.from_dict(decision.as_dict()) == decision
    assert Decision.from_dict({**fault(1.0, "ps-0", "exit 1").as_dict(), "host": "h"}) == fault(
        1.0, "ps-0", "exit 1"
    )
    for bad in (None, [], {"at": "x"}, {**decision.as_dict(), "worker": 3}):
        assert Decision.from_dict(bad) is None
