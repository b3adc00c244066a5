"""The pieces every local supervision loop shares (a thin I/O shell over the policy).

``elasticps train`` (:mod:`elasticps.launcher.local`), :class:`elasticps.Local`
(:mod:`elasticps.api.servers`) and :func:`elasticps.dist_train` each watch
their processes and feed the one supervision policy
(:class:`~elasticps.launcher.supervisor.Supervisor`). What they do around
it is written once here:

- :func:`returncode_of`: a child's end as ``Popen`` says it (``-N`` for
  signal ``N``), also for a role on another host whose ssh session relays
  ``128 + N`` (:func:`~elasticps.launcher.supervisor.relayed_returncode`);
- :func:`release_keys`: the etcd keys a reaped server held under its lease,
  deleted at once (only while they still name its pid);
- :class:`DecisionLog`: the policy's decisions, recorded with the time
  (``run.json``'s ``decisions``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from elasticps.coord.store import JobStore
from elasticps.errors import ElasticPSError
from elasticps.launcher.ssh import SshProcess
from elasticps.launcher.supervisor import (
    Action,
    Decision,
    Event,
    Kind,
    Progressed,
    Supervisor,
    decision_of,
    relayed_returncode,
)

__all__ = ["DecisionLog", "release_keys", "returncode_of"]

log = logging.getLogger(__name__)


def returncode_of(proc: object, code: int) -> int:
    """The ``Popen``-style return code of a child that ended with ``code``.

    Args:
        proc: the child's handle (a :class:`subprocess.Popen`, a fork-server
            child, or an :class:`~elasticps.launcher.ssh.SshProcess`).
        code: what its ``poll()`` or ``wait()`` returned.

    Returns:
        ``code``, except for an ssh session, whose ``128 + N`` (the role
        killed by signal ``N`` on its host) becomes ``-N`` like a local
        child's.
    """
    if isinstance(proc, SshProcess):
        return relayed_returncode(code)
    return code


def release_keys(store: JobStore, kind: Kind, pid: int, num_ps: int) -> str | None:
    """Delete the PS slot or master lock that the reaped process ``pid`` held.

    The process is certainly dead (it was reaped), so its key can go now
    rather than one lease TTL later: a restarted PS reclaims its slot at once
    and a standby master takes over at once. Only a key that still names
    ``pid`` is deleted. Errors of etcd are logged, not raised: the lease
    expires on its own.

    Args:
        store: the job's store.
        kind: :attr:`Kind.PS` (any slot, a spare may hold one) or
            :attr:`Kind.MASTER` (the lock); other kinds hold no such key.
        pid: the reaped process's id.
        num_ps: the job's number of PS slots.

    Returns:
        The deleted key, or None.
    """
    if kind is Kind.PS:
        keys = [store.keys.ps(i) for i in range(num_ps)]
    elif kind is Kind.MASTER:
        keys = [store.keys.master_lock]
    else:
        return None
    for key in keys:
        try:
            if store.delete_if_pid(key, pid):
                log.info("released %s of pid %d", key, pid)
                return key
        except ElasticPSError as exc:  # etcd down: the lease will expire on its own
            log.info("could not release %s of pid %d: %s", key, pid, exc)
            return None
    return None


class DecisionLog:
    """The supervision policy's decisions, in order (thread-safe).

    Args:
        clock: seconds since the epoch (:func:`time.time` by default).
        on_record: called with each decision as it is recorded (the job's
            event log), outside the log's lock.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        on_record: Callable[[Decision], None] | None = None,
    ) -> None:
        self._clock = clock
        self._on_record = on_record
        self._lock = threading.Lock()
        self._decide_lock = threading.Lock()
        self._records: list[Decision] = []

    def record(self, event: Event, action: Action) -> Decision | None:
        """Record the policy's ``action`` on ``event`` (task progress is not recorded).

        Returns:
            The record, or None if nothing was recorded.
        """
        if isinstance(event, Progressed):
            return None  # once a second; the clock is not read for it
        decision = decision_of(self._clock(), event, action)
        if decision is not None:
            with self._lock:
                self._records.append(decision)
            if self._on_record is not None:
                self._on_record(decision)
        return decision

    def decide(self, policy: Supervisor, event: Event) -> Action:
        """``policy``'s answer to ``event``, recorded (the one way the launchers ask it;
        calls are serialized, so that ``policy`` sees one event at a time)."""
        with self._decide_lock:
            action = policy.handle(event)
            self.record(event, action)
            return action

    def records(self) -> list[Decision]:
        """Every decision so far, oldest first."""
        with self._lock:
            return list(self._records)

    def as_json(self) -> list[dict[str, object]]:
        """Every decision so far as JSON-ready dicts (``run.json``'s ``decisions``)."""
        return [d.as_dict() for d in self.records()]
