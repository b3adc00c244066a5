"""The job's view of etcd: key layout, kept leases, membership, slots and the master lock.

This module is a thin I/O shell over the ``pyetcd`` client (``etcd-sdk-python``).
Decisions (which task to dispatch, when to scale) live elsewhere; here every
method is one or two etcd round trips, and every etcd or gRPC failure leaves as
:class:`~elasticps.errors.CoordinationError`.

Key layout, per job, under ``/elasticps/<job>/`` (see ``docs/architecture.md``).
Every value is a UTF-8 JSON document:

============================  ===============  =================================
key                           written by       value
============================  ===============  =================================
``master/lock``               master (lease)   ``{"address": "host:port"}``
``trainers/<id>``             trainer (lease)  the trainer's info object
``ps_desired``                launcher         number of PS slots, a JSON integer
``ps/<index>``                PS (txn, lease)  ``{"address": "host:port"}``
``tasks/<id>``                master (fenced)  one task's ledger record
``queue/meta``                master (fenced)  the task queue's pass, counters
``queue/spec``                master (fenced)  the data split the ledger is for
``passes/<pass>``             master (fenced)  the audit of a completed pass
``checkpoints/<version>``     master (fenced)  a checkpoint manifest (later)
``job/state``                 launcher/master  a JSON string, e.g. ``"running"``
============================  ===============  =================================

Numeric ids in keys (task ids, checkpoint versions) are zero-padded so that a
prefix listing, which etcd sorts by key bytes, comes out in numeric order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any, Final, Self

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd import events as etcd_events
from pyetcd import exceptions as etcd_exceptions
from pyetcd.utils import prefix_range_end

from elasticps.coord.etcd_server import parse_endpoint
from elasticps.errors import ConfigError, CoordinationError

__all__ = [
    "MAX_TXN_OPS",
    "JobStore",
    "KeptLease",
    "Keys",
    "PSSlot",
    "TrainerMap",
    "Watch",
    "is_transient",
]

_log = logging.getLogger(__name__)

#: The errors the pyetcd client raises for etcd or transport failures.
_ETCD_ERRORS: Final = (etcd_exceptions.Etcd3Exception, grpc.RpcError)

#: Longest sleep between two reads while waiting for a key, in seconds.
_POLL_MAX_S: Final = 0.05
#: First sleep between two reads while waiting for a key, in seconds.
_POLL_MIN_S: Final = 0.005
#: Longest pause between two attempts to re-create a broken watch, in seconds.
_REWATCH_MAX_S: Final = 1.0

#: Most operations etcd accepts in one transaction (its ``--max-txn-ops`` default).
MAX_TXN_OPS: Final = 128

# gRPC's default reconnect backoff grows to 120 s, far longer than a lease TTL:
# after an etcd restart the client would stay disconnected long after etcd is
# back. Cap it at 1 s.
_GRPC_OPTIONS: Final = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]

_NAME_RE: Final = re.compile(r"[A-Za-z0-9_.-]+")

#: Trainer id -> the info object the trainer registered.
TrainerMap = dict[str, dict[str, object]]


@dataclasses.dataclass(frozen=True)
class PSSlot:
    """A claimed parameter-server slot.

    Attributes:
        index: the slot, 0-based.
        address: ``host:port`` of the server holding it.
        epoch: the etcd revision that created the slot key: no other claim of
            the slot ever has it (the fencing token of the claim).
        unix: the server's AF_UNIX path, or None.
        host_id: the server host's id (see ``local_host_id``), or None.
    """

    index: int
    address: str
    epoch: int
    unix: str | None = None
    host_id: str | None = None


def _check_name(what: str, name: str) -> str:
    if not _NAME_RE.fullmatch(name) or name in {".", ".."}:
        raise ConfigError(f"{what} {name!r} must be non-empty and use only A-Z a-z 0-9 _ . -")
    return name


class Keys:
    """Builds the etcd keys of one job. Pure: no I/O.

    Args:
        job: the job name, ``[A-Za-z0-9_.-]+``.

    Raises:
        ConfigError: the job name is empty or has other characters.
    """

    def __init__(self, job: str) -> None:
        self.job: Final = _check_name("job name", job)
        #: Prefix of every key of the job, ending in ``/``.
        self.root: Final = f"/elasticps/{job}/"

    @property
    def master_lock(self) -> str:
        """Key held (under a lease) by the active master; its value holds the address."""
        return self.root + "master/lock"

    @property
    def trainers_prefix(self) -> str:
        """Prefix of the live trainers' keys."""
        return self.root + "trainers/"

    def trainer(self, trainer_id: str) -> str:
        """Key of one trainer's registration.

        Raises:
            ConfigError: the id is empty or has characters other than ``[A-Za-z0-9_.-]``.
        """
        return self.trainers_prefix + _check_name("trainer id", trainer_id)

    @property
    def ps_desired(self) -> str:
        """Key holding the number of parameter-server slots."""
        return self.root + "ps_desired"

    @property
    def trainers_wanted(self) -> str:
        """Key holding the wanted number of trainers (``elasticps scale``), a JSON integer."""
        return self.root + "trainers_wanted"

    @property
    def ps_prefix(self) -> str:
        """Prefix of the claimed parameter-server slots."""
        return self.root + "ps/"

    def ps(self, index: int) -> str:
        """Key of parameter-server slot ``index`` (0-based).

        Raises:
            ConfigError: the index is negative.
        """
        if index < 0:
            raise ConfigError(f"parameter-server index must be >= 0, got {index}")
        return f"{self.ps_prefix}{index}"

    @property
    def tasks_prefix(self) -> str:
        """Prefix of the task ledger, one key per task."""
        return self.root + "tasks/"

    def task(self, task_id: int) -> str:
        """Key of one task's ledger entry; the id is zero-padded to 10 digits.

        Raises:
            ConfigError: the id is negative.
        """
        if task_id < 0:
            raise ConfigError(f"task id must be >= 0, got {task_id}")
        return f"{self.tasks_prefix}{task_id:010d}"

    @property
    def queue_meta(self) -> str:
        """Key of the task queue's meta record (pass, finished, ...); exists once the
        ledger is complete."""
        return self.root + "queue/meta"

    @property
    def queue_spec(self) -> str:
        """Key identifying the data split the task ledger was created for."""
        return self.root + "queue/spec"

    @property
    def passes_prefix(self) -> str:
        """Prefix of the per-pass audit summaries."""
        return self.root + "passes/"

    def pass_summary(self, pass_id: int) -> str:
        """Key of the audit summary of pass ``pass_id``, zero-padded to 6 digits.

        Raises:
            ConfigError: the pass id is negative.
        """
        if pass_id < 0:
            raise ConfigError(f"pass id must be >= 0, got {pass_id}")
        return f"{self.passes_prefix}{pass_id:06d}"

    @property
    def checkpoints_prefix(self) -> str:
        """Prefix of the checkpoint manifests."""
        return self.root + "checkpoints/"

    def checkpoint(self, version: int) -> str:
        """Key of the manifest of the checkpoint at model ``version``, zero-padded to 12 digits.

        Raises:
            ConfigError: the version is negative.
        """
        if version < 0:
            raise ConfigError(f"checkpoint version must be >= 0, got {version}")
        return f"{self.checkpoints_prefix}{version:012d}"

    @property
    def job_state(self) -> str:
        """Key holding the job's state as a JSON string (e.g. ``"running"``)."""
        return self.root + "job/state"

    def __repr__(self) -> str:
        return f"Keys({self.job!r})"


# --- small helpers -------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    """One line describing a pyetcd or gRPC error."""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        call: Any = exc
        return f"{call.code().name}: {call.details()}"
    return str(exc) or type(exc).__name__


def is_transient(exc: BaseException) -> bool:
    """Whether an error (or its cause) means etcd could not be reached or did not answer
    in time, so that retrying the same request may succeed.

    Errors such as an invalid request or a failed compare are not transient.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(
            seen,
            etcd_exceptions.ConnectionFailedError
            | etcd_exceptions.ConnectionTimeoutError
            | etcd_exceptions.NoServerAvailableError
            | etcd_exceptions.InternalServerError,
        ):
            return True
        if isinstance(seen, grpc.RpcError) and hasattr(seen, "code"):
            call: Any = seen
            if call.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                return True
        seen = seen.__cause__
    return False


def _encode(obj: object) -> str:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True)


def _decode(raw: bytes, key: str) -> object:
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CoordinationError(f"etcd key {key} does not hold valid UTF-8 JSON") from exc


def _decode_object(raw: bytes, key: str) -> dict[str, object]:
    value = _decode(raw, key)
    if not isinstance(value, dict):
        raise CoordinationError(f"etcd key {key} holds {type(value).__name__}, expected an object")
    return value


def _address_of(raw: bytes, key: str) -> str:
    address = _decode_object(raw, key).get("address")
    if not isinstance(address, str):
        raise CoordinationError(f"etcd key {key} has no string 'address'")
    return address


def _poll_delays() -> Iterator[float]:
    """Sleeps between polls, in seconds: 5 ms doubling up to 50 ms."""
    delay = _POLL_MIN_S
    while True:
        yield delay
        delay = min(delay * 2, _POLL_MAX_S)


def _sleep_until_next_poll(delays: Iterator[float], deadline: float) -> None:
    time.sleep(max(0.0, min(next(delays), deadline - time.monotonic())))


class _LeaseEquals:
    """A transaction compare ``lease(key) == lease_id``; pyetcd only builds the others.

    pyetcd's ``transaction`` only calls ``build_message()`` on each compare. For a
    missing key etcd compares lease 0, so the compare fails for any granted lease.
    """

    def __init__(self, key: str, lease_id: int) -> None:
        self._key = key
        self._lease_id = lease_id

    def build_message(self) -> Any:
        compare = etcdrpc.Compare()
        compare.key = self._key.encode("utf-8")
        compare.result = etcdrpc.Compare.EQUAL
        compare.target = etcdrpc.Compare.LEASE
        compare.lease = self._lease_id
        return compare


# --- leases ------------------------------------------------------------------------


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

    Created by :meth:`JobStore.grant_lease`.

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
    ) -> None:
        self._client = client
        self.unreachable_grace_s: Final = (
            unreachable_grace_s if unreachable_grace_s is not None else max(30.0, 10 * ttl_s)
        )
        self.id: Final = lease_id
        self.ttl_s: Final = ttl_s
        self.lost: Final = threading.Event()
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._revoked = False
        self._revoke_lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._keep_alive, name=f"elasticps-lease-{lease_id:x}", daemon=True
        )
        self._thread.start()

    @property
    def interval_s(self) -> float:
        """Time between two refreshes, in seconds."""
        return self.ttl_s / 3

    def revoke(self) -> None:
        """Stop refreshing and revoke the lease, deleting its keys.

        Idempotent. Errors are ignored: if etcd is unreachable, the lease expires
        on its own within its TTL. Safe to call from ``on_lost``.
        """
        with self._revoke_lock:
            if self._revoked:
                return
            self._revoked = True
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        with contextlib.suppress(*_ETCD_ERRORS, ValueError):
            self._client.revoke_lease(self.id)

    def __repr__(self) -> str:
        return f"KeptLease(id={self.id:#x}, ttl_s={self.ttl_s:g}, lost={self.lost.is_set()})"

    def _keep_alive(self) -> None:
        last_ok_sent = time.monotonic()
        wait_s = self.interval_s
        retry_s = min(self.interval_s, 0.25)
        while not self._stop.wait(wait_s):
            sent = time.monotonic()
            try:
                responses = list(self._client.refresh_lease(self.id))
            except (*_ETCD_ERRORS, ValueError) as exc:
                if time.monotonic() - last_ok_sent >= self.unreachable_grace_s:
                    self._declare_lost(
                        f"etcd unreachable for {self.unreachable_grace_s:g} s ({_describe(exc)})"
                    )
                    return
                _log.debug("lease %x: refresh failed (%s); retrying", self.id, _describe(exc))
                wait_s = retry_s
                continue
            if not responses or responses[-1].TTL <= 0:
                self._declare_lost("etcd says the lease has expired or was revoked")
                return
            last_ok_sent = sent
            wait_s = self.interval_s

    def _declare_lost(self, reason: str) -> None:
        if self._stop.is_set():
            return  # revoked meanwhile: not a loss
        _log.warning("lease %x lost: %s", self.id, reason)
        self.lost.set()
        if self._on_lost is not None:
            try:
                self._on_lost()
            except Exception:
                _log.exception("lease %x: on_lost callback failed", self.id)


# --- watches -----------------------------------------------------------------------

_CANCELLED: Final = object()
_REPORT: Final = object()


class Watch:
    """Mirrors one key prefix and reports the full decoded map after each change.

    The watch starts from a given etcd revision, seeded with the prefix as it was
    just before that revision, so no change is missed between a read and the
    start of the watch. Callbacks run on the watch's own thread, never on the
    client's, so they may call the store.

    etcd watches do not survive an etcd restart; when the stream breaks, the
    thread re-creates the watch from the last seen revision + 1 with a backoff
    (up to 1 s). If that revision was compacted meanwhile, it re-reads the
    prefix and reports the current map.

    Created by :meth:`JobStore.watch_trainers`.
    """

    def __init__(
        self,
        client: Any,
        prefix: str,
        decode: Callable[[bytes, str], dict[str, object]],
        on_change: Callable[[dict[str, dict[str, object]]], None],
        start_revision: int,
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._decode = decode
        self._on_change = on_change
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._cancelled = False
        self._cancel_event = threading.Event()  # wakes a re-watch backoff on cancel
        self._generation = 0
        self._watch_id: int | None = None
        self._state: dict[str, dict[str, object]] = {}
        self._next_revision = start_revision
        self._seed(start_revision)
        self._create()  # the first attempt raises, so a broken etcd surfaces to the caller
        self._thread = threading.Thread(
            target=self._run, name=f"elasticps-watch-{prefix}", daemon=True
        )
        self._thread.start()

    def cancel(self) -> None:
        """Stop the watch; ``on_change`` is not called after this returns (unless
        called from ``on_change`` itself). Idempotent."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            watch_id = self._watch_id
        self._cancel_event.set()
        if watch_id is not None:
            with contextlib.suppress(*_ETCD_ERRORS, ValueError):
                self._client.cancel_watch(watch_id)
        self._queue.put(_CANCELLED)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # --- internals ----------------------------------------------------------------

    def _read(self, revision: int | None) -> tuple[dict[str, dict[str, object]], int]:
        kwargs = {} if revision is None else {"revision": revision}
        response = self._client.get_prefix_response(self._prefix, **kwargs)
        state: dict[str, dict[str, object]] = {}
        for kv in response.kvs:
            key = kv.key.decode("utf-8")
            with contextlib.suppress(CoordinationError):
                state[key[len(self._prefix) :]] = self._decode(kv.value, key)
        return state, int(response.header.revision)

    def _seed(self, start_revision: int) -> None:
        if start_revision <= 1:
            return  # nothing exists before revision 1
        try:
            self._state, _ = self._read(start_revision - 1)
        except grpc.RpcError as exc:
            code: Any = exc
            if code.code() != grpc.StatusCode.OUT_OF_RANGE:  # compacted
                raise CoordinationError(f"reading {self._prefix} failed: {_describe(exc)}") from exc
            # The history before start_revision is gone: start from the current
            # map, and report it from the watch thread once that runs.
            self._resync(report=False)
            self._queue.put(_REPORT)
        except etcd_exceptions.Etcd3Exception as exc:
            raise CoordinationError(f"reading {self._prefix} failed: {_describe(exc)}") from exc

    def _resync(self, *, report: bool = True) -> None:
        """Replace the mirror by a fresh read; report it if it changed and ``report``."""
        state, revision = self._read(None)
        changed = state != self._state
        self._state = state
        self._next_revision = revision + 1
        if changed and report:
            self._report()

    def _create(self) -> None:
        with self._lock:
            if self._cancelled:
                return
            self._generation += 1
            generation = self._generation

        def on_response(response: object) -> None:
            self._queue.put((generation, response))

        try:
            watch_id = self._client.add_watch_prefix_callback(
                self._prefix, on_response, start_revision=self._next_revision
            )
        except _ETCD_ERRORS as exc:
            raise CoordinationError(f"watching {self._prefix} failed: {_describe(exc)}") from exc
        with self._lock:
            self._watch_id = int(watch_id)
            cancelled = self._cancelled
        if cancelled:
            with contextlib.suppress(*_ETCD_ERRORS, ValueError):
                self._client.cancel_watch(watch_id)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _CANCELLED:
                return
            if item is _REPORT:
                self._report()
                continue
            assert isinstance(item, tuple)
            generation, response = item
            if generation != self._generation:
                continue  # left over from a watch we replaced
            if isinstance(response, BaseException) or response is None:
                if not self._rewatch(response):
                    return
                continue
            self._apply(response)

    def _apply(self, response: Any) -> None:
        changed = False
        for event in response.events:
            revision = int(event.mod_revision)
            if revision < self._next_revision:
                continue  # already seen (replayed after a re-watch)
            key = event.key.decode("utf-8")
            name = key[len(self._prefix) :]
            if isinstance(event, etcd_events.DeleteEvent):
                changed |= self._state.pop(name, None) is not None
            else:
                try:
                    self._state[name] = self._decode(event.value, key)
                    changed = True
                except CoordinationError:
                    _log.warning("watch %s: ignoring undecodable value at %s", self._prefix, key)
            self._next_revision = revision + 1
        if changed:
            self._report()

    def _rewatch(self, cause: BaseException | None) -> bool:
        """Re-create the watch after its stream broke. Returns False once cancelled."""
        _log.info(
            "watch %s broke (%s); re-watching from revision %d",
            self._prefix,
            "stream closed" if cause is None else _describe(cause),
            self._next_revision,
        )
        compacted = isinstance(cause, etcd_exceptions.RevisionCompactedError)
        delay = 0.05
        while True:
            with self._lock:
                if self._cancelled:
                    return False
            try:
                if compacted:
                    self._resync()
                    compacted = False
                self._create()
                _log.info("watch %s: re-established", self._prefix)
                return True
            except CoordinationError as exc:
                if isinstance(exc.__cause__, etcd_exceptions.RevisionCompactedError):
                    compacted = True
                _log.debug("watch %s: re-watch failed (%s)", self._prefix, exc)
            except (*_ETCD_ERRORS, ValueError) as exc:
                _log.debug("watch %s: resync failed (%s)", self._prefix, _describe(exc))
            if self._cancel_event.wait(delay):
                return False
            delay = min(delay * 2, _REWATCH_MAX_S)

    def _report(self) -> None:
        with self._lock:
            if self._cancelled:
                return
        try:
            self._on_change(dict(self._state))
        except Exception:
            _log.exception("watch %s: on_change callback failed", self._prefix)


# --- the store -----------------------------------------------------------------------


class JobStore:
    """The job's view of etcd. Owns one pyetcd client (one per process is enough).

    Args:
        endpoint: etcd client endpoint, ``"host:port"`` or ``"http://host:port"``.
        job: the job name; every key lives under ``/elasticps/<job>/``.
        timeout_s: how long to wait for etcd to answer at construction, and the
            deadline of every etcd request, in seconds.

    Raises:
        ConfigError: the endpoint or the job name is malformed.
        CoordinationError: etcd did not answer within ``timeout_s``.
    """

    def __init__(self, endpoint: str, job: str, *, timeout_s: float = 5.0) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"etcd timeout_s must be > 0, got {timeout_s}")
        self.keys: Final = Keys(job)
        self.endpoint: Final = endpoint
        host, port = parse_endpoint(endpoint)
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._closed = False
        self._leases: list[KeptLease] = []
        self._watches: list[Watch] = []
        # pyetcd marks an endpoint "failed" after one UNAVAILABLE error and then
        # refuses to use it for time_retry seconds (300 by default); with a single
        # endpoint that would make an etcd restart fatal. Retry at once instead.
        ep = pyetcd.Endpoint(
            f"[{host}]" if ":" in host else host,
            port,
            secure=False,
            time_retry=0.0,
            opts=_GRPC_OPTIONS,
        )
        self._client: Any = pyetcd.MultiEndpointEtcd3Client(endpoints=[ep], timeout=timeout_s)
        ready = grpc.channel_ready_future(ep.channel)
        try:
            ready.result(timeout=timeout_s)
        except grpc.FutureTimeoutError as exc:
            ready.cancel()
            self._client.close()
            raise CoordinationError(
                f"etcd at {endpoint} did not answer within {timeout_s:g} s; is it running?"
            ) from exc

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
        return f"JobStore({self.endpoint!r}, {self.keys.job!r})"

    @contextlib.contextmanager
    def _etcd(self, what: str) -> Iterator[None]:
        """Translate pyetcd and gRPC errors raised inside into CoordinationError."""
        if self._closed:
            raise CoordinationError(f"{what}: the store is closed")
        try:
            yield
        except _ETCD_ERRORS as exc:
            raise CoordinationError(
                f"etcd {self.endpoint}: {what} failed: {_describe(exc)}"
            ) from exc

    # --- leases -----------------------------------------------------------------------

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
        with self._etcd("granting a lease"):
            granted = self._client.lease(math.ceil(ttl_s))
        lease = KeptLease(
            self._client,
            int(granted.id),
            float(granted.ttl),
            on_lost,
            unreachable_grace_s=unreachable_grace_s,
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
        return None if raw is None else _decode_object(raw, key)

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
        self._put(key, _encode(dict(obj)), lease)

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
                objects[key[len(prefix) :]] = _decode_object(kv.value, key)
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
            while not woken.wait(max(0.0, min(_POLL_MAX_S, deadline - time.monotonic()))):
                if (cancel is not None and cancel.is_set()) or time.monotonic() >= deadline:
                    return False
        finally:
            with contextlib.suppress(*_ETCD_ERRORS, ValueError):
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

    # --- trainers ----------------------------------------------------------------------

    def register_trainer(
        self, trainer_id: str, info: Mapping[str, object], lease: KeptLease
    ) -> None:
        """Publish a live trainer under ``trainers/<id>``, attached to its lease.

        Args:
            trainer_id: ``[A-Za-z0-9_.-]+``.
            info: JSON-serialisable description (address, host, ...).
            lease: the trainer's lease; the key vanishes when it ends.

        Raises:
            ConfigError: the trainer id is malformed.
            CoordinationError: etcd failed.
        """
        self.put_json(self.keys.trainer(trainer_id), info, lease)

    def live_trainers(self) -> tuple[TrainerMap, int]:
        """Read the live trainers.

        Returns:
            The map trainer id -> info, and the etcd revision of the read (pass
            revision + 1 to :meth:`watch_trainers` to miss no change).

        Raises:
            CoordinationError: etcd failed or a value is not a JSON object.
        """
        prefix = self.keys.trainers_prefix
        with self._etcd("listing trainers"):
            response = self._client.get_prefix_response(prefix)
        trainers: TrainerMap = {}
        for kv in response.kvs:
            key = kv.key.decode("utf-8")
            trainers[key[len(prefix) :]] = _decode_object(kv.value, key)
        return trainers, int(response.header.revision)

    def watch_trainers(self, on_change: Callable[[TrainerMap], None], start_revision: int) -> Watch:
        """Call ``on_change`` with the full map of live trainers after each change.

        Changes are registrations, updates and removals, including removals by
        lease expiry. ``on_change`` runs on the watch's thread.

        Args:
            on_change: receives a fresh dict trainer id -> info.
            start_revision: first etcd revision to report; usually the revision
                returned by :meth:`live_trainers` plus 1.

        Returns:
            The watch; :meth:`Watch.cancel` it when done.

        Raises:
            CoordinationError: etcd failed.
        """
        return self._start_watch(
            "trainers", self.keys.trainers_prefix, _decode_object, on_change, start_revision
        )

    def watch_pass_summaries(
        self, on_change: Callable[[dict[int, dict[str, object]]], None]
    ) -> Watch:
        """Call ``on_change`` with every pass audit written so far, after each new one.

        The master writes ``passes/<n>`` in the transaction that completes
        pass ``n``. Reads the prefix first and watches from the next revision,
        so no pass is missed. ``on_change`` runs on the watch's thread.

        Returns:
            The watch; :meth:`Watch.cancel` it when done.

        Raises:
            CoordinationError: etcd failed.
        """
        prefix = self.keys.passes_prefix
        _, revision = self.get_prefix_json(prefix)

        def report(values: dict[str, dict[str, object]]) -> None:
            on_change({int(k): v for k, v in values.items() if k.isdigit()})

        return self._start_watch("pass summaries", prefix, _decode_object, report, revision + 1)

    def watch_ps(
        self, on_change: Callable[[dict[int, str]], None], start_revision: int = 0
    ) -> Watch:
        """Call ``on_change`` with slot index -> address after each change of ``ps/``.

        Args:
            on_change: receives a fresh dict of claimed slots; runs on the
                watch's thread.
            start_revision: first etcd revision to report; 0 reads the current
                slots first and watches from there.

        Returns:
            The watch; :meth:`Watch.cancel` it when done.

        Raises:
            CoordinationError: etcd failed.
        """
        if start_revision <= 0:
            _, start_revision = self.get_prefix_json(self.keys.ps_prefix)
            start_revision += 1

        def report(slots: dict[str, dict[str, object]]) -> None:
            on_change(
                {
                    int(k): str(v["address"])
                    for k, v in slots.items()
                    if k.isdigit() and isinstance(v.get("address"), str)
                }
            )

        return self._start_watch(
            "parameter servers", self.keys.ps_prefix, _decode_object, report, start_revision
        )

    # --- wanted trainers ----------------------------------------------------------------

    def set_trainers_wanted(self, n: int) -> None:
        """Set the wanted number of trainers; the worker manager clamps it to its range.

        Raises:
            ConfigError: ``n`` < 0.
            CoordinationError: etcd failed.
        """
        if n < 0:
            raise ConfigError(f"the wanted number of trainers must be >= 0, got {n}")
        self._put(self.keys.trainers_wanted, _encode(n))

    def trainers_wanted(self) -> int | None:
        """Return the wanted number of trainers, or None if unset.

        Raises:
            CoordinationError: etcd failed or the value is not a non-negative integer.
        """
        with self._etcd("reading trainers_wanted"):
            raw, _ = self._client.get(self.keys.trainers_wanted)
        return None if raw is None else self._decode_trainers_wanted(raw, self.keys.trainers_wanted)

    @staticmethod
    def _decode_trainers_wanted(raw: bytes, key: str) -> int:
        value = _decode(raw, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise CoordinationError(f"etcd key {key} must hold a non-negative integer")
        return value

    def watch_trainers_wanted(self, on_change: Callable[[int | None], None]) -> Watch:
        """Call ``on_change`` with the wanted number of trainers after each change.

        Reads the current value first and watches from the next revision, so no
        change is missed. A malformed value is logged and ignored. ``on_change``
        runs on the watch's thread; it receives None if the key is deleted.

        Returns:
            The watch; :meth:`Watch.cancel` it when done.

        Raises:
            CoordinationError: etcd failed.
        """
        key = self.keys.trainers_wanted
        with self._etcd("reading trainers_wanted"):
            response = self._client.get_response(key)
        start_revision = int(response.header.revision) + 1

        def decode(raw: bytes, full_key: str) -> dict[str, object]:
            try:
                return {"count": self._decode_trainers_wanted(raw, full_key)}
            except CoordinationError as exc:
                _log.warning("ignoring %s", exc)
                return {}

        def report(values: dict[str, dict[str, object]]) -> None:
            count = values.get("", {}).get("count")  # the exact key, not a longer one
            on_change(count if isinstance(count, int) else None)

        return self._start_watch("trainers_wanted", key, decode, report, start_revision)

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
        with self._etcd(f"watching {what}"):
            watch = Watch(self._client, prefix, decode, report, start_revision)
        with self._lock:
            self._watches.append(watch)
        return watch

    # --- parameter servers ------------------------------------------------------------

    def set_ps_desired(self, n: int) -> None:
        """Set the number of parameter-server slots.

        Raises:
            ConfigError: ``n`` < 1.
            CoordinationError: etcd failed.
        """
        if n < 1:
            raise ConfigError(f"the number of parameter servers must be >= 1, got {n}")
        self._put(self.keys.ps_desired, _encode(n))

    def ps_desired(self) -> int | None:
        """Return the number of parameter-server slots, or None if unset.

        Raises:
            CoordinationError: etcd failed or the value is not an integer.
        """
        with self._etcd("reading ps_desired"):
            raw, _ = self._client.get(self.keys.ps_desired)
        return None if raw is None else self._decode_ps_desired(raw)

    def _decode_ps_desired(self, raw: bytes) -> int:
        value = _decode(raw, self.keys.ps_desired)
        if not isinstance(value, int) or isinstance(value, bool):
            raise CoordinationError(f"etcd key {self.keys.ps_desired} must hold an integer")
        return value

    def claim_ps_slot(self, address: str, lease: KeptLease) -> int:
        """Claim the lowest free parameter-server slot for ``address``.

        Each slot is claimed with a put-if-absent transaction under the lease, so
        two servers never hold the same slot; a slot frees when its holder's
        lease ends.

        Args:
            address: where trainers reach this server, ``"host:port"``.
            lease: the server's lease.

        Returns:
            The claimed index, 0-based.

        Raises:
            CoordinationError: ps_desired is unset, every slot is taken, or etcd failed.
        """
        n = self.ps_desired()
        if n is None:
            raise CoordinationError(f"cannot claim a PS slot: {self.keys.ps_desired} is not set")
        index = self._try_claim_ps_slot(address, lease, n)
        if index is None:
            raise CoordinationError(f"cannot claim a PS slot: all {n} slots are taken")
        return index

    def ps_slots(self) -> dict[int, PSSlot]:
        """The claimed parameter-server slots with their epochs, from one read.

        Raises:
            CoordinationError: etcd failed, or a slot value is malformed.
        """
        prefix = self.keys.ps_prefix
        with self._etcd("listing PS slots"):
            response = self._client.get_prefix_response(prefix)
        slots: dict[int, PSSlot] = {}
        for kv in response.kvs:
            key = kv.key.decode("utf-8")
            suffix = key[len(prefix) :]
            if not suffix.isdigit():
                continue
            obj = _decode_object(kv.value, key)
            address = obj.get("address")
            if not isinstance(address, str):
                raise CoordinationError(f"{key} has no address")
            unix, host_id = obj.get("unix"), obj.get("host_id")
            slots[int(suffix)] = PSSlot(
                int(suffix),
                address,
                int(kv.create_revision),
                unix if isinstance(unix, str) else None,
                host_id if isinstance(host_id, str) else None,
            )
        return slots

    def slot_epoch(self, index: int) -> int | None:
        """The epoch of slot ``index``'s current claim, or None if it is free.

        Raises:
            CoordinationError: etcd failed.
        """
        key = self.keys.ps(index)
        with self._etcd(f"reading {key}"):
            response = self._client.get_response(key)
        if not response.kvs:
            return None
        return int(response.kvs[0].create_revision)

    def wait_ps_slots(
        self, timeout_s: float, *, cancel: threading.Event | None = None
    ) -> list[PSSlot]:
        """Wait until every one of ``ps_desired`` slots is claimed; return them by index.

        Raises:
            CoordinationError: not all claimed within ``timeout_s`` seconds
                (the message names the missing slots), cancelled, or etcd failed.
        """
        deadline = time.monotonic() + timeout_s
        delays = _poll_delays()
        while True:
            desired = self.ps_desired()
            slots = self.ps_slots()
            missing = [] if desired is None else [i for i in range(desired) if i not in slots]
            if desired is not None and not missing:
                return [slots[i] for i in range(desired)]
            if cancel is not None and cancel.is_set():
                raise CoordinationError("cancelled while waiting for the parameter servers")
            if time.monotonic() >= deadline:
                if desired is None:
                    raise CoordinationError(
                        f"{self.keys.ps_desired} was not set within {timeout_s:g} s"
                    )
                raise CoordinationError(
                    f"parameter servers missing after {timeout_s:g} s: "
                    f"slots {missing} of {desired} are not claimed"
                )
            _sleep_until_next_poll(delays, deadline)

    def watch_ps_slots(self, on_change: Callable[[dict[int, PSSlot]], None]) -> Watch:
        """Call ``on_change`` with the claimed slots (epochs included) after each change.

        Runs ``on_change`` on the watch's thread, with a fresh read of the slots.

        Raises:
            CoordinationError: etcd failed.
        """

        def changed(_: dict[int, str]) -> None:
            try:
                slots = self.ps_slots()
            except CoordinationError as exc:
                _log.warning("could not read the PS slots after a change: %s", exc)
                return
            on_change(slots)

        return self.watch_ps(changed)

    def ps_addresses(self, timeout_s: float) -> list[str]:
        """Wait until every parameter-server slot is claimed; return their addresses.

        Args:
            timeout_s: how long to wait, in seconds.

        Returns:
            The addresses of slots 0..ps_desired-1, in index order.

        Raises:
            CoordinationError: the slots were not all claimed in time (the message
                names the missing indices), or etcd failed.
        """
        return [slot.address for slot in self.wait_ps_slots(timeout_s)]

    def claim_ps_slot_within(
        self,
        address: str,
        lease: KeptLease,
        timeout_s: float,
        *,
        cancel: threading.Event | None = None,
        unix: str | None = None,
    ) -> int:
        """Claim the lowest free parameter-server slot, waiting up to ``timeout_s`` for one.

        A restarted server uses this to get its old index back: its slot frees
        when the old lease expires, and until then every slot may be taken.
        Also waits for ``ps_desired`` to be set.

        Args:
            address: where trainers reach this server, ``"host:port"``.
            lease: the server's lease.
            timeout_s: how long to keep trying, in seconds (0: once).
            cancel: when set, stop waiting (raises CoordinationError).
            unix: the AF_UNIX path the server also listens on, recorded next to
                ``address`` (as ``"unix"``, with ``"host_id"``) for clients on the
                same host; None: TCP only.

        Returns:
            The claimed index, 0-based.

        Raises:
            CoordinationError: no slot freed in time, cancelled, or etcd failed.
        """
        deadline = time.monotonic() + timeout_s
        delays = _poll_delays()
        while True:
            n = self.ps_desired()
            index = None if n is None else self._try_claim_ps_slot(address, lease, n, unix)
            if index is not None:
                return index
            if cancel is not None and cancel.is_set():
                raise CoordinationError("cancelled while waiting for a free PS slot")
            if time.monotonic() >= deadline:
                if n is None:
                    raise CoordinationError(
                        f"cannot claim a PS slot: {self.keys.ps_desired} was not set "
                        f"within {timeout_s:g} s"
                    )
                raise CoordinationError(
                    f"cannot claim a PS slot: all {n} slots stayed taken for {timeout_s:g} s"
                )
            _sleep_until_next_poll(delays, deadline)

    def _try_claim_ps_slot(
        self, address: str, lease: KeptLease, n: int, unix: str | None = None
    ) -> int | None:
        """One pass of put-if-absent transactions over slots 0..n-1; the index won, or None."""
        txns = self._client.transactions
        record: dict[str, object] = {"address": address, "pid": os.getpid()}
        if unix is not None:
            from elasticps.wire.frame import local_host_id

            record.update(unix=unix, host_id=local_host_id())
        value = _encode(record)
        for index in range(n):
            key = self.keys.ps(index)
            succeeded, _ = self._txn(
                f"claiming {key}",
                compare=[txns.version(key) == 0],
                success=[txns.put(key, value, lease=lease.id)],
                failure=[],
            )
            if succeeded:
                return index
        return None

    def wait_ps_address(self, index: int, *, not_equal: str | None = None, timeout_s: float) -> str:
        """Wait until slot ``index`` is claimed (by an address other than ``not_equal``).

        Args:
            index: the slot, 0-based.
            not_equal: an address to wait past (the server that went away), or None.
            timeout_s: how long to wait, in seconds.

        Returns:
            The address of the server holding the slot.

        Raises:
            CoordinationError: nothing suitable within ``timeout_s``, or etcd failed.
        """
        key = self.keys.ps(index)
        deadline = time.monotonic() + timeout_s
        delays = _poll_delays()
        while True:
            with self._etcd(f"reading {key}"):
                raw, _ = self._client.get(key)
            if raw is not None:
                address = _address_of(raw, key)
                if address != not_equal:
                    return address
            if time.monotonic() >= deadline:
                raise CoordinationError(
                    f"no parameter server claimed slot {index} within {timeout_s:g} s"
                    + ("" if not_equal is None else f" (other than {not_equal})")
                )
            _sleep_until_next_poll(delays, deadline)

    # --- master -------------------------------------------------------------------------

    def acquire_master_lock(self, address: str, lease: KeptLease) -> bool:
        """Try once to become the master: put-if-absent ``master/lock`` under the lease.

        Args:
            address: where the master serves, ``"host:port"``.
            lease: the master's lease; the lock is released when it ends.

        Returns:
            True if this lease now holds the lock (including if it already did).

        Raises:
            CoordinationError: etcd failed.
        """
        return self.acquire_master_lock_with({"address": address}, lease)

    def acquire_master_lock_with(self, value: Mapping[str, object], lease: KeptLease) -> bool:
        """Like :meth:`acquire_master_lock`, with more in the lock's JSON value.

        Args:
            value: the lock's value; must hold the master's ``"address"``
                (``"host:port"``), and may hold more (e.g. its ``"pid"``, which the
                local launcher uses to find the active master).
            lease: the master's lease; the lock is released when it ends.

        Returns:
            True if this lease now holds the lock (including if it already did;
            the value is then left as it was).

        Raises:
            ConfigError: ``value`` has no string ``"address"``.
            CoordinationError: etcd failed.
        """
        if not isinstance(value.get("address"), str):
            raise ConfigError(f"the master lock's value needs a string 'address', got {value!r}")
        key = self.keys.master_lock
        txns = self._client.transactions
        succeeded, responses = self._txn(
            "acquiring the master lock",
            compare=[txns.version(key) == 0],
            success=[txns.put(key, _encode(dict(value)), lease=lease.id)],
            failure=[txns.get(key)],
        )
        if succeeded:
            return True
        held = responses[0] if responses else []
        return bool(held) and int(held[0][1].lease_id) == lease.id

    def master_address(self, timeout_s: float) -> str:
        """Wait until a master holds the lock; return its address.

        Args:
            timeout_s: how long to wait, in seconds.

        Raises:
            CoordinationError: no master within ``timeout_s``, or etcd failed.
        """
        key = self.keys.master_lock
        deadline = time.monotonic() + timeout_s
        delays = _poll_delays()
        while True:
            with self._etcd("reading the master lock"):
                raw, _ = self._client.get(key)
            if raw is not None:
                return _address_of(raw, key)
            if time.monotonic() >= deadline:
                raise CoordinationError(f"no master holds {key} after {timeout_s:g} s")
            _sleep_until_next_poll(delays, deadline)

    def fenced_put(self, key: str, value: str, lease: KeptLease) -> bool:
        """Write ``key`` only while ``lease`` holds the master lock.

        The check and the write are one etcd transaction, so a master that lost
        its lock (lease expired, another master took over) cannot write, even if
        it has not noticed yet. The written key is not attached to the lease.

        Args:
            key: the full key, e.g. ``keys.task(7)``.
            value: the value (JSON text by convention).
            lease: the lease the caller acquired the master lock with.

        Returns:
            True if written; False if ``lease`` does not hold the lock (step down).

        Raises:
            CoordinationError: etcd failed.
        """
        txns = self._client.transactions
        succeeded, _ = self._txn(
            f"fenced write of {key}",
            compare=[_LeaseEquals(self.keys.master_lock, lease.id)],
            success=[txns.put(key, value)],
            failure=[],
        )
        return bool(succeeded)

    def fenced_write(
        self,
        puts: Sequence[tuple[str, str]],
        lease: KeptLease,
        *,
        delete_prefixes: Sequence[str] = (),
    ) -> bool:
        """Write several keys in one transaction, only while ``lease`` holds the master lock.

        Like :meth:`fenced_put`, but all-or-nothing over many keys: the prefix
        deletions run first, then the puts, in order. The written keys are not
        attached to the lease. etcd refuses a transaction in which a put falls
        inside a deleted range.

        Args:
            puts: ``(key, value)`` pairs (full keys, JSON text by convention).
            lease: the lease the caller acquired the master lock with.
            delete_prefixes: key prefixes to delete first (each is one operation).

        Returns:
            True if written; False if ``lease`` does not hold the lock (step down).

        Raises:
            ConfigError: more than :data:`MAX_TXN_OPS` operations, or none.
            CoordinationError: etcd failed.
        """
        num_ops = len(puts) + len(delete_prefixes)
        if not 0 < num_ops <= MAX_TXN_OPS:
            raise ConfigError(f"a fenced write needs 1..{MAX_TXN_OPS} operations, got {num_ops}")
        txns = self._client.transactions
        ops: list[Any] = [
            txns.delete(prefix, range_end=prefix_range_end(prefix.encode("utf-8")))
            for prefix in delete_prefixes
        ]
        ops.extend(txns.put(key, value) for key, value in puts)
        succeeded, _ = self._txn(
            f"fenced write of {num_ops} key(s)",
            compare=[_LeaseEquals(self.keys.master_lock, lease.id)],
            success=ops,
            failure=[],
        )
        return bool(succeeded)

    # --- job state ---------------------------------------------------------------------

    def set_job_state(self, state: str) -> None:
        """Set the job state (e.g. ``"running"``, ``"finished"``).

        Raises:
            CoordinationError: etcd failed.
        """
        self._put(self.keys.job_state, _encode(state))

    def job_state(self) -> str | None:
        """Return the job state, or None if unset.

        Raises:
            CoordinationError: etcd failed or the value is not a JSON string.
        """
        key = self.keys.job_state
        with self._etcd("reading the job state"):
            raw, _ = self._client.get(key)
        if raw is None:
            return None
        state = _decode(raw, key)
        if not isinstance(state, str):
            raise CoordinationError(f"etcd key {key} must hold a JSON string")
        return state
