"""Watches that mirror a key prefix and survive etcd restarts and compaction.

Internal to :mod:`elasticps.coord`; created through the store's ``watch_*``
methods.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import grpc
from pyetcd import events as etcd_events
from pyetcd import exceptions as etcd_exceptions

from elasticps.coord.client import ETCD_ERRORS, describe
from elasticps.errors import CoordinationError

__all__ = ["Watch", "WatchedValue"]

_log = logging.getLogger(__name__)

#: Longest pause between two attempts to re-create a broken watch, in seconds.
_REWATCH_MAX_S: Final = 1.0


@dataclass(frozen=True)
class WatchedValue:
    """One key's decoded value in a :class:`Watch`'s mirror, with its creation revision.

    Attributes:
        value: the decoded JSON object.
        create_revision: the etcd revision at which the key was last created
            (``create_revision`` of its key-value); a key deleted and created
            again gets a new, larger one.
    """

    value: dict[str, object]
    create_revision: int


_CANCELLED: Final = object()
_REPORT: Final = object()


class Watch:
    """Mirrors one key prefix and reports the full decoded map after each change.

    Every value is reported with the ``create_revision`` of its key
    (:class:`WatchedValue`), taken from the same key-value as the value, both
    from watch events and from the re-reads after a compaction, so a key that
    was deleted and created again while the watch was broken is reported as a
    change even if its value is the same.

    The watch starts from a given etcd revision, seeded with the prefix as it was
    just before that revision, so no change is missed between a read and the
    start of the watch. Callbacks run on the watch's own thread, never on the
    client's, so they may call the store.

    etcd watches do not survive an etcd restart; when the stream breaks, the
    thread re-creates the watch from the last seen revision + 1 with a backoff
    (up to 1 s). If that revision was compacted meanwhile, it re-reads the
    prefix and reports the current map.

    Created by the store's ``watch_*`` methods.

    Args:
        client: the pyetcd client.
        prefix: the key prefix to mirror (a full key mirrors that key and the
            keys it prefixes).
        decode: turns a raw value and its full key into an object; raises
            CoordinationError for a value to ignore.
        on_change: receives key suffix (after ``prefix``) -> value after each change.
        start_revision: first etcd revision to report.

    Raises:
        CoordinationError: the prefix could not be read before the start
            revision, or the watch could not be created.
    """

    def __init__(
        self,
        client: Any,
        prefix: str,
        decode: Callable[[bytes, str], dict[str, object]],
        on_change: Callable[[dict[str, WatchedValue]], None],
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
        self._state: dict[str, WatchedValue] = {}
        self._next_revision = start_revision
        self._seed(start_revision)
        self._create()  # the first attempt raises, so a broken etcd surfaces to the caller
        self._thread = threading.Thread(
            target=self._run, name=f"elasticps-watch-{prefix}", daemon=True
        )
        self._thread.start()

    def report_now(self) -> None:
        """Report the current mirror once more, from the watch's thread, after any
        change already received. A no-op once cancelled."""
        self._queue.put(_REPORT)

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
            with contextlib.suppress(*ETCD_ERRORS, ValueError):
                self._client.cancel_watch(watch_id)
        self._queue.put(_CANCELLED)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # --- internals ----------------------------------------------------------------

    def _read(self, revision: int | None) -> tuple[dict[str, WatchedValue], int]:
        kwargs = {} if revision is None else {"revision": revision}
        response = self._client.get_prefix_response(self._prefix, **kwargs)
        state: dict[str, WatchedValue] = {}
        for kv in response.kvs:
            key = kv.key.decode("utf-8")
            with contextlib.suppress(CoordinationError):
                state[key[len(self._prefix) :]] = WatchedValue(
                    self._decode(kv.value, key), int(kv.create_revision)
                )
        return state, int(response.header.revision)

    def _seed(self, start_revision: int) -> None:
        if start_revision <= 1:
            return  # nothing exists before revision 1
        try:
            self._state, _ = self._read(start_revision - 1)
        except grpc.RpcError as exc:
            code: Any = exc
            if code.code() != grpc.StatusCode.OUT_OF_RANGE:  # compacted
                raise CoordinationError(f"reading {self._prefix} failed: {describe(exc)}") from exc
            # The history before start_revision is gone: start from the current
            # map, and report it from the watch thread once that runs.
            self._resync(report=False)
            self._queue.put(_REPORT)
        except etcd_exceptions.Etcd3Exception as exc:
            raise CoordinationError(f"reading {self._prefix} failed: {describe(exc)}") from exc

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
        except ETCD_ERRORS as exc:
            raise CoordinationError(f"watching {self._prefix} failed: {describe(exc)}") from exc
        with self._lock:
            self._watch_id = int(watch_id)
            cancelled = self._cancelled
        if cancelled:
            with contextlib.suppress(*ETCD_ERRORS, ValueError):
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
        # The events of one transaction share its revision: the next revision
        # moves past it only once all of them are applied.
        first = self._next_revision
        for event in response.events:
            revision = int(event.mod_revision)
            if revision < first:
                continue  # already seen (replayed after a re-watch)
            key = event.key.decode("utf-8")
            name = key[len(self._prefix) :]
            if isinstance(event, etcd_events.DeleteEvent):
                changed |= self._state.pop(name, None) is not None
            else:
                try:
                    self._state[name] = WatchedValue(
                        self._decode(event.value, key), int(event.create_revision)
                    )
                    changed = True
                except CoordinationError:
                    _log.warning("watch %s: ignoring undecodable value at %s", self._prefix, key)
            self._next_revision = max(self._next_revision, revision + 1)
        if changed:
            self._report()

    def _rewatch(self, cause: BaseException | None) -> bool:
        """Re-create the watch after its stream broke. Returns False once cancelled."""
        _log.info(
            "watch %s broke (%s); re-watching from revision %d",
            self._prefix,
            "stream closed" if cause is None else describe(cause),
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
            except (*ETCD_ERRORS, ValueError) as exc:
                _log.debug("watch %s: resync failed (%s)", self._prefix, describe(exc))
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
