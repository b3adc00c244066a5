"""The master's side of the parameter servers: end-of-pass verification and sealing.

The master talks to every parameter server over the tensor plane's CONTROL
requests (:class:`~elasticps.snapshot.ControlClient`), addressed by slot and
epoch: a request reaches only the server that holds the slot's current claim,
and an answer counts only if etcd still names the same claim after it came
(a server paused past its lease may answer late, after a successor took the
slot from an older checkpoint; such a server also refuses with ERROR
``fenced`` when it notices in time).
:class:`PassVerifier` runs the end of every pass (see
:mod:`elasticps.master.verify` for the rules): it asks each shard which
records of the pass it holds, re-opens what some shard lacks, and seals the
pass once every shard holds it all.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence

from elasticps.coord.store import JobStore, PSSlot
from elasticps.errors import ElasticPSError, RemoteError
from elasticps.master.verify import ShardCoverage, judge_pass, records_missing
from elasticps.snapshot import ControlClient

__all__ = ["PassVerifier", "ShardController", "coverage_report"]

log = logging.getLogger(__name__)

_RETRY_S = 0.2

# Most requests in flight at once from one controller (one per server).
_MAX_PARALLEL = 16

# Codes meaning "the server answering is not (or may not be) the slot's current one".
_SHARD_CHANGED_CODES = frozenset({"wrong_epoch", "changed", "fenced"})


class ShardsChangedError(ElasticPSError):
    """A parameter server went away or was replaced during a round of requests."""


class ShardController:
    """CONTROL connections to every parameter server of a job, at their current epochs.

    Args:
        store: the job's store (to find the slots).
        timeout_s: connect timeout and default reply deadline, seconds. Short:
            a server that does not answer is being replaced (stopped, cut off)
            more often than slow, and a caller blocked on it would not see its
            successor; the caller retries, finding the slot's current server.
    """

    def __init__(self, store: JobStore, *, timeout_s: float = 5.0) -> None:
        self._store = store
        self._timeout_s = timeout_s
        self._clients: dict[int, tuple[PSSlot, ControlClient]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _requests(self) -> concurrent.futures.ThreadPoolExecutor:
        """The threads that send requests to several servers at once (made on first use)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                _MAX_PARALLEL, thread_name_prefix="ps-control"
            )
        return self._pool

    def slots(self, timeout_s: float | None = None) -> list[PSSlot]:
        """Every slot's current claim (waits until all are claimed, at most
        ``timeout_s`` seconds; default: the controller's timeout).

        Raises:
            CoordinationError: not all claimed in time, or etcd failed.
        """
        return self._store.wait_ps_slots(self._timeout_s if timeout_s is None else timeout_s)

    def request_all(
        self,
        body: Mapping[str, object],
        *,
        timeout_s: float | None = None,
        confirm: bool = True,
    ) -> dict[int, dict[str, object]]:
        """Send one CONTROL request to every server at once; their answers by slot.

        A server no trainer has said hello to yet answers as holding nothing
        (``{"initialized": False, "sealed": False, "intervals": []}``).

        Args:
            body: the request.
            timeout_s: reply deadline, seconds (default: the controller's).
            confirm: check afterwards that etcd still names every claim that
                answered; without it the caller must call :meth:`confirm`
                before acting on the answers.

        Raises:
            ShardsChangedError: a server could not be reached, or holds
                another epoch than etcd says (it is being replaced).
            RemoteError: a server refused the request.
            CoordinationError: etcd failed.
        """
        slots = self.slots()
        return self.request_slots(
            slots,
            {slot.index: body for slot in slots},
            timeout_s=timeout_s,
            confirm=confirm,
            uninitialized_ok=True,
        )

    def request_slots(
        self,
        slots: Sequence[PSSlot],
        bodies: Mapping[int, Mapping[str, object]],
        *,
        timeout_s: float | None = None,
        confirm: bool = True,
        uninitialized_ok: bool = False,
    ) -> dict[int, dict[str, object]]:
        """Send ``bodies[i]`` to the server of claim ``slots[i]``, all at once; answers by slot.

        The requests go out in parallel (a pass's end waits for the slowest
        server, not for the sum). Every request is answered or failed before
        this returns or raises.

        Args:
            slots: the claims to address (as :meth:`slots` returned them).
            bodies: slot index -> request, one per slot.
            timeout_s: reply deadline, seconds (default: the controller's).
            confirm: as for :meth:`request_all`.
            uninitialized_ok: answer for a server with ERROR
                ``not_initialized`` as holding nothing, instead of raising.

        Raises:
            ShardsChangedError / RemoteError / CoordinationError: as
                :meth:`request_all`; the first failure in slot order.
        """
        clients = [(slot, self._client(slot)) for slot in slots]  # before any request goes
        pool = self._requests()
        futures = [
            (slot, pool.submit(client.request, bodies[slot.index], timeout_s=timeout_s))
            for slot, client in clients
        ]
        concurrent.futures.wait([future for _, future in futures])
        out: dict[int, dict[str, object]] = {}
        failure: ElasticPSError | None = None
        for slot, future in futures:
            try:
                out[slot.index] = self._answer(slot, future.result, uninitialized_ok)
            except ElasticPSError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure
        if confirm:
            self.confirm(slots)
        return out

    def request_one(
        self, index: int, body: Mapping[str, object], *, timeout_s: float | None = None
    ) -> dict[str, object]:
        """Send one CONTROL request to the server of slot ``index``.

        Raises:
            ShardsChangedError: the server could not be reached, holds another
                epoch, or changed since the last look (ERROR ``changed``).
            RemoteError: the server refused the request.
            CoordinationError: etcd failed.
        """
        slot = self._store.ps_slots().get(index)
        if slot is None:
            raise ShardsChangedError(f"parameter server slot {index} is not claimed")
        client = self._client(slot)
        answer = self._answer(slot, lambda: client.request(body, timeout_s=timeout_s))
        self.confirm([slot])
        return answer

    def _answer(
        self,
        slot: PSSlot,
        request: Callable[[], dict[str, object]],
        uninitialized_ok: bool = False,
    ) -> dict[str, object]:
        """``request()``'s answer, with its errors translated (see :meth:`request_all`).

        Raises:
            ShardsChangedError: the server could not be reached or refused as
                not (or maybe not) the slot's current one; its connection is
                dropped.
            RemoteError: the server refused the request otherwise.
        """
        try:
            return request()
        except RemoteError as exc:
            if exc.code == "not_initialized" and uninitialized_ok:
                # No trainer has said hello to it yet: it holds nothing.
                return {"initialized": False, "sealed": False, "intervals": []}
            if exc.code in _SHARD_CHANGED_CODES:
                self._drop(slot.index)
                raise ShardsChangedError(str(exc)) from exc
            raise
        except ElasticPSError as exc:
            self._drop(slot.index)
            raise ShardsChangedError(
                f"parameter server {slot.index} at {slot.address}: {exc}"
            ) from exc

    def confirm(self, asked: Sequence[PSSlot]) -> None:
        """Check that etcd still names the claims that just answered.

        Raises:
            ShardsChangedError: a slot was claimed anew (or released) since
                the request went out: its answer may come from a server that
                was deposed meanwhile, so it must not be acted on.
            CoordinationError: etcd failed.
        """
        now = self._store.ps_slots()
        for slot in asked:
            current = now.get(slot.index)
            if current is None or current.epoch != slot.epoch:
                self._drop(slot.index)
                raise ShardsChangedError(
                    f"parameter server slot {slot.index} was claimed anew (epoch {slot.epoch} -> "
                    f"{'none' if current is None else current.epoch}) while it answered"
                )

    def slots_changed(self, slots: Mapping[int, PSSlot]) -> None:
        """Interrupt requests to servers whose slot was claimed anew (any thread).

        A request blocked on a server that was stopped or cut off fails at
        once instead of at its deadline, and the caller retries on the
        slot's new server.
        """
        for index, (slot, client) in list(self._clients.items()):
            now = slots.get(index)
            if now is None or now.epoch != slot.epoch:
                client.interrupt()

    def _client(self, slot: PSSlot) -> ControlClient:
        held = self._clients.get(slot.index)
        if held is not None and held[0].epoch == slot.epoch:
            return held[1]
        self._drop(slot.index)
        try:
            client = ControlClient(slot.address, timeout_s=self._timeout_s, epoch=slot.epoch)
        except ElasticPSError as exc:
            raise ShardsChangedError(str(exc)) from exc
        self._clients[slot.index] = (slot, client)
        return client

    def _drop(self, index: int) -> None:
        held = self._clients.pop(index, None)
        if held is not None:
            held[1].close()

    def close(self) -> None:
        """Close every connection, and the request threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for index in list(self._clients):
            self._drop(index)


class PassVerifier:
    """Checks each finished pass on the parameter servers, then seals and completes it.

    Runs on its own thread, one pass at a time, retrying through server
    restarts until the pass is complete or the master stops.

    Args:
        store: the job's store.
        task_records: returns task id -> records in the task (read at each
            check: a stream's tasks grow).
        done_tasks: returns the tasks done in the current pass.
        reopen: re-opens tasks at records (task id -> record); the master's
            queue mutation, made durable before it returns.
        complete: completes a pass: ``complete(pass_id, records_lost,
            passes_lost)``.
        failed_tasks_of: the failed tasks of an earlier pass (from its
            summary), or None if its summary is not kept.
        repair: re-opens records of an earlier, sealed pass for the servers
            that lack them: ``repair(pass_id, {task: record})``; returns
            whether any repair was opened (see
            :meth:`~elasticps.master.taskqueue.TaskQueue.open_repairs`).
        stop: set when the master stops.
    """

    def __init__(
        self,
        store: JobStore,
        *,
        task_records: Callable[[], Mapping[int, int]],
        done_tasks: Callable[[], Sequence[int]],
        reopen: Callable[[dict[int, int]], None],
        complete: Callable[[int, int, Sequence[int]], None],
        failed_tasks_of: Callable[[int], Sequence[int] | None],
        stop: threading.Event,
        repair: Callable[[int, dict[int, int]], bool] | None = None,
    ) -> None:
        self._task_records = task_records
        self._done_tasks = done_tasks
        self._reopen = reopen
        self._complete = complete
        self._failed_tasks_of = failed_tasks_of
        self._repair = repair
        self._stop = stop
        self._controller = ShardController(store)
        self._lock = threading.Lock()
        self._running: int | None = None

    def start(self, pass_id: int) -> None:
        """Verify ``pass_id`` in the background (once; a second call is ignored)."""
        with self._lock:
            if self._running == pass_id:
                return
            self._running = pass_id
        threading.Thread(
            target=self._run, args=(pass_id,), name=f"verify-pass-{pass_id}", daemon=True
        ).start()

    def close(self) -> None:
        """Close the connections to the servers."""
        self._controller.close()

    def _run(self, pass_id: int) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._verify(pass_id)
                    return
                except ElasticPSError as exc:
                    log.warning("pass %d: checking the parameter servers: %s; retrying",
                                pass_id, exc)  # fmt: skip
                    self._stop.wait(_RETRY_S)
        finally:
            with self._lock:
                if self._running == pass_id:
                    self._running = None

    def _verify(self, pass_id: int) -> None:
        # One read of the claims for the whole check: the answers of both
        # rounds count only if etcd names the same claims after the last one.
        slots = self._controller.slots()
        answers = self._controller.request_slots(
            slots,
            {slot.index: {"op": "coverage", "pass": pass_id} for slot in slots},
            confirm=False,
            uninitialized_ok=True,
        )
        reports = [coverage_report(index, a) for index, a in sorted(answers.items())]
        done = list(self._done_tasks())
        verdict = judge_pass(self._task_records(), done, reports)
        if not verdict.complete:
            self._controller.confirm(slots)
            log.warning(
                "pass %d: parameter server(s) %s lack records of %d task(s) (%s records); "
                "re-opening them (the servers that hold them drop them as duplicates)",
                pass_id, sorted(verdict.missing), len(verdict.rewinds),
                sum(verdict.missing.values()),
            )  # fmt: skip
            self._reopen(verdict.rewinds)
            return
        earlier = self._earlier_coverage(pass_id, answers)
        if self._repair is not None and self._open_repairs(earlier, answers, slots):
            return
        lost, passes_lost = self._lost_earlier_passes(earlier)
        bodies: dict[int, dict[str, object]] = {}
        for index, answer in sorted(answers.items()):
            body: dict[str, object] = {"op": "seal", "pass": pass_id}
            if isinstance(answer.get("version"), int):
                body["if_version"] = answer["version"]
            bodies[index] = body
        # Sealing writes a checkpoint, as long as the disk takes: every server
        # at once, since the next pass waits for the last. A server that
        # changed since its coverage answer refuses (``if_version``, its
        # epoch), and the confirmation after the seals checks the claims.
        sealed = self._controller.request_slots(slots, bodies, timeout_s=300.0)
        not_durable = sorted(i for i, a in sealed.items() if not a.get("durable"))
        log.info(
            "pass %d: every parameter server holds every record of it; sealed%s",
            pass_id,
            "" if not not_durable else f" (servers {not_durable} keep no checkpoints)",
        )
        self._complete(pass_id, lost, passes_lost)

    def _earlier_coverage(
        self, pass_id: int, answers: Mapping[int, Mapping[str, object]]
    ) -> dict[int, list[ShardCoverage]]:
        """Earlier pass -> the coverage of each shard that has not sealed it.

        Such a shard was restored from a checkpoint older than the pass's
        seal (or from none: it holds nothing of any pass).
        """
        earlier: dict[int, list[ShardCoverage]] = {}
        for index, answer in sorted(answers.items()):
            sealed_through = answer.get("sealed_through", -1)
            initialized = bool(answer.get("initialized", True))
            if not isinstance(sealed_through, int) or not initialized:
                sealed_through = -1
            for old in range(sealed_through + 1, pass_id):
                report = coverage_report(
                    index, self._controller.request_all({"op": "coverage", "pass": old})[index]
                )
                if not initialized:
                    report = ShardCoverage(index, sealed=False, initialized=False)
                earlier.setdefault(old, []).append(report)
        return earlier

    def _open_repairs(
        self,
        earlier: Mapping[int, Sequence[ShardCoverage]],
        answers: Mapping[int, Mapping[str, object]],
        slots: Sequence[PSSlot],
    ) -> bool:
        """Re-open, for the oldest earlier pass that has some, the records that
        shards restored from an older checkpoint lack; returns whether any was.

        A shard whose values came from a trainer since its last seal
        (``opaque``: it restarted with no readable checkpoint) or that holds
        nothing is not repaired, nor is a pass whose summary is not kept:
        what they lack is reported lost.
        """
        assert self._repair is not None
        opaque = {i for i, a in answers.items() if a.get("opaque") or not a.get("initialized", 1)}
        task_records = self._task_records()
        for old, reports in sorted(earlier.items()):
            failed = self._failed_tasks_of(old)
            repairable = [r for r in reports if r.shard not in opaque]
            if failed is None or not repairable:
                continue
            done = [t for t in task_records if t not in set(failed)]
            verdict = judge_pass(task_records, done, repairable)
            if verdict.complete:
                continue
            self._controller.confirm(slots)
            if self._repair(old, verdict.rewinds):
                log.warning(
                    "parameter server(s) %s lack %d records of sealed pass %d (restored from a "
                    "checkpoint older than its seal); re-opening %d task(s) of it as repairs "
                    "(the servers that hold them drop them as duplicates)",
                    sorted(verdict.missing), sum(verdict.missing.values()), old,
                    len(verdict.rewinds),
                )  # fmt: skip
                return True
        return False

    def _lost_earlier_passes(
        self, earlier: Mapping[int, Sequence[ShardCoverage]]
    ) -> tuple[int, list[int]]:
        """Records of sealed passes that a restored shard does not hold (lost for good)."""
        lost = 0
        passes: set[int] = set()
        task_records = self._task_records()
        for old, reports in sorted(earlier.items()):
            failed = set(self._failed_tasks_of(old) or ())
            done = [t for t in task_records if t not in failed]
            for report in reports:
                missing = records_missing(task_records, done, report)
                if missing:
                    lost += missing
                    passes.add(old)
                    log.error(
                        "parameter server %d lost %d records of pass %d for good: it was "
                        "restored from a checkpoint older than that pass's seal (or from none), "
                        "and they could not be trained again onto it",
                        report.shard, missing, old,
                    )  # fmt: skip
        return lost, sorted(passes)


def coverage_report(index: int, answer: Mapping[str, object]) -> ShardCoverage:
    """A server's answer to the ``coverage`` op as a :class:`ShardCoverage`.

    Raises:
        ElasticPSError: a malformed interval.
    """
    raw = answer.get("intervals", [])
    intervals: list[tuple[int, int, int]] = []
    if isinstance(raw, list):
        for item in raw:
            if (
                isinstance(item, list)
                and len(item) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) for v in item)
            ):
                intervals.append((item[0], item[1], item[2]))
            else:
                raise ElasticPSError(f"parameter server {index} sent a malformed interval")
    return ShardCoverage(index, bool(answer.get("sealed")), intervals)


def close_quietly(verifier: PassVerifier | None) -> None:
    """Close a verifier's connections, ignoring errors."""
    if verifier is not None:
        with contextlib.suppress(ElasticPSError, OSError):
            verifier.close()
