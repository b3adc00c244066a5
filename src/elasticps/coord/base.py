"""The connection every part of the job's store shares: client, leases, watches, JSON.

:class:`StoreBase` owns one pyetcd client, the leases it granted and the
watches it started, and closes them together. The concern classes
(:class:`~elasticps.coord.membership.TrainerMembership`,
:class:`~elasticps.coord.slots.PSSlots`,
:class:`~elasticps.coord.masterlock.MasterLock`,
:class:`~elasticps.coord.jobstate.JobProgress`) extend it, and
:class:`~elasticps.coord.store.JobStore` is all of them on one connection.
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from types import TracebackType
from typing import Any, Final, Self

from pyetcd import events as etcd_events
from pyetcd.utils import prefix_range_end

from elasticps.coord.client import (
    ETCD_ERRORS,
    POLL_MAX_S,
    connect,
    decode_object,
    describe,
    encode,
)
from elasticps.coord.keys import Keys
from elasticps.coord.lease import KeptLease
from elasticps.coord.watch import Watch, WatchedValue
from elasticps.errors import ConfigError, CoordinationError
from elasticps.jobca import Credential

__all__ = ["StoreBase"]


class StoreBase:
    """One etcd connection for one job: leases, generic JSON access and watches.

    Owns one pyetcd client (one per process is enough). The concern classes
    extend it; use :class:`~elasticps.coord.store.JobStore`, which is all of
    them on one connection, unless a process needs only one concern.

    Args:
        endpoint: etcd client endpoint, ``"host:port"`` or ``"http://host:port"``.
        job: the job name; every key lives under ``/elasticps/<job>/``.
        timeout_s: how long to wait for etcd to answer at construction, and the
            deadline of every etcd request, in seconds.
        tls: the TLS identity to show etcd; None: this process's
            (:func:`~elasticps.security.etcd_tls_from_env`), if any.

    Raises:
        ConfigError: the endpoint or the job name is malformed, or a TLS file
            cannot be read.
        CoordinationError: etcd did not answer within ``timeout_s``.
    """

    def __init__(
        self, endpoint: str, job: str, *, timeout_s: float = 5.0, tls: Credential | None = None
    ) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"etcd timeout_s must be > 0, got {timeout_s}")
        self.keys: Final = Keys(job)
        self.endpoint: Final = endpoint
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._leases: list[KeptLease] = []
        self._watches: list[Watch] = []
        self._client: Any = connect(endpoint, timeout_s, tls)

    # --- lifecycle ------------------------------------------------------------------

    def close(self) -> None:
        """Cancel this store's watches, revoke its leases and close the client. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            watches, self._watches = self._watches, []
            leases, self._leases = self._leases, []
        for watch in watches:
            watch.cancel()
        for lease in leases:
            lease.revoke()
        self._client.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.endpoint!r}, {self.keys.job!r})"

    @contextlib.contextmanager
    def _etcd(self, what: str) -> Iterator[None]:
        """Translate pyetcd and gRPC errors raised inside into CoordinationError."""
        if self._closed:
            raise CoordinationError(f"{what}: the store is closed")
        try:
            yield
        except ETCD_ERRORS as exc:
            raise CoordinationError(
                f"etcd {self.endpoint}: {what} failed: {describe(exc)}"
            ) from exc

    # --- leases -------------------------------------------------------------------------

    def grant_lease(
        self,
        ttl_s: float,
        on_lost: Callable[[], None] | None = None,
        *,
        unreachable_grace_s: float | None = None,
    ) -> KeptLease:
        """Grant a lease and keep it alive from a daemon thread.

        Args:
            ttl_s: time to live, in seconds. etcd rounds it up to whole seconds
                (and to its minimum, 1 s for the server this package starts).
            on_lost: called once, from the refresh thread, if the lease is lost.
            unreachable_grace_s: how long to keep the lease while etcd cannot be
                reached at all, seconds; default ``max(30, 10 * ttl_s)``.

        Returns:
            The kept lease; :meth:`KeptLease.revoke` it when done.

        Raises:
            ConfigError: ``ttl_s`` is not positive.
            CoordinationError: etcd refused or did not answer.
        """
        if not ttl_s > 0:
            raise ConfigError(f"lease ttl_s must be > 0, got {ttl_s}")
        sent = time.monotonic()
        with self._etcd("granting a lease"):
            granted = self._client.lease(math.ceil(ttl_s))
        lease = KeptLease(
            self._client,
            int(granted.id),
            float(granted.ttl),
            on_lost,
            unreachable_grace_s=unreachable_grace_s,
            granted_at=sent,
        )
        with self._lock:
            self._leases.append(lease)
        return lease

    # --- generic JSON access --------------------------------------------------------

    def get_json(self, key: str) -> dict[str, object] | None:
        """Read a JSON object.

        Args:
            key: the full key (build it with :attr:`keys`).

        Returns:
            The object, or None if the key does not exist.

        Raises:
            CoordinationError: etcd failed, or the value is not a JSON object.
        """
        with self._etcd(f"reading {key}"):
            raw, _ = self._client.get(key)
        return None if raw is None else decode_object(raw, key)

    def delete_if_pid(self, key: str, pid: int) -> bool:
        """Delete ``key`` if its JSON value names process ``pid``, atomically.

        The local launcher calls this when it has reaped a process (so it is
        certainly dead) to release its lease-held key at once rather than one
        TTL later. The compare on the key's mod revision makes sure a value
        written meanwhile by a successor (a new lock holder, a restarted PS)
        is never deleted.

        Returns:
            True if the key was deleted.

        Raises:
            CoordinationError: etcd failed.
        """
        with self._etcd(f"reading {key}"):
            raw, meta = self._client.get(key)
        if raw is None:
            return False
        try:
            value = json.loads(raw)
        except ValueError:
            return False
        if not isinstance(value, dict) or value.get("pid") != pid:
            return False
        txns = self._client.transactions
        succeeded, _ = self._txn(
            f"deleting {key}",
            compare=[txns.mod(key) == int(meta.mod_revision)],
            success=[txns.delete(key)],
            failure=[],
        )
        return bool(succeeded)

    def put_json(self, key: str, obj: Mapping[str, object], lease: KeptLease | None = None) -> None:
        """Write a JSON object, attached to ``lease`` if given.

        Raises:
            CoordinationError: etcd failed (e.g. the lease no longer exists).
        """
        self._put(key, encode(dict(obj)), lease)

    def get_prefix_json(
        self, prefix: str, *, page_size: int = 1000
    ) -> tuple[dict[str, dict[str, object]], int]:
        """Read every key under a prefix as JSON objects, at one etcd revision.

        Reads pages of ``page_size`` keys (so one response never grows with the
        prefix); every page after the first is read at the first page's revision,
        so the result is one consistent snapshot.

        Args:
            prefix: the full key prefix (build it with :attr:`keys`).
            page_size: keys per range request, >= 1.

        Returns:
            ``(objects, revision)``: key suffix (after ``prefix``) -> object, and
            the etcd revision of the snapshot.

        Raises:
            ConfigError: ``page_size`` < 1.
            CoordinationError: etcd failed, or a value is not a JSON object.
        """
        if page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {page_size}")
        end = prefix_range_end(prefix.encode("utf-8"))
        start = prefix.encode("utf-8")
        revision: int | None = None
        objects: dict[str, dict[str, object]] = {}
        while True:
            pinned = {} if revision is None else {"revision": revision}
            with self._etcd(f"reading {prefix}"):
                response = self._client.get_range_response(start, end, limit=page_size, **pinned)
            if revision is None:
                revision = int(response.header.revision)
            for kv in response.kvs:
                key = kv.key.decode("utf-8")
                objects[key[len(prefix) :]] = decode_object(kv.value, key)
            if not response.more or not response.kvs:
                return objects, revision
            start = bytes(response.kvs[-1].key) + b"\0"

    def wait_for_deletion(
        self, key: str, timeout_s: float, *, cancel: threading.Event | None = None
    ) -> bool:
        """Wait until ``key`` does not exist, watching it rather than polling.

        Args:
            key: the full key.
            timeout_s: how long to wait, in seconds.
            cancel: stop waiting early once this is set.

        Returns:
            True if the key is absent (now, or deleted while watched); False on
            timeout or cancel. If the watch stream breaks, returns whether the key
            is absent on a fresh read, so callers loop until they get what they want.

        Raises:
            CoordinationError: etcd failed.
        """
        deadline = time.monotonic() + timeout_s
        with self._etcd(f"reading {key}"):
            response = self._client.get_response(key)
        if response.count == 0:
            return True
        woken = threading.Event()
        broken = False

        def on_response(watched: object) -> None:
            nonlocal broken
            if isinstance(watched, BaseException) or watched is None:
                broken = True
                woken.set()
                return
            events: Any = getattr(watched, "events", ())
            if any(isinstance(e, etcd_events.DeleteEvent) for e in events):
                woken.set()

        with self._etcd(f"watching {key}"):
            watch_id = self._client.add_watch_callback(
                key, on_response, start_revision=int(response.header.revision) + 1
            )
        try:
            while not woken.wait(max(0.0, min(POLL_MAX_S, deadline - time.monotonic()))):
                if (cancel is not None and cancel.is_set()) or time.monotonic() >= deadline:
                    return False
        finally:
            with contextlib.suppress(*ETCD_ERRORS, ValueError):
                self._client.cancel_watch(watch_id)
        if not broken:
            return True
        with self._etcd(f"reading {key}"):
            raw, _ = self._client.get(key)
        return raw is None

    def _put(self, key: str, value: str, lease: KeptLease | None = None) -> None:
        with self._etcd(f"writing {key}"):
            self._client.put(key, value, lease=None if lease is None else lease.id)

    def _txn(self, what: str, compare: list[Any], success: list[Any], failure: list[Any]) -> Any:
        with self._etcd(what):
            return self._client.transaction(compare=compare, success=success, failure=failure)

    def _start_watch(
        self,
        what: str,
        prefix: str,
        decode: Callable[[bytes, str], dict[str, object]],
        report: Callable[[dict[str, dict[str, object]]], None],
        start_revision: int,
    ) -> Watch:
        """A :class:`Watch` of ``prefix``, closed with the store.

        Raises:
            CoordinationError: etcd failed.
        """

        def report_values(state: dict[str, WatchedValue]) -> None:
            report({name: watched.value for name, watched in state.items()})

        return self._start_watch_revisions(what, prefix, decode, report_values, start_revision)

    def _start_watch_revisions(
        self,
        what: str,
        prefix: str,
        decode: Callable[[bytes, str], dict[str, object]],
        report: Callable[[dict[str, WatchedValue]], None],
        start_revision: int,
    ) -> Watch:
        """Like :meth:`_start_watch`, reporting each value with its key's create revision.

        Raises:
            CoordinationError: etcd failed.
        """
        with self._etcd(f"watching {what}"):
            watch = Watch(self._client, prefix, decode, report, start_revision)
        with self._lock:
            self._watches.append(watch)
        return watch
