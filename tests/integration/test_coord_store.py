"""EtcdServer and JobStore against a real etcd on a free loopback port."""

from __future__ import annotations

import queue
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pyetcd
import pytest

from elasticps.coord.etcd_server import EtcdServer, EtcdServerConfig
from elasticps.coord.store import JobStore, TrainerMap
from elasticps.errors import CoordinationError, PortInUseError
from elasticps.netutil import LOOPBACK, free_port
from elasticps.testing import pid_gone, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


def next_map(changes: queue.Queue[TrainerMap], want: Callable[[TrainerMap], bool]) -> TrainerMap:
    """Return the first reported trainer map satisfying ``want`` (5 s deadline)."""
    deadline = time.monotonic() + 5.0
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            pytest.fail("timed out waiting for a watch report")
        try:
            seen = changes.get(timeout=remaining)
        except queue.Empty:
            continue
        if want(seen):
            return seen


@pytest.fixture
def store(etcd_server: EtcdServer, job_name: str) -> Iterator[JobStore]:
    with JobStore(etcd_server.endpoint, job_name) as job_store:
        yield job_store


@pytest.fixture
def other_store(etcd_server: EtcdServer, job_name: str) -> Iterator[JobStore]:
    """A second client on the same job, as another process would have."""
    with JobStore(etcd_server.endpoint, job_name) as job_store:
        yield job_store


# --- EtcdServer --------------------------------------------------------------------------


def test_server_starts_on_a_free_port_answers_and_stops_by_pid(tmp_path: Path) -> None:
    server = EtcdServer(EtcdServerConfig(data_dir=tmp_path / "data", client_port=0))
    with server:
        pid = server.pid
        assert pid is not None
        assert server.alive()
        assert server.endpoint == f"{LOOPBACK}:{server.port}"
        with JobStore(server.endpoint, "j") as job_store:
            job_store.set_job_state("running")
            assert job_store.job_state() == "running"
    assert not server.alive()
    assert server.pid is None
    assert pid_gone(pid)
    server.stop()  # idempotent


def test_start_refuses_a_requested_port_that_is_taken(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = EtcdServer(EtcdServerConfig(data_dir=tmp_path / "data", client_port=port))
        with pytest.raises(PortInUseError, match=str(port)):
            server.start()
    assert server.pid is None


def test_spawn_returns_at_once_and_start_waits_for_that_process(tmp_path: Path) -> None:
    server = EtcdServer(EtcdServerConfig(data_dir=tmp_path / "data", client_port=0))
    try:
        server.spawn()
        pid = server.pid
        assert pid is not None
        endpoint = server.endpoint  # known at once: the ports are picked by spawn()
        server.start()
        assert (server.pid, server.endpoint) == (pid, endpoint)  # the same process
        with JobStore(endpoint, "j") as job_store:
            job_store.set_job_state("running")
            assert job_store.job_state() == "running"
    finally:
        server.stop()
    assert pid_gone(pid)


def test_a_spawned_etcd_that_never_started_stops_by_pid(tmp_path: Path) -> None:
    server = EtcdServer(EtcdServerConfig(data_dir=tmp_path / "data", client_port=0))
    server.spawn()
    pid = server.pid
    assert pid is not None
    server.stop()
    assert pid_gone(pid)
    assert server.pid is None


def test_start_after_spawn_picks_new_ports_when_a_picked_one_was_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elasticps.coord import etcd_server

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind((LOOPBACK, 0))
        taken.listen()
        port = taken.getsockname()[1]
        picks = iter([port])
        real = etcd_server.free_port
        # The first pick is a port another process holds (the race start() retries).
        monkeypatch.setattr(etcd_server, "free_port", lambda host: next(picks, None) or real(host))
        server = EtcdServer(EtcdServerConfig(data_dir=tmp_path / "data", client_port=0))
        try:
            server.spawn()
            server.start()
            assert server.port != port
            with JobStore(server.endpoint, "j") as job_store:
                assert job_store.job_state() is None
        finally:
            server.stop()


def test_restart_keeps_data_and_endpoint(
    etcd_server_factory: Callable[[], EtcdServer],
) -> None:
    server = etcd_server_factory()
    endpoint, old_pid = server.endpoint, server.pid
    with JobStore(endpoint, "j") as job_store:
        job_store.put_json(job_store.keys.root + "probe", {"kept": True})
    server.restart()
    assert server.endpoint == endpoint
    assert server.pid not in (None, old_pid)
    with JobStore(endpoint, "j") as job_store:
        assert job_store.get_json(job_store.keys.root + "probe") == {"kept": True}


def test_start_quotes_etcd_log_when_etcd_exits(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    server = EtcdServer(EtcdServerConfig(data_dir=not_a_dir, client_port=0))
    with pytest.raises(CoordinationError, match="not a directory"):
        server.start()
    assert server.pid is None


def test_store_reports_unreachable_etcd() -> None:
    endpoint = f"{LOOPBACK}:{free_port()}"
    with pytest.raises(CoordinationError, match=endpoint):
        JobStore(endpoint, "j", timeout_s=0.3)


# --- trainers ----------------------------------------------------------------------------


def test_registered_trainer_is_live_until_its_lease_is_revoked(store: JobStore) -> None:
    lease = store.grant_lease(5)
    store.register_trainer("t0", {"address": "h:1"}, lease)
    trainers, revision = store.live_trainers()
    assert trainers == {"t0": {"address": "h:1"}}
    assert revision > 0
    lease.revoke()
    assert store.live_trainers()[0] == {}
    assert not lease.lost.is_set()


_REGISTER_AND_HANG = textwrap.dedent(
    """
    import sys, threading
    from elasticps.coord.store import JobStore
    store = JobStore(sys.argv[1], sys.argv[2])
    store.register_trainer("doomed", {}, store.grant_lease(1))
    print("registered", flush=True)
    threading.Event().wait()
    """
)


def test_trainer_key_expires_after_its_process_is_killed(
    etcd_server: EtcdServer, store: JobStore
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _REGISTER_AND_HANG, etcd_server.endpoint, store.keys.job],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "registered"
        assert "doomed" in store.live_trainers()[0]
        child.send_signal(signal.SIGKILL)
        child.wait()
        # TTL 1 s, plus etcd's 0.5 s expiry scan.
        wait_for(lambda: "doomed" not in store.live_trainers()[0], "the lease to expire")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if child.stdout is not None:
            child.stdout.close()


def test_watch_reports_a_registration_and_a_removal(store: JobStore, other_store: JobStore) -> None:
    changes: queue.Queue[TrainerMap] = queue.Queue()
    _, revision = store.live_trainers()
    watch = store.watch_trainers(changes.put, revision + 1)
    lease = other_store.grant_lease(5)
    other_store.register_trainer("t1", {"address": "h:2"}, lease)
    assert next_map(changes, lambda m: "t1" in m) == {"t1": {"address": "h:2"}}
    lease.revoke()
    assert next_map(changes, lambda m: "t1" not in m) == {}
    watch.cancel()


def test_watch_applies_every_change_of_one_revision(store: JobStore, other_store: JobStore) -> None:
    """Keys changed in one transaction (or freed with one lease) share a revision:
    the watch reports them all, not only the first."""
    changes: queue.Queue[TrainerMap] = queue.Queue()
    _, revision = store.live_trainers()
    watch = store.watch_trainers(changes.put, revision + 1)
    lease = other_store.grant_lease(5)
    for name in ("t1", "t2", "t3"):
        other_store.register_trainer(name, {}, lease)
    assert set(next_map(changes, lambda m: len(m) == 3)) == {"t1", "t2", "t3"}
    lease.revoke()  # one revision deletes the three
    assert next_map(changes, lambda m: not m) == {}
    watch.cancel()


def test_watch_misses_no_change_between_read_and_watch(store: JobStore) -> None:
    lease = store.grant_lease(5)
    store.register_trainer("early", {}, lease)
    trainers, revision = store.live_trainers()
    assert set(trainers) == {"early"}
    store.register_trainer("between", {}, lease)  # after the read, before the watch
    changes: queue.Queue[TrainerMap] = queue.Queue()
    watch = store.watch_trainers(changes.put, revision + 1)
    assert set(next_map(changes, lambda m: True)) == {"early", "between"}
    watch.cancel()


# --- parameter servers -------------------------------------------------------------------


def test_ps_slots_are_claimed_once_and_freed_with_the_lease(store: JobStore) -> None:
    store.set_ps_desired(2)
    first, second, third = (store.grant_lease(5) for _ in range(3))
    assert store.claim_ps_slot("h:10", first) == 0
    assert store.claim_ps_slot("h:11", second) == 1
    with pytest.raises(CoordinationError, match="all 2 slots are taken"):
        store.claim_ps_slot("h:12", third)
    first.revoke()
    assert store.claim_ps_slot("h:12", third) == 0
    assert store.ps_addresses(timeout_s=1.0) == ["h:12", "h:11"]


def test_claim_fails_while_ps_desired_is_unset(store: JobStore) -> None:
    with pytest.raises(CoordinationError, match="ps_desired is not set"):
        store.claim_ps_slot("h:10", store.grant_lease(5))


def test_ps_addresses_waits_for_every_slot_in_index_order(
    store: JobStore, other_store: JobStore
) -> None:
    store.set_ps_desired(2)
    assert store.claim_ps_slot("z:1", store.grant_lease(5)) == 0
    late_lease = other_store.grant_lease(5)
    claimer = threading.Timer(0.2, other_store.claim_ps_slot, args=("a:1", late_lease))
    claimer.start()
    try:
        assert store.ps_addresses(timeout_s=5.0) == ["z:1", "a:1"]
    finally:
        claimer.join()


def test_ps_addresses_timeout_names_missing_slots(store: JobStore) -> None:
    store.set_ps_desired(3)
    store.claim_ps_slot("h:10", store.grant_lease(5))
    with pytest.raises(CoordinationError, match=r"slots \[1, 2\] of 3"):
        store.ps_addresses(timeout_s=0.2)


# --- master lock and fencing -------------------------------------------------------------


def test_only_one_master_holds_the_lock_until_its_lease_ends(
    store: JobStore, other_store: JobStore
) -> None:
    winner_lease, loser_lease = store.grant_lease(5), other_store.grant_lease(5)
    assert store.acquire_master_lock("m:1", winner_lease)
    assert not other_store.acquire_master_lock("m:2", loser_lease)
    assert store.acquire_master_lock("m:1", winner_lease)  # re-acquiring is idempotent
    assert other_store.master_address(timeout_s=1.0) == "m:1"

    winner_lease.revoke()
    assert other_store.acquire_master_lock("m:2", loser_lease)
    assert store.master_address(timeout_s=1.0) == "m:2"


def test_fenced_put_refuses_a_non_holder_and_a_deposed_holder(
    store: JobStore, other_store: JobStore
) -> None:
    key = store.keys.task(7)
    first, second = store.grant_lease(5), other_store.grant_lease(5)
    assert not store.fenced_put(key, '"nobody holds the lock"', first)
    assert store.acquire_master_lock("m:1", first)
    assert store.fenced_put(key, '{"by": "first"}', first)
    assert not other_store.fenced_put(key, '{"by": "second"}', second)

    first.revoke()  # the first master is deposed
    assert other_store.acquire_master_lock("m:2", second)
    assert not store.fenced_put(key, '{"by": "stale first"}', first)
    assert other_store.fenced_put(key, '{"by": "second"}', second)
    assert store.get_json(key) == {"by": "second"}


def test_master_address_times_out_without_a_master(store: JobStore) -> None:
    with pytest.raises(CoordinationError, match="no master"):
        store.master_address(timeout_s=0.1)


# --- job state ---------------------------------------------------------------------------


def test_job_state_round_trips(store: JobStore) -> None:
    assert store.job_state() is None
    store.set_job_state("running")
    store.set_job_state("finished")
    assert store.job_state() == "finished"


# --- etcd failures -----------------------------------------------------------------------


def test_lease_is_declared_lost_once_when_etcd_stays_down_past_the_grace(
    etcd_server_factory: Callable[[], EtcdServer],
) -> None:
    server = etcd_server_factory()
    calls: list[None] = []
    with JobStore(server.endpoint, "j", timeout_s=0.5) as job_store:
        lease = job_store.grant_lease(
            1, on_lost=lambda: calls.append(None), unreachable_grace_s=1.5
        )
        server.kill()
        assert lease.lost.wait(timeout=6.0)
        wait_for(lambda: len(calls) == 1, "on_lost to be called")
        assert len(calls) == 1


def test_lease_survives_an_etcd_restart_shorter_than_the_grace(
    etcd_server_factory: Callable[[], EtcdServer],
) -> None:
    server = etcd_server_factory()
    with JobStore(server.endpoint, "j", timeout_s=0.5) as job_store:
        lease = job_store.grant_lease(2, unreachable_grace_s=30)
        job_store.register_trainer("7", {"pid": 1}, lease)
        server.kill()
        # Down for longer than the TTL: etcd extends the lease when it is back.
        assert not lease.lost.wait(timeout=3.0)
        server.restart()

        def registered() -> bool:
            try:
                return "7" in job_store.live_trainers()[0]
            except CoordinationError:
                return False  # the client is still reconnecting

        wait_for(registered, "the key to be readable again")
        # Refreshes succeed again: the key outlives another TTL.
        assert not lease.lost.wait(timeout=3.0)
        assert "7" in job_store.live_trainers()[0]


def test_watch_resumes_after_etcd_restarts(
    etcd_server_factory: Callable[[], EtcdServer],
) -> None:
    server = etcd_server_factory()
    changes: queue.Queue[TrainerMap] = queue.Queue()
    with JobStore(server.endpoint, "j", timeout_s=1.0) as job_store:
        _, revision = job_store.live_trainers()
        job_store.watch_trainers(changes.put, revision + 1)
        server.restart()

        def register_after_restart() -> bool:
            try:
                job_store.register_trainer("t2", {}, job_store.grant_lease(5))
            except CoordinationError:
                return False  # the client is still reconnecting
            return True

        wait_for(register_after_restart, "etcd to accept writes again")
        assert set(next_map(changes, lambda m: "t2" in m)) == {"t2"}


def test_watch_from_a_compacted_revision_reports_the_current_map(
    etcd_server_factory: Callable[[], EtcdServer],
) -> None:
    server = etcd_server_factory()
    with JobStore(server.endpoint, "j") as job_store:
        lease = job_store.grant_lease(5)
        job_store.register_trainer("old", {}, lease)
        job_store.register_trainer("kept", {}, lease)
        job_store.put_json(job_store.keys.trainer("old"), {"gone": "soon"})
        _, revision = job_store.live_trainers()
        # Compact away the history, as etcd's auto-compaction eventually does.
        compactor = pyetcd.client(host=server.host, port=server.port, timeout=5)
        try:
            compactor.compact(revision, physical=True)
            compactor.delete(job_store.keys.trainer("old"))
        finally:
            compactor.close()
        changes: queue.Queue[TrainerMap] = queue.Queue()
        job_store.watch_trainers(changes.put, start_revision=2)
        assert set(next_map(changes, lambda m: True)) == {"kept"}
