"""Kept leases: an etcd lease refreshed from a daemon thread, and what the holder may
conclude from it locally.

Two beliefs come from a :class:`KeptLease`, for two different uses:

- :attr:`KeptLease.lost`: the lease is gone for good (etcd said so, or etcd
  stayed unreachable past a long grace). Processes use it to decide when to
  give up and exit.
- :meth:`KeptLease.is_valid`: the lease is *certainly* still held right now,
  from the local clock alone. Actions that a successor may also take once the
  lease ends (applying updates to a shard, writing its checkpoint files) must
  check this, because the lease can have expired in etcd long before
  :attr:`~KeptLease.lost` is set (for instance while this process is cut off
  from etcd).
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from elasticps.coord.client import ETCD_ERRORS, describe

__all__ = ["KeptLease", "LeaseValidity"]

_log = logging.getLogger(__name__)


class LeaseValidity:
    """The time until which a lease is certainly held, from its answered renewals. Pure.

    A renewal (or the grant) sent at monotonic time ``s`` and answered by etcd
    with a TTL of ``t`` seconds proves that the lease lives at least until
    ``s + t``: etcd started the new TTL when it *received* the request, which
    is after ``s``. Answers that come late do not move the bound past
    ``s + t``. This is the rule of Gray and Cheriton, "Leases: An Efficient
    Fault-Tolerant Mechanism for Distributed File Cache Consistency"
    (SOSP 1989, section 2), with the clock-drift allowance ε taken as 0: the
    local monotonic clock and etcd's are assumed to run at the same rate over
    one TTL. etcd itself only revokes an expired lease at its next expiry scan
    (every 500 ms), which adds margin on its side.

    Args:
        sent_at: monotonic time the grant request was sent, in seconds.
        ttl_s: the TTL etcd granted, in seconds.
    """

    def __init__(self, sent_at: float, ttl_s: float) -> None:
        self._valid_until = sent_at + ttl_s
        self._ended = False

    @property
    def valid_until(self) -> float:
        """Monotonic time until which the lease is certainly held, in seconds;
        ``-inf`` once it has ended."""
        return -math.inf if self._ended else self._valid_until

    @property
    def ended(self) -> bool:
        """Whether :meth:`end` was called."""
        return self._ended

    def renewed(self, sent_at: float, ttl_s: float) -> None:
        """Record a renewal sent at ``sent_at`` that etcd answered with ``ttl_s`` (> 0).

        The bound never moves back: a stale answer cannot shorten it.
        """
        self._valid_until = max(self._valid_until, sent_at + ttl_s)

    def end(self) -> None:
        """The lease is lost or revoked: it is never valid again."""
        self._ended = True

    def is_valid(self, now: float) -> bool:
        """Whether the lease is certainly held at monotonic time ``now`` (seconds)."""
        return now < self.valid_until


class KeptLease:
    """A lease refreshed by a daemon thread every ``ttl_s / 3`` seconds.

    When etcd answers that the lease no longer exists, the lease is *lost*:
    :attr:`lost` is set and ``on_lost`` (if any) is called once, from the
    refresh thread. The holder must then assume that every key attached to the
    lease is gone and that others may hold what it held (a slot, the master
    lock).

    While etcd cannot be reached at all, the lease is kept for up to
    ``unreachable_grace_s`` seconds: an etcd server that restarts extends every
    lease by its TTL when it comes back (the lessor's ``Promote``), so a
    restart of etcd must not make every process of the job give up. This is
    safe because nothing relies on the local belief alone: the master's ledger
    writes are fenced by the lock's lease inside etcd, and a refresh after the
    restart tells the truth. Past the grace the lease is declared lost.

    :attr:`lost` is a belief about the *process's* lifetime, not a licence to
    act. For actions that a successor may also take once the lease ends, use
    :meth:`is_valid` (or :meth:`wait_valid`): the classic rule of leases (Gray
    and Cheriton, "Leases: An Efficient Fault-Tolerant Mechanism for
    Distributed File Cache Consistency", SOSP 1989) is that a holder may act
    only before the time at which it *sent* its last renewal that was answered,
    plus the TTL granted in that answer (:meth:`valid_until`). etcd starts the
    TTL when it receives the request, which is later, so the holder's bound
    expires first; it assumes the two clocks run at the same rate over one TTL.
    The refresh thread renews every ``ttl_s / 3`` seconds counted from the
    previous send, so a healthy lease stays valid without a gap; while etcd is
    unreachable the bound runs out within one TTL of the last answered send,
    and the first answered renewal after an etcd restart makes the lease valid
    again.

    Created by :meth:`~elasticps.coord.store.JobStore.grant_lease`.

    Args:
        client: the pyetcd client (anything with ``refresh_lease(id)``
            yielding responses with a ``TTL``, and ``revoke_lease(id)``).
        lease_id: etcd's lease id.
        ttl_s: the TTL etcd granted, in seconds.
        on_lost: called once, from the refresh thread, if the lease is lost.
        unreachable_grace_s: how long to keep the lease while etcd cannot be
            reached at all, seconds; default ``max(30, 10 * ttl_s)``.
        granted_at: ``clock()`` time the grant request was sent, seconds; None:
            now (a later time than the truth, so pass it when known).
        clock: the monotonic clock, in seconds; ``time.monotonic`` unless a
            test injects a fake one.

    Attributes:
        id: etcd's lease id.
        ttl_s: the TTL etcd granted, in seconds (etcd rounds up to whole seconds
            and to its minimum TTL).
        lost: set once the lease is lost; not set by :meth:`revoke`.
    """

    def __init__(
        self,
        client: Any,
        lease_id: int,
        ttl_s: float,
        on_lost: Callable[[], None] | None = None,
        *,
        unreachable_grace_s: float | None = None,
        granted_at: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._client = client
        self._clock = clock
        self.unreachable_grace_s: Final = (
            unreachable_grace_s if unreachable_grace_s is not None else max(30.0, 10 * ttl_s)
        )
        self.id: Final = lease_id
        self.ttl_s: Final = ttl_s
        self.lost: Final = threading.Event()
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._running = threading.Event()  # cleared while renewals are paused
        self._running.set()
        self._revoked = False
        self._revoke_lock = threading.Lock()
        self._granted_at = clock() if granted_at is None else granted_at
        self._validity = LeaseValidity(self._granted_at, ttl_s)
        self._validity_changed = threading.Condition()
        self._thread = threading.Thread(
            target=self._keep_alive, name=f"elasticps-lease-{lease_id:x}", daemon=True
        )
        self._thread.start()

    @property
    def interval_s(self) -> float:
        """Time between two refreshes, in seconds."""
        return self.ttl_s / 3

    def valid_until(self) -> float:
        """Monotonic time until which the lease is certainly still held, in seconds.

        The time at which the last renewal that etcd answered (or the grant
        request) was sent, plus the TTL etcd returned in that answer; ``-inf``
        once the lease is lost or revoked. Compare it with ``time.monotonic()``
        (or the injected clock).
        """
        with self._validity_changed:
            return self._validity.valid_until

    def is_valid(self) -> bool:
        """Whether the lease is certainly still held now (see :meth:`valid_until`).

        False once the lease is lost or revoked, and while renewals go
        unanswered for longer than the TTL minus the renewal interval.
        """
        now = self._clock()
        with self._validity_changed:
            return self._validity.is_valid(now)

    def wait_valid(self, timeout_s: float | None) -> bool:
        """Block until the lease is valid, lost or revoked, or ``timeout_s`` passes.

        Args:
            timeout_s: how long to block, in seconds of real time; None: no limit.

        Returns:
            Whether the lease is valid on return (False if it ended or the time ran out).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._validity_changed:
            while True:
                if self._validity.is_valid(self._clock()):
                    return True
                if self._validity.ended:
                    return False
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._validity_changed.wait(remaining)

    def pause_renewals(self) -> None:
        """Stop sending renewals until :meth:`resume_renewals`, as if etcd were cut off.

        For fault-injection tests and drills: the lease then runs out in etcd
        one TTL after the last renewal, and :meth:`is_valid` turns False no
        later than that. A renewal already under way completes.
        """
        self._running.clear()

    def resume_renewals(self) -> None:
        """Send renewals again after :meth:`pause_renewals` (the next one at once)."""
        self._running.set()

    def revoke(self) -> None:
        """Stop refreshing and revoke the lease, deleting its keys.

        Idempotent. Errors are ignored: if etcd is unreachable, the lease expires
        on its own within its TTL. Safe to call from ``on_lost``.
        """
        with self._revoke_lock:
            if self._revoked:
                return
            self._revoked = True
        self._end()
        self._stop.set()
        self._running.set()  # wake a paused refresh thread, so that it sees the stop
        if threading.current_thread() is not self._thread:
            self._thread.join()
        with contextlib.suppress(*ETCD_ERRORS, ValueError):
            self._client.revoke_lease(self.id)

    def __repr__(self) -> str:
        return f"KeptLease(id={self.id:#x}, ttl_s={self.ttl_s:g}, lost={self.lost.is_set()})"

    def _keep_alive(self) -> None:
        last_ok_sent = self._granted_at
        wait_s = max(0.0, self._granted_at + self.interval_s - self._clock())
        retry_s = min(self.interval_s, 0.25)
        while not self._stop.wait(wait_s):
            if not self._running.is_set():
                self._running.wait()  # paused; revoke() sets it too
                if self._stop.is_set():
                    return
            sent = self._clock()
            try:
                responses = list(self._client.refresh_lease(self.id))
            except (*ETCD_ERRORS, ValueError) as exc:
                if self._clock() - last_ok_sent >= self.unreachable_grace_s:
                    self._declare_lost(
                        f"etcd unreachable for {self.unreachable_grace_s:g} s ({describe(exc)})"
                    )
                    return
                _log.debug("lease %x: refresh failed (%s); retrying", self.id, describe(exc))
                wait_s = retry_s
                continue
            if not responses or responses[-1].TTL <= 0:
                self._declare_lost("etcd says the lease has expired or was revoked")
                return
            last_ok_sent = sent
            with self._validity_changed:
                self._validity.renewed(sent, float(responses[-1].TTL))
                self._validity_changed.notify_all()
            # Paced from the send, not the answer: a slow answer must not
            # delay the next renewal past the point where the bound runs out.
            wait_s = max(0.0, sent + self.interval_s - self._clock())

    def _end(self) -> None:
        with self._validity_changed:
            self._validity.end()
            self._validity_changed.notify_all()

    def _declare_lost(self, reason: str) -> None:
        if self._stop.is_set():
            return  # revoked meanwhile: not a loss
        _log.warning("lease %x lost: %s", self.id, reason)
        self._end()
        self.lost.set()
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:
                _log.exception("lease %x: on_lost callback failed", self.id)
