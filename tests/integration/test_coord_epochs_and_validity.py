"""Slot epochs and local lease validity, against a real etcd on a free loopback port."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator

import pyetcd
import pytest

from elasticps.coord.etcd_server import EtcdServer
from elasticps.coord.store import JobStore, PSSlot, SlotClaim
from elasticps.errors import CoordinationError
from elasticps.testing import wait_for
from elasticps.wire.frame import local_host_id

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

SlotMap = dict[int, PSSlot]


@pytest.fixture
def store(etcd_server: EtcdServer, job_name: str) -> Iterator[JobStore]:
    with JobStore(etcd_server.endpoint, job_name) as job_store:
        yield job_store


@pytest.fixture
def other_store(etcd_server: EtcdServer, job_name: str) -> Iterator[JobStore]:
    """A second client on the same job, as another process would have."""
    with JobStore(etcd_server.endpoint, job_name) as job_store:
        yield job_store


def next_slots(changes: queue.Queue[SlotMap], want: Callable[[SlotMap], bool]) -> SlotMap:
    """Return the first reported slot map satisfying ``want`` (10 s deadline)."""
    deadline = time.monotonic() + 10.0
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


def reconnecting(action: Callable[[], object]) -> Callable[[], bool]:
    """A wait_for condition: ``action`` succeeded (etcd may still be coming back)."""

    def attempt() -> bool:
        try:
            action()
        except CoordinationError:
            return False
        return True

    return attempt


# --- slot epochs ---------------------------------------------------------------------


def test_a_claim_returns_the_epoch_readers_see(store: JobStore, other_store: JobStore) -> None:
    store.set_ps_desired(2)
    claim = store.claim_ps_slot_with_epoch("h:1", store.grant_lease(5), timeout_s=1.0)
    assert claim == SlotClaim(0, claim.epoch)
    assert other_store.slot_epoch(0) == claim.epoch
    assert other_store.slot_epoch(1) is None
    slots = other_store.ps_slots()
    assert slots == {0: PSSlot(0, "h:1", claim.epoch)}
    assert slots[0].claim == claim


def test_every_claim_of_a_slot_has_a_new_larger_epoch(store: JobStore) -> None:
    store.set_ps_desired(1)
    epochs = []
    for _ in range(3):
        lease = store.grant_lease(5)
        epochs.append(store.claim_ps_slot_with_epoch("same:1", lease, timeout_s=1.0).epoch)
        assert store.slot_epoch(0) == epochs[-1]
        lease.revoke()
    assert epochs == sorted(set(epochs))
    # The old API still claims, and its claim has an epoch too.
    assert store.claim_ps_slot_within("same:1", store.grant_lease(5), 1.0) == 0
    current = store.slot_epoch(0)
    assert current is not None and current > epochs[-1]


def test_a_value_rewrite_keeps_the_epoch(store: JobStore) -> None:
    store.set_ps_desired(1)
    lease = store.grant_lease(5)
    claim = store.claim_ps_slot_with_epoch("h:1", lease, timeout_s=1.0)
    store.put_json(store.keys.ps(0), {"address": "h:1", "pid": 1}, lease)
    assert store.slot_epoch(0) == claim.epoch


def test_wait_ps_slots_returns_every_slot_in_order_with_its_transport(
    store: JobStore, other_store: JobStore
) -> None:
    store.set_ps_desired(2)
    first = store.claim_ps_slot_with_epoch(
        "h:1", store.grant_lease(5), timeout_s=1.0, unix="/run/ps-0.sock"
    )
    with pytest.raises(CoordinationError, match=r"slots \[1\] of 2"):
        other_store.wait_ps_slots(timeout_s=0.1)
    second = other_store.claim_ps_slot_with_epoch("h:2", other_store.grant_lease(5), 1.0)
    assert store.wait_ps_slots(timeout_s=1.0) == [
        PSSlot(0, "h:1", first.epoch, unix="/run/ps-0.sock", host_id=local_host_id()),
        PSSlot(1, "h:2", second.epoch),
    ]
    assert first.epoch < second.epoch


def test_claim_with_epoch_waits_for_a_slot_to_free(store: JobStore, other_store: JobStore) -> None:
    store.set_ps_desired(1)
    holder = store.grant_lease(5)
    store.claim_ps_slot_with_epoch("old:1", holder, timeout_s=1.0)
    with pytest.raises(CoordinationError, match="stayed taken"):
        other_store.claim_ps_slot_with_epoch("new:1", other_store.grant_lease(5), 0.1)
    holder.revoke()
    claim = other_store.claim_ps_slot_with_epoch("new:1", other_store.grant_lease(5), 1.0)
    assert store.ps_slots()[0].epoch == claim.epoch


def test_watch_reports_current_slots_first_then_reclaims_with_new_epochs(
    store: JobStore, other_store: JobStore
) -> None:
    store.set_ps_desired(2)
    first_lease = store.grant_lease(5)
    first = store.claim_ps_slot_with_epoch("h:1", first_lease, timeout_s=1.0)
    changes: queue.Queue[SlotMap] = queue.Queue()
    watch = other_store.watch_ps_slots(changes.put)
    assert next_slots(changes, lambda m: True) == {0: PSSlot(0, "h:1", first.epoch)}

    first_lease.revoke()
    assert next_slots(changes, lambda m: True) == {}
    again = store.claim_ps_slot_with_epoch("h:1", store.grant_lease(5), timeout_s=1.0)
    seen = next_slots(changes, lambda m: 0 in m)
    assert seen == {0: PSSlot(0, "h:1", again.epoch)}
    assert again.epoch > first.epoch
    watch.cancel()


def test_watch_epochs_survive_an_etcd_restart(
    etcd_server_factory: Callable[[], EtcdServer],
) -> None:
    server = etcd_server_factory()
    changes: queue.Queue[SlotMap] = queue.Queue()
    with (
        JobStore(server.endpoint, "j", timeout_s=1.0) as claimer,
        JobStore(server.endpoint, "j", timeout_s=1.0) as watcher,
    ):
        claimer.set_ps_desired(2)
        first = claimer.claim_ps_slot_with_epoch("h:1", claimer.grant_lease(30), timeout_s=1.0)
        watcher.watch_ps_slots(changes.put)
        assert next_slots(changes, lambda m: True) == {0: PSSlot(0, "h:1", first.epoch)}

        server.restart()
        claims: list[SlotClaim] = []
        wait_for(
            reconnecting(
                lambda: claims.append(
                    claimer.claim_ps_slot_with_epoch("h:2", claimer.grant_lease(30), 0)
                )
            ),
            "etcd to accept a claim again",
        )
        (second,) = claims
        assert second.index == 1
        seen = next_slots(changes, lambda m: 1 in m)
        assert seen == {0: PSSlot(0, "h:1", first.epoch), 1: PSSlot(1, "h:2", second.epoch)}
        assert watcher.slot_epoch(0) == first.epoch  # the restart kept the revision


def test_watch_from_a_compacted_revision_reports_epochs_of_the_current_claims(
    etcd_server_factory: Callable[[], EtcdServer],
) -> None:
    server = etcd_server_factory()
    with JobStore(server.endpoint, "j") as job_store:
        job_store.set_ps_desired(1)
        lease = job_store.grant_lease(30)
        job_store.claim_ps_slot_with_epoch("h:1", lease, timeout_s=1.0)
        lease.revoke()
        claim = job_store.claim_ps_slot_with_epoch("h:1", job_store.grant_lease(30), 1.0)
        compactor = pyetcd.client(host=server.host, port=server.port, timeout=5)
        try:
            compactor.compact(claim.epoch, physical=True)
        finally:
            compactor.close()
        changes: queue.Queue[SlotMap] = queue.Queue()
        job_store.watch_ps_slots(changes.put, start_revision=2)
        assert next_slots(changes, lambda m: True) == {0: PSSlot(0, "h:1", claim.epoch)}


# --- lease validity ------------------------------------------------------------------


def test_a_kept_lease_stays_valid_while_renewals_are_answered(store: JobStore) -> None:
    lease = store.grant_lease(3)
    deadline = time.monotonic() + 2 * lease.ttl_s
    while time.monotonic() < deadline:
        assert lease.is_valid()
        assert lease.valid_until() > time.monotonic()
        time.sleep(0.05)  # sampling, not synchronisation


def test_validity_runs_out_within_ttl_of_paused_renewals_then_the_lease_expires(
    store: JobStore,
) -> None:
    lease = store.grant_lease(1)
    key = store.keys.trainer("paused")
    store.put_json(key, {"pid": 1}, lease)
    lease.pause_renewals()
    paused_at = time.monotonic()
    wait_for(lambda: not lease.is_valid(), "validity to run out", timeout_s=5.0)
    bound = lease.valid_until()
    # No renewal was sent after the pause (one already under way may end after it).
    assert bound <= paused_at + lease.ttl_s + 0.5
    assert not lease.lost.is_set()

    def key_gone() -> bool:
        return store.get_json(key) is None

    wait_for(key_gone, "etcd to expire the lease", timeout_s=10.0)
    assert bound <= time.monotonic()
    lease.resume_renewals()
    assert lease.lost.wait(10.0)  # etcd says the lease has expired
    assert not lease.wait_valid(1.0)


def test_validity_lapses_while_etcd_is_down_and_returns_after_its_restart(
    etcd_server_factory: Callable[[], EtcdServer],
) -> None:
    server = etcd_server_factory()
    with JobStore(server.endpoint, "j", timeout_s=0.5) as job_store:
        lease = job_store.grant_lease(2, unreachable_grace_s=60)
        job_store.register_trainer("7", {"pid": 1}, lease)
        assert lease.is_valid()
        server.kill()  # returns once etcd is dead: no renewal is answered after this
        killed_at = time.monotonic()
        wait_for(lambda: not lease.is_valid(), "validity to run out", timeout_s=10.0)
        assert lease.valid_until() <= killed_at + lease.ttl_s
        assert not lease.lost.is_set()  # the process keeps its lease through the restart

        server.restart()
        assert lease.wait_valid(30.0)
        assert lease.is_valid()
        assert not lease.lost.is_set()
        wait_for(
            reconnecting(job_store.live_trainers),
            "etcd to answer reads again",
        )
        assert "7" in job_store.live_trainers()[0]
