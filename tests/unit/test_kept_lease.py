"""KeptLease's local validity, with a fake clock and a scripted etcd client (no sockets).

The fake client answers each keep-alive only when the test says so, and the
fake clock moves only when the test moves it, so every assertion about
``is_valid`` is exact. The real-etcd counterparts are in
``tests/integration/test_coord_epochs_and_validity.py``.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
from pyetcd import exceptions as etcd_exceptions

from elasticps.coord.lease import KeptLease, LeaseValidity

pytestmark = pytest.mark.timeout(30)

#: Real seconds to wait for the refresh thread to make its next request.
THREAD_DEADLINE_S = 10.0
TTL_S = 0.3  # real renewal interval TTL_S / 3 = 0.1 s


class FakeClock:
    """A monotonic clock that moves only when told to."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


Answer = Callable[[], list[SimpleNamespace]]


class ScriptedClient:
    """Answers each ``refresh_lease`` with what the test puts in :attr:`answers`."""

    def __init__(self, clock: FakeClock) -> None:
        self._clock = clock
        self.calls: queue.Queue[float] = queue.Queue()  # the clock at each request
        self.answers: queue.Queue[Answer] = queue.Queue()
        self.revoked: list[int] = []
        self._closed = threading.Event()

    def refresh_lease(self, lease_id: int) -> list[SimpleNamespace]:
        self.calls.put(self._clock())
        while not self._closed.is_set():
            try:
                return self.answers.get(timeout=0.05)()
            except queue.Empty:
                continue
        return [SimpleNamespace(TTL=TTL_S)]

    def close(self) -> None:
        """From now on, answer every request at once (so that the thread can stop)."""
        self._closed.set()

    def revoke_lease(self, lease_id: int) -> None:
        self.revoked.append(lease_id)

    def next_call(self) -> float:
        """Wait for the refresh thread's next request; return the clock when it was sent."""
        return self.calls.get(timeout=THREAD_DEADLINE_S)

    def answer_ttl(self, ttl_s: float) -> None:
        self.answers.put(lambda: [SimpleNamespace(TTL=ttl_s)])

    def answer_unreachable(self) -> None:
        def fail() -> list[SimpleNamespace]:
            raise etcd_exceptions.ConnectionFailedError()

        self.answers.put(fail)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(100.0)


@pytest.fixture
def client(clock: FakeClock) -> ScriptedClient:
    return ScriptedClient(clock)


@pytest.fixture
def lease(client: ScriptedClient, clock: FakeClock) -> Iterator[KeptLease]:
    kept = KeptLease(client, 7, TTL_S, unreachable_grace_s=10.0, granted_at=99.9, clock=clock)
    try:
        yield kept
    finally:
        client.close()
        kept.revoke()


def wait_valid_in_thread(lease: KeptLease) -> tuple[threading.Thread, list[bool]]:
    result: list[bool] = []
    waiter = threading.Thread(target=lambda: result.append(lease.wait_valid(THREAD_DEADLINE_S)))
    waiter.start()
    return waiter, result


# --- the pure bound -------------------------------------------------------------------


def test_validity_is_the_send_time_plus_the_answered_ttl() -> None:
    validity = LeaseValidity(sent_at=10.0, ttl_s=3.0)
    assert validity.valid_until == 13.0
    assert validity.is_valid(12.99)
    assert not validity.is_valid(13.0)
    validity.renewed(sent_at=12.0, ttl_s=3.0)
    assert validity.valid_until == 15.0


def test_validity_never_moves_back_and_ends_for_good() -> None:
    validity = LeaseValidity(sent_at=10.0, ttl_s=3.0)
    validity.renewed(sent_at=5.0, ttl_s=3.0)  # a stale answer
    assert validity.valid_until == 13.0
    validity.end()
    assert validity.valid_until == -math.inf
    validity.renewed(sent_at=20.0, ttl_s=3.0)
    assert not validity.is_valid(20.0)


# --- KeptLease --------------------------------------------------------------------------


def test_lease_is_valid_until_grant_time_plus_ttl_without_answers(
    lease: KeptLease, clock: FakeClock, client: ScriptedClient
) -> None:
    assert lease.valid_until() == pytest.approx(99.9 + TTL_S)
    assert lease.is_valid()
    client.next_call()  # the first renewal is sent but not answered
    clock.now = 99.9 + TTL_S - 1e-6
    assert lease.is_valid()
    clock.now = 99.9 + TTL_S
    assert not lease.is_valid()
    assert not lease.lost.is_set()


def test_a_late_answer_counts_from_when_the_renewal_was_sent(
    lease: KeptLease, clock: FakeClock, client: ScriptedClient
) -> None:
    sent = client.next_call()
    clock.now = 500.0  # the answer arrives long after the request was sent
    waiter, result = wait_valid_in_thread(lease)
    client.answer_ttl(TTL_S)
    assert client.next_call() == 500.0  # answered: the thread renews again at once
    assert lease.valid_until() == pytest.approx(sent + TTL_S)
    assert not lease.is_valid()
    client.answer_ttl(TTL_S)  # this renewal was sent at 500: valid again
    waiter.join(THREAD_DEADLINE_S)
    assert result == [True]
    assert lease.valid_until() == pytest.approx(500.0 + TTL_S)
    assert lease.is_valid()


def test_unanswered_renewals_let_validity_run_out_but_do_not_lose_the_lease(
    lease: KeptLease, clock: FakeClock, client: ScriptedClient
) -> None:
    client.next_call()
    client.answer_ttl(TTL_S)
    sent = client.next_call()
    bound = sent + TTL_S
    assert lease.valid_until() == pytest.approx(bound)
    clock.now = bound + 1.0
    client.answer_unreachable()
    assert client.next_call() == bound + 1.0  # the retry after the failure
    assert not lease.is_valid()
    assert not lease.wait_valid(0.05)
    assert not lease.lost.is_set()
    client.answer_ttl(TTL_S)  # etcd is back: the first answered renewal restores validity
    assert lease.wait_valid(THREAD_DEADLINE_S)
    assert lease.valid_until() == pytest.approx(bound + 1.0 + TTL_S)


def test_unreachable_past_the_grace_loses_the_lease_on_the_lease_clock(
    lease: KeptLease, clock: FakeClock, client: ScriptedClient
) -> None:
    client.next_call()
    clock.now = 105.0
    client.answer_unreachable()
    client.next_call()
    assert not lease.lost.is_set()
    clock.now = 110.0  # the grace counts from the last answered send (the grant, at 99.9)
    client.answer_unreachable()
    assert lease.lost.wait(THREAD_DEADLINE_S)
    assert lease.valid_until() == -math.inf
    assert not lease.wait_valid(THREAD_DEADLINE_S)


def test_an_expired_answer_loses_the_lease_and_wakes_waiters(
    clock: FakeClock, client: ScriptedClient
) -> None:
    calls: list[None] = []
    lease = KeptLease(client, 7, TTL_S, on_lost=lambda: calls.append(None), clock=clock)
    client.next_call()
    clock.now = 1000.0
    waiter, result = wait_valid_in_thread(lease)
    client.answer_ttl(-1)  # etcd: no such lease
    waiter.join(THREAD_DEADLINE_S)
    assert result == [False]
    assert lease.lost.is_set()
    assert calls == [None]
    assert not lease.is_valid()
    client.close()
    lease.revoke()


def test_paused_renewals_are_not_sent_until_resumed(
    lease: KeptLease, clock: FakeClock, client: ScriptedClient
) -> None:
    client.next_call()
    lease.pause_renewals()
    client.answer_ttl(TTL_S)  # the renewal under way completes
    with pytest.raises(queue.Empty):
        client.calls.get(timeout=5 * TTL_S)  # ample time for several renewals
    lease.resume_renewals()
    client.next_call()


def test_revoke_ends_validity_and_revokes_in_etcd(clock: FakeClock, client: ScriptedClient) -> None:
    lease = KeptLease(client, 9, TTL_S, clock=clock)
    lease.pause_renewals()
    assert lease.is_valid()
    client.close()
    lease.revoke()  # also stops a paused refresh thread
    assert not lease.is_valid()
    assert not lease.wait_valid(None)
    assert client.revoked == [9]
    assert not lease.lost.is_set()
