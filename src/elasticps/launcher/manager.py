"""The worker manager: keeps a job's trainers in range, and its PS in place.

Two layers, as everywhere in elasticps:

- :class:`ManagerCore` is pure. It is told what the backend reported
  (:meth:`~ManagerCore.observe`), which creations failed
  (:meth:`~ManagerCore.create_failed`), and, on each step, the wanted trainer
  count, the clock and each trainer's last progress time; it answers with
  :class:`Create` and :class:`Delete` actions. No threads, sockets or sleeps:
  the unit tests drive it with a fake clock.
- :class:`WorkerManager` is the thin shell: one thread that feeds the core
  with :meth:`Backend.watch <elasticps.launcher.backend.Backend.watch>`
  events, the wanted count (a :class:`DesiredCountSource`, e.g.
  :class:`EtcdDesiredCount` reading ``/elasticps/<job>/trainers_wanted``) and
  a periodic tick, and applies the actions to the backend.

The rules (each unit-tested in ``tests/unit/test_manager.py``):

- The wanted count is clamped to ``[min_trainers, max_trainers]``; missing
  trainers are created with fresh indices (a trainer id is never reused, so a
  new trainer never collides with the lease key of an old one).
- Above the wanted count, trainers are deleted newest first, after any not yet
  running (retrying, unschedulable or pending), which do no work.
- A worker that cannot be placed (:class:`~elasticps.errors.UnschedulableError`
  on create, or reported :attr:`~WorkerState.UNSCHEDULABLE`, which is deleted
  first) is created again after an exponential backoff with jitter, capped:
  tenacity's ``wait_exponential_jitter``, the strategy Google Cloud Storage
  recommends (https://cloud.google.com/storage/docs/retry-strategy). The delay
  before attempt ``n + 1`` is ``min(base * 2**(n-1) + U(0, base), cap)``.
- A running trainer whose last progress (or start) is more than
  ``stuck_after_s`` old is deleted; the count rule then replaces it.
- What a worker's end means is not decided here but by the job's
  supervision policy (:class:`~elasticps.launcher.supervisor.Supervisor`),
  which every launcher shares: the core turns each end it did not cause
  into a supervisor event and applies the answer. A replaced trainer is
  re-created by the count rule above; a fixed worker (a PS) that the policy
  restarts is created again with the same spec, so the same index: it
  reloads its checkpoint; a :class:`~elasticps.launcher.supervisor.FailJob`
  stops all creation and is handed to the shell (the local launcher ends
  the job; on Kubernetes the job is marked failed).
- The policy counts trainers failing in a row with internal errors while no
  task progresses; the shell tells it of progress (the local launcher from
  the master's status; on Kubernetes, a ``task_progress`` source read once per
  tick, :class:`LedgerTaskProgress`, which counts a task done or its offset
  advanced, never a mere dispatch).
- A trainer that exits with status 0 on its own means the master said the job
  is finished: from then on nothing is created (:meth:`ManagerCore.finish`
  does the same).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final, Protocol

import tenacity

from elasticps.config import ManagerConfig
from elasticps.coord.store import JobStore
from elasticps.errors import ElasticPSError, UnschedulableError
from elasticps.launcher.backend import Backend, Cancel, Role, WorkerEvent, WorkerSpec, WorkerState
from elasticps.launcher.supervisor import Action as PolicyAction
from elasticps.launcher.supervisor import (
    Deleted,
    Exited,
    FailJob,
    Kind,
    Progressed,
    Supervisor,
    SupervisorConfig,
    exited_from_reason,
)
from elasticps.launcher.supervisor import Event as PolicyEvent

__all__ = [
    "Action",
    "Create",
    "Decide",
    "Delete",
    "DesiredCountSource",
    "EtcdDesiredCount",
    "FailJob",
    "LedgerProgress",
    "LedgerTaskProgress",
    "ManagerCore",
    "ProgressSource",
    "StaticDesiredCount",
    "TaskProgressSource",
    "WorkerManager",
    "backoff_delay_s",
    "policy_event",
    "task_marks",
    "tasks_progressed",
]

log = logging.getLogger(__name__)

_LIVE: Final = frozenset({WorkerState.PENDING, WorkerState.RUNNING, WorkerState.UNSCHEDULABLE})
_ENDED: Final = frozenset({WorkerState.SUCCEEDED, WorkerState.FAILED, WorkerState.DELETED})


@dataclass(frozen=True)
class Create:
    """Create a worker.

    Attributes:
        spec: what to run.
        attempt: 1 for a first try; n for the n-th try after unschedulable ones.
        reason: why (``scale up``, ``replace ps-1``, ``retry``...).
    """

    spec: WorkerSpec
    attempt: int
    reason: str


@dataclass(frozen=True)
class Delete:
    """Delete a worker.

    Attributes:
        name: the worker's name.
        reason: why (``scale down``, ``stuck``, ``unschedulable``).
    """

    name: str
    reason: str


Action = Create | Delete | FailJob
"""What :meth:`ManagerCore.step` returns; a :class:`FailJob` comes from the supervision policy."""

Decide = Callable[[PolicyEvent], PolicyAction]
"""The supervision policy's transition (:meth:`Supervisor.handle`, behind a lock if shared)."""


def policy_event(event: WorkerEvent, deleted_on_purpose: bool) -> PolicyEvent:
    """The supervisor event of a worker's end, as a backend reported it (pure).

    Args:
        event: a SUCCEEDED, FAILED or DELETED event.
        deleted_on_purpose: the manager (or the launcher) deleted it.
    """
    kind = Kind(event.role.value)
    if deleted_on_purpose:
        return Deleted(event.name, kind)
    if event.state is WorkerState.SUCCEEDED:
        return Exited(event.name, kind, status=0, message=event.message)
    # FAILED, or DELETED from outside (preempted, evicted, kubectl delete).
    return exited_from_reason(event.name, kind, event.reason or "Deleted", event.message)


def backoff_delay_s(attempt: int, base_s: float, cap_s: float) -> float:
    """Delay before the next creation after ``attempt`` failed ones, seconds.

    tenacity's ``wait_exponential_jitter`` (Google Cloud Storage's retry
    strategy): ``min(base_s * 2**(attempt-1) + U(0, base_s), cap_s)``, with
    ``random.uniform`` for the jitter.

    Args:
        attempt: failed attempts so far, >= 1.
        base_s: first delay, seconds, > 0.
        cap_s: longest delay, seconds.

    Raises:
        ValueError: ``attempt`` < 1.
    """
    if attempt < 1:
        raise ValueError(f"attempt must be >= 1, got {attempt}")
    wait = tenacity.wait_exponential_jitter(multiplier=base_s, max=cap_s, jitter=base_s)
    state = tenacity.RetryCallState(tenacity.Retrying(), None, (), {})
    state.attempt_number = attempt
    return float(wait(state))


@dataclass
class _Worker:
    spec: WorkerSpec
    state: WorkerState
    seq: int  # creation order, for "newest first"
    attempt: int = 1  # which creation attempt this is
    running_since: float | None = None
    deleting: bool = False


@dataclass
class _Retry:
    spec: WorkerSpec
    attempt: int  # failed attempts so far
    due: float
    seq: int


class ManagerCore:
    """The worker manager's decisions, pure: no I/O, no threads, no clock of its own.

    Args:
        config: range, stuck threshold and backoff.
        trainer_spec: builds the spec of trainer ``index``.
        fixed: workers that must always exist (the PS), restarted with the same
            spec when they end, as the policy allows.
        decide: the supervision policy; by default a private
            :class:`~elasticps.launcher.supervisor.Supervisor` with no restart
            limit (Kubernetes restarts pods without one).
    """

    def __init__(
        self,
        config: ManagerConfig,
        trainer_spec: Callable[[int], WorkerSpec],
        fixed: Iterable[WorkerSpec] = (),
        decide: Decide | None = None,
    ) -> None:
        self.config = config
        self._trainer_spec = trainer_spec
        self._fixed: dict[str, WorkerSpec] = {s.name: s for s in fixed}
        self._decide: Decide = decide or Supervisor(SupervisorConfig(max_restarts=None)).handle
        self._failed: FailJob | None = None
        self._failure_reported = False
        self._workers: dict[str, _Worker] = {}
        self._retries: dict[str, _Retry] = {}
        self._next_index = 0
        self._seq = 0
        self._finishing = False

    # --- inputs -------------------------------------------------------------------

    @property
    def finishing(self) -> bool:
        """Whether the job is finishing: nothing is created any more."""
        return self._finishing

    def finish(self) -> None:
        """The job is finished: create nothing from now on (deletions still happen)."""
        self._finishing = True
        self._retries.clear()

    @property
    def failed(self) -> FailJob | None:
        """The policy's decision that failed the job, or None."""
        return self._failed

    def progressed(self) -> None:
        """The job's tasks progressed: tell the policy (it resets its count of failing trainers)."""
        self._decide(Progressed())

    def observe(self, event: WorkerEvent, now: float) -> PolicyAction | None:
        """Record what the backend reported about one worker.

        An unknown live worker is adopted (a restarted manager, or a worker
        created by someone else): its index is never given to a new trainer.
        The end of a known worker goes to the supervision policy, whose
        answer is applied (see the module docstring) and returned.

        Args:
            event: the backend's event.
            now: the clock, seconds (monotonic).

        Returns:
            The policy's action for the end of a known worker, else None.
        """
        worker = self._workers.get(event.name)
        if event.role is Role.TRAINER:
            self._next_index = max(self._next_index, event.index + 1)
        if event.state in _ENDED:
            if worker is None:
                return None
            del self._workers[event.name]
            action = self._decide(policy_event(event, worker.deleting))
            if worker.deleting:
                return action
            log.info("%s ended on its own: %s %s", event.name, event.state.value, event.reason)
            if event.role is Role.TRAINER and event.state is WorkerState.SUCCEEDED:
                # Trainers exit 0 only when the master says the job is finished.
                self._finishing = True
            if isinstance(action, FailJob) and self._failed is None:
                self._failed = action
                self.finish()
            return action
        if worker is None:
            spec = self._spec_of(event)
            worker = _Worker(spec, event.state, self._next_seq())
            self._workers[event.name] = worker
            self._retries.pop(event.name, None)
        worker.state = event.state
        if event.state is WorkerState.RUNNING and worker.running_since is None:
            worker.running_since = now
        return None

    def create_failed(self, spec: WorkerSpec, now: float, reason: str) -> float:
        """Record that creating ``spec`` failed; schedule the next attempt.

        Args:
            spec: the spec of the :class:`Create` action that failed.
            now: the clock, seconds.
            reason: the backend's message, for the log.

        Returns:
            The delay before the next attempt, seconds.
        """
        worker = self._workers.pop(spec.name, None)
        attempt = worker.attempt if worker is not None else 1
        seq = worker.seq if worker is not None else self._next_seq()
        return self._schedule_retry(spec, attempt, seq, now, reason)

    # --- decisions --------------------------------------------------------------------

    def step(
        self, now: float, wanted: int, progress: Mapping[str, float] | None = None
    ) -> list[Action]:
        """Decide what to do now.

        Every :class:`Create` returned is recorded as a pending worker at once;
        the caller reports a failed one with :meth:`create_failed`.

        Args:
            now: the clock, seconds (monotonic; the same clock as ``progress``).
            wanted: the wanted number of trainers, before clamping.
            progress: trainer name -> clock time of its last progress; trainers
                missing from it count from the time they were seen running.
                None: no stuck detection in this step.

        Returns:
            The actions, deletions first.
        """
        actions: list[Action] = []
        if self._failed is not None and not self._failure_reported:
            self._failure_reported = True
            actions.append(self._failed)
        # Unschedulable workers: delete them, and create them again after a backoff.
        for name, w in list(self._workers.items()):
            if w.state is WorkerState.UNSCHEDULABLE and not w.deleting:
                w.deleting = True
                actions.append(Delete(name, "unschedulable"))
                if not self._finishing:
                    self._schedule_retry(w.spec, w.attempt, w.seq, now, "unschedulable")
        # Stuck trainers: delete them; the count below replaces them.
        stuck_s = self.config.stuck_after_s
        # A finishing job's trainers are on their way out: none is stuck.
        if stuck_s is not None and progress is not None and not self._finishing:
            for name, w in self._workers.items():
                if w.spec.role is not Role.TRAINER or w.deleting or w.running_since is None:
                    continue
                last = max(w.running_since, progress.get(name, -math.inf))
                if now - last >= stuck_s:
                    w.deleting = True
                    actions.append(Delete(name, f"stuck: no progress for {now - last:.1f} s"))
        if self._finishing:
            return actions
        actions.extend(self._scale_trainers(wanted))
        # Fixed workers (PS): always one per spec, same index.
        for name, spec in self._fixed.items():
            if name not in self._workers and name not in self._retries:
                actions.append(self._create(spec, 1, f"replace {name}"))
        # Retries that are due, once the worker they replace is gone.
        for name, retry in sorted(self._retries.items(), key=lambda kv: kv[1].seq):
            if retry.due <= now and name not in self._workers:
                del self._retries[name]
                actions.append(self._create(retry.spec, retry.attempt + 1, "retry", retry.seq))
        return actions

    def next_due(self) -> float | None:
        """Clock time of the earliest scheduled retry, or None."""
        return min((r.due for r in self._retries.values()), default=None)

    def live_trainers(self) -> list[str]:
        """Names of the trainers created or running and not being deleted, oldest first."""
        return [
            n
            for n, w in sorted(self._workers.items(), key=lambda kv: kv[1].seq)
            if w.spec.role is Role.TRAINER and not w.deleting
        ]

    def retrying(self) -> dict[str, int]:
        """Workers waiting for their next creation attempt -> failed attempts so far."""
        return {n: r.attempt for n, r in self._retries.items()}

    # --- internals ------------------------------------------------------------------------

    def _scale_trainers(self, wanted: int) -> list[Action]:
        target = self.config.clamp(wanted)
        running = [
            (n, w)
            for n, w in self._workers.items()
            if w.spec.role is Role.TRAINER and not w.deleting
        ]
        retrying = [(n, r) for n, r in self._retries.items() if r.spec.role is Role.TRAINER]
        excess = len(running) + len(retrying) - target
        actions: list[Action] = []
        if excess > 0:
            # Not-yet-placed trainers first (they do no work), newest first.
            for name, _ in sorted(retrying, key=lambda nr: -nr[1].seq)[:excess]:
                del self._retries[name]
                excess -= 1
            victims = sorted(
                running, key=lambda nw: (nw[1].state is WorkerState.RUNNING, -nw[1].seq)
            )
            for name, w in victims[:excess]:
                w.deleting = True
                actions.append(Delete(name, f"scale down to {target}"))
        elif excess < 0:
            for _ in range(-excess):
                spec = self._trainer_spec(self._next_index)
                self._next_index += 1
                actions.append(self._create(spec, 1, f"scale up to {target}"))
        return actions

    def _create(
        self, spec: WorkerSpec, attempt: int, reason: str, seq: int | None = None
    ) -> Create:
        self._workers[spec.name] = _Worker(
            spec, WorkerState.PENDING, self._next_seq() if seq is None else seq, attempt
        )
        return Create(spec, attempt, reason)

    def _schedule_retry(
        self, spec: WorkerSpec, attempt: int, seq: int, now: float, reason: str
    ) -> float:
        delay = backoff_delay_s(attempt, self.config.backoff_base_s, self.config.backoff_cap_s)
        self._retries[spec.name] = _Retry(spec, attempt, now + delay, seq)
        log.warning(
            "%s could not be scheduled (attempt %d: %s); next attempt in %.2f s",
            spec.name,
            attempt,
            reason,
            delay,
        )
        return delay

    def _spec_of(self, event: WorkerEvent) -> WorkerSpec:
        fixed = self._fixed.get(event.name)
        if fixed is not None:
            return fixed
        if event.role is Role.TRAINER:
            return self._trainer_spec(event.index)
        return WorkerSpec(event.role, event.index)

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq


# --- sources ------------------------------------------------------------------------------


class DesiredCountSource(Protocol):
    """Where the wanted trainer count comes from (etcd locally; a ConfigMap on Kubernetes)."""

    def get(self) -> int | None:
        """The current wanted count, or None if unset."""
        ...

    def watch(self, on_change: Callable[[int | None], None]) -> Cancel:
        """Call ``on_change`` with every later value until cancelled."""
        ...


class StaticDesiredCount:
    """A wanted count that changes only through :meth:`set` (tests, fixed jobs).

    Args:
        count: the initial count.
    """

    def __init__(self, count: int) -> None:
        self._count = count
        self._lock = threading.Lock()
        self._listeners: list[Callable[[int | None], None]] = []

    def get(self) -> int | None:
        """The current count."""
        return self._count

    def set(self, count: int) -> None:
        """Change the count and tell the watchers."""
        with self._lock:
            self._count = count
            listeners = list(self._listeners)
        for listener in listeners:
            listener(count)

    def watch(self, on_change: Callable[[int | None], None]) -> Cancel:
        """Call ``on_change`` on every :meth:`set` until cancelled."""
        with self._lock:
            self._listeners.append(on_change)

        def cancel() -> None:
            with self._lock:
                if on_change in self._listeners:
                    self._listeners.remove(on_change)

        return cancel


class EtcdDesiredCount:
    """The wanted trainer count in etcd, ``/elasticps/<job>/trainers_wanted``.

    ``elasticps scale JOB --trainers N`` writes it; the watch delivers it at once.

    Args:
        store: the job's etcd view.
    """

    def __init__(self, store: JobStore) -> None:
        self._store = store

    def get(self) -> int | None:
        """The current value, or None if unset.

        Raises:
            CoordinationError: etcd failed or the value is malformed.
        """
        return self._store.trainers_wanted()

    def watch(self, on_change: Callable[[int | None], None]) -> Cancel:
        """Call ``on_change`` after each change of the key, until cancelled.

        Raises:
            CoordinationError: etcd failed.
        """
        return self._store.watch_trainers_wanted(on_change).cancel


ProgressSource = Callable[[], Mapping[str, float]]
"""Trainer name -> clock time (the manager's clock) of its last progress."""

TaskProgressSource = Callable[[], bool]
"""Whether the job's tasks progressed since the last call (see :func:`tasks_progressed`)."""

TaskMark = tuple[int, int, int]


def task_marks(records: Mapping[str, Mapping[str, object]]) -> dict[str, TaskMark]:
    """How far each task of the ledger got: ``(pass, done, offset)`` by task key (pure).

    Args:
        records: the ledger's task records by key, as the master persists
            them (:meth:`elasticps.master.taskqueue.TaskQueue.task_record`:
            ``pass``, ``state``, ``offset``...); malformed ones are skipped.
    """
    marks: dict[str, TaskMark] = {}
    for key, record in records.items():
        pass_id, offset = record.get("pass"), record.get("offset")
        if not isinstance(pass_id, int) or not isinstance(offset, int):
            continue
        marks[key] = (pass_id, int(record.get("state") == "done"), offset)
    return marks


def tasks_progressed(before: Mapping[str, TaskMark], after: Mapping[str, TaskMark]) -> bool:
    """Whether some task got further: done, its offset advanced, or a later pass (pure).

    A dispatch or a requeue changes no mark, so a trainer that takes a task
    and dies is no progress: the supervision policy's count of trainers
    failing in a row goes on (:data:`~elasticps.launcher.supervisor.MAX_TRAINER_FAILURES`).

    Args:
        before: the marks at the last look (:func:`task_marks`).
        after: the marks now.
    """
    return any(mark > before.get(key, (0, 0, 0)) for key, mark in after.items())


class LedgerTaskProgress:
    """A :data:`TaskProgressSource` over the task ledger in etcd.

    Each call reads the ``tasks/`` prefix (one etcd range read), at most once
    per ``every_s`` seconds; the first read sets the baseline.

    Args:
        store: the job's etcd view.
        every_s: the least time between two reads, seconds.
        clock: monotonic clock, seconds.
    """

    def __init__(
        self, store: JobStore, every_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._store = store
        self._every_s = every_s
        self._clock = clock
        self._marks: dict[str, TaskMark] | None = None
        self._read_at = -math.inf

    def __call__(self) -> bool:
        """Whether a task progressed since the last read.

        Raises:
            CoordinationError: etcd failed.
        """
        now = self._clock()
        if now - self._read_at < self._every_s:
            return False
        self._read_at = now
        tasks, _ = self._store.get_prefix_json(self._store.keys.tasks_prefix)
        marks = task_marks({k: v for k, v in tasks.items() if isinstance(v, Mapping)})
        before, self._marks = self._marks, marks
        return before is not None and tasks_progressed(before, marks)


class LedgerProgress:
    """Each trainer's last progress, read from the task ledger in etcd.

    A trainer progresses when a task it holds changes (dispatch, progress
    report within the task, done). A registered trainer holding no task is
    idle, not stuck (in sync mode it waits for work). A trainer absent from
    ``trainers/`` is not reported, so it counts from its start: one that never
    registers is stuck too. One that registered and then left keeps its last
    progress time (it is exiting, or stuck on the way out). Each call is two
    prefix reads of etcd, so call it about once a second, and only when stuck
    detection is on. Set ``--stuck-after-s`` above a trainer's start-up time.

    Args:
        store: the job's etcd view.
        clock: the manager's clock, seconds.
        name_of: trainer id (``trainers/<id>``) -> worker name.
    """

    def __init__(
        self,
        store: JobStore,
        clock: Callable[[], float] = time.monotonic,
        name_of: Callable[[str], str] = lambda tid: f"trainer-{tid}",
    ) -> None:
        self._store = store
        self._clock = clock
        self._name_of = name_of
        self._seen: dict[str, tuple[object, ...]] = {}
        self._last: dict[str, float] = {}

    def __call__(self) -> Mapping[str, float]:
        """Trainer name -> clock time of its last progress.

        Raises:
            CoordinationError: etcd failed.
        """
        now = self._clock()
        tasks, _ = self._store.get_prefix_json(self._store.keys.tasks_prefix)
        registered, _ = self._store.live_trainers()
        held: dict[str, list[tuple[object, ...]]] = {}
        for task_id, record in tasks.items():
            trainer = record.get("trainer")
            if isinstance(trainer, str) and record.get("state") == "pending":
                held.setdefault(trainer, []).append(
                    (task_id, record.get("pass"), record.get("attempt"), record.get("offset"))
                )
        for trainer_id in registered:
            name = self._name_of(trainer_id)
            fingerprint = tuple(sorted(map(str, held.get(trainer_id, []))))
            if not fingerprint or self._seen.get(name) != fingerprint:
                self._last[name] = now
            self._seen[name] = fingerprint
        # A trainer that unregistered (it is exiting) keeps its last progress time.
        return dict(self._last)


# --- the shell ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActionRecord:
    """One action the manager applied, for logs and ``run.json``.

    Attributes:
        at_s: wall-clock time, seconds since the epoch.
        action: ``create`` or ``delete``.
        name: the worker.
        reason: why.
        attempt: the creation attempt (0 for deletions).
        result: ``ok``, ``unschedulable`` or ``error``.
        retry_in_s: the backoff delay after a failed creation, else None.
    """

    at_s: float
    action: str
    name: str
    reason: str
    attempt: int = 0
    result: str = "ok"
    retry_in_s: float | None = None


class WorkerManager:
    """Runs a :class:`ManagerCore` against a backend on its own thread.

    Args:
        backend: creates, deletes and watches workers.
        config: the manager's config.
        desired_source: the wanted trainer count; when unset, ``min_trainers``.
        progress_source: each trainer's last progress (read once per tick, only
            when ``config.stuck_after_s`` is set), or None.
        clock: monotonic clock, seconds.
        trainer_spec: builds the spec of trainer ``index``.
        fixed: workers that must always exist (PS), restarted with the same spec.
        decide: the supervision policy (see :class:`ManagerCore`).
        task_progress: whether the job's tasks progressed (read once per
            tick), told to the policy; None where the shell tells it itself
            (the local launcher).
        on_decision: called from the manager's thread with each worker end it
            did not cause and the policy's answer (the local launcher prints
            it and ends the job on a :class:`FailJob`; on Kubernetes the job
            is marked failed).
    """

    def __init__(
        self,
        backend: Backend,
        config: ManagerConfig,
        desired_source: DesiredCountSource,
        progress_source: ProgressSource | None,
        clock: Callable[[], float] = time.monotonic,
        *,
        trainer_spec: Callable[[int], WorkerSpec],
        fixed: Sequence[WorkerSpec] = (),
        decide: Decide | None = None,
        task_progress: TaskProgressSource | None = None,
        on_decision: Callable[[WorkerEvent, PolicyAction], None] | None = None,
    ) -> None:
        self.backend = backend
        self._task_progress = task_progress
        self.config = config
        self.core = ManagerCore(config, trainer_spec, fixed, decide)
        self._on_decision = on_decision
        self._desired = desired_source
        self._progress = progress_source
        self._clock = clock
        self._inbox: queue.SimpleQueue[WorkerEvent | int | str | None] = queue.SimpleQueue()
        self._wanted = config.min_trainers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cancels: list[Cancel] = []
        self._lock = threading.Lock()
        self._records: list[ActionRecord] = []
        self._live: list[str] = []

    # --- public ---------------------------------------------------------------------

    def start(self) -> None:
        """Subscribe to the backend and the wanted count, and start the thread.

        Raises:
            ElasticPSError: the backend or the desired-count source failed;
                nothing stays subscribed, so ``start`` may be called again.
        """
        try:
            self._cancels.append(self.backend.watch(self._inbox.put))
            self._cancels.append(self._desired.watch(self._on_wanted))
            initial = self._desired.get()
        except BaseException:
            for cancel in self._cancels:
                cancel()
            self._cancels.clear()
            raise
        if initial is not None:
            self._wanted = initial
        now = self._clock()
        for event in self.backend.list():
            self.core.observe(event, now)
        self._thread = threading.Thread(target=self._run, name="worker-manager", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        """The job is finished: create no more workers."""
        self._inbox.put("finish")

    def stop(self) -> None:
        """Stop the thread and the subscriptions; the workers are left as they are."""
        self._stop.set()
        self._inbox.put("stop")
        for cancel in self._cancels:
            cancel()
        self._cancels.clear()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=30)

    @property
    def wanted(self) -> int:
        """The last wanted count seen (before clamping)."""
        return self._wanted

    def records(self) -> list[ActionRecord]:
        """Every action applied so far, oldest first."""
        with self._lock:
            return list(self._records)

    def live_trainers(self) -> list[str]:
        """Trainers created and not being deleted, as of the last step."""
        with self._lock:
            return list(self._live)

    # --- the thread -----------------------------------------------------------------

    def _on_wanted(self, count: int | None) -> None:
        if count is not None:
            self._inbox.put(count)

    def _run(self) -> None:
        next_tick = self._clock()
        while not self._stop.is_set():
            now = self._clock()
            due = self.core.next_due()
            wake = min(next_tick, due) if due is not None else next_tick
            try:
                item = self._inbox.get(timeout=max(0.0, wake - now))
            except queue.Empty:
                item = None
            self._absorb(item)
            while True:  # drain, so a burst of events costs one step
                try:
                    self._absorb(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if self._stop.is_set():
                return
            now = self._clock()
            # Stuck checks only on ticks, with fresh progress data.
            progress: Mapping[str, float] | None = None
            if now >= next_tick:
                next_tick = now + self.config.tick_s
                if self._progress is not None and self.config.stuck_after_s is not None:
                    try:
                        progress = self._progress()
                    except ElasticPSError as exc:
                        log.warning("could not read trainer progress: %s", exc)
                if self._task_progress is not None:
                    try:
                        if self._task_progress():
                            self.core.progressed()
                    except ElasticPSError as exc:
                        log.warning("could not read the task ledger: %s", exc)
            try:
                self._apply(self.core.step(now, self._wanted, progress))
            except Exception:  # keep managing: one bad step must not end elasticity
                log.exception("worker manager step failed")

    def _absorb(self, item: WorkerEvent | int | str | None) -> None:
        if isinstance(item, WorkerEvent):
            action = self.core.observe(item, self._clock())
            if action is not None and self._on_decision is not None:
                try:
                    self._on_decision(item, action)
                except Exception:  # the shell's callback must not end elasticity
                    log.exception("the decision callback failed")
        elif isinstance(item, int):
            if item != self._wanted:
                log.info(
                    "wanted trainers: %d -> %d (kept in %d..%d)",
                    self._wanted,
                    item,
                    self.config.min_trainers,
                    self.config.max_trainers,
                )
            self._wanted = item
        elif item == "finish":
            self.core.finish()

    def _apply(self, actions: list[Action]) -> None:
        for action in actions:
            if self._stop.is_set():
                return
            if isinstance(action, FailJob):
                log.error("the job fails: %s", action.message)
                continue
            if isinstance(action, Delete):
                log.info("deleting %s (%s)", action.name, action.reason)
                try:
                    self.backend.delete(action.name)
                    self._record(ActionRecord(time.time(), "delete", action.name, action.reason))
                except ElasticPSError as exc:
                    log.warning("could not delete %s: %s", action.name, exc)
                    self._record(
                        ActionRecord(
                            time.time(), "delete", action.name, action.reason, result="error"
                        )
                    )
                continue
            spec = action.spec
            log.info("creating %s (%s, attempt %d)", spec.name, action.reason, action.attempt)
            record = ActionRecord(time.time(), "create", spec.name, action.reason, action.attempt)
            try:
                self.backend.create(spec)
            except UnschedulableError as exc:
                delay = self.core.create_failed(spec, self._clock(), str(exc))
                record = dataclasses.replace(record, result="unschedulable", retry_in_s=delay)
            except ElasticPSError as exc:
                delay = self.core.create_failed(spec, self._clock(), f"error: {exc}")
                record = dataclasses.replace(record, result="error", retry_in_s=delay)
            self._record(record)
        with self._lock:
            self._live = self.core.live_trainers()

    def _record(self, record: ActionRecord) -> None:
        with self._lock:
            self._records.append(record)
